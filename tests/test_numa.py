"""NUMA placement of the CPU expert pools (ktlite/numa.py, kernels/cpu/threads.py, CPUMoE): the topology and the
pool -> node deal on fake sysfs trees, each pool thread's affinity, the memory policy and node of the experts'
pages, and what `numa_report()` / the startup log say. A CI machine has one node, so two-node cases use a fake
topology whose nodes are this process's cpus split in two; what needs the kernel's memory-policy syscalls skips
with the refusal (a container's seccomp profile: EPERM) as its reason."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ktlite import numa
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.kernels.cpu.quant import empty_quantized
from ktlite.kernels.cpu.threads import ExpertPools
from ktlite.numa import MPOL_INTERLEAVE, MPOL_PREFERRED, PAGE, PoolPlacement, Topology

E, H, I = 4, 256, 128  # a gate_up row of a slot spans several pages in every format below


def _experts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g))


def _two_nodes() -> Topology:
    """This process's cpus as two fake nodes (with one cpu, the same cpu twice)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return Topology({0: frozenset(cpus[:half]), 1: frozenset(cpus[half:] or cpus[:half])})


def _syscalls_or_skip() -> int:
    """The first real node, after checking the memory-policy syscalls run here (else skip, saying why)."""
    node = next(iter(Topology.probe().nodes))
    try:
        numa.probe_placement(node)
    except numa.NumaError as exc:
        pytest.skip(f"memory-policy syscalls refused on this machine ({exc}): page placement cannot be checked")
    return node


# ---- topology and the pool -> node deal --------------------------------------------------------------------------


def test_cpu_list_and_format():
    assert numa.cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and numa.cpu_list("") == set()
    assert numa.format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and numa.format_cpus(set()) == ""
    for text in ("0", "0-63", "1,3,5-9,100"):
        assert numa.format_cpus(numa.cpu_list(text)) == text


def test_topology_probe_on_a_fake_sysfs_tree(tmp_path):
    for name, cpus in (("node0", "0-3"), ("node1", "4-7"), ("node2", "")):  # node2: memory only (CXL, HBM)
        (tmp_path / name).mkdir()
        (tmp_path / name / "cpulist").write_text(cpus + "\n")
    (tmp_path / "node3").mkdir()  # no cpulist: left out
    (tmp_path / "possible").write_text("0-3\n")
    assert Topology.probe(tmp_path, allowed=set(range(8))).nodes == {0: frozenset(range(4)), 1: frozenset(range(4, 8))}
    # only the cpus this process may use count; a node with none of them is left out
    assert Topology.probe(tmp_path, allowed={1, 2, 5}).nodes == {0: frozenset({1, 2}), 1: frozenset({5})}
    assert Topology.probe(tmp_path, allowed={6}).nodes == {1: frozenset({6})}
    # no tree (not Linux, no NUMA): one node 0 with every allowed cpu
    assert Topology.probe(tmp_path / "missing", allowed={0, 1}).nodes == {0: frozenset({0, 1})}
    assert Topology.probe().nodes  # this machine's


def test_place_pools_one_per_node_more_and_fewer():
    two = Topology({0: frozenset({0, 1}), 1: frozenset({2, 3})})
    assert numa.place_pools(two, 2) == [PoolPlacement(0, (0,), frozenset({0, 1})), PoolPlacement(1, (1,), frozenset({2, 3}))]
    # more pools than nodes: dealt round-robin, pools on one node share its cpus
    four = numa.place_pools(two, 4)
    assert [p.nodes for p in four] == [(0,), (1,), (0,), (1,)] and four[2].cpus == frozenset({0, 1})
    assert all(p.policy == MPOL_PREFERRED for p in four)
    # fewer: a pool spans nodes, its pages interleaved over them
    (one,) = numa.place_pools(two, 1)
    assert one.nodes == (0, 1) and one.cpus == frozenset(range(4)) and one.policy == MPOL_INTERLEAVE
    wide = Topology({n: frozenset({n}) for n in (0, 1, 4, 5)})  # node ids need not be contiguous
    assert [p.nodes for p in numa.place_pools(wide, 2)] == [(0, 4), (1, 5)]
    assert numa.place_pools(two, 2)[1].describe() == "pool 1: node 1, cpus 2-3, pages preferred"
    assert one.describe() == "pool 0: nodes 0,1, cpus 0-3, pages interleave"


