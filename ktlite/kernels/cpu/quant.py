"""Weight formats of the CPU experts, `--kt-method` names, group-wise INT8/INT4 quantization.

Weights are torch-Linear shaped `[..., N_out, K_in]` (leading dims stack experts). Every format is
row-major along K so a kernel streams one output row front to back; `QuantizedWeight.method` names
the format:

- INT8: `qweight` int8 `[..., N, Kp]`, `scales` fp32 `[..., N, Kp / G]`; w = q * s, q in [-127, 127].
- INT4: `qweight` uint8 `[..., N, Kp / 2]`, `scales` as INT8; w = (nibble - 8) * s. Inside each chunk
  of 128 weights (64 bytes), byte j holds k = j (low nibble) and k = j + 64 (high nibble), so both
  halves decode into contiguous runs (2-3x faster than adjacent nibbles, see MEASURED.md) and the
  layout does not depend on G.
- BF16: `qweight` uint16 (bf16 bit patterns) `[..., N, K]`, no scales.
- FP8: e4m3 bytes with fp32 scales per row and group (fp8.py), as block- or channel-scaled FP8
  checkpoints ship them.
- Q4_K, Q5_K, Q6_K, Q8_0: GGUF blocks as llama.cpp stores them (gguf_quants.py).
- MXFP4, MXFP8: e2m1 / e4m3 codes with one e8m0 scale byte per 32 weights (uint8 `scales`), as MX checkpoints
  ship them (mx.py).

Kp is K rounded up to a multiple of max(G, 64) (INT8, FP8, MX) or max(G, 128) (INT4), zero padded (the
kernels decode fixed 64-byte chunks), so any K works; GGUF rows are whole blocks.

INT4 scales are chosen per group to minimise the squared error over a few candidates around the
"largest |w| maps to -8" scale (quantizer.py), then rounded to whole multiples (1-15) of one step per row, which
the AMX tiles fold into the weights: on gaussian weights that is ~9.2 % relative error at G=64 (9.1 % before the
rounding; 8.1 % at G=32) against 15 % for one scale per output row.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
import torch

from ktlite.errors import ConfigError, KtliteError
from ktlite.kernels.cpu.fp8 import E4M3
from ktlite.kernels.cpu.gguf_quants import BLOCKS, block_weights, is_gguf_format
from ktlite.kernels.cpu.mx import MX_GROUP, MX_METHODS, code_dtype, codes_per_byte
from ktlite.kernels.cpu.quantizer import quantize_rows

logger = logging.getLogger(__name__)

# --kt-method values, KTransformers' names: what ktlite stores for each (README "--kt-method")
METHODS = ("INT4", "INT8", "BF16", "FP8", "RAWINT4", "LLAMAFILE", "MXFP4", "MXFP8")
# methods whose weights ktlite quantizes (or widens) from float tensors; the others keep a checkpoint's
# own encoding and are filled by ktlite/runtime/expert_sources.py
QUANTIZED_METHODS = ("INT4", "INT8", "BF16")
METHOD_ALIASES = {
    "AMXINT4": "INT4",
    "MOE_INT4": "INT4",
    "AMXINT8": "INT8",
    "MOE_INT8": "INT8",
    "FP8_PERCHANNEL": "FP8",  # the checkpoint's scale tensors say whether they are per block or channel
    "FP4": "MXFP4",  # DeepSeek-V4's FP4 experts: e2m1 + ue8m0 per 32, MXFP4's numerics in per-expert tensors
}
GROUP_SIZES = (32, 64, 128)
RAWINT4_GROUP = 32  # the group of the compressed-tensors INT4 checkpoints RAWINT4 reads


@functools.lru_cache(maxsize=None)
def _log_alias(name: str, method: str) -> None:
    # lru_cache makes the message appear once per process and alias
    logger.info("--kt-method %s is served by ktlite's %s format", name, method)


def normalize_kt_method(name: str) -> str:
    """A `--kt-method` value (ktlite or KTransformers spelling, any case) -> one of METHODS."""
    key = str(name).strip().upper()
    if key in METHODS:
        return key
    if key in METHOD_ALIASES:
        _log_alias(key, METHOD_ALIASES[key])
        return METHOD_ALIASES[key]
    valid = ", ".join(METHODS + tuple(METHOD_ALIASES))
    raise ConfigError(f"--kt-method {name!r} is not supported; valid values: {valid}")


# INT8 defaults to groups of 128: its MoE-output error stays below kt-kernel's per-channel INT8 (1.9-2.0 % vs 2.8-3.0 %
# in bench/cpu_moe.py), and on AMX tiles each group costs a rescale of the int32 sums that costs twice the multiply
# (groups of 64: 1.07-1.26x kt-kernel's prefill time when last measured, before the AMX results' vector stores; 128:
# 0.53-0.85x after them, V3 at 512 tokens per expert the 0.82-0.85x; bench/RESULTS.md). INT4 keeps 64: its scales fold
# into the weights on the tiles (quantizer._row_multiples), and its error doubles from 64 to per-channel.
DEFAULT_GROUP_SIZES = {"INT4": 64, "INT8": 128}


def check_group_size(method: str, group_size: int | None) -> int:
    """group_size, or the method's default for None (DEFAULT_GROUP_SIZES; 64 for the formats that ignore it)."""
    if method in MX_METHODS:  # the format fixes it
        if group_size not in (None, MX_GROUP):
            raise ConfigError(f"{method} has one scale per {MX_GROUP} weights; group size {group_size} does not apply")
        return MX_GROUP
    if group_size is None:
        return DEFAULT_GROUP_SIZES.get(method, 64)
    if method in ("INT4", "INT8") and group_size not in GROUP_SIZES:
        raise ConfigError(f"group size {group_size} is not supported; use one of {GROUP_SIZES}")
    return group_size


