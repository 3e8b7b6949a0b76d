"""Weight formats of the CPU experts: method names, INT8/INT4 group-wise quantization, BF16."""

from __future__ import annotations

import logging

import numba
import numpy as np
import pytest
import torch

from ktlite.errors import ConfigError
from ktlite.kernels.cpu.gemm import dequant_matrix
from ktlite.kernels.cpu.quant import (
    check_group_size,
    dequantize,
    normalize_kt_method,
    quantize,
    relative_error,
)


def gaussian(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def per_row_int4(w: torch.Tensor) -> torch.Tensor:
    """KTransformers-style INT4: one symmetric scale per output row (the baseline to beat)."""
    s = w.abs().amax(1, keepdim=True) / 7
    return (w / s).round().clamp(-8, 7) * s


@pytest.mark.parametrize("name,method", [("int4", "INT4"), ("INT8", "INT8"), ("bf16", "BF16"),
                                         ("AMXINT4", "INT4"), ("moe_int8", "INT8"), ("FP8", "FP8"),
                                         ("fp8_perchannel", "FP8"), ("LLAMAFILE", "LLAMAFILE"),
                                         ("RAWINT4", "RAWINT4")])
def test_method_names_and_aliases(name, method):
    assert normalize_kt_method(name) == method


def test_alias_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="ktlite.kernels.cpu.quant")
    normalize_kt_method("AMXINT8")
    normalize_kt_method("amxint8")
    assert sum("AMXINT8 is served by ktlite's INT8" in r.getMessage() for r in caplog.records) <= 1


def test_unknown_method_lists_valid_values():
    with pytest.raises(ConfigError, match="INT4, INT8, BF16, FP8, RAWINT4, LLAMAFILE, MXFP4, MXFP8, AMXINT4"):
        normalize_kt_method("Q4_K")


def test_group_size_checked():
    with pytest.raises(ConfigError, match="32, 64, 128"):
        check_group_size("INT4", 48)


@pytest.mark.parametrize("method,group,bound", [("INT8", 64, 0.01), ("INT8", 128, 0.01), ("INT4", 32, 0.085),
                                                ("INT4", 64, 0.095), ("INT4", 128, 0.10), ("BF16", 64, 0.005)])
def test_quantization_error_bounded(method, group, bound):
    # Measured on gaussian weights: INT8 ~0.6 %; INT4 8.1 / 9.0 / 9.7 % at G = 32 / 64 / 128. The issue's
    # "INT4 < 8 %" is out of reach at G >= 64: a 4-bit code cannot beat 2^-4 = 6.25 % on gaussian
    # data (rate-distortion bound), and uniform levels cost ~1.4x that.
    w = gaussian(128, 2048)  # K of DeepSeek-V2-Lite's experts
    qw = quantize(w, method, group)
    err = relative_error(dequantize(qw), w)
    assert err < bound
    if method == "INT4":
        assert err < 0.7 * relative_error(per_row_int4(w), w)  # per-row INT4 is ~15 % here


@pytest.mark.parametrize("method", ["INT8", "INT4", "BF16"])
def test_shapes_padding_and_stacking(method):
    w = torch.randn(3, 5, 96)  # K = 96 is not a multiple of the 64/128-weight chunks: padded
    qw = quantize(w, method, 64)
    assert qw.shape == (3, 5, 96)
    deq = dequantize(qw)
    assert deq.shape == w.shape
    assert relative_error(deq, w) < (0.1 if method == "INT4" else 0.01)
    assert qw.nbytes() == qw.qweight.nbytes + qw.scales.nbytes


def test_int4_layout():
    # one 128-weight chunk: byte j holds k = j (low nibble) and k = j + 64 (high nibble), value + 8
    q = torch.tensor([(k % 15) - 7 for k in range(128)], dtype=torch.float32)
    w = q[None, :] * 0.5
    qw = quantize(w, "INT4", 128)
    scale = float(qw.scales[0, 0])
    nib = np.round(w[0].numpy() / scale).astype(int) + 8
    assert np.array_equal(qw.qweight[0], (nib[:64] | (nib[64:] << 4)).astype(np.uint8))
    torch.testing.assert_close(dequantize(qw), w)


def test_zero_group_stays_zero():
    w = torch.zeros(2, 128)
    w[1, 64:] = 1.0
    for method in ("INT8", "INT4"):
        deq = dequantize(quantize(w, method, 64))
        assert torch.isfinite(deq).all()
        torch.testing.assert_close(deq, w)


@pytest.mark.parametrize("method", ["INT8", "INT4"])
def test_bf16_dequantize_rounds_like_torch(method):
    """The prefill path's dequantize-to-bf16 kernel (LLVM fptrunc: vcvtneps2bf16 on AVX512-BF16, integer
    rounding elsewhere) gives exactly torch's round-to-nearest-even of the fp32 weights, over 60 decades."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 256)
    qw = quantize(w, method, 64)
    scratch = np.empty((numba.config.NUMBA_NUM_THREADS, 2, 256), np.float32)
    got = dequant_matrix(qw.qweight, qw.scales, 6, 256, 256, torch.bfloat16, scratch)
    assert torch.equal(got.view(torch.int16), dequantize(qw).to(torch.bfloat16).view(torch.int16))
