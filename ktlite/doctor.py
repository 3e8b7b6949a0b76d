"""`ktlite doctor`: what matters for this engine on this machine, one line per check: ok, warn or
fail, with the fix.

CPU (model, physical cores, NUMA nodes and where each expert pool would run and keep its experts, the
vector flags the expert kernels use and what Numba compiles for), memory (RAM, free RAM, huge pages),
GPUs (name, memory, compute capability, driver, whether ktlite's Triton and FP8 kernels run there),
versions, and the Numba threading layer the expert pools need. Nothing is compiled or allocated (but
the one page the NUMA check places), and torch is imported only when an NVIDIA driver is present, so it
runs in a few seconds without a GPU. The machine probes it reports (usable CPUs, physical cores, NUMA
nodes, available RAM, CPU flags, the driver) are ktlite/machine.py's, which knobs and kernels read too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import shutil
from dataclasses import asdict, dataclass

from ktlite import numa
from ktlite.machine import (available_ram, cgroup_cpu_limit, cpu_features, cpu_flags, cpu_model, meminfo, numa_nodes,
                            nvidia_driver_version, physical_cores, transparent_hugepages, usable_cpus)

OK, WARN, FAIL = "ok", "warn", "fail"
_GIB = 2**30
THREADSAFE_LAYERS = ("omp", "tbb", "threadsafe", "safe")
TRITON_MIN_CC = (8, 0)  # ktlite's Triton kernels are built for sm80+ (kernels/triton/aot_check.py)
FP8_MMA_CC = (8, 9)  # FP8 tensor-core MMA from Ada / Hopper on (kernels/triton/fp8.py)


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    value: str
    fix: str = ""


def _version(dist: str) -> str | None:
    """Installed version from the package metadata (importing torch alone takes seconds)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- checks --------------------------------------------------------------------------------


def _cpu_checks() -> list[Check]:
    cpus = usable_cpus()
    cores, nodes, limit = physical_cores(cpus), numa_nodes(cpus), cgroup_cpu_limit()
    quota = f", cgroup quota {limit} CPUs" if limit else ""
    out = [
        Check("cpu", OK, cpu_model()),
        Check("cores", OK, f"{cores} physical, {len(cpus)} logical usable{quota}: --kt-cpuinfer {cores} is chosen "
                           "when you do not set it"),
        Check("numa", OK, f"{nodes} node{'s' if nodes > 1 else ''}: --kt-threadpool-count {nodes} is chosen when you "
                          "do not set it (one expert pool per node)"),
    ]
    flags = cpu_flags()
    if "avx512f" in flags:
        extra = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("amx_tile", "AMX")) if flag in flags]
        out.append(Check("cpu vector flags", OK, f"AVX-512{' + ' + ' + '.join(extra) if extra else ''} ({cpu_features()})"))
    elif "avx2" in flags:
        out.append(Check("cpu vector flags", WARN, f"AVX2 only ({cpu_features()})",
                         "the CPU expert kernels use 256-bit vectors here; a CPU with AVX-512 decodes experts faster"))
    else:
        out.append(Check("cpu vector flags", FAIL, cpu_features(),
                         "the CPU expert kernels expect at least AVX2; on this CPU they run as scalar code"))
    out.append(_numba_target(flags))
    return out


