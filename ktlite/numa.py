"""NUMA placement of the CPU expert pools: which node(s) and cpus each pool gets, and the memory-policy
syscalls that put its experts' pages there.

    topology = Topology.probe()                  # nodes -> usable cpus, from /sys/devices/system/node
    placements = place_pools(topology, count)    # pool p -> node(s), cpus, memory policy
    bind_rows(array, owners, placements)         # rows of a [slots, ...] array -> their pool's node(s)
    page_nodes(array)                            # node of each resident page (move_pages, nodes=NULL)

Pools and nodes: with as many pools as nodes (the automatic --kt-threadpool-count) pool p owns node p; with more
pools, nodes are dealt round-robin and the pools on a node share its cpus; with fewer, nodes are dealt round-robin
to pools and a pool spans several. A pool on one node prefers that node for its pages (MPOL_PREFERRED: a full node
spills over instead of the process being OOM-killed, as MPOL_BIND would); one spanning nodes interleaves over them.
Pages are bound with MPOL_MF_MOVE, so pages an allocator already touched move too. The syscalls go through libc's
`syscall` (no libnuma); where the kernel refuses them (a container's seccomp profile: EPERM) `NumaError` says so and
the caller degrades with a warning. Nothing here imports numba, so `ktlite doctor` uses it too.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SYSFS_NODES = Path("/sys/devices/system/node")
MPOL_PREFERRED, MPOL_INTERLEAVE = 1, 3
MPOL_NAMES = {0: "default", MPOL_PREFERRED: "preferred", 2: "bind", MPOL_INTERLEAVE: "interleave"}
_MPOL_MF_MOVE = 2  # mbind: move pages already in the range to follow the policy
_MPOL_F_ADDR = 2  # get_mempolicy: the policy of the mapping at addr, not the thread's
_MASK_BITS = 1024  # node-mask bits passed to the kernel (its MAX_NUMNODES on common builds)
_SYSCALLS = {  # (mbind, get_mempolicy, move_pages)
    "x86_64": (237, 239, 279),
    "aarch64": (235, 236, 239),
}
PAGE = mmap.PAGESIZE


class NumaError(OSError):
    """A memory-policy syscall failed or is not available on this architecture."""


def cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def format_cpus(cpus: set[int] | frozenset[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (the sysfs / taskset form)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class Topology:
    """NUMA node id -> the cpus of it this process may run on (nodes with none are left out)."""

    nodes: dict[int, frozenset[int]]

    @classmethod
    def probe(cls, root: str | Path = SYSFS_NODES, allowed: set[int] | None = None) -> Topology:
        """Read `root` (laid out as /sys/devices/system/node: nodeN/cpulist); `allowed` defaults to this process's
        affinity. No such tree (not Linux, or no NUMA support): one node 0 holding every allowed cpu."""
        allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
        nodes = {}
        for node in Path(root).glob("node[0-9]*"):
            try:
                cpus = cpu_list((node / "cpulist").read_text()) & allowed
            except OSError:
                continue
            if cpus:
                nodes[int(node.name[4:])] = frozenset(cpus)
        return cls(dict(sorted(nodes.items())) or {0: frozenset(allowed)})


@dataclass(frozen=True)
class PoolPlacement:
    """Where one expert pool runs and keeps its experts."""

    pool: int
    nodes: tuple[int, ...]
    cpus: frozenset[int]

    @property
    def policy(self) -> int:
        return MPOL_PREFERRED if len(self.nodes) == 1 else MPOL_INTERLEAVE

    def describe(self) -> str:
        where = f"node {self.nodes[0]}" if len(self.nodes) == 1 else f"nodes {','.join(map(str, self.nodes))}"
        return f"pool {self.pool}: {where}, cpus {format_cpus(self.cpus)}, pages {MPOL_NAMES[self.policy]}"


def place_pools(topology: Topology, count: int) -> list[PoolPlacement]:
    """Pool -> node(s) and cpus (see the module docstring for the deal)."""
    ids = list(topology.nodes)
    out = []
    for p in range(count):
        mine = tuple(ids[p % len(ids):: count]) if count < len(ids) else (ids[p % len(ids)],)
        out.append(PoolPlacement(p, mine, frozenset().union(*(topology.nodes[n] for n in mine))))
    return out


# ---- memory-policy syscalls -----------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(which: int, *args) -> int:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise NumaError(errno.ENOSYS, f"no NUMA syscall numbers for {platform.machine()}")
    names = ("mbind", "get_mempolicy", "move_pages")
    result = _libc.syscall(ctypes.c_long(numbers[which]), *args)
    if result < 0:
        code = ctypes.get_errno()
        raise NumaError(code, f"{names[which]}: {os.strerror(code)}")
    return result


def _mask(nodes: tuple[int, ...] | list[int]) -> ctypes.Array:
    words = (ctypes.c_ulong * (_MASK_BITS // 64))()
    for n in nodes:
        words[n // 64] |= 1 << (n % 64)
    return words


def mbind(start: int, length: int, mode: int, nodes: tuple[int, ...]) -> None:
    """Policy `mode` over nodes for the page-aligned range [start, start + length), moving resident pages."""
    # maxnode is one more than the mask's bits: the kernel reads maxnode - 1 of them
    _syscall(0, ctypes.c_void_p(start), ctypes.c_ulong(length), ctypes.c_long(mode), _mask(nodes),
             ctypes.c_ulong(_MASK_BITS + 1), ctypes.c_uint(_MPOL_MF_MOVE))


def policy_at(addr: int) -> tuple[int, tuple[int, ...]]:
    """(mode, nodes) of the memory policy covering the page at `addr` (get_mempolicy, MPOL_F_ADDR)."""
    mode, mask = ctypes.c_int(), _mask(())
    _syscall(1, ctypes.byref(mode), mask, ctypes.c_ulong(_MASK_BITS), ctypes.c_void_p(addr - addr % PAGE),
             ctypes.c_ulong(_MPOL_F_ADDR))
    return mode.value, tuple(n for n in range(_MASK_BITS) if mask[n // 64] >> (n % 64) & 1)


def nodes_of(pages: np.ndarray) -> np.ndarray:
    """Node of each page address in `pages` (move_pages with nodes=NULL moves nothing and returns where each page is;
    a negative value is -errno: -ENOENT for a page never touched)."""
    addrs = np.ascontiguousarray(pages, np.uint64)
    status = np.empty(addrs.size, np.int32)
    if addrs.size:
        _syscall(2, ctypes.c_int(0), ctypes.c_ulong(addrs.size), ctypes.c_void_p(addrs.ctypes.data), None,
                 ctypes.c_void_p(status.ctypes.data), ctypes.c_int(0))
    return status


def row_ranges(a: np.ndarray) -> np.ndarray:
    """[rows, 2] page-aligned (start, end) of each row of C-contiguous `a`: the pages whose first byte lies in that
    row (a page straddling two rows goes with the row its start lies in; one starting before `a`, e.g. on
    the allocator's header, is left out)."""
    if not a.flags.c_contiguous:
        raise ValueError("row_ranges needs a C-contiguous array")
    base, row = a.ctypes.data, (a.nbytes // a.shape[0] if a.shape[0] else 0)
    bounds = base + row * np.arange(a.shape[0] + 1, dtype=np.uint64)
    pages = (bounds + np.uint64(PAGE - 1)) // np.uint64(PAGE) * np.uint64(PAGE)  # first page starting at or after
    return np.stack([pages[:-1], pages[1:]], axis=1)


def bind_rows(a: np.ndarray, owners: np.ndarray, placements: list[PoolPlacement]) -> int:
    """Each row r of `a` ([slots, ...]) gets pool owners[r]'s policy; consecutive rows with one policy (one pool's,
    or pools' on the same node) are one call, so one memory mapping. Returns the bytes bound. Raises NumaError on
    the first refusal."""
    ranges, bound = row_ranges(a), 0
    where = [(p.policy, p.nodes) for p in placements]
    r = 0
    while r < len(ranges):
        end = r + 1
        while end < len(ranges) and where[int(owners[end])] == where[int(owners[r])]:
            end += 1
        start, stop = int(ranges[r, 0]), int(ranges[end - 1, 1])
        if stop > start:
            place = placements[int(owners[r])]
            mbind(start, stop - start, place.policy, place.nodes)
            bound += stop - start
        r = end
    return bound


def sample_pages(ranges: np.ndarray, per_range: int = 4) -> np.ndarray:
    """Up to `per_range` page addresses spread over each (start, end) range: enough to check where a pool's
    experts are without listing every page of hundreds of GiB."""
    out = []
    for start, stop in ranges.tolist():
        count = (stop - start) // PAGE
        if count:
            out.append(start + PAGE * np.unique(np.linspace(0, count - 1, min(count, per_range)).astype(np.uint64)))
    return np.concatenate(out).astype(np.uint64) if out else np.zeros(0, np.uint64)


def page_nodes(a: np.ndarray, rows: np.ndarray, per_row: int = 4) -> Counter[int]:
    """Node -> sampled resident pages of `a`'s rows where `rows` [slots] is True (untouched pages are not counted)."""
    status = nodes_of(sample_pages(row_ranges(a)[rows], per_row))
    return Counter(int(s) for s in status if s >= 0)


def probe_placement(node: int) -> str:
    """Try, on one fresh anonymous page, what CPUMoE does to its experts' pages: mbind (MPOL_PREFERRED `node`),
    get_mempolicy, a first touch and move_pages. Returns what was seen; raises NumaError naming the refused call."""
    buf = mmap.mmap(-1, PAGE)
    page = np.frombuffer(buf, np.uint8)
    try:
        addr = page.ctypes.data
        mbind(addr, PAGE, MPOL_PREFERRED, (node,))
        mode, nodes = policy_at(addr)
        page[0] = 1  # first touch
        (where,) = nodes_of(np.array([addr], np.uint64))
        if where < 0:
            raise NumaError(-where, f"move_pages: {os.strerror(-where)}")
        return f"a test page got policy {MPOL_NAMES.get(mode, mode)} {','.join(map(str, nodes))} and landed on node {where}"
    finally:
        del page
        buf.close()


def probe_pinning(cpus: frozenset[int]) -> str | None:
    """Whether this thread may set its affinity (set to `cpus` and back); None, or why not."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        return str(exc)
    finally:
        os.sched_setaffinity(0, before)
    return None
