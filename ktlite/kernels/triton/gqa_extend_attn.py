"""GQA extend (prefill / chunked prefill) attention over the token pool: causal flash attention.

A program owns a tile of BLOCK_T new tokens of one request x BLOCK_H query heads of one kv head,
flattened into BLOCK_T * BLOCK_H query rows (row r = token r // BLOCK_H, head r % BLOCK_H of the
group), and streams that kv head's K/V (the cached prefix and the chunk's own tokens, all
addressed through req_to_token) in BLOCK_N tiles with an online softmax. Flattening the group
into the rows lets one K/V tile serve every query head that reads it, and with short chunks
(e.g. decode-sized mixed chunks) it keeps the causal frontier tight.
Sliding window: a row sees keys q_pos - window + 1 .. q_pos, and the tile's loop starts at its first row's window.
Sinks: each row's online softmax starts from its head's sink logit (max = sink, sum = 1, nothing accumulated).
Packed FP8 pools are read through head_tile, as in gqa_decode_attn.
"""

import logging

import torch
import triton
import triton.language as tl

from ktlite.kernels.triton.common import dot, dot_width
from ktlite.kernels.triton.gqa_decode_attn import NO_WINDOW
from ktlite.kernels.triton.head_tile import head_operands, key_tile, scaled_scores, value_tile

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634


@triton.jit
def _gqa_extend_kernel(
    Q, K, V, KScale, VScale, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, ExtendStart, Out, Sinks,
    qk_scale, group, window,
    stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_kss, stride_ksh, stride_vss, stride_vsh, stride_rt, stride_on, stride_oh,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr,
    E4M3_BITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    t_block = tl.program_id(1)
    head_block = tl.program_id(2)
    ext_len = tl.load(ExtendLens + b)
    if t_block * BLOCK_T >= ext_len:
        return
    prefix = tl.load(PrefixLens + b)
    ext_start = tl.load(ExtendStart + b).to(tl.int64)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    blocks_per_kv = tl.cdiv(group, BLOCK_H)
    kv_head = head_block // blocks_per_kv

    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    offs_t = t_block * BLOCK_T + rows // BLOCK_H  # token index within this request's chunk
    in_group = (head_block % blocks_per_kv) * BLOCK_H + rows % BLOCK_H
    offs_h = kv_head * group + in_group
    mask_m = (offs_t < ext_len) & (in_group < group)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_D
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DV

    q_ptr = Q + (ext_start + offs_t)[:, None] * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [M, BD]
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    ks_base = KScale + kv_head * stride_ksh
    vs_base = VScale + kv_head * stride_vsh

    q_pos = prefix + offs_t  # absolute position of each row's token
    # keys up to the tile's last token; one loop with the causal mask everywhere keeps the kernel small
    kv_end = prefix + tl.minimum((t_block + 1) * BLOCK_T, ext_len)
    # the first tile holding a key of the tile's first row's window (window: a huge value without one)
    kv_lo = tl.maximum(prefix + t_block * BLOCK_T - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    if HAS_SINKS:  # in log2 units, as the scores
        m_i = tl.load(Sinks + offs_h, mask=mask_m, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_T * BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(kv_lo, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        slot = tl.load(ReqToToken + req * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None],
                    mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BD, BN]
        s = dot(q, key_tile(k, q, E4M3_BITS), tl.zeros([BLOCK_T * BLOCK_H, BLOCK_N], tl.float32)) * qk_scale
        s = scaled_scores(s, ks_base, slot, stride_kss, mask_n, PACKED, E4M3_BITS)
        seen = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(mask_n[None, :] & seen, s, float("-inf"))
        # a row whose window starts past this tile has seen nothing yet: keep its max finite (0), so no NaN
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_dv[None, :],
                    mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # [BN, BDV]
        v = value_tile(v, vs_base, slot, stride_vss, mask_n, q, PACKED, E4M3_BITS)
        acc = dot(p.to(q.dtype), v, acc * alpha[:, None])
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptr = Out + (ext_start + offs_t)[:, None] * stride_on + offs_h[:, None] * stride_oh + offs_dv[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


def gqa_extend_triton(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
    extend_start_loc: torch.Tensor | None = None,
    max_extend_len: int | None = None,
    block_t: int | None = None,
    block_h: int | None = None,
    block_n: int = 64,
    e4m3_bits: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Triton twin of reference.gqa_extend_torch (see there for shapes); returns [N, Hq, Dv].

    extend_start_loc [B] (exclusive cumsum of extend_lens) and max_extend_len are derived when
    not given; passing max_extend_len avoids a device->host sync. A program has block_t * block_h
    query rows (>= 16 for tl.dot on a GPU); default: the group padded to a power of two (at most
    16 heads) times enough tokens for 64 rows.
    """
    num_tokens, num_heads, head_d = q.shape
    kv = head_operands(k_buffer, v_buffer, e4m3_bits)
    num_kv_heads, head_dv = kv.k.shape[1], kv.v.shape[2]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads do not split over {num_kv_heads} kv heads"
    assert kv.k.shape[2] == head_d and kv.v.shape[:2] == kv.k.shape[:2]
    assert q.stride(2) == 1 and kv.k.stride(2) == 1 and kv.v.stride(2) == 1
    out = torch.empty(num_tokens, num_heads, head_dv, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if extend_start_loc is None:
        extend_start_loc = torch.cumsum(extend_lens, 0) - extend_lens
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    group = num_heads // num_kv_heads
    block_h = block_h or min(16, triton.next_power_of_2(group))
    block_t = block_t or max(1, 64 // block_h)
    head_blocks = num_kv_heads * triton.cdiv(group, block_h)
    grid = (extend_lens.shape[0], triton.cdiv(max_extend_len, block_t), head_blocks)
    _gqa_extend_kernel[grid](
        q, *kv.pointers, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc, out,
        out if sinks is None else sinks.float().contiguous(), sm_scale * _LOG2E, group,
        window if window > 0 else NO_WINDOW,
        q.stride(0), q.stride(1), *kv.strides, req_to_token.stride(0),
        out.stride(0), out.stride(1),
        HEAD_D=head_d, HEAD_DV=head_dv, BLOCK_D=dot_width(head_d),
        BLOCK_DV=triton.next_power_of_2(head_dv),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_N=block_n, **kv.constexprs, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