# --cpu-activations: what INT4/INT8 rows are dotted with. int8: activations quantized per 32 values
# (activations.quantize_activations) and integer dot products, llama.cpp's and kt-kernel's AMX methods' way,
# ~0.5 % relative error added per matmul; fp32: the exact fp32 activations; auto: int8 where the CPU does
# the integer dots in hardware (AVX2), else fp32
ACTIVATIONS = ("auto", "int8", "fp32")
INT_DOT_METHODS = ("INT4", "INT8")  # storage formats the int8-activation dot reads


def normalize_activations(setting: str) -> str:
    """A --cpu-activations value (any case) -> one of ACTIVATIONS."""
    key = str(setting).strip().lower()
    if key not in ACTIVATIONS:
        raise ConfigError(f"--cpu-activations {setting!r} is not supported; valid values: {', '.join(ACTIVATIONS)}")
    return key


def int8_activations(setting: str) -> bool:
    """Whether a --cpu-activations value (auto, int8, fp32; any case) means int8 activations on this CPU."""
    key = normalize_activations(setting)
    if key == "auto":
        from ktlite.kernels.cpu.int8_dots import int_dot_in_hardware  # numba code: imported on use only

        return int_dot_in_hardware()
    return key == "int8"


INT4_CHUNK = 128  # weights per 64-byte chunk
INT8_CHUNK = 64


