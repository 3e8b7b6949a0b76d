"""MLA decode attention in absorbed form, flash-decoding style (split-KV + reduce).

Each request's KV is split into num_splits chunks (a runtime value in stage 1, so following the
batch size costs no recompiles; stage 2 compiles once per power of two). A stage-1 program
handles one request, one group of BLOCK_H heads and one chunk: a token's latent vector (shared
by every head in MLA) is loaded once for all BLOCK_H heads, so decode is bound by reading the
pool once per head group rather than once per head. Stage 2 merges the chunks' partial softmaxes with their
log-sum-exp. Scores use exp2 with log2(e) folded into the scale. The pool is plain or packed FP8
(latent_tile: dequantized in registers).
"""

import logging

import torch
import triton
import triton.language as tl

from ktlite.kernels.triton.common import dot, dot_width, shared_bytes
from ktlite.kernels.triton.latent_tile import latent_operands, load_latent

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_stage1(
    Q, KV, KVScale, KVRope, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse,
    qk_scale, num_heads, num_splits,
    stride_qb, stride_qh, stride_kv, stride_ks, stride_kr, stride_rt,
    stride_mob, stride_moh, stride_mos, stride_lb, stride_lh,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, PACKED: tl.constexpr, E4M3_BITS: tl.constexpr,
):
    b = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < KV_LORA
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE

    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqPoolIdx + b).to(tl.int64)
    # chunk length rounded to BLOCK_N so every chunk but the last issues full tiles
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    q_base = Q + b * stride_qb + offs_h[:, None] * stride_qh
    q_c = tl.load(q_base + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)  # [BH, BC]
    q_r = tl.load(q_base + KV_LORA + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(ReqToToken + req * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_c, k_r = load_latent(KV, KVScale, KVRope, slot, mask_n, q_c, stride_kv, stride_ks, stride_kr,
                               KV_LORA, ROPE, BLOCK_C, BLOCK_R, GROUP, PACKED, E4M3_BITS)  # [BC, BN], [BR, BN]
        s = dot(q_c, k_c, tl.zeros([BLOCK_H, BLOCK_N], tl.float32))
        s = dot(q_r, k_r, s) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot(p.to(k_c.dtype), tl.trans(k_c), acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0  # false for an empty chunk (start >= end)
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    mo = MidO + b * stride_mob + offs_h[:, None] * stride_moh + split * stride_mos + offs_c[None, :]
    tl.store(mo, out, mask=mask_h[:, None] & mask_c[None, :])
    tl.store(MidLse + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out,
    num_splits, stride_mob, stride_moh, stride_mos, stride_lb, stride_lh, stride_ob, stride_oh,
    KV_LORA: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < KV_LORA
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # a row with seq_len 0 (padding in a fixed-size batch) has every chunk empty: output zeros
    w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0)), 0.0)
    o = tl.load(
        MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_c[None, :],
        mask=mask_s[:, None] & mask_c[None, :], other=0.0,
    )
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_c, res.to(Out.dtype.element_ty), mask=mask_c)


# Stage-1 tiles on a GPU with >= WIDE_SHARED_BYTES of shared memory per block (sm80, sm90): 64 heads x 64 tokens,
# 8 warps, so each KV tile is read for 64 heads at once instead of 16. On an H200 (a sweep in
# bench/history/2026-12-04-h200-triton-avx512-xeon.md) that read the latent 2.9-3.0x faster than 16 x 32 x 4 at
# batch 16-64 x 8k context, 1.1-1.4x at batch 1 x 32k; it needs 147 KB
# (bf16 pool) to 148 KB (fp8) of shared memory, so 101-KB GPUs (sm86, sm89) and the interpreter keep 16 x 32 x 4.
WIDE_TILES = (64, 64, 8)  # block_h (capped by the head count), block_n, num_warps
NARROW_TILES = (16, 32, 4)
WIDE_SHARED_BYTES = 150_000


def stage1_tiles(device: torch.device, num_heads: int) -> tuple[int, int, int]:
    """(block_h, block_n, num_warps) of stage 1 on `device`."""
    if device.type != "cuda":
        return NARROW_TILES
    props = torch.cuda.get_device_properties(device)
    # the table where torch does not report the opt-in limit
    shared = getattr(props, "shared_memory_per_block_optin", 0) or shared_bytes(10 * props.major + props.minor)
    if shared < WIDE_SHARED_BYTES:
        return NARROW_TILES
    block_h, block_n, warps = WIDE_TILES
    return min(block_h, max(16, triton.next_power_of_2(num_heads))), block_n, warps


def default_num_kv_splits(batch: int, num_heads: int, device: torch.device, block_h: int = 16) -> int:
    """Chunks per request so stage 1 has about two programs per SM, without reading seq_lens
    (no host sync, so the call stays CUDA-graph friendly). Empty chunks exit right away."""
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    groups = batch * triton.cdiv(num_heads, block_h)
    return max(1, min(32, triton.cdiv(2 * sms, groups)))


def mla_decode_triton(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    num_kv_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    e4m3_bits: bool | None = None,
) -> torch.Tensor:
    """Triton twin of reference.mla_decode_torch (see there for shapes); returns [B, H, kv_lora_rank].

    num_kv_splits defaults to default_num_kv_splits(); block_h is heads per program (>= 16 for
    tl.dot on a GPU), block_n tokens per KV tile, num_warps stage 1's (each defaults to stage1_tiles');
    e4m3_bits is latent_operands'.
    """
    batch, num_heads, dk = q.shape
    tiles = stage1_tiles(q.device, num_heads)
    block_h, block_n, num_warps = block_h or tiles[0], block_n or tiles[1], num_warps or tiles[2]
    rope = dk - kv_lora_rank
    assert q.stride(2) == 1
    kv = latent_operands(kv_buffer, kv_lora_rank, dk, e4m3_bits)
    splits = num_kv_splits or default_num_kv_splits(batch, num_heads, q.device, block_h)
    mid_o = torch.empty(batch, num_heads, splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_c = dot_width(kv_lora_rank)
    _decode_stage1[(batch, triton.cdiv(num_heads, block_h), splits)](
        q, *kv.pointers, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        sm_scale * _LOG2E, num_heads, splits,
        q.stride(0), q.stride(1), *kv.strides, req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        KV_LORA=kv_lora_rank, ROPE=rope, BLOCK_C=block_c, BLOCK_R=dot_width(rope),
        BLOCK_H=block_h, BLOCK_N=block_n, **kv.constexprs,
        num_warps=num_warps, num_stages=num_stages,
    )
    _decode_stage2[(batch, num_heads)](
        mid_o, mid_lse, out, splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        KV_LORA=kv_lora_rank, BLOCK_C=block_c, BLOCK_S=triton.next_power_of_2(splits),
    )
    return out