# ---- threads --------------------------------------------------------------------------------------------------------


def test_each_pool_thread_runs_on_its_nodes_cpus():
    """Unfixed, every pool thread kept the whole process mask."""
    topology = _two_nodes()
    process = os.sched_getaffinity(0)
    pools = ExpertPools(2, 2, topology)
    try:
        if any(pools.pin_errors):
            pytest.skip(f"sched_setaffinity refused here: {pools.pin_errors}")
        for place in pools.placements:
            assert pools.submit(place.pool, os.sched_getaffinity, 0).result() == topology.nodes[place.pool]
        assert os.sched_getaffinity(0) == process  # the caller's thread is left alone
    finally:
        pools.close()


_TEAM = """
import ctypes, json, os
import numba, numpy as np
from ktlite.kernels.cpu.threads import ExpertPools, ensure_threadsafe_layer
from ktlite.numa import Topology, cpu_list

ensure_threadsafe_layer()
gettid = ctypes.CDLL(None).gettid
gettid.restype, gettid.argtypes = ctypes.c_int, ()

@numba.njit(parallel=True)
def who(n):
    tid = np.empty(n, np.int64)
    for i in numba.prange(n):
        tid[i] = gettid()
    return tid

def mask(tid):
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return sorted(cpu_list(line.split(":")[1]))

cpu0 = min(os.sched_getaffinity(0))
pools = ExpertPools(2, 1, Topology({0: frozenset({cpu0})}))
assert not pools.pin_errors[0], pools.pin_errors
pool_tid = pools.submit(0, lambda: gettid()).result()
team = set(pools.submit(0, who, 1 << 20).result().tolist())
print(json.dumps([numba.threading_layer(), cpu0, sorted(os.sched_getaffinity(0)), mask(pool_tid),
                  [mask(t) for t in team if t != pool_tid]]))
pools.close()
"""


