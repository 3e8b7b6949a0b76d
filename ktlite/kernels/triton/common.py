"""Pieces shared by the Triton kernels: the interpreter switch and a tl.dot that works under it."""

import os

import triton
import triton.language as tl

# Read once at import, like triton.jit itself: a kernel module decorated without TRITON_INTERPRET
# compiles for a GPU forever, one decorated with it is interpreted forever.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET = tl.constexpr(INTERPRET)


# usable shared memory per block (bytes) by compute capability (10 * major + minor)
SHARED_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def shared_bytes(arch: int) -> int:
    """Shared memory per block on sm{arch}; an unknown arch gets the smallest of the table."""
    return SHARED_BYTES.get(arch, min(SHARED_BYTES.values()))


def dot_width(n: int) -> int:
    """Tile width for a dimension that a tl.dot contracts over: a power of two, and at least 16,
    which a GPU compile demands (the interpreter does not, so tiny test shapes would pass it and
    fail on a GPU). Loads mask the columns past `n`, so the extra width adds zeros."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def dot(a, b, acc):
    """acc + a @ b with fp32 accumulation.

    The interpreter (triton 3.9) stores bf16 as uint16 and its tl.dot multiplies those bit
    patterns, so under TRITON_INTERPRET both operands are widened to fp32 first; the products of
    bf16/fp16/fp8 values are exact in fp32, so this matches the GPU's fp32-accumulating MMA.
    On a GPU the branch folds away (constexpr) and tensor cores see the native dtype.
    """
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def cast_like(x, like):
    """x converted to like's dtype. The interpreter turns int -> bf16 into garbage (NaN), so under
    TRITON_INTERPRET the conversion goes through fp32 (exact for int8/int4 values)."""
    if _INTERPRET:
        return x.to(tl.float32).to(like.dtype)
    else:
        return x.to(like.dtype)
