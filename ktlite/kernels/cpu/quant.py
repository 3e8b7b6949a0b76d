"""Weight formats of the CPU experts: method names, group-wise INT8/INT4 quantization, BF16.

Weights are torch-Linear shaped `[..., N_out, K_in]` (leading dims stack experts). Every format is
row-major along K so a kernel streams one output row front to back:

- INT8: `qweight` int8 `[..., N, Kp]`, `scales` fp32 `[..., N, Kp / G]`; w = q * s, q in [-127, 127].
- INT4: `qweight` uint8 `[..., N, Kp / 2]`, `scales` as INT8; w = (nibble - 8) * s. Inside each chunk
  of 128 weights (64 bytes), byte j holds k = j (low nibble) and k = j + 64 (high nibble), so both
  halves decode into contiguous runs (2-3x faster than adjacent nibbles, see MEASURED.md) and the
  layout does not depend on G.
- BF16: `qweight` uint16 (bf16 bit patterns) `[..., N, Kp]`, no scales.

Kp is K rounded up to a multiple of max(G, 64) (INT8) or max(G, 128) (INT4), zero padded (the
kernels decode fixed 64-byte chunks), so any K works.

INT4 scales are chosen per group to minimise the squared error over a few candidates around the
"largest |w| maps to -8" scale: on gaussian weights that is ~9.0 % relative error at G=64 (8.1 % at
G=32) against 15 % for one scale per output row.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ktlite.errors import ConfigError

logger = logging.getLogger(__name__)

METHODS = ("INT4", "INT8", "BF16")
# KTransformers' --kt-method names and the ktlite format that serves each of them
METHOD_ALIASES = {
    "AMXINT4": "INT4",
    "MOE_INT4": "INT4",
    "RAWINT4": "INT4",
    "LLAMAFILE": "INT4",
    "AMXINT8": "INT8",
    "MOE_INT8": "INT8",
    "FP8": "INT8",  # group-wise INT8 is at least as accurate as FP8 e4m3 at the same byte per weight
}
GROUP_SIZES = (32, 64, 128)
_INT4_DIVISORS = (7.0, 7.5, 8.0, 8.5, 9.0, 9.5, 10.0)  # candidate scales: max|w| / d


@functools.lru_cache(maxsize=None)
def _log_alias(name: str, method: str) -> None:
    # lru_cache makes the message appear once per process and alias
    logger.info("--kt-method %s is served by ktlite's %s format", name, method)


def normalize_kt_method(name: str) -> str:
    """A `--kt-method` value (ktlite or KTransformers spelling, any case) -> "INT4" | "INT8" | "BF16"."""
    key = str(name).strip().upper()
    if key in METHODS:
        return key
    if key in METHOD_ALIASES:
        _log_alias(key, METHOD_ALIASES[key])
        return METHOD_ALIASES[key]
    valid = ", ".join(METHODS + tuple(METHOD_ALIASES))
    raise ConfigError(f"--kt-method {name!r} is not supported; valid values: {valid}")


def check_group_size(method: str, group_size: int) -> int:
    if method != "BF16" and group_size not in GROUP_SIZES:
        raise ConfigError(f"group size {group_size} is not supported; use one of {GROUP_SIZES}")
    return group_size


INT4_CHUNK = 128  # weights per 64-byte chunk
INT8_CHUNK = 64


def padded_k(k: int, method: str, group_size: int) -> int:
    if method == "BF16":
        return k
    step = max(group_size, INT4_CHUNK if method == "INT4" else INT8_CHUNK)
    return -(-k // step) * step


@dataclass
class QuantizedWeight:
    """One matrix `[N, K]` or a stack of them `[..., N, K]` in one of the formats above."""

    method: str
    group_size: int
    k: int  # logical input size (qweight may be padded to a multiple of group_size)
    qweight: np.ndarray
    scales: np.ndarray  # fp32 [..., N, Kp / G]; shape [..., N, 0] for BF16

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.qweight.shape[:-1], self.k)

    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


def empty_quantized(method: str, group_size: int, lead: tuple[int, ...], n: int, k: int) -> QuantizedWeight:
    """Zero-filled storage for `lead` stacked `[n, k]` matrices, to be filled by `quantize_into`."""
    kp = padded_k(k, method, group_size)
    if method == "INT8":
        q = np.zeros((*lead, n, kp), np.int8)
    elif method == "INT4":
        q = np.full((*lead, n, kp // 2), 0x88, np.uint8)  # nibble 8 encodes zero
    else:
        q = np.zeros((*lead, n, kp), np.uint16)
    ngroups = kp // group_size if method != "BF16" else 0
    return QuantizedWeight(method, group_size, k, q, np.zeros((*lead, n, ngroups), np.float32))


def _group_scales_int8(g: torch.Tensor) -> torch.Tensor:
    return g.abs().amax(-1, keepdim=True) / 127.0


def _group_scales_int4(g: torch.Tensor) -> torch.Tensor:
    # signed value of largest magnitude; scale = it / -d so it lands on (or near) -8
    peak = g.gather(-1, g.abs().argmax(-1, keepdim=True))
    best_scale, best_err = None, None
    for d in _INT4_DIVISORS:
        s = peak / -d
        safe = torch.where(s == 0, torch.ones_like(s), s)
        err = ((g / safe).round().clamp(-8, 7) * s - g).square().sum(-1, keepdim=True)
        if best_err is None:
            best_scale, best_err = s, err
        else:
            better = err < best_err
            best_scale, best_err = torch.where(better, s, best_scale), torch.where(better, err, best_err)
    return best_scale


def quantize(w: torch.Tensor, method: str, group_size: int = 64) -> QuantizedWeight:
    """`w [..., N, K]` (any float dtype) -> QuantizedWeight."""
    out = empty_quantized(method, group_size, tuple(w.shape[:-2]), w.shape[-2], w.shape[-1])
    quantize_into(out, (), w)
    return out


def quantize_into(dst: QuantizedWeight, index: tuple, w: torch.Tensor) -> None:
    """Quantize `w [..., N, K]` into `dst.qweight[index]` / `dst.scales[index]` (in place)."""
    method, gsz = dst.method, dst.group_size
    if tuple(w.shape[-2:]) != (dst.qweight.shape[-2], dst.k):
        raise ValueError(f"weight shape {tuple(w.shape)} does not match storage {dst.shape}")
    w = w.detach().to(torch.float32)
    if method == "BF16":
        dst.qweight[index] = w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return
    kp = dst.qweight.shape[-1] * (2 if method == "INT4" else 1)
    if kp != w.shape[-1]:
        w = torch.nn.functional.pad(w, (0, kp - w.shape[-1]))
    g = w.reshape(*w.shape[:-1], kp // gsz, gsz)
    if method == "INT8":
        s = _group_scales_int8(g)
        q = (g / torch.where(s == 0, torch.ones_like(s), s)).round().clamp(-127, 127).to(torch.int8)
        dst.qweight[index] = q.reshape(w.shape).numpy()
    else:
        s = _group_scales_int4(g)
        q = (g / torch.where(s == 0, torch.ones_like(s), s)).round().clamp(-8, 7).to(torch.int32) + 8
        q = q.reshape(*w.shape[:-1], kp // INT4_CHUNK, 2, INT4_CHUNK // 2)
        packed = (q[..., 0, :] | (q[..., 1, :] << 4)).to(torch.uint8)
        dst.qweight[index] = packed.reshape(*w.shape[:-1], kp // 2).numpy()
    dst.scales[index] = s.squeeze(-1).numpy()


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """QuantizedWeight -> fp32 `[..., N, K]` (the exact values the kernels compute with)."""
    q = torch.from_numpy(qw.qweight)
    if qw.method == "BF16":
        return q.view(torch.bfloat16).float()
    lead_n = q.shape[:-1]
    gsz = qw.group_size
    if qw.method == "INT8":
        vals = q.to(torch.float32)
    else:
        nib = q.to(torch.int32).reshape(*lead_n, -1, INT4_CHUNK // 2)
        vals = torch.cat([(nib & 15) - 8, (nib >> 4) - 8], dim=-1).to(torch.float32)
    g = vals.reshape(*lead_n, -1, gsz) * torch.from_numpy(qw.scales)[..., None]
    return g.reshape(*lead_n, -1)[..., : qw.k]


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius)."""
    return float((approx.float() - exact.float()).norm() / exact.float().norm().clamp_min(1e-30))