@pytest.mark.parametrize("layer", ["omp", "tbb"])
def test_which_of_a_pools_threads_are_pinned(layer):
    """The masks of the threads that ran a parallel region of a pool pinned to one cpu. omp: the pool thread's
    OpenMP team starts from it and inherits its mask, so all of them. tbb: the pool thread only; the workers, one
    set shared by all pools, keep the process's mask (the limitation threads.py and the README state)."""
    if layer == "tbb" and not _has_tbb():
        pytest.skip("the tbb package is not installed (a dependency on x86-64 only)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    env |= {"NUMBA_THREADING_LAYER": layer, "NUMBA_NUM_THREADS": "2"}
    res = subprocess.run([sys.executable, "-c", _TEAM], env=env, capture_output=True, text=True, timeout=300)
    if res.returncode and "No threading layer could be loaded" in res.stderr:
        pytest.skip(f"numba's {layer} threading layer does not load here")
    assert res.returncode == 0, res.stderr[-2000:]
    got, cpu0, process, pool_thread, others = json.loads(res.stdout.splitlines()[-1])
    assert got == layer and pool_thread == [cpu0]
    if layer == "omp":
        assert others and all(m == [cpu0] for m in others)  # the other OpenMP thread ran iterations, pinned
    else:
        assert all(m == process for m in others)  # whichever TBB workers took part: not pinned


def _has_tbb() -> bool:
    try:
        importlib.metadata.distribution("tbb")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# ---- pages --------------------------------------------------------------------------------------------------------


def test_row_ranges_pages_start_in_their_row():
    a = np.empty((3, 2 * PAGE + 100), np.uint8)
    r = numa.row_ranges(a)
    assert r.shape == (3, 2) and (r % PAGE == 0).all() and (r[1:, 0] == r[:-1, 1]).all()
    base = a.ctypes.data
    for row, (start, stop) in enumerate(r.tolist()):
        assert base + row * a.shape[1] <= start < base + (row + 1) * a.shape[1] and stop > start
    assert numa.row_ranges(np.empty((0, 8), np.uint8)).shape == (0, 2)


def test_bind_rows_gives_each_pool_its_rows(monkeypatch):
    """The split on a fake two-node topology: one mbind per run of a pool's consecutive rows, with its node."""
    calls = []
    monkeypatch.setattr(numa, "mbind", lambda *args: calls.append(args))
    places = numa.place_pools(_two_nodes(), 2)
    a = np.empty((6, 3 * PAGE), np.uint8)
    r = numa.row_ranges(a)
    owners = np.array([0, 0, 1, 0, 1, 1])
    assert numa.bind_rows(a, owners, places) == int(r[-1, 1] - r[0, 0])
    assert calls == [(int(r[0, 0]), int(r[1, 1] - r[0, 0]), MPOL_PREFERRED, (0,)),
                     (int(r[2, 0]), int(r[2, 1] - r[2, 0]), MPOL_PREFERRED, (1,)),
                     (int(r[3, 0]), int(r[3, 1] - r[3, 0]), MPOL_PREFERRED, (0,)),
                     (int(r[4, 0]), int(r[5, 1] - r[4, 0]), MPOL_PREFERRED, (1,))]
    # pools on one node: one call (one memory mapping) for the lot
    calls.clear()
    numa.bind_rows(a, owners, numa.place_pools(Topology({0: frozenset({0})}), 2))
    assert calls == [(int(r[0, 0]), int(r[-1, 1] - r[0, 0]), MPOL_PREFERRED, (0,))]


def test_mbind_then_first_touch_lands_on_the_node():
    node = _syscalls_or_skip()
    buf = mmap.mmap(-1, 16 * PAGE)  # fresh pages (np.empty may reuse heap pages already touched)
    a = np.frombuffer(buf, np.uint8).reshape(2, 8 * PAGE)
    start = int(numa.row_ranges(a)[0, 0])
    assert numa.policy_at(start) == (0, ())  # the default policy
    places = [PoolPlacement(0, (node,), frozenset()), PoolPlacement(1, (node,), frozenset())]
    numa.bind_rows(a, np.array([0, 1]), places)
    for start, stop in numa.row_ranges(a).tolist():
        assert numa.policy_at(start) == (MPOL_PREFERRED, (node,)) == numa.policy_at(stop - PAGE)
    assert numa.page_nodes(a, np.ones(2, bool)) == {}  # nothing touched yet: move_pages finds no page
    a[...] = 1
    assert numa.page_nodes(a, np.ones(2, bool)) == {node: 8}  # 4 sampled pages a row
    everywhere = tuple(Topology.probe().nodes)
    b = np.empty((1, 4 * PAGE), np.uint8)
    numa.bind_rows(b, np.zeros(1, int), [PoolPlacement(0, everywhere, frozenset())])
    assert numa.policy_at(int(numa.row_ranges(b)[0, 0])) == ((MPOL_PREFERRED, everywhere) if len(everywhere) == 1
                                                             else (MPOL_INTERLEAVE, everywhere))
    del a
    buf.close()


@pytest.mark.parametrize("method", ["INT4", "INT8", "FP8", "BF16", "Q4_K"])
def test_empty_quantized_places_each_array_before_its_fill(method):
    seen = []

    def place(array):  # what CPUMoE's binding may find: memory someone else wrote
        seen.append(array)
        array.view(np.uint8)[...] = 0xAB

    w = empty_quantized(method, 32 if method != "Q4_K" else 256, (3,), 16, 256, place)
    assert [id(x) for x in seen] == [id(w.qweight), id(w.scales)]
    assert (w.qweight.view(np.uint8) == (0x88 if method == "INT4" else 0)).all()  # INT4: nibble 8 encodes zero
    assert not w.scales.view(np.uint8).any()
    if method == "INT8":
        assert w.qweight.ctypes.data % 64 == 0  # AMX tile rows on cache lines


# ---- CPUMoE -------------------------------------------------------------------------------------------------------


def _layer_arrays(moe: CPUMoE, layer: int = 0):
    lay = moe.layers[layer]
    return lay.pool_of, [a for w in (lay.gate_up, lay.down) for a in (w.qweight, w.scales)]


def test_cpu_moe_binds_each_slot_to_its_pools_node(monkeypatch):
    """Two pools on a fake two-node topology: every row of every expert array is bound to its pool's node before
    its first write, and numa_report names each pool's node, cpus, pinning and pages."""
    calls = []
    monkeypatch.setattr(numa, "mbind", lambda *args: calls.append(args))  # node 1 does not exist here
    topology = _two_nodes()
    gate, up, down = _experts()
    with CPUMoE("INT4", 32, num_threads=2, threadpool_count=2, topology=topology) as m:
        m.add_layer(0, gate, up, down)
        pool_of, arrays = _layer_arrays(m)
        assert m.bind_error is None and pool_of.tolist() == [0, 0, 1, 1]  # a block of slots per pool
        assert len(calls) <= 2 * len(arrays)  # one mbind per pool per array
        for a in arrays:
            for slot, (start, stop) in enumerate(numa.row_ranges(a).tolist()):
                if stop > start:
                    assert [nodes for at, length, _, nodes in calls if at <= start and stop <= at + length] == \
                        [(int(pool_of[slot]),)]
        report = m.numa_report()
    assert len(report) == 2
    for p, line in enumerate(report):
        assert line.startswith(f"CPU expert pool {p}: node {p}, cpus {numa.format_cpus(topology.nodes[p])}, "
                               "pages preferred; its thread")
        # the fake mbind placed nothing: this machine's one node holds the pages, and the report says so
        assert "GiB of experts' pages placed" in line and f"sampled pages on node {p}" in line
        assert "not pinned" not in line.split(";")[1]


def test_cpu_moe_pages_get_their_pools_policy_and_node():
    """This machine's topology, the real syscalls: every slot's rows carry its pool's policy (unfixed: the default
    policy) and sampled pages lie on the pool's node."""
    _syscalls_or_skip()
    gate, up, down = _experts()
    with CPUMoE("INT4", 32, num_threads=2, threadpool_count=2) as m:
        m.add_layer(0, gate, up, down)
        if getattr(m, "bind_error", None):
            pytest.skip(f"mbind refused for the experts here: {m.bind_error}")
        pool_of, arrays = _layer_arrays(m)
        for a in arrays:
            for slot, (start, stop) in enumerate(numa.row_ranges(a).tolist()):
                if stop > start:
                    place = m.pools.placements[pool_of[slot]]
                    assert numa.policy_at(start) == (place.policy, place.nodes)
        for place, line in zip(m.pools.placements, m.numa_report()):
            nodes = ",".join(map(str, place.nodes))
            counts = line.rsplit("; ", 1)[1].split(" sampled")[0]  # "<on its nodes>/<sampled>"
            on, sampled = map(int, counts.split(", ")[-1].split("/"))
            assert sampled > 0 and on == sampled and f"on node{'s' * (len(place.nodes) > 1)} {nodes}" in line


def test_cpu_moe_reports_a_refused_mbind(monkeypatch, caplog):
    def refuse(*args):
        raise numa.NumaError(1, "mbind: Operation not permitted")

    monkeypatch.setattr(numa, "mbind", refuse)
    caplog.set_level(logging.WARNING, logger="ktlite.kernels.cpu.moe")
    gate, up, down = _experts()
    with CPUMoE("INT8", 32, num_threads=2, threadpool_count=2) as m:
        m.add_layer(0, gate, up, down)
        m.add_layer(1, gate, up, down)
        assert m.bind_error == "[Errno 1] mbind: Operation not permitted"
        assert all("experts' pages not placed ([Errno 1] mbind: Operation not permitted)" in line
                   for line in m.numa_report())
    assert sum("not placed on their pools' NUMA nodes" in r.getMessage() for r in caplog.records) == 1


def test_startup_log_reports_the_pools(tiny_v3, caplog):
    from ktlite import Engine

    caplog.set_level(logging.INFO, logger="ktlite.runtime.assembly")
    with Engine(str(tiny_v3), kt_method="INT4", kt_cpuinfer=2, kt_threadpool_count=2, max_total_tokens=256,
                chunked_prefill_size=64, gpu_memory="1GiB"):
        pass
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU expert pool")]
    assert [line.split(":")[0] for line in lines] == ["CPU expert pool 0", "CPU expert pool 1"]
    assert all("cpus" in line and "pinned" in line and "pages" in line for line in lines)
