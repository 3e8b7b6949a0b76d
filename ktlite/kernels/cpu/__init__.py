"""CPU expert kernels (Numba). Numba's cache for this package is keyed on a hash of all its sources
(numba_cache.py), so a kernel is never loaded from the cache after a helper it inlines from another file changed;
then Numba's compile target is fixed, from the CPU's real flags (target.py): every kernel module below compiles
for it."""

from ktlite.kernels.cpu.numba_cache import key_cache_on_sources
from ktlite.kernels.cpu.target import configure_numba

key_cache_on_sources()
configure_numba()
