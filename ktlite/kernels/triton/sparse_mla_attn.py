"""Sparse MLA in absorbed form: each query token attends to its own list of selected pool slots
(DSA sparse attention). Decode and extend are the same call, one row of slots per query token.

A program owns one query token, one group of BLOCK_H heads and one chunk of the token's slot list.
It gathers the selected latent rows BLOCK_N at a time (a row is shared by every head, so it is read
once per head group), scores them as q_c . k_c + q_r . k_r (latent and rope parts as separate dots,
like decode_attn) and keeps an online exp2 softmax over the chunk.

Splitting the slot list: with few query tokens (decode) there are too few (token, head group)
programs to fill a GPU, so the list is cut into num_splits chunks and decode_attn's stage 2 merges
the chunks' partial softmaxes by log-sum-exp. With many tokens (prefill) num_splits is 1 and the
programs write the final output directly: no partial buffers, no second launch.

Padding: the indexer puts -1 after the valid slots of a short context (fewer tokens than top-k),
so each program first scans its chunk's slot ids (8 bytes each, cheap next to a 576-wide latent
row) for the end of the valid ones and streams latents only up to there; -1s inside that range
are masked. A query whose slots are all -1 gets zeros.

The pool is plain or packed FP8 (latent_tile: dequantized in registers).
"""

import logging

import torch
import triton
import triton.language as tl

from ktlite.kernels.triton.common import dot, dot_width
from ktlite.kernels.triton.decode_attn import _decode_stage2, default_num_kv_splits
from ktlite.kernels.triton.latent_tile import latent_operands, load_latent

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634


@triton.jit
def _sparse_mla_kernel(
    Q, KV, KVScale, KVRope, TopK, O, Lse,
    qk_scale, num_heads, topk, split_len,
    stride_qn, stride_qh, stride_kv, stride_ks, stride_kr, stride_tn,
    stride_on, stride_oh, stride_os, stride_ln, stride_lh,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, GROUP: tl.constexpr, PACKED: tl.constexpr, E4M3_BITS: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # int64: n * stride_qn passes 2**31 for long prefills
    head_group = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < KV_LORA
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE

    start = split * split_len
    chunk_end = tl.minimum(start + split_len, topk)
    slots_row = TopK + n * stride_tn
    # end of this chunk's valid slots: the latent loop below stops there instead of at chunk_end
    end = start
    for k0 in range(start, chunk_end, BLOCK_N):
        offs_k = k0 + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_row + offs_k, mask=offs_k < chunk_end, other=-1)
        end = tl.maximum(end, tl.max(tl.where(slot >= 0, offs_k + 1, 0), 0))

    q_base = Q + n * stride_qn + offs_h[:, None] * stride_qh
    q_c = tl.load(q_base + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)  # [BH, BC]
    q_r = tl.load(q_base + KV_LORA + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for k0 in range(start, end, BLOCK_N):
        offs_k = k0 + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_row + offs_k, mask=offs_k < end, other=-1)
        valid = slot >= 0
        k_c, k_r = load_latent(KV, KVScale, KVRope, tl.where(valid, slot, 0), valid, q_c, stride_kv, stride_ks,
                               stride_kr, KV_LORA, ROPE, BLOCK_C, BLOCK_R, GROUP, PACKED, E4M3_BITS)  # [BC|BR, BN]
        s = dot(q_c, k_c, tl.zeros([BLOCK_H, BLOCK_N], tl.float32))
        s = dot(q_r, k_r, s) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a tile of only -1 slots before any valid one leaves m_new at -inf: shift by 0 instead, so
        # alpha and p come out 0 rather than NaN (inf - inf)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot(p.to(k_c.dtype), tl.trans(k_c), acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0  # false when the chunk holds no valid slot
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    o = O + n * stride_on + offs_h[:, None] * stride_oh + split * stride_os + offs_c[None, :]
    tl.store(o, out.to(O.dtype.element_ty), mask=mask_h[:, None] & mask_c[None, :])
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(Lse + n * stride_ln + offs_h * stride_lh + split, lse, mask=mask_h)


def sparse_mla_triton(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    topk_slots: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    block_h: int = 16,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    e4m3_bits: bool | None = None,
) -> torch.Tensor:
    """Triton twin of reference.sparse_mla_torch (see there for shapes); returns [N, H, kv_lora_rank].

    num_splits (chunks of each query's slot list) defaults to decode_attn's rule: about two programs
    per SM, so 1 for prefill-sized N, and never more chunks than BLOCK_N tiles. It depends on shapes
    only (no host sync: CUDA-graph friendly). block_h is heads per program (>= 16 for tl.dot on a GPU),
    block_n slots per gathered tile; e4m3_bits is latent_operands'.
    """
    num_tokens, num_heads, dk = q.shape
    topk = topk_slots.shape[1]
    rope = dk - kv_lora_rank
    assert topk_slots.shape[0] == num_tokens and q.stride(2) == 1 and topk_slots.stride(1) == 1
    kv = latent_operands(kv_buffer, kv_lora_rank, dk, e4m3_bits)
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    splits = num_splits or min(default_num_kv_splits(num_tokens, num_heads, q.device, block_h),
                               max(1, triton.cdiv(topk, block_n)))
    split_len = triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n  # whole tiles per chunk
    block_c = dot_width(kv_lora_rank)
    dims = dict(KV_LORA=kv_lora_rank, ROPE=rope, BLOCK_C=block_c, BLOCK_R=dot_width(rope),
                BLOCK_H=block_h, BLOCK_N=block_n, **kv.constexprs)
    grid = (num_tokens, triton.cdiv(num_heads, block_h), splits)
    common = (q, *kv.pointers, topk_slots)
    scalars = (sm_scale * _LOG2E, num_heads, topk, split_len, q.stride(0), q.stride(1), *kv.strides,
               topk_slots.stride(0))
    if splits == 1:
        # Lse is never touched without SPLIT; out stands in for it
        _sparse_mla_kernel[grid](*common, out, out, *scalars, out.stride(0), out.stride(1), 0, 0, 0,
                                 **dims, SPLIT=False, num_warps=num_warps, num_stages=num_stages)
        return out
    mid_o = torch.empty(num_tokens, num_heads, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    _sparse_mla_kernel[grid](
        *common, mid_o, mid_lse, *scalars, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), **dims, SPLIT=True, num_warps=num_warps, num_stages=num_stages,
    )
    _decode_stage2[(num_tokens, num_heads)](
        mid_o, mid_lse, out, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        KV_LORA=kv_lora_rank, BLOCK_C=block_c, BLOCK_S=triton.next_power_of_2(splits),
    )
    return out
