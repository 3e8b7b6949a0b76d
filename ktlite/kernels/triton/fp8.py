"""FP8 block-scaled GEMM for block-FP8 checkpoints' dense/attention weights (float8_e4m3fn + 128x128
weight_scale_inv), so the GPU keeps 1 byte per weight.

Two modes, one kernel:
- weight-only: fp8 tiles are converted to x's dtype in registers, tl.dot in bf16/fp16;
- w8a8 (GPUs with FP8 MMA, sm89+): x is quantized per token per 128-column group (the
  activation scheme of the block-FP8 checkpoints) and tl.dot runs fp8 x fp8.
Before sm89 Triton has no e4m3 type at all (it refuses to compile a float8_e4m3fn pointer), so
there the weight is passed as raw bytes and decoded with integer ops (E4M3_BITS).
A BLOCK_K tile lies inside one 128-wide scale block, so each tile's product is scaled once
(per column by the weight scale, per row by the activation scale) instead of dequantizing every
weight. Small-M (decode) shapes use split-K so the K loop is spread over more SMs.
"""

import logging

import torch
import triton
import triton.language as tl

from ktlite.kernels.triton.common import cast_like, dot

logger = logging.getLogger(__name__)

SCALE_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@triton.jit
def _fp8_gemm_kernel(
    X, XScale, W, WScale, Bias, Out,
    M, N, K, k_per_split,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_os, stride_om,
    W8A8: tl.constexpr, E4M3_BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # grouped tile order: GROUP_M row tiles walk the same weight columns while they sit in L2
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = W + offs_n[None, :].to(tl.int64) * stride_wn
    ws_cols = WScale + (offs_n // SCALE_BLOCK) * stride_wsn  # [BN]

    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = k0 + offs_k < k_end
        a = tl.load(x_rows + k0 + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_cols + k0 + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        ws = tl.load(ws_cols + k0 // SCALE_BLOCK, mask=mask_n, other=0.0)
        zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if W8A8:
            xs = tl.load(XScale + offs_m * stride_xsm + k0 // SCALE_BLOCK, mask=mask_m, other=0.0)
            acc += dot(a, w, zero) * xs[:, None] * ws[None, :]
        elif E4M3_BITS:
            acc += dot(a, cast_like(_e4m3_bits_to_f16(w), a), zero) * (ws * 256.0)[None, :]
        else:
            acc += dot(a, cast_like(w, a), zero) * ws[None, :]

    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    o_ptrs = Out + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _e4m3_bits_to_f16(x):
    """float8_e4m3fn bit patterns (uint8) -> their value / 256 as fp16, exactly: moving the 4-bit
    exponent and 3-bit mantissa into fp16's fields shifts the exponent bias from 7 to 15, i.e.
    divides by 2^8 (e4m3 subnormals land on fp16 subnormals); the caller folds the 256 into the
    scale. NaN (0x7f/0xff) is not preserved; checkpoints hold none."""
    bits = ((x & 0x7F).to(tl.uint16) << 7) | ((x & 0x80).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0) -> (float8_e4m3fn [M, K], fp32 scales [M, K / 128]) with
    x ~= q * scale per token per 128 columns."""
    m, k = x.shape
    groups = x.float().view(m, k // SCALE_BLOCK, SCALE_BLOCK)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), scale


def supports_w8a8(device: torch.device) -> bool:
    """FP8 tensor-core MMA exists from sm89 (Ada) / sm90 (Hopper) on."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    w8a8: bool | None = None,
    e4m3_bits: bool | None = None,
    split_k: int | None = None,
    block_m: int | None = None,
    block_n: int = 128,
    block_k: int = 128,
    group_m: int = 8,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Triton twin of reference.fp8_linear_torch: x [M, K] @ dequant(weight [N, K])^T + bias -> [M, N].

    w8a8 defaults to supports_w8a8() (needs K % 128 == 0); e4m3_bits (decode the weight's bytes
    with integer ops) defaults to True on CUDA GPUs without FP8 support; split_k defaults to
    enough K splits for about one wave of programs when M is small; block_k must divide 128.
    """
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and SCALE_BLOCK % block_k == 0 and x.stride(1) == 1 and weight.stride(1) == 1
    if w8a8 is None:
        w8a8 = supports_w8a8(x.device) and k % SCALE_BLOCK == 0
    if e4m3_bits is None:
        e4m3_bits = x.is_cuda and not supports_w8a8(x.device)
    assert not (e4m3_bits and w8a8), "w8a8 needs FP8 MMA, which implies native e4m3 support"
    if e4m3_bits:
        weight = weight.view(torch.uint8)
    if w8a8:
        a, a_scale = quantize_act_fp8(x)
    else:
        a, a_scale = x, x  # scale pointer unused
    block_m = block_m or (16 if m <= 16 else 64)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = max(1, min(k_blocks // 4, _num_sms(x.device) // tiles))
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty splits
    # split-K partials are summed in fp32 outside the kernel (deterministic, unlike atomics)
    out = torch.empty(split_k, m, n, dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    _fp8_gemm_kernel[(tiles, split_k)](
        a, a_scale, weight, weight_scale_inv, bias if bias is not None else x, out,
        m, n, k, k_per_split,
        a.stride(0), a_scale.stride(0), weight.stride(0), weight_scale_inv.stride(0), out.stride(0), out.stride(1),
        W8A8=w8a8, E4M3_BITS=e4m3_bits, HAS_BIAS=bias is not None and split_k == 1, SCALE_BLOCK=SCALE_BLOCK,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split_k == 1:
        return out[0]
    res = out.sum(0)
    if bias is not None:
        res += bias.float()
    return res.to(x.dtype)
