"""How the GQA kernels (decode, extend) read the K and V caches, plain or packed FP8.

A pool buffer is either plain values [slots, kv_heads, head_dim] in a float dtype, or packed FP8 rows
[slots, kv_heads, head_dim + 4] uint8 (kv_fp8.head_rows: head_dim e4m3 codes and one fp32 scale per token and
kv head). `head_operands` turns either into the same kernel arguments: K and V value pointers, their scale
pointers and all their strides, and the constexprs PACKED / E4M3_BITS; the kernels then run one code path for
both layouts, and a plain pool compiles to exactly the loads and math it had before.

Where the scales go: a key's scale multiplies its column of QK^T in fp32 after the dot (one multiply per score
instead of head_dim, and the codes reach tl.dot exactly: e4m3 values are exact in bf16 and fp16); a value
tile is dequantized in fp32 and then cast to q's dtype (folding its scale into the probabilities instead
would push p * scale into fp16's subnormals for small heads at long contexts).

Before sm89 Triton has no e4m3 type, so there the codes are passed as bytes and decoded with integer ops
(fp8._e4m3_bits_to_f16, which yields value / 256; the 256 goes into the scale), as latent_tile does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ktlite.kernels.triton.common import cast_like
from ktlite.kernels.triton.fp8 import _e4m3_bits_to_f16
from ktlite.kernels.triton.kv_fp8 import e4m3_as_bytes, is_packed, packed_head_rows


@dataclass(frozen=True)
class HeadOperands:
    k: torch.Tensor  # [slots, kv_heads, D]: the float buffer itself, or e4m3 codes (or their bytes)
    v: torch.Tensor  # [slots, kv_heads, Dv]
    k_scales: torch.Tensor  # [slots, kv_heads, 1] fp32; a plain pool passes k again (never read)
    v_scales: torch.Tensor
    packed: bool
    e4m3_bits: bool

    @property
    def pointers(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.k_scales, self.v_scales

    @property
    def strides(self) -> tuple[int, ...]:
        """(slot, head) strides of k, v, k_scales, v_scales, in their own elements."""
        return tuple(s for t in self.pointers for s in t.stride()[:2])

    @property
    def constexprs(self) -> dict[str, object]:
        return dict(PACKED=self.packed, E4M3_BITS=self.e4m3_bits)


def head_operands(k_buffer: torch.Tensor, v_buffer: torch.Tensor, e4m3_bits: bool | None = None) -> HeadOperands:
    """The kernel arguments for a layer's K and V pool buffers. e4m3_bits (decode the fp8 bytes with integer ops)
    defaults to True for a packed pool on a CUDA GPU before sm89."""
    assert v_buffer.dtype == k_buffer.dtype, "K and V pools must share a dtype"
    if not is_packed(k_buffer):
        assert not e4m3_bits, "e4m3_bits needs packed FP8 rows"
        return HeadOperands(k_buffer, v_buffer, k_buffer, v_buffer, False, False)
    (k, k_scales, _), (v, v_scales, _) = (packed_head_rows(b).views(b) for b in (k_buffer, v_buffer))
    if e4m3_bits is None:
        e4m3_bits = e4m3_as_bytes(k_buffer)
    if e4m3_bits:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    return HeadOperands(k, v, k_scales, v_scales, True, e4m3_bits)


@triton.jit
def _token_scales(Scales, slot, stride, valid, E4M3_BITS: tl.constexpr):
    """fp32 [BN]: the scale of the token at each pool slot (Scales at the kv head already; 0 where not valid),
    times 256 for codes decoded as value / 256."""
    scale = tl.load(Scales + slot * stride, mask=valid, other=0.0)
    if E4M3_BITS:
        scale = scale * 256.0
    return scale


@triton.jit
def key_tile(k, q, E4M3_BITS: tl.constexpr):
    """A loaded K tile [BD, BN] in q's dtype, ready for tl.dot: values, or e4m3 codes (scales go on the scores)."""
    if E4M3_BITS:
        return cast_like(_e4m3_bits_to_f16(k), q)
    else:
        return cast_like(k, q)


@triton.jit
def scaled_scores(s, KScales, slot, stride, valid, PACKED: tl.constexpr, E4M3_BITS: tl.constexpr):
    """QK^T [rows, BN] against key_tile's codes -> against the real keys: column j times its token's scale."""
    if PACKED:
        return s * _token_scales(KScales, slot, stride, valid, E4M3_BITS)[None, :]
    else:
        return s


@triton.jit
def value_tile(v, VScales, slot, stride, valid, q, PACKED: tl.constexpr, E4M3_BITS: tl.constexpr):
    """A loaded V tile [BN, BDV] as real values in q's dtype, ready for tl.dot."""
    if PACKED:
        scale = _token_scales(VScales, slot, stride, valid, E4M3_BITS)[:, None]
        if E4M3_BITS:
            return cast_like(_e4m3_bits_to_f16(v).to(tl.float32) * scale, q)
        else:
            return cast_like(v.to(tl.float32) * scale, q)
    else:
        return cast_like(v, q)
