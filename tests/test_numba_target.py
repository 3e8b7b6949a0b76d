"""Numba's compile target comes from the CPU's real flags (ktlite/kernels/cpu/target.py): a wrong LLVM
guess is corrected, nothing the CPU lacks is ever added, and the user's NUMBA_CPU_* settings win."""

from __future__ import annotations

import os
import subprocess
import sys

from ktlite.machine import cpu_flags
from ktlite.kernels.cpu.target import CPUINFO_TO_LLVM, choose_target, configure_numba

# flags as /proc/cpuinfo lists them (the relevant subset)
SAPPHIRE_RAPIDS = {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl",
                   "avx512_vnni", "avx512_vbmi2", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8",
                   "amx_bf16"}
ZEN3 = {"avx2", "fma", "f16c", "bmi2", "vaes", "vpclmulqdq"}
ZEN5 = ZEN3 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
               "avx512_vp2intersect"}


def llvm_features(flags: set[str], drop: set[str] = frozenset()) -> dict[str, bool]:
    """LLVM's host feature dict for a CPU with `flags`, minus the `drop`ped LLVM features."""
    return {CPUINFO_TO_LLVM[f]: CPUINFO_TO_LLVM[f] not in drop for f in flags if f in CPUINFO_TO_LLVM}


def test_xeon_taken_for_rocketlake_is_compiled_for_sapphire_rapids_with_its_amx():
    t = choose_target(SAPPHIRE_RAPIDS, "GenuineIntel", "rocketlake",
                      llvm_features(SAPPHIRE_RAPIDS, drop={"amx-tile", "amx-int8", "amx-bf16"}))
    assert t.name == "sapphirerapids" and t.corrected
    assert t.added == ("amx-bf16", "amx-int8", "amx-tile")
    assert all(t.enabled(f) for f in ("avx512bf16", "avx512vnni", "amx-int8"))
    assert "corrected from LLVM's guess rocketlake" in t.describe()


def test_a_right_or_newer_guess_is_kept():
    zen3 = choose_target(ZEN3, "AuthenticAMD", "znver3", llvm_features(ZEN3))
    assert (zen3.name, zen3.added, zen3.corrected) == ("znver3", (), False)
    newer = choose_target(SAPPHIRE_RAPIDS, "GenuineIntel", "graniterapids", llvm_features(SAPPHIRE_RAPIDS))
    assert newer.name == "graniterapids" and not newer.corrected
    zen5 = choose_target(ZEN5, "AuthenticAMD", "znver4", llvm_features(ZEN5))  # an LLVM older than the core
    assert zen5.name == "znver5" and zen5.corrected


def test_nothing_the_cpu_lacks_is_added():
    for flags, vendor, guess in ((ZEN3, "AuthenticAMD", "generic"), (SAPPHIRE_RAPIDS, "GenuineIntel", "x86-64"),
                                 (set(), "Unknown", "generic")):
        t = choose_target(flags, vendor, guess, {})
        enabled = {f.lstrip("+") for f in t.features.split(",") if f}
        assert enabled <= {CPUINFO_TO_LLVM[f] for f in flags if f in CPUINFO_TO_LLVM}
    unknown = choose_target(set(), "Unknown", "generic", {})
    assert (unknown.name, unknown.corrected) == ("generic", False)


def test_this_machine_targets_every_feature_it_has():
    flags = cpu_flags()
    target = configure_numba()
    if target.user_set:
        assert "NUMBA_CPU" in " ".join(os.environ)
        return
    assert all(target.enabled(CPUINFO_TO_LLVM[f]) for f in flags if f in CPUINFO_TO_LLVM), target.describe()


def test_the_users_numba_cpu_name_wins():
    code = ("from ktlite.kernels.cpu.target import configure_numba; t = configure_numba(); "
            "print(t.name, t.user_set, t.describe())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NUMBA_CPU_NAME": "generic"},
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("generic True") and "set by NUMBA_CPU_NAME" in out
