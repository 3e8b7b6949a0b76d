"""`ktlite doctor`: fast on a CPU-only machine, machine-readable with --json, and a broken setting is a
fail with its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from ktlite import doctor, numa
from ktlite.cli import main
from ktlite.doctor import FAIL, OK, WARN
from ktlite.machine import numa_nodes, physical_cores, usable_cpus

EXPECTED = {"cpu", "cores", "numa", "numa placement", "cpu vector flags", "numba target", "ram", "huge pages", "python", "torch",
            "triton", "numba", "numpy", "numba threading layer"}


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    """Run `ktlite doctor` in a fresh process (the timeout only guards against a hang)."""
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"} | env
    return subprocess.run([sys.executable, "-m", "ktlite.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=300, env=environ)


_COST_PROBE = """
import gc, json, os, shutil, sys
from numba.core.dispatcher import Dispatcher
from ktlite.doctor import run_checks
run_checks()
gpu_driver = shutil.which("nvidia-smi") is not None or os.path.exists("/proc/driver/nvidia/version")
print(json.dumps({"torch": "torch" in sys.modules, "gpu_driver": gpu_driver,
                  "kernels": sum(isinstance(d, Dispatcher) for d in gc.get_objects()),
                  "compiled": [d.py_func.__qualname__ for d in gc.get_objects() if isinstance(d, Dispatcher) and d.overloads]}))
"""


def test_doctor_compiles_nothing_and_imports_torch_only_for_a_gpu():
    """What keeps `ktlite doctor` fast, counted instead of timed (a timing depends on the machine and its load):
    it reads the kernels' module but compiles (or loads from numba's cache) no kernel, and imports torch (seconds)
    only where an NVIDIA driver asks for the GPU checks."""
    probe = json.loads(subprocess.run([sys.executable, "-c", _COST_PROBE], capture_output=True, text=True,
                                      check=True, timeout=300).stdout)
    assert probe["kernels"] > 0  # the probe sees the kernels' dispatchers, and none of them has run
    assert probe["compiled"] == []
    assert not probe["torch"] or probe["gpu_driver"]


def test_doctor_json_lists_every_check():
    out = _doctor("--json")
    checks = json.loads(out.stdout)
    assert EXPECTED <= {c["name"] for c in checks}
    assert all(c["status"] in (OK, WARN, FAIL) and c["value"] for c in checks)
    assert all(c["fix"] for c in checks if c["status"] != OK)  # every warn/fail says what to do
    assert out.returncode == (1 if any(c["status"] == FAIL for c in checks) else 0)


def test_doctor_flags_a_thread_unsafe_numba_layer():
    out = _doctor("--json", NUMBA_THREADING_LAYER="workqueue")
    layer = next(c for c in json.loads(out.stdout) if c["name"] == "numba threading layer")
    assert out.returncode == 1 and layer["status"] == FAIL
    assert "workqueue" in layer["value"] and "unset NUMBA_THREADING_LAYER" in layer["fix"]


def test_doctor_text_lines_carry_status_and_fix(monkeypatch):
    monkeypatch.setenv("NUMBA_THREADING_LAYER", "workqueue")
    result = CliRunner().invoke(main, ["doctor"])
    lines = result.output.splitlines()
    assert result.exit_code == 1 and "checks: 1 fail" in lines[-1]
    failed = next(i for i, l in enumerate(lines) if l.startswith("fail") and "numba threading layer" in l)
    assert "fix: unset NUMBA_THREADING_LAYER" in lines[failed + 1]


def test_cpu_topology_parsing():
    assert numa.cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11} and numa.cpu_list("") == set()
    cpus = usable_cpus()
    assert 1 <= physical_cores(cpus) <= len(cpus) and 1 <= numa_nodes(cpus) <= len(cpus)


def test_numa_placement_check_says_where_pools_go_and_what_is_permitted():
    check = doctor._numa_placement_check("tbb")
    topology = numa.Topology.probe()
    assert check.value.startswith(numa.place_pools(topology, len(topology.nodes))[0].describe())
    assert "TBB's workers are shared by all pools" in check.value
    assert "mbind/move_pages permitted: a test page" in check.value or "Errno" in check.value
    assert "its numba team pinned with its thread" in doctor._numa_placement_check("omp").value


def test_numa_placement_check_warns_of_refused_syscalls_on_two_nodes(monkeypatch):
    def refuse(node):
        raise numa.NumaError(1, "mbind: Operation not permitted")

    monkeypatch.setattr(numa, "probe_placement", refuse)
    monkeypatch.setattr(numa.Topology, "probe", classmethod(lambda cls, *a, **k: cls({0: frozenset({0}), 1: frozenset({1})})))
    monkeypatch.setattr(numa, "probe_pinning", lambda cpus: None)
    check = doctor._numa_placement_check("omp")
    assert check.status == WARN and "pool 0: node 0, cpus 0" in check.value and "pool 1: node 1, cpus 1" in check.value
    assert "mbind: Operation not permitted" in check.value and "SYS_NICE" in check.fix
    monkeypatch.setattr(numa.Topology, "probe", classmethod(lambda cls, *a, **k: cls({0: frozenset({0})})))
    check = doctor._numa_placement_check("omp")
    assert check.status == OK and "one node: nothing to place" in check.value
