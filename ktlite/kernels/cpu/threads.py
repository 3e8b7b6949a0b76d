"""Numba threading for the CPU experts: a thread-safe layer and P pools of worker threads.

Each pool is one Python worker thread that calls the parallel (prange) kernels with its own share
of the threads (`numba.set_num_threads` is per calling thread). Several pools, or a pool and the
caller, then launch parallel regions at the same time, which numba's default 'workqueue' layer does
not allow (it aborts the process), so the layer is switched to a thread-safe one before numba starts
its first parallel region: 'tbb' where the `tbb` package is installed (a dependency on x86-64), else
'omp'. If some other code already started 'workqueue', kernel launches are serialised with a lock
instead (correct, but pools no longer overlap).

Why tbb first: the engine launches its kernels from its forward thread, not the process's initial
thread, and there GNU OpenMP's team workers went to sleep between parallel regions and each region
waited ~0.5-2 ms for them to wake (measured on a 2-core Xeon VM: a tiny kernel took 1.4 ms from a
second thread, 55 us from the initial one; an 8-layer V2-Lite-shaped CPU-only decode step 94 ms, the
same layers at tiny widths 77 ms). With TBB's shared arena: 80 us, 52 ms and 13 ms (bench/history/).
pip's `tbb` wheel puts libtbb.so.12 under <prefix>/lib, off the loader's path, so it is loaded by
its full path before numba looks for it.

NUMA: each pool runs on its node's cpus (ktlite.numa.place_pools): its thread pins itself there when the pool
starts, before any kernel. Under 'omp' the pool thread is its OpenMP team's master and the team's threads, started
from it, inherit the mask (libgomp sets none of its own without OMP_PROC_BIND / GOMP_CPU_AFFINITY), so the whole
pool is pinned. Under 'tbb' every parallel region is a task arena on one process-wide set of TBB workers that
move between the pools' arenas and keep the process's mask, also when a pinned pool thread's region started them:
only the pool thread, which runs its share of each region, is pinned; a pool of one thread is pinned whole
(tests/test_numa.py reads both layers' thread masks). On a CPU device CPUMoE.forward runs every pool's share on
the calling thread (run_here), which is not pinned. The experts' pages are placed on their pools' nodes whatever
the layer (moe.py).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numba
from numba.np.ufunc import parallel as _numba_parallel

from ktlite.numa import PoolPlacement, Topology, format_cpus, place_pools

logger = logging.getLogger(__name__)


@functools.cache  # one look (and at most one warning) per process
def load_tbb() -> bool:
    """Load the `tbb` package's libtbb.so.12 (RTLD_GLOBAL: numba's tbbpool then finds it by its soname);
    False where the package is not installed or its library does not load."""
    try:
        files = importlib.metadata.files("tbb") or []
        dist = importlib.metadata.distribution("tbb")
    except importlib.metadata.PackageNotFoundError:
        return False
    for f in files:
        if f.name == "libtbb.so.12":
            try:
                ctypes.CDLL(str(dist.locate_file(f)), mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError as exc:
                logger.warning("the tbb package's %s does not load (%s): numba uses OpenMP threads", f, exc)
    return False


def ensure_threadsafe_layer() -> bool:
    """Pick a thread-safe numba threading layer if still possible ('tbb' if it loads, else 'omp': see the
    module docstring); True if launches may overlap. NUMBA_THREADING_LAYER, if set, is left alone."""
    if not _numba_parallel._is_initialized:
        tbb = load_tbb()  # also where NUMBA_THREADING_LAYER asks for tbb: numba alone would not find it
        if "NUMBA_THREADING_LAYER" not in os.environ:
            numba.config.THREADING_LAYER = "tbb" if tbb else "threadsafe"  # threadsafe: tbb, else omp
    if not _numba_parallel._is_initialized:
        return numba.config.THREADING_LAYER in ("threadsafe", "safe", "omp", "tbb")
    return numba.threading_layer() in ("omp", "tbb")


def _enter_pool(cpus: frozenset[int], threads: int) -> str | None:
    """A pool thread's first task: pin it to its node's cpus (None, or why not) and set its numba thread count."""
    numba.set_num_threads(threads)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        return str(exc)
    return None


def pinned_threads() -> str:
    """Which of a pool's threads its pinning reaches under the threading layer in use (see the module docstring)."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region yet: the layer numba will pick
        layer = numba.config.THREADING_LAYER
    if layer == "omp":
        return "its thread and OpenMP team pinned"
    if layer == "tbb":
        return "its thread pinned (TBB's workers, shared by all pools, are not)"
    return "its thread pinned"


class ExpertPools:
    """`count` single-thread executors; pool p runs its kernels with `threads[p]` numba threads, pinned to the cpus
    of `placements[p]` (from `topology`, default: this machine's)."""

    def __init__(self, num_threads: int | None = None, count: int = 1, topology: Topology | None = None):
        total = num_threads or numba.config.NUMBA_NUM_THREADS
        if total > numba.config.NUMBA_NUM_THREADS:
            logger.warning("--kt-cpuinfer %d is more than numba's %d threads (NUMBA_NUM_THREADS); using %d",
                           total, numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS)
            total = numba.config.NUMBA_NUM_THREADS
        if count < 1 or count > total:
            raise ValueError(f"threadpool count must be between 1 and the thread count {total}, got {count}")
        self.threads = [total // count + (1 if p < total % count else 0) for p in range(count)]
        self._concurrent = ensure_threadsafe_layer()
        if not self._concurrent and count > 1:
            logger.warning("numba threading layer %r is not thread-safe: %d CPU expert pools will run one at a time",
                           numba.threading_layer(), count)
        self._launch_lock = threading.Lock()
        self.placements: list[PoolPlacement] = place_pools(topology or Topology.probe(), count)
        self._executors = [ThreadPoolExecutor(1, thread_name_prefix=f"ktlite-cpu-moe-{p}") for p in range(count)]
        # each thread starts now and pins itself before its first kernel (an OpenMP team inherits the mask then)
        self.pin_errors = [ex.submit(_enter_pool, place.cpus, n).result()
                           for ex, place, n in zip(self._executors, self.placements, self.threads)]
        for place, error in zip(self.placements, self.pin_errors):
            if error:
                logger.warning("CPU expert pool %d: its thread is not pinned to cpus %s (%s)", place.pool,
                               format_cpus(place.cpus), error)

    @property
    def count(self) -> int:
        return len(self._executors)

    def submit(self, pool: int, fn: Callable, *args) -> Future:
        return self._executors[pool].submit(self._run, fn, *args)

    def run_here(self, fn: Callable, *args):
        """fn(*args) on the calling thread with all the pools' threads, for a caller with nothing to
        overlap (a CPU device): a hand-off to a pool thread would only add a queue, a wake-up and GIL
        hand-offs to every layer of a decode step."""
        previous, total = numba.get_num_threads(), sum(self.threads)
        if previous == total:  # the usual case (a CPU device's forward thread): numba's setter costs ~10 us a call
            return self._run(fn, *args)
        numba.set_num_threads(total)
        try:
            return self._run(fn, *args)
        finally:
            numba.set_num_threads(previous)

    def _run(self, fn: Callable, *args):
        if self._concurrent:
            return fn(*args)
        with self._launch_lock:
            return fn(*args)

    def close(self) -> None:
        for ex in self._executors:
            ex.shutdown(wait=True)
