"""What Numba compiles the CPU kernels for, from what the CPU really has.

LLVM names the host CPU from its CPUID family/model. Inside VMs that model is often masked or newer
than the LLVM table: a Sapphire Rapids Xeon (AMX, AVX-512 BF16/VNNI) was compiled for as `rocketlake`
(MEASURED.md), whose scheduling model and implied features are a client core's. The kernel's flags in
/proc/cpuinfo are what the CPU executes, so they choose the name (the newest LLVM core whose
features the CPU has) and add any feature LLVM's host list lacks. Nothing the CPU lacks is ever
added, so a choice can only be slower, never illegal. NUMBA_CPU_NAME / NUMBA_CPU_FEATURES set by the
user win and are left alone.

`configure_numba()` runs before the first kernel compiles (ktlite/kernels/cpu/__init__.py) and logs a
wrong guess once; `ktlite version` and `ktlite doctor` print the target. `bf16_gemm_wins()` says
whether oneDNN's bf16 GEMMs beat its fp32 ones here (the CPU GEMM paths' dtype follows it).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from ktlite.machine import cpu_flags, cpu_vendor  # the machine probes (stdlib only)

logger = logging.getLogger(__name__)

# /proc/cpuinfo flag -> LLVM feature, for the features the kernels (or LLVM's vectorizer) can use
CPUINFO_TO_LLVM = {
    "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi2": "bmi2", "avx_vnni": "avxvnni",
    "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16",
    "avx512_fp16": "avx512fp16", "amx_tile": "amx-tile", "amx_int8": "amx-int8", "amx_bf16": "amx-bf16",
}
# newest first: the first whose flags the CPU has all of names it (vendor-specific rows by vendor)
_INTEL = (
    ("graniterapids", {"amx_tile", "amx_int8", "amx_bf16", "amx_fp16", "avx512_fp16"}),
    ("sapphirerapids", {"amx_tile", "amx_int8", "amx_bf16", "avx512_fp16"}),
    ("cooperlake", {"avx512_bf16", "avx512_vnni", "avx512bw"}),
    ("icelake-server", {"avx512_vnni", "avx512_vbmi2", "avx512bw"}),
    ("cascadelake", {"avx512_vnni", "avx512bw"}),
    ("skylake-avx512", {"avx512f", "avx512bw"}),
)
_AMD = (
    ("znver5", {"avx512f", "avx_vnni", "avx512_vp2intersect"}),
    ("znver4", {"avx512f", "avx512_bf16"}),
    ("znver3", {"avx2", "vaes", "vpclmulqdq"}),
)


@dataclass(frozen=True)
class NumbaTarget:
    """The CPU name and LLVM feature string Numba compiles for, and LLVM's own guess."""

    name: str
    features: str  # "+avx2,+fma,..." (LLVM's host list plus what /proc/cpuinfo adds)
    llvm_name: str  # LLVM's host guess
    added: tuple[str, ...]  # LLVM features the guess lacked and the CPU has
    user_set: bool  # NUMBA_CPU_NAME / NUMBA_CPU_FEATURES came from the environment

    @property
    def corrected(self) -> bool:
        return not self.user_set and (self.name != self.llvm_name or bool(self.added))

    def enabled(self, llvm_feature: str) -> bool:
        return f"+{llvm_feature}" in self.features.split(",")

    def describe(self) -> str:
        wide = [f for f in ("avx512f", "avx512vnni", "avx512bf16", "amx-int8", "amx-bf16") if self.enabled(f)]
        text = f"{self.name} ({', '.join(wide) or 'no AVX-512'})"
        if self.user_set:
            return text + ", set by NUMBA_CPU_NAME/NUMBA_CPU_FEATURES"
        if self.corrected:
            return text + f", corrected from LLVM's guess {self.llvm_name}" + (
                f" (+{', +'.join(self.added)})" if self.added else "")
        return text


