"""GQA decode attention over the token pool, flash-decoding style (split-KV + reduce).

A stage-1 program owns one request, one chunk of its sequence and the query heads of one kv head
(up to BLOCK_H of them; a kv head with more query heads gets several programs). All those heads
share the kv head's K/V rows, so each row is read once per group instead of once per query head,
and the group is padded to BLOCK_H rows (>= 16 on a GPU) so QK^T and PV run as tl.dot.
Stage 2 is MLA decode's merge kernel (decode_attn._decode_stage2): the partial results have the
same [B, H, splits, width] layout, and merging by log-sum-exp does not care where they came from.

Sliding window: the chunks split only the last `window` keys. Sinks: split 0 starts its online softmax from the
head's sink logit (running max = sink, sum = 1, nothing accumulated), so the merge counts the sink once in the
denominator and it adds nothing to the output.
Packed FP8 pools (kv_fp8.head_rows, a scale per token and kv head) are read through head_tile: key scales
go on the scores, value tiles are dequantized in registers, codes decode with integer ops before sm89.
"""

import logging

import torch
import triton
import triton.language as tl

from ktlite.kernels.triton.common import dot, dot_width
from ktlite.kernels.triton.decode_attn import _decode_stage2, default_num_kv_splits
from ktlite.kernels.triton.head_tile import head_operands, key_tile, scaled_scores, value_tile

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the kernels' window without one: more keys than any sequence has


@triton.jit
def _gqa_decode_stage1(
    Q, K, V, KScale, VScale, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse, Sinks,
    qk_scale, group, num_splits, window,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_kss, stride_ksh, stride_vss, stride_vsh, stride_rt,
    stride_mob, stride_moh, stride_mos, stride_lb, stride_lh,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr, E4M3_BITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    blocks_per_kv = tl.cdiv(group, BLOCK_H)
    kv_head = head_block // blocks_per_kv
    in_group = (head_block % blocks_per_kv) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < group
    offs_h = kv_head * group + in_group  # query heads; padded rows are masked
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_D
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DV

    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    kv_start = tl.maximum(seq_len - window, 0)  # the window's first key (window: a huge value without one)
    # chunk length rounded to BLOCK_N so every chunk but the last issues full tiles
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, num_splits), BLOCK_N) * BLOCK_N
    start = kv_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q_ptr = Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BH, BD]
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    ks_base = KScale + kv_head * stride_ksh
    vs_base = VScale + kv_head * stride_vsh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if HAS_SINKS:
        if split == 0:  # the sink joins the softmax once: in split 0, as a key with value 0 (log2 units)
            m_i = tl.load(Sinks + offs_h, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(ReqToToken + req * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None],
                    mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BD, BN]
        s = dot(q, key_tile(k, q, E4M3_BITS), tl.zeros([BLOCK_H, BLOCK_N], tl.float32)) * qk_scale
        s = scaled_scores(s, ks_base, slot, stride_kss, mask_n, PACKED, E4M3_BITS)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_dv[None, :],
                    mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # [BN, BDV]
        v = value_tile(v, vs_base, slot, stride_vss, mask_n, q, PACKED, E4M3_BITS)
        acc = dot(p.to(q.dtype), v, acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0  # false for an empty chunk (start >= end)
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    mo = MidO + b * stride_mob + offs_h[:, None] * stride_moh + split * stride_mos + offs_dv[None, :]
    tl.store(mo, out, mask=mask_h[:, None] & mask_dv[None, :])
    tl.store(MidLse + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_h)


def gqa_decode_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
    num_kv_splits: int | None = None,
    block_h: int | None = None,
    block_n: int = 64,
    e4m3_bits: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Triton twin of reference.gqa_decode_torch (see there for shapes); returns [B, Hq, Dv].

    block_h is query heads per program (default: the group padded to a power of two, at least 16
    for tl.dot on a GPU, at most 64); num_kv_splits defaults to decode_attn.default_num_kv_splits();
    e4m3_bits is head_tile.head_operands'.
    """
    batch, num_heads, head_d = q.shape
    kv = head_operands(k_buffer, v_buffer, e4m3_bits)
    num_kv_heads, head_dv = kv.k.shape[1], kv.v.shape[2]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not split over {num_kv_heads} kv heads"
    assert kv.k.shape[2] == head_d and kv.v.shape[:2] == kv.k.shape[:2]
    assert q.stride(2) == 1 and kv.k.stride(2) == 1 and kv.v.stride(2) == 1
    group = num_heads // num_kv_heads
    block_h = block_h or min(64, max(16, triton.next_power_of_2(group)))
    head_blocks = num_kv_heads * triton.cdiv(group, block_h)
    # default_num_kv_splits counts programs per request as cdiv(heads, block_h): one per head block here
    splits = num_kv_splits or default_num_kv_splits(batch, head_blocks, q.device, block_h=1)
    out = torch.empty(batch, num_heads, head_dv, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    mid_o = torch.empty(batch, num_heads, splits, head_dv, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    block_dv = triton.next_power_of_2(head_dv)
    _gqa_decode_stage1[(batch, head_blocks, splits)](
        q, *kv.pointers, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        mid_lse if sinks is None else sinks.float().contiguous(), sm_scale * _LOG2E, group, splits,
        window if window > 0 else NO_WINDOW,
        q.stride(0), q.stride(1), *kv.strides, req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        HEAD_D=head_d, HEAD_DV=head_dv, BLOCK_D=dot_width(head_d), BLOCK_DV=block_dv,
        BLOCK_H=block_h, BLOCK_N=block_n, **kv.constexprs, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    _decode_stage2[(batch, num_heads)](
        mid_o, mid_lse, out, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        KV_LORA=head_dv, BLOCK_C=block_dv, BLOCK_S=triton.next_power_of_2(splits),
    )
    return out
