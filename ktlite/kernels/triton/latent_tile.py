"""How the MLA kernels (decode, extend, sparse) read the latent cache, plain or packed FP8.

A pool buffer is either plain values [slots, kv_lora_rank + rope] in a float dtype, or packed FP8 rows
[slots, bytes] uint8 (kv_fp8.latent_rows: e4m3 latent, an fp32 scale per 128 values, bf16 rope).
`latent_operands` turns either into the same kernel arguments: three row pointers (latent values,
scales, rope) with their row strides, and the constexprs PACKED / E4M3_BITS / GROUP. `load_latent`
loads one tile of tokens through them and dequantizes in registers, so every kernel has one code
path for both layouts, and a plain buffer compiles to exactly the loads it had before.

Before sm89 Triton has no e4m3 type, so there the latent bytes are decoded with integer ops
(fp8._e4m3_bits_to_f16, which yields value / 256; the 256 goes into the scale), as fp8.py and the GQA
kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ktlite.kernels.triton.common import cast_like
from ktlite.kernels.triton.fp8 import _e4m3_bits_to_f16
from ktlite.kernels.triton.kv_fp8 import e4m3_as_bytes, is_packed, latent_rows


@dataclass(frozen=True)
class LatentOperands:
    values: torch.Tensor  # [slots, kv_lora_rank]: the float buffer itself, or e4m3 values (or their bytes)
    scales: torch.Tensor  # [slots, groups] fp32; a plain buffer passes its values again (never read)
    rope: torch.Tensor  # [slots, rope]
    packed: bool
    e4m3_bits: bool
    group: int

    @property
    def pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.values, self.scales, self.rope

    @property
    def strides(self) -> tuple[int, int, int]:
        return self.values.stride(0), self.scales.stride(0), self.rope.stride(0)

    @property
    def constexprs(self) -> dict[str, object]:
        return dict(GROUP=self.group, PACKED=self.packed, E4M3_BITS=self.e4m3_bits)


def latent_operands(kv_buffer: torch.Tensor, kv_lora_rank: int, width: int,
                    e4m3_bits: bool | None = None) -> LatentOperands:
    """The kernel arguments for a latent pool buffer whose unpacked rows hold `width` values.
    e4m3_bits (decode the fp8 bytes with integer ops) defaults to True on CUDA GPUs before sm89."""
    assert kv_buffer.stride(-1) == 1
    if not is_packed(kv_buffer):
        assert kv_buffer.shape[1] == width
        return LatentOperands(kv_buffer, kv_buffer, kv_buffer[:, kv_lora_rank:], False, False, 1)
    rows = latent_rows(kv_lora_rank, width - kv_lora_rank)
    values, scales, rope = rows.views(kv_buffer)
    if e4m3_bits is None:
        e4m3_bits = e4m3_as_bytes(kv_buffer)
    # the kernels tile the latent in BLOCK_C = next_power_of_2(kv_lora_rank) values: a scale group wider than
    # that (a small test model) is one group of BLOCK_C
    group = min(rows.group, triton.next_power_of_2(kv_lora_rank))
    return LatentOperands(values.view(torch.uint8) if e4m3_bits else values, scales, rope, True, e4m3_bits, group)


@triton.jit
def load_latent(Values, Scales, Rope, slot, valid, like, stride_v, stride_s, stride_r,
                KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                GROUP: tl.constexpr, PACKED: tl.constexpr, E4M3_BITS: tl.constexpr):
    """The latent tile [BLOCK_C, BN] and rope tile [BLOCK_R, BN] of the tokens at pool slots `slot` [BN]
    (int64; where `valid` is false they read as 0), in like's dtype, ready for tl.dot."""
    if PACKED:
        # loaded as [groups, GROUP, BN] so each group's scale [groups, 1, BN] broadcasts in registers; the
        # reshape back to [BLOCK_C, BN] is free (a gathered [BLOCK_C, BN] scale tile would be staged
        # through shared memory)
        offs_g = tl.arange(0, BLOCK_C // GROUP)
        offs_c = offs_g[:, None, None] * GROUP + tl.arange(0, GROUP)[None, :, None]
        k_c = tl.load(Values + slot[None, None, :] * stride_v + offs_c,
                      mask=(offs_c < KV_LORA) & valid[None, None, :], other=0.0)
        scale = tl.load(Scales + slot[None, None, :] * stride_s + offs_g[:, None, None],
                        mask=(offs_g * GROUP < KV_LORA)[:, None, None] & valid[None, None, :], other=0.0)
        if E4M3_BITS:
            k_c = _e4m3_bits_to_f16(k_c).to(tl.float32) * (scale * 256.0)
        else:
            k_c = k_c.to(tl.float32) * scale
        k_c = tl.reshape(k_c, [BLOCK_C, slot.shape[0]])
    else:
        offs_c = tl.arange(0, BLOCK_C)
        k_c = tl.load(Values + slot[None, :] * stride_v + offs_c[:, None],
                      mask=(offs_c < KV_LORA)[:, None] & valid[None, :], other=0.0)
    offs_r = tl.arange(0, BLOCK_R)
    k_r = tl.load(Rope + slot[None, :] * stride_r + offs_r[:, None],
                  mask=(offs_r < ROPE)[:, None] & valid[None, :], other=0.0)
    return cast_like(k_c, like), cast_like(k_r, like)