def choose_target(flags: set[str], vendor: str, llvm_name: str, llvm_features: dict[str, bool]) -> NumbaTarget:
    """The target for a CPU with these /proc/cpuinfo `flags` and `vendor` (GenuineIntel/AuthenticAMD)
    where LLVM guessed `llvm_name` with `llvm_features` (pure: tests give any CPU)."""
    table = _INTEL if vendor == "GenuineIntel" else _AMD if vendor == "AuthenticAMD" else ()
    names = [n for n, _ in table]
    derived = next((n for n, needs in table if needs <= flags), None)
    # LLVM's guess stays when the flags name nothing, or it is a server core at least as new
    trust = derived is None or (llvm_name in names and names.index(llvm_name) <= names.index(derived))
    name = llvm_name if trust else derived
    have = {k for k, v in llvm_features.items() if v}
    added = tuple(sorted(CPUINFO_TO_LLVM[f] for f in flags
                         if f in CPUINFO_TO_LLVM and CPUINFO_TO_LLVM[f] not in have))
    features = ",".join(sorted(f"+{f}" for f in have | set(added)))
    return NumbaTarget(name, features, llvm_name, added, user_set=False)


# the probe's GEMM: one V2-Lite expert's gate/up rows times 48 tokens (its share of a 512-token prefill)
_PROBE_SHAPE = (48, 2048, 2816)


@functools.cache
def bf16_gemm_wins() -> bool:
    """Whether torch's bf16 GEMM beats its fp32 one on this CPU (the dtype of the CPU GEMM paths follows it).
    Without AVX512-BF16 or AMX-BF16 oneDNN widens bf16 as it goes (a Zen 3: 3.6x its fp32 time); with AMX it
    is ~3x faster than fp32. With AVX512-BF16 alone it depends on the core (Zen 5: 819 vs 185 GFLOP/s; an
    Emerald Rapids VM that hides AMX: 153 vs 205, bench/history/), so there both are timed once (~30 ms)."""
    flags = cpu_flags()
    if "amx_bf16" in flags or "avx512_bf16" not in flags:
        return "amx_bf16" in flags
    import time

    import torch

    m, k, n = _PROBE_SHAPE
    best = {}
    for _ in range(4):  # interleaved, best of each: the first round warms oneDNN's kernels up
        for dtype in (torch.bfloat16, torch.float32):
            a, b = torch.ones(m, k, dtype=dtype), torch.ones(n, k, dtype=dtype)
            start = time.perf_counter()
            torch.matmul(a, b.T)
            best[dtype] = min(best.get(dtype, float("inf")), time.perf_counter() - start)
    wins = best[torch.bfloat16] < best[torch.float32]
    logger.info("bf16 GEMM %.2f ms vs fp32 %.2f ms on this CPU: the CPU GEMM paths use %s", best[torch.bfloat16] * 1e3,
                best[torch.float32] * 1e3, "bf16" if wins else "fp32")
    return wins


def bf16_attention_cpu() -> bool:
    """Whether this CPU multiplies bf16 in hardware for the CPU attention's bf16 block products: AMX-BF16 tiles
    that Linux grants, or AVX512-BF16 dots (the kernels' own check, bf16_blocks.products_available, also needs
    numba's compile target to have them)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or ("amx_bf16" in flags and amx_permitted())


# Linux: the AMX tile data state is off until a process asks (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA));
# a tile instruction before that is SIGILL, so the AMX kernels run only where this returned True
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def amx_permitted() -> bool:
    """Ask Linux (x86-64) for the AMX tile state, once per process; True where granted."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64" or "amx_tile" not in cpu_flags():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    granted = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    if not granted:
        logger.warning("the kernel refused the AMX tile state (errno %d): the CPU experts run without AMX",
                       ctypes.get_errno())
    return granted


@functools.cache
def configure_numba() -> NumbaTarget:
    """Point Numba at the CPU's real name and features (once, before any kernel compiles)."""
    import llvmlite.binding as llvm
    import numba

    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return NumbaTarget(numba.config.CPU_NAME or llvm.get_host_cpu_name(),
                           numba.config.CPU_FEATURES or llvm.get_host_cpu_features().flatten(),
                           llvm.get_host_cpu_name(), (), user_set=True)
    target = choose_target(cpu_flags(), cpu_vendor(), llvm.get_host_cpu_name(), dict(llvm.get_host_cpu_features()))
    if target.corrected:
        logger.warning("Numba's LLVM took this CPU for %s; compiling the CPU kernels for %s", target.llvm_name,
                       target.describe())
        numba.config.CPU_NAME, numba.config.CPU_FEATURES = target.name, target.features
    return target