def _numa_placement_check(layer: str | None) -> Check:
    """Where the automatic pools (one per node) would run and keep their experts, and whether this process may do
    it: pin a thread (sched_setaffinity) and place a page (mbind, get_mempolicy, move_pages), tried on one page."""
    topology = numa.Topology.probe()
    pools = "; ".join(p.describe() for p in numa.place_pools(topology, len(topology.nodes)))
    team = {"omp": "pinned with its thread", "tbb": "not pinned: TBB's workers are shared by all pools"}
    threads = f"each pool's thread pinned to its cpus, its numba team {team.get(layer, 'as its threading layer allows')}"
    problems, fixes = [], []
    pin = numa.probe_pinning(topology.nodes[next(iter(topology.nodes))])
    if pin:
        problems.append(f"sched_setaffinity refused ({pin}): pool threads run unpinned")
        fixes.append("allow sched_setaffinity (it only fails where a seccomp profile or a cgroup forbids it)")
    try:
        placed = numa.probe_placement(next(iter(topology.nodes)))
    except numa.NumaError as exc:
        placed = ""
        problems.append(f"{exc}: experts' pages go where the kernel's default policy puts them (first touch)")
        fixes.append("in a container, allow mbind/get_mempolicy/move_pages (docker: --cap-add SYS_NICE, which its "
                     "default seccomp profile requires for them)")
    value = f"{pools}; {threads}; " + ("; ".join(problems) if problems else f"mbind/move_pages permitted: {placed}")
    if problems and len(topology.nodes) > 1:
        return Check("numa placement", WARN, value, "; ".join(fixes))
    if problems:
        value += " (one node: nothing to place)"
    return Check("numa placement", OK, value)


def _numba_target(flags: set[str]) -> Check:
    """What Numba's LLVM compiles the expert kernels for, against what the CPU has."""
    try:
        from ktlite.kernels.cpu.target import CPUINFO_TO_LLVM, configure_numba

        target = configure_numba()
    except Exception as exc:  # noqa: BLE001
        return Check("numba target", FAIL, f"numba/llvmlite do not import: {exc}", "pip install numba")
    from ktlite.kernels.cpu.amx_tiles import AMX

    amx = "; prefill of the CPU experts and CPU-only dense layers runs on AMX-INT8 tiles"
    value = target.describe() + (amx if AMX else "")
    wanted = ("avx512f", "avx512_vnni", "avx512_bf16")
    missing = [f for f in wanted if f in flags and not target.enabled(CPUINFO_TO_LLVM[f])]
    if missing:
        return Check("numba target", WARN, value + f"; the CPU has {', '.join(missing)} that Numba does not target",
                     "unset NUMBA_CPU_NAME / NUMBA_CPU_FEATURES so Numba targets this CPU")
    return Check("numba target", OK, value)


def _memory_checks() -> list[Check]:
    info = meminfo()
    total, free = info.get("MemTotal", 0), available_ram()
    status = WARN if total and free < 0.1 * total else OK
    out = [Check("ram", status, f"{total / _GIB:.1f} GiB total, {free / _GIB:.1f} GiB available",
                 "free memory: the CPU experts must fit in the available RAM (ktlite plan says how much they need)"
                 if status == WARN else "")]
    mode = transparent_hugepages()
    pages = info.get("HugePages_Total", 0)
    value = f"transparent huge pages: {mode}; {pages} reserved huge pages"
    if mode == "never":
        out.append(Check("huge pages", WARN, value, "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled "
                                                    "(fewer TLB misses while streaming expert weights)"))
    else:
        out.append(Check("huge pages", OK, value))
    return out


def _gpu_checks() -> list[Check]:
    driver = nvidia_driver_version()
    if driver is None and shutil.which("nvidia-smi") is None:  # no NVIDIA driver: skip importing torch (seconds)
        return [Check("gpu", WARN, "no NVIDIA driver: attention and dense layers run on the CPU (torch twins)",
                      "fine for trying ktlite; serve big models on a machine with an NVIDIA GPU")]
    import torch

    if not torch.cuda.is_available():
        return [Check("gpu", FAIL, f"an NVIDIA driver ({driver or 'nvidia-smi found'}) but torch {torch.__version__} "
                                   "sees no CUDA GPU",
                      "install a CUDA build of torch (pip install torch) or check CUDA_VISIBLE_DEVICES")]
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        cc = (props.major, props.minor)
        value = (f"{props.name}, {props.total_memory / _GIB:.1f} GiB, compute capability {props.major}.{props.minor}, "
                 f"driver {driver or 'unknown'}, CUDA {torch.version.cuda}")
        if cc < TRITON_MIN_CC:
            out.append(Check(f"gpu {i}", WARN, value + "; ktlite's Triton kernels need 8.0+",
                             "use an Ampere or newer GPU for the Triton kernels"))
            continue
        fp8 = "FP8 MMA" if cc >= FP8_MMA_CC else "FP8 weights decoded to bf16 in the kernel (no FP8 MMA before 8.9)"
        out.append(Check(f"gpu {i}", OK, f"{value}; Triton kernels: yes; {fp8}"))
    return out