def padded_k(k: int, method: str, group_size: int) -> int:
    """Stored row length (in weights) of a K-wide row in format `method`."""
    if method == "BF16" or is_gguf_format(method):
        return k
    step = max(group_size, INT4_CHUNK if method == "INT4" else INT8_CHUNK)
    return -(-k // step) * step


def matrix_bytes(method: str, group_size: int, n: int, k: int) -> int:
    """RAM of one [n, k] matrix in storage format `method` (a GGUF type, or INT4/INT8/BF16/FP8)."""
    if is_gguf_format(method):
        dtype, qk = BLOCKS[method]
        return n * (k // qk) * dtype.itemsize
    kp = padded_k(k, method, group_size)
    if method == "BF16":
        return n * k * 2
    if method in MX_METHODS:  # one e8m0 byte per group
        return n * kp // codes_per_byte(method) + n * (kp // group_size)
    return n * (kp // 2 if method == "INT4" else kp) + n * (kp // group_size) * 4


@dataclass
class QuantizedWeight:
    """One matrix `[N, K]` or a stack of them `[..., N, K]` in one of the formats above."""

    method: str  # the storage format: INT4, INT8, BF16, FP8 or a GGUF type
    group_size: int  # weights per scale (GGUF: per block)
    k: int  # logical input size (qweight may be padded to kp)
    qweight: np.ndarray
    # fp32 [..., N, Kp / G]; MX: e8m0 bytes (uint8); [..., N, 0] for BF16 and GGUF (scales inside the blocks)
    scales: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.qweight.shape[:-1], self.k)

    @property
    def kp(self) -> int:
        """Stored row length in weights (what a kernel's input vector must be padded to)."""
        return padded_k(self.k, self.method, self.group_size)

    @property
    def group_shift(self) -> int:
        """log2 of the group size, as the kernels take it (GGUF blocks carry their own scales: 0)."""
        return 0 if is_gguf_format(self.method) or self.method == "BF16" else self.group_size.bit_length() - 1

    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def __getitem__(self, index) -> QuantizedWeight:
        """The matrices at `index` of the leading (stacking) dims, as views."""
        return QuantizedWeight(self.method, self.group_size, self.k, self.qweight[index], self.scales[index])


def _on_cache_lines(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """np.empty starting on a cache line (amx_kernels.cache_line_bytes): AMX tile loads read INT8 rows straight from
    storage (amx_tiles.amx_block_dot)."""
    from ktlite.kernels.cpu.amx_kernels import cache_line_bytes  # numba code: imported on use only

    return cache_line_bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize).view(dtype).reshape(shape)


def empty_quantized(method: str, group_size: int, lead: tuple[int, ...], n: int, k: int,
                    place: Callable[[np.ndarray], None] | None = None) -> QuantizedWeight:
    """Zero-filled storage for `lead` stacked `[n, k]` matrices in storage format `method`. `place(array)` sees each
    array before it is filled: the fill is the pages' first touch (CPUMoE binds them to NUMA nodes there)."""
    kp = padded_k(k, method, group_size)
    ngroups = kp // group_size
    zero = 0
    scale_dtype = np.uint8 if method in MX_METHODS else np.float32
    if method == "INT8":
        q = _on_cache_lines((*lead, n, kp), np.int8)  # kp bytes a row, a multiple of 64: AMX tile rows
    elif method == "INT4":
        q, zero = np.empty((*lead, n, kp // 2), np.uint8), 0x88  # nibble 8 encodes zero
    elif method == "FP8":
        q = np.empty((*lead, n, kp), E4M3)
    elif method in MX_METHODS:
        q = np.empty((*lead, n, kp // codes_per_byte(method)), code_dtype(method))
    elif is_gguf_format(method):
        if k % block_weights(method):
            raise KtliteError(f"{method} rows hold whole {block_weights(method)}-weight blocks; K = {k} is not a multiple")
        q = np.empty((*lead, n, k // block_weights(method)), BLOCKS[method][0])
        ngroups = 0
    elif method == "BF16":
        q = np.empty((*lead, n, kp), np.uint16)
        ngroups = 0
    else:
        raise KtliteError(f"unknown CPU expert storage format {method!r}")
    scales = np.empty((*lead, n, ngroups), scale_dtype)
    for array, value in ((q, zero), (scales, 0)):
        if place is not None:
            place(array)
        array[...] = value
    return QuantizedWeight(method, group_size, k, q, scales)


def quantize(w: torch.Tensor, method: str, group_size: int | None = None) -> QuantizedWeight:
    """`w [..., N, K]` (any float dtype) -> QuantizedWeight in INT4, INT8 or BF16 (group_size None: the method's
    default)."""
    out = empty_quantized(method, check_group_size(method, group_size), tuple(w.shape[:-2]), w.shape[-2], w.shape[-1])
    quantize_into(out, (), w)
    return out


def _source_rows(w: torch.Tensor) -> np.ndarray:
    """`w [..., N, K]` as numpy rows [R, K] the quantizer reads: bf16 as its bits (no fp32 copy), else fp32."""
    w = w.detach().cpu().contiguous()
    if w.dtype == torch.bfloat16:
        return w.view(torch.int16).numpy().view(np.uint16).reshape(-1, w.shape[-1])
    return w.to(torch.float32).numpy().reshape(-1, w.shape[-1])


def quantize_into(dst: QuantizedWeight, index: tuple, w: torch.Tensor) -> None:
    """Quantize `w [..., N, K]` into `dst.qweight[index]` / `dst.scales[index]` (in place); `index` may
    select rows too, e.g. (slot, slice(0, I)) for the gate half of a gate_up stack."""
    target = dst[index]
    if tuple(w.shape[-2:]) != (target.qweight.shape[-2], dst.k):
        raise ValueError(f"weight shape {tuple(w.shape)} does not match storage {target.shape}")
    if dst.method == "BF16":
        target.qweight[...] = w.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return
    if dst.method not in ("INT4", "INT8"):
        raise KtliteError(f"{dst.method} experts keep the checkpoint's own encoding; they are not quantized by ktlite")
    q, s = target.qweight, target.scales
    contiguous = q.flags.c_contiguous and s.flags.c_contiguous
    q_rows = q.reshape(-1, q.shape[-1]) if contiguous else np.empty((w[..., 0].numel(), q.shape[-1]), q.dtype)
    s_rows = s.reshape(-1, s.shape[-1]) if contiguous else np.empty((q_rows.shape[0], s.shape[-1]), s.dtype)
    quantize_rows(_source_rows(w), dst.method, dst.group_size, q_rows, s_rows)
    if not contiguous:
        q[...] = q_rows.reshape(q.shape)
        s[...] = s_rows.reshape(s.shape)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """QuantizedWeight -> fp32 `[..., N, K]` (the exact values the kernels compute with)."""
    q = torch.from_numpy(qw.qweight) if qw.method in QUANTIZED_METHODS else None
    if qw.method == "BF16":
        return q.view(torch.bfloat16).float()
    if q is None:  # FP8, MX and GGUF: the kernels' own decoder (bit-exact code * scale; ggml's block math)
        return _dequantize_native(qw)
    lead_n = q.shape[:-1]
    gsz = qw.group_size
    if qw.method == "INT8":
        vals = q.to(torch.float32)
    else:
        nib = q.to(torch.int32).reshape(*lead_n, -1, INT4_CHUNK // 2)
        vals = torch.cat([(nib & 15) - 8, (nib >> 4) - 8], dim=-1).to(torch.float32)
    g = vals.reshape(*lead_n, -1, gsz) * torch.from_numpy(qw.scales)[..., None]
    return g.reshape(*lead_n, -1)[..., : qw.k]


def _dequantize_native(qw: QuantizedWeight) -> torch.Tensor:
    from ktlite.kernels.cpu.linear_kernels import dequant_rows_f32  # numba code: compiled on first use only

    q = np.ascontiguousarray(qw.qweight).reshape(-1, qw.qweight.shape[-1])
    s = np.ascontiguousarray(qw.scales).reshape(q.shape[0], qw.scales.shape[-1])
    out = np.empty((q.shape[0], qw.k), np.float32)
    scratch = np.empty((numba.config.NUMBA_NUM_THREADS, 2, qw.kp), np.float32)
    dequant_rows_f32(q, s, qw.group_shift, qw.kp, scratch, out)
    return torch.from_numpy(out).reshape(qw.shape)


def int8_activation_values(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., K] -> the values the int8-activation kernels multiply (xq * xd per `block` values of the zero-padded
    row, activations.quantize_activations' fp32 arithmetic; the AMX tiles quantize per weight group), in fp64
    [..., K]: their reference."""
    k = x.shape[-1]
    blocks = torch.nn.functional.pad(x.float(), (0, -k % block)).reshape(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    xd = amax / torch.tensor(127.0)
    values = torch.round(blocks * inv).double() * xd.double()  # round: to nearest even, as np.rint
    return values.reshape(*x.shape[:-1], -1)[..., :k]


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius)."""
    return float((approx.float() - exact.float()).norm() / exact.float().norm().clamp_min(1e-30))
