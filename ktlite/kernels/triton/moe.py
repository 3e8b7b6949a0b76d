"""Fused MoE for the experts that live on the GPU: two grouped GEMMs over expert-sorted pairs.

1. align: the T*k (token, expert) pairs whose expert is enabled in expert_mask are sorted by
   expert and each expert's run is padded to BLOCK_M, so every BLOCK_M rows share one expert;
   done with torch ops on the device and no host sync (CUDA-graph friendly), sized by the
   worst case T*k + min(E, T*k) * (BLOCK_M - 1) rows.
2. gate+up GEMM with the experts' gated activation fused in the epilogue (kernels/expert_activation.py: SiLU(gate)
   * up, or its clamped forms; the gate/up bias added first where the experts have one) -> act [T*k, I].
3. down GEMM with the down bias and the routing weight applied in the epilogue -> per-pair rows [T*k, H] (pairs of
   disabled experts stay 0), summed over k.
Weights: dense bf16/fp16, or QuantizedWeight INT8/INT4 or MX (MXFP4 / MXFP8 codes with e8m0 scales, quant.py)
dequantized in-kernel: one K tile is one quantization group, so each tile's partial product is scaled once per
column. MX codes become exact values in registers (e2m1 by integer ops, e4m3 via fp8._e4m3_bits_to_f16).
"""

import logging

import torch
import triton
import triton.language as tl

from ktlite.kernels.expert_activation import SWIGLU, ExpertActivation
from ktlite.kernels.triton.common import cast_like, dot
from ktlite.kernels.triton.fp8 import _e4m3_bits_to_f16
from ktlite.kernels.triton.quant import QuantizedWeight
from ktlite.kernels.triton.reference import local_pairs

logger = logging.getLogger(__name__)