def _version_checks() -> list[Check]:
    out = [Check("python", OK, platform.python_version())]
    for dist, fix in (("torch", "pip install torch"), ("triton", "pip install triton"), ("numba", "pip install numba"),
                      ("numpy", "pip install 'numpy<2.6'")):
        version = _version(dist)
        out.append(Check(dist, OK, version) if version else Check(dist, FAIL, "not installed", fix))
    if os.environ.get("TRITON_INTERPRET") == "1":
        out.append(Check("TRITON_INTERPRET", WARN, "1: Triton kernels run in the interpreter (slow)",
                         "unset TRITON_INTERPRET outside tests"))
    return out


def _layers() -> tuple[str | None, list[str]]:
    """(NUMBA_THREADING_LAYER, the thread-safe layers that load, in the order ktlite prefers them)."""
    from ktlite.kernels.cpu.threads import load_tbb  # numba: imported on use only

    load_tbb()  # as ktlite does before numba looks for the tbb layer
    available = []
    for layer, module in (("tbb", "numba.np.ufunc.tbbpool"), ("omp", "numba.np.ufunc.omppool")):
        try:
            importlib.import_module(module)
            available.append(layer)
        except Exception:  # noqa: BLE001 - a layer whose library is missing is what the checks report
            pass
    return os.environ.get("NUMBA_THREADING_LAYER"), available


def _threading_check() -> Check:
    """The expert pools launch Numba parallel regions from several threads at once, which only a
    thread-safe threading layer allows (workqueue aborts the process)."""
    name = "numba threading layer"
    forced, available = _layers()
    if forced and forced not in THREADSAFE_LAYERS:
        return Check(name, FAIL, f"NUMBA_THREADING_LAYER={forced}: not thread-safe; the expert pools run one at a time "
                                 "(two at once would abort the process)",
                     f"unset NUMBA_THREADING_LAYER (ktlite then picks {available[0] if available else 'omp or tbb'})")
    if forced in ("omp", "tbb") and forced not in available:
        return Check(name, FAIL, f"NUMBA_THREADING_LAYER={forced} but that layer does not load",
                     "unset NUMBA_THREADING_LAYER, or install " + ("the OpenMP runtime (libgomp)" if forced == "omp" else "tbb (pip install tbb)"))
    if not available:
        return Check(name, FAIL, "neither omp nor tbb loads: the expert pools run one at a time",
                     "install tbb (pip install tbb) or the OpenMP runtime (libgomp)")
    threads = os.environ.get("NUMBA_NUM_THREADS")
    value = f"{forced or available[0]} (thread-safe){'; NUMBA_NUM_THREADS=' + threads if threads else ''}"
    if (forced or available[0]) == "omp":  # see kernels/cpu/threads.py
        return Check(name, WARN, value + ": OpenMP's workers sleep between the kernels the engine's thread launches "
                                         "(~1 ms to wake each; CPU-only decode ran 1.8x slower than with tbb)",
                     "pip install tbb" if "tbb" not in available else "unset NUMBA_THREADING_LAYER")
    return Check(name, OK, value)


def run_checks() -> list[Check]:
    forced, available = _layers()
    layer = forced or (available[0] if available else None)
    return [*_cpu_checks(), _numa_placement_check(layer), *_memory_checks(), *_gpu_checks(), *_version_checks(),
            _threading_check()]


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.value}")
        if c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    lines.append(f"{len(checks)} checks: {fails} fail, {warns} warn")
    return "\n".join(lines)


def to_json(checks: list[Check]) -> str:
    return json.dumps([asdict(c) for c in checks], indent=2)
