"""Numba threading for the CPU experts: a thread-safe layer and P pools of worker threads.

Each pool is one Python worker thread that calls the parallel (prange) kernels with its own share
of the threads (`numba.set_num_threads` is per calling thread). Several pools, or a pool and the
caller, then launch parallel regions at the same time, which numba's default 'workqueue' layer does
not allow (it aborts the process), so the layer is switched to a thread-safe one ('tbb' or 'omp')
before numba starts its first parallel region. If some other code already started 'workqueue',
kernel launches are serialised with a lock instead (correct, but pools no longer overlap).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numba
from numba.np.ufunc import parallel as _numba_parallel

logger = logging.getLogger(__name__)


def ensure_threadsafe_layer() -> bool:
    """Pick a thread-safe numba threading layer if still possible; True if launches may overlap."""
    if not _numba_parallel._is_initialized and "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "threadsafe"
    if not _numba_parallel._is_initialized:
        return numba.config.THREADING_LAYER in ("threadsafe", "safe", "omp", "tbb")
    return numba.threading_layer() in ("omp", "tbb")


class ExpertPools:
    """`count` single-thread executors; pool p runs its kernels with `threads[p]` numba threads."""

    def __init__(self, num_threads: int | None = None, count: int = 1):
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
        self._executors = [
            ThreadPoolExecutor(1, thread_name_prefix=f"ktlite-cpu-moe-{p}", initializer=numba.set_num_threads,
                               initargs=(n,))
            for p, n in enumerate(self.threads)
        ]

    @property
    def count(self) -> int:
        return len(self._executors)

    def submit(self, pool: int, fn: Callable, *args) -> Future:
        return self._executors[pool].submit(self._run, fn, *args)

    def run_here(self, fn: Callable, *args):
        """fn(*args) on the calling thread with all the pools' threads, for a caller with nothing to
        overlap (a CPU device): a hand-off to a pool thread would only add a queue, a wake-up and GIL
        hand-offs to every layer of a decode step."""
        previous = numba.get_num_threads()
        numba.set_num_threads(sum(self.threads))
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