@triton.jit
def _moe_gemm_kernel(
    A, W, Scales, Out, SortedIds, ExpertIds, NumPadded, TopkWeights, Bias,
    N, K, num_pairs, gate_offset, alpha, limit, up_offset,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_be,
    A_ROW_DIV: tl.constexpr,  # top_k when A is hidden (row = token), 1 when A is act (row = pair)
    GATED: tl.constexpr,  # True: out = act(A @ W[:N]^T, A @ W[gate_offset:]^T) (expert_activation.py)
    HAS_BIAS: tl.constexpr,  # Bias [E, N (x2 when GATED)] is added to the products
    WEIGHTED: tl.constexpr,  # True: out *= routing weight of the pair
    BITS: tl.constexpr,  # 16 (dense), 8 or 4
    MX: tl.constexpr,  # BITS 4 / 8 are e2m1 / e4m3 codes with e8m0 scales (else integers with float scales)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m)
    mask_m = pair < num_pairs  # padding rows hold num_pairs
    a_row = tl.where(mask_m, pair // A_ROW_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_rows = A + a_row[:, None] * stride_am  # [BM, 1]
    w_base = W + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn  # [1, BN]
    w_up = w_base + gate_offset * stride_wn
    s_base = Scales + expert * stride_se + offs_n * stride_sn  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if BITS == 16:
            mask_k = k0 + offs_k < K
            a = tl.load(a_rows + k0 + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w_mask = mask_k[:, None] & mask_n[None, :]
            acc = dot(a, tl.load(w_base + k0 + offs_k[:, None], mask=w_mask, other=0.0), acc)
            if GATED:
                acc_up = dot(a, tl.load(w_up + k0 + offs_k[:, None], mask=w_mask, other=0.0), acc_up)
        else:
            # one K tile = one quantization group (K % BLOCK_K == 0, checked on the host): the
            # tile's integer product is scaled once per output column
            if MX:
                s = _e8m0_scale(tl.load(s_base + k0 // BLOCK_K, mask=mask_n, other=0))[None, :]
                if BITS == 8:
                    a = tl.load(a_rows + k0 + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                    acc += _e4m3_tile_dot(a, w_base + k0, offs_k, mask_n, BLOCK_M, BLOCK_N) * s
                else:
                    # A's even / odd columns, matching the low / high nibbles of each byte
                    half = tl.arange(0, BLOCK_K // 2)
                    a_ev = tl.load(a_rows + k0 + 2 * half[None, :], mask=mask_m[:, None], other=0.0)
                    a_od = tl.load(a_rows + k0 + 2 * half[None, :] + 1, mask=mask_m[:, None], other=0.0)
                    acc += _e2m1_tile_dot(a_ev, a_od, w_base + k0 // 2, half, mask_n, BLOCK_M, BLOCK_N) * s
                if GATED:
                    s_up = _e8m0_scale(tl.load(s_base + gate_offset * stride_sn + k0 // BLOCK_K, mask=mask_n,
                                               other=0))[None, :]
                    if BITS == 8:
                        acc_up += _e4m3_tile_dot(a, w_up + k0, offs_k, mask_n, BLOCK_M, BLOCK_N) * s_up
                    else:
                        acc_up += _e2m1_tile_dot(a_ev, a_od, w_up + k0 // 2, half, mask_n, BLOCK_M, BLOCK_N) * s_up
            elif BITS == 8:
                s = tl.load(s_base + k0 // BLOCK_K, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                a = tl.load(a_rows + k0 + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                acc += _int8_tile_dot(a, w_base + k0, offs_k, mask_n, BLOCK_M, BLOCK_N) * s
                if GATED:
                    s_up = tl.load(s_base + gate_offset * stride_sn + k0 // BLOCK_K, mask=mask_n, other=0.0)
                    acc_up += _int8_tile_dot(a, w_up + k0, offs_k, mask_n, BLOCK_M, BLOCK_N) * s_up.to(
                        tl.float32
                    )[None, :]
            else:
                s = tl.load(s_base + k0 // BLOCK_K, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                # A's two K halves, matching the low / high nibbles of the packed group
                half = tl.arange(0, BLOCK_K // 2)
                a_lo = tl.load(a_rows + k0 + half[None, :], mask=mask_m[:, None], other=0.0)
                a_hi = tl.load(a_rows + k0 + BLOCK_K // 2 + half[None, :], mask=mask_m[:, None], other=0.0)
                acc += _int4_tile_dot(a_lo, a_hi, w_base + k0 // 2, half, mask_n, BLOCK_M, BLOCK_N) * s
                if GATED:
                    s_up = tl.load(s_base + gate_offset * stride_sn + k0 // BLOCK_K, mask=mask_n, other=0.0)
                    acc_up += _int4_tile_dot(
                        a_lo, a_hi, w_up + k0 // 2, half, mask_n, BLOCK_M, BLOCK_N
                    ) * s_up.to(tl.float32)[None, :]

    if HAS_BIAS:
        b_ptr = Bias + expert * stride_be + offs_n
        acc += tl.load(b_ptr, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + gate_offset, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:  # g * sigmoid(alpha g) * (u + up_offset), g and u clamped by limit (inf-like: no clamp)
        g = tl.minimum(acc, limit)
        u = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = g / (1.0 + tl.exp(-alpha * g)) * (u + up_offset)
    if WEIGHTED:
        acc = acc * tl.load(TopkWeights + pair, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    o_ptrs = Out + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _int8_tile_dot(a, w_ptr, offs_k, mask_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """a [BM, BK] @ int8 tile [BK, BN] at w_ptr ([1, BN] column pointers), unscaled, fp32."""
    q = tl.load(w_ptr + offs_k[:, None], mask=mask_n[None, :], other=0)
    return dot(a, cast_like(q, a), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))


@triton.jit
def _int4_tile_dot(a_lo, a_hi, w_ptr, half, mask_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[a_lo | a_hi] [BM, BK] @ packed int4 group [BK/2 bytes, BN] at w_ptr, unscaled, fp32.
    Byte j holds k = j (low nibble) and k = j + BK/2 (high nibble), stored as q + 8."""
    packed = tl.load(w_ptr + half[:, None], mask=mask_n[None, :], other=0)  # [BK/2, BN] uint8
    lo = cast_like((packed & 0xF).to(tl.int8) - 8, a_lo)
    hi = cast_like((packed >> 4).to(tl.int8) - 8, a_lo)
    return dot(a_hi, hi, dot(a_lo, lo, tl.zeros([BLOCK_M, BLOCK_N], tl.float32)))


@triton.jit
def _e8m0_scale(s):
    """e8m0 bytes -> fp32 2^(s - 127), from the bits (0: the subnormal 2^-127)."""
    s = s.to(tl.int32)
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_tile_dot(a, w_ptr, offs_k, mask_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """a [BM, BK] @ e4m3 tile [BK, BN] (bit patterns) at w_ptr, unscaled, fp32 (the codes decode to value / 256,
    fp8._e4m3_bits_to_f16: the product is multiplied back, exactly, before any scale)."""
    q = tl.load(w_ptr + offs_k[:, None], mask=mask_n[None, :], other=0)
    return dot(a, cast_like(_e4m3_bits_to_f16(q), a), tl.zeros([BLOCK_M, BLOCK_N], tl.float32)) * 256.0


@triton.jit
def _e2m1_values(c):
    """e2m1 codes (0..15) -> their exact values in fp32: (m + 2 [e > 0]) << max(e - 1, 0) halves, signed."""
    e = (c >> 1) & 3
    m = c & 1
    normal = (e != 0).to(tl.int32)
    whole = ((m | (normal << 1)) << (e - normal)).to(tl.float32) * 0.5
    return tl.where((c & 8) != 0, -whole, whole)


@triton.jit
def _e2m1_tile_dot(a_ev, a_od, w_ptr, half, mask_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[a_ev | a_od] (A's even / odd columns of the group) @ packed e2m1 group [BK/2 bytes, BN] at w_ptr,
    unscaled, fp32. Byte j holds k = 2j (low nibble) and k = 2j + 1 (high nibble)."""
    packed = tl.load(w_ptr + half[:, None], mask=mask_n[None, :], other=0).to(tl.int32)  # [BK/2, BN]
    lo = cast_like(_e2m1_values(packed & 0xF), a_ev)
    hi = cast_like(_e2m1_values(packed >> 4), a_ev)
    return dot(a_od, hi, dot(a_ev, lo, tl.zeros([BLOCK_M, BLOCK_N], tl.float32)))


def moe_align(
    topk_ids: torch.Tensor, expert_mask: torch.Tensor | None, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort this device's (token, expert) pairs (reference.local_pairs) by expert, padded per
    expert to block_m rows.

    Returns sorted_ids [R] (pair index t*k + j, or num_pairs for padding), expert_ids [R / block_m]
    (expert of each block; num_experts past the end) and num_padded [1] (rows in use), where R is
    the worst-case row count so no value needs to reach the host.
    """
    flat, keep = local_pairs(topk_ids, expert_mask, num_experts)
    num_pairs = flat.numel()
    flat = torch.where(keep, flat, num_experts)  # pairs computed elsewhere -> bucket E, dropped
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m

    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    valid = sorted_expert < num_experts
    e = sorted_expert.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[e]
    dest = torch.where(valid, padded_end[e] - padded[e] + rank, rows)  # rows = a scratch slot
    sorted_ids = torch.full((rows + 1,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, rows, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_ids[:rows], expert_ids, padded_end[-1:].to(torch.int32)


def _weight_args(w: torch.Tensor | QuantizedWeight, block_k: int) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """(tensor, scales, bits, block_k, mx) for the kernel; quantized weights force block_k = group."""
    if isinstance(w, QuantizedWeight):
        return w.qweight, w.scales, w.bits, w.group_size, w.mx
    return w, w, 16, block_k, False  # scales unused for dense weights


def _launch(
    a: torch.Tensor, w: torch.Tensor | QuantizedWeight, out: torch.Tensor, align: tuple, topk_weights: torch.Tensor,
    n: int, gated: bool, a_row_div: int, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
    activation: ExpertActivation, bias: torch.Tensor | None,
) -> None:
    sorted_ids, expert_ids, num_padded = align
    tensor, scales, bits, block_k, mx = _weight_args(w, block_k)
    k = a.shape[1]
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    alpha, limit, up_offset = (float(v) for v in activation.params())
    _moe_gemm_kernel[grid](
        a, tensor, scales, out, sorted_ids, expert_ids, num_padded, topk_weights, out if bias is None else bias,
        n, k, topk_weights.numel(), n, alpha, limit, up_offset,
        a.stride(0), tensor.stride(0), tensor.stride(1), scales.stride(0), scales.stride(1), out.stride(0),
        0 if bias is None else bias.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, HAS_BIAS=bias is not None, WEIGHTED=not gated, BITS=bits, MX=mx,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_mask: torch.Tensor | None = None,
    activation: ExpertActivation = SWIGLU,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Triton twin of reference.fused_moe_torch (see there for shapes). block_m defaults to 16 for
    decode-sized batches (few pairs per expert) and 64 for prefill; block_k is ignored for
    quantized weights (it is their group size)."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    assert hidden.stride(1) == 1 and w2.shape[1] == hidden_size and w2.shape[2] == inter
    for w in (w13, w2):
        if isinstance(w, QuantizedWeight) and w.group_size % 16:
            raise ValueError(f"group size {w.group_size} must be a multiple of 16 for tl.dot")
    if block_m is None:
        block_m = 16 if num_tokens * top_k <= 8 * num_experts else 64
    align = moe_align(topk_ids, expert_mask, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()

    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    b13, b2 = (None, None) if biases is None else (b.contiguous() for b in biases)
    _launch(hidden, w13, act, align, weights, inter, True, top_k, block_m, block_n, block_k, num_warps, num_stages,
            activation, b13)
    # rows of pairs whose expert is elsewhere are never written: start from zeros
    per_pair = torch.zeros(num_tokens * top_k, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _launch(act, w2, per_pair, align, weights, hidden_size, False, 1, block_m, block_n, block_k, num_warps, num_stages,
            activation, b2)
    return per_pair.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)
