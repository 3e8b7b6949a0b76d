"""Machine probes: what this machine has (CPU model, vendor and flags, usable CPUs, physical cores, NUMA
nodes, RAM, huge pages, the NVIDIA driver), read from /proc and /sys.

The ground floor: stdlib only at import (no torch, no numba; `numa_nodes` imports ktlite.numa when
called), so every layer may ask: ktlite.runtime.knobs chooses knobs from these, the CPU kernels' Numba
target (kernels/cpu/target.py) from the CPU flags, the benches name the machine with them, and
`ktlite doctor` (ktlite/doctor.py) reports them.
"""

from __future__ import annotations

import math
import os
import platform
import re
from pathlib import Path

VECTOR_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def read(path: str | Path) -> str | None:
    """A small /proc or /sys file, stripped; None where it cannot be read."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


# ---- the CPU ---------------------------------------------------------------------------------


def _cpuinfo(key: str) -> str | None:
    for line in (read("/proc/cpuinfo") or "").splitlines():
        if line.startswith(key):
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD, ... ("" where /proc/cpuinfo does not say)."""
    return _cpuinfo("vendor_id") or ""


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def cpu_features() -> str:
    flags = cpu_flags()
    return " ".join(f for f in VECTOR_FLAGS if f in flags) or "no AVX2/AVX-512/AMX flags found"


def usable_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def cgroup_cpu_limit() -> int | None:
    """Whole CPUs a cgroup v2 quota allows (a container started with --cpus), None if unlimited."""
    quota = (read("/sys/fs/cgroup/cpu.max") or "max").split()
    if quota[0] == "max" or len(quota) < 2:
        return None
    return max(1, math.ceil(int(quota[0]) / int(quota[1])))


def physical_cores(cpus: set[int]) -> int:
    """Distinct (package, core) pairs among `cpus`, capped by a cgroup CPU quota."""
    cores = set()
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        package, core = read(f"{topo}/physical_package_id"), read(f"{topo}/core_id")
        cores.add((package, core) if package is not None and core is not None else ("cpu", cpu))
    limit = cgroup_cpu_limit()
    return max(1, min(len(cores), limit) if limit else len(cores))


def numa_nodes(cpus: set[int]) -> int:
    """NUMA nodes that hold at least one of `cpus` (1 when the kernel exposes no topology)."""
    from ktlite import numa  # numpy: imported on use only

    return len(numa.Topology.probe(allowed=cpus).nodes)


# ---- memory ----------------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (the HugePages_* counts stay counts)."""
    out = {}
    for line in (read("/proc/meminfo") or "").splitlines():
        match = re.fullmatch(r"(\S+):\s+(\d+)(\s+kB)?", line.strip())
        if match:
            out[match.group(1)] = int(match.group(2)) * (1024 if match.group(3) else 1)
    return out


def available_ram() -> int:
    """Bytes this process can still allocate: MemAvailable, capped by a cgroup v2 memory limit."""
    info = meminfo()
    free = info.get("MemAvailable", info.get("MemFree", 0))
    limit, used = read("/sys/fs/cgroup/memory.max"), read("/sys/fs/cgroup/memory.current")
    if limit and limit.isdigit() and used and used.isdigit():
        free = min(free, int(limit) - int(used))
    return max(free, 0)


def transparent_hugepages() -> str:
    """The transparent huge page mode (always, madvise, never), "unknown" where the kernel does not say."""
    thp = THP_ENABLED.read_text().strip() if THP_ENABLED.is_file() else ""
    return thp[thp.find("[") + 1:thp.find("]")] if "[" in thp else "unknown"


# ---- GPUs ------------------------------------------------------------------------------------


def nvidia_driver_version() -> str | None:
    """The loaded NVIDIA kernel driver's version, None without one."""
    for word in (read("/proc/driver/nvidia/version") or "").split():
        if re.fullmatch(r"\d+(\.\d+)+", word):
            return word
    return None
