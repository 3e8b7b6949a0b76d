"""CPU expert kernels (Numba). Numba's compile target is fixed first, from the CPU's real flags
(target.py): every kernel module below compiles for it."""

from ktlite.kernels.cpu.target import configure_numba

configure_numba()
