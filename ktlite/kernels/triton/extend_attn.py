"""MLA extend (prefill / chunked prefill) attention in absorbed form.

A program owns a tile of BLOCK_T new tokens x BLOCK_H heads of one request, flattened into
BLOCK_T * BLOCK_H query rows (row r = token r // BLOCK_H, head r % BLOCK_H), and streams the
request's latent KV (cached prefix and the chunk's own tokens, all addressed via req_to_token)
in BLOCK_N tiles with an online softmax. Grouping heads lets one latent tile serve many heads
and keeps the causal frontier tight when chunks are short (e.g. 2 tokens x 16 heads). The pool is plain
or packed FP8 (latent_tile: dequantized in registers).
"""

import logging

import torch
import triton
import triton.language as tl

from ktlite.kernels.triton.common import dot, dot_width
from ktlite.kernels.triton.latent_tile import latent_operands, load_latent

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    Q, KV, KVScale, KVRope, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, ExtendStart, Out,
    qk_scale, num_heads,
    stride_qn, stride_qh, stride_kv, stride_ks, stride_kr, stride_rt, stride_on, stride_oh,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, PACKED: tl.constexpr, E4M3_BITS: tl.constexpr,
):
    b = tl.program_id(0)
    t_block = tl.program_id(1)
    head_group = tl.program_id(2)
    ext_len = tl.load(ExtendLens + b)
    if t_block * BLOCK_T >= ext_len:
        return
    prefix = tl.load(PrefixLens + b)
    ext_start = tl.load(ExtendStart + b).to(tl.int64)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)

    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    offs_t = t_block * BLOCK_T + rows // BLOCK_H  # token index within this request's chunk
    offs_h = head_group * BLOCK_H + rows % BLOCK_H
    mask_m = (offs_t < ext_len) & (offs_h < num_heads)
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < KV_LORA
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE

    q_base = Q + (ext_start + offs_t)[:, None] * stride_qn + offs_h[:, None] * stride_qh
    q_c = tl.load(q_base + offs_c[None, :], mask=mask_m[:, None] & mask_c[None, :], other=0.0)  # [M, BC]
    q_r = tl.load(q_base + KV_LORA + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)

    q_pos = prefix + offs_t  # absolute position of each row's token
    # keys up to the last token of this tile; the first prefix + t_block*BLOCK_T need no causal mask,
    # but one loop with the mask keeps the kernel small and the mask costs little next to two dots
    kv_end = prefix + tl.minimum((t_block + 1) * BLOCK_T, ext_len)

    m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        slot = tl.load(ReqToToken + req * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_c, k_r = load_latent(KV, KVScale, KVRope, slot, mask_n, q_c, stride_kv, stride_ks, stride_kr,
                               KV_LORA, ROPE, BLOCK_C, BLOCK_R, GROUP, PACKED, E4M3_BITS)  # [BC, BN], [BR, BN]
        s = dot(q_c, k_c, tl.zeros([BLOCK_T * BLOCK_H, BLOCK_N], tl.float32))
        s = dot(q_r, k_r, s) * qk_scale
        s = tl.where(mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
        # every row (padded ones too) sees key 0 in the first tile, so m_new is finite: no NaN guard
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot(p.to(k_c.dtype), tl.trans(k_c), acc * alpha[:, None])
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptr = Out + (ext_start + offs_t)[:, None] * stride_on + offs_h[:, None] * stride_oh + offs_c[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


def mla_extend_triton(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    extend_start_loc: torch.Tensor | None = None,
    max_extend_len: int | None = None,
    block_t: int | None = None,
    block_h: int | None = None,
    block_n: int = 32,
    num_warps: int = 8,
    num_stages: int = 1,
    e4m3_bits: bool | None = None,
) -> torch.Tensor:
    """Triton twin of reference.mla_extend_torch (see there for shapes); returns [N, H, kv_lora_rank].

    extend_start_loc [B] (exclusive cumsum of extend_lens) and max_extend_len are derived when
    not given; passing max_extend_len avoids a device->host sync. block_t * block_h query rows
    per program (>= 16 for tl.dot on a GPU); default 16 heads x 2 tokens. e4m3_bits is latent_operands'.
    """
    num_tokens, num_heads, dk = q.shape
    rope = dk - kv_lora_rank
    assert q.stride(2) == 1
    kv = latent_operands(kv_buffer, kv_lora_rank, dk, e4m3_bits)
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if extend_start_loc is None:
        extend_start_loc = torch.cumsum(extend_lens, 0) - extend_lens
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    block_h = block_h or min(16, triton.next_power_of_2(num_heads))
    block_t = block_t or max(1, 32 // block_h)
    grid = (extend_lens.shape[0], triton.cdiv(max_extend_len, block_t), triton.cdiv(num_heads, block_h))
    _extend_kernel[grid](
        q, *kv.pointers, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc, out,
        sm_scale * _LOG2E, num_heads,
        q.stride(0), q.stride(1), *kv.strides, req_to_token.stride(0), out.stride(0), out.stride(1),
        KV_LORA=kv_lora_rank, ROPE=rope,
        BLOCK_C=dot_width(kv_lora_rank), BLOCK_R=dot_width(rope),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_N=block_n, **kv.constexprs,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
