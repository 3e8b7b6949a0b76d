"""Weight-only INT8/INT4 format for GPU experts (symmetric, group-wise along the input dim).

Layout of a stacked expert weight of logical shape [E, N, K] (N outputs, K inputs), group size G
(64 or 128, must divide K):
- scales: [E, N, K // G], fp16 or fp32; dequantized w[e, n, k] = q[e, n, k] * scales[e, n, k // G].
- bits=8: qweight int8 [E, N, K], q in [-127, 127].
- bits=4: qweight uint8 [E, N, K // 2], q in [-8, 7] stored as the nibble q + 8. Within group g,
  byte g*G/2 + j holds k = g*G + j in its low nibble and k = g*G + G/2 + j in its high nibble, so
  the kernel unpacks a group into two contiguous K halves (two tl.dot calls, no interleave
  shuffle). This is the same nibble order the CPU INT4 kernels were measured with (MEASURED.md).

MX (`mx=True`, group 32, kernels/cpu/mx.py's numerics): scales uint8 e8m0 [E, N, K // 32], w = value(code) *
2^(scale - 127). bits=4 (MXFP4 / FP4): qweight uint8 [E, N, K // 2], two e2m1 codes a byte, the low nibble the
even k, as gpt-oss and DeepSeek-V4 store them; bits=8 (MXFP8): qweight uint8 [E, N, K], e4m3 bit patterns.
"""

import logging
from dataclasses import dataclass

import torch

from ktlite.kernels.cpu.mx import E2M1_VALUES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizedWeight:
    """A stacked per-expert weight [E, N, K] in the layout above."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    mx: bool = False  # e2m1 / e4m3 codes with e8m0 scales (group 32) instead of integers with float scales

    @property
    def shape(self) -> tuple[int, int, int]:
        num_experts, n, groups = self.scales.shape
        return num_experts, n, groups * self.group_size

    @property
    def device(self) -> torch.device:
        return self.qweight.device


def quantize_weight(
    w: torch.Tensor, bits: int, group_size: int = 128, scale_dtype: torch.dtype = torch.float16
) -> QuantizedWeight:
    """Quantize w [E, N, K] (any float dtype) to the INT8/INT4 group-wise format."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    num_experts, n, k = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"group_size {group_size} must be even and divide the input dim {k}")
    qmax = 127 if bits == 8 else 7
    groups = w.float().reshape(num_experts, n, k // group_size, group_size)
    scales = (groups.abs().amax(dim=-1) / qmax).clamp(min=1e-10).to(scale_dtype)
    # round against the stored (possibly fp16) scale so dequantization reproduces it exactly
    q = torch.round(groups / scales.float()[..., None]).clamp(-qmax - (bits == 4), qmax)
    if bits == 8:
        qweight = q.to(torch.int8).reshape(num_experts, n, k)
    else:
        nib = (q + 8).to(torch.uint8)
        half = group_size // 2
        qweight = (nib[..., :half] | (nib[..., half:] << 4)).reshape(num_experts, n, k // 2)
    return QuantizedWeight(qweight.contiguous(), scales.contiguous(), bits, group_size)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> fp32 2^(s - 127), built from the bits (0: the subnormal 2^-127; 255: +inf)."""
    s = scales.to(torch.int32)
    return torch.where(s == 0, 0x00400000, s << 23).view(torch.float32)


def _mx_codes(w: QuantizedWeight, e: int) -> torch.Tensor:
    """Expert e's MX code values (no scale) as fp32 [N, K]."""
    if w.bits == 8:
        return w.qweight[e].view(torch.float8_e4m3fn).float()
    table = torch.tensor(E2M1_VALUES, device=w.device)
    packed = w.qweight[e].long()
    return torch.stack([table[packed & 15], table[packed >> 4]], dim=-1).flatten(-2)


def dequantize_expert(w: QuantizedWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e of w as a dense [N, K] tensor in dtype."""
    _, n, k = w.shape
    groups = k // w.group_size
    if w.mx:  # one fp32 rounding of code * scale, as transformers' dequantization
        q = _mx_codes(w, e).reshape(n, groups, w.group_size) * e8m0_to_float(w.scales[e])[..., None]
        return q.reshape(n, k).to(dtype)
    if w.bits == 8:
        q = w.qweight[e].float().reshape(n, groups, w.group_size)
    else:
        packed = w.qweight[e].reshape(n, groups, w.group_size // 2)
        q = torch.cat([packed & 0xF, packed >> 4], dim=-1).float() - 8
    return (q * w.scales[e].float()[..., None]).reshape(n, k).to(dtype)


def expert_weight(w: torch.Tensor | QuantizedWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e of a stack, dense [N, K] in dtype: a slice of a dense stack, or dequantize_expert."""
    if isinstance(w, QuantizedWeight):
        return dequantize_expert(w, e, dtype)
    return w[e].to(dtype)
