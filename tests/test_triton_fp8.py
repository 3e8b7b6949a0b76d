"""FP8 block-scaled GEMM: Triton (under TRITON_INTERPRET, fp8 tensors on CPU) vs torch twin vs
a float64 dequantize-and-matmul reference.

Tolerances (atol + rtol * |ref|; outputs are O(1)):
- twin vs float64 reference (fp32 x): 1e-5 + 1e-5.
- Triton weight-only vs twin: fp32 1e-4 + 1e-5; bf16 2e-2 + 1.6e-2 (the twin rounds the
  dequantized weight to bf16, the kernel keeps the exact fp8 value and scales in fp32).
- Triton w8a8 vs a torch emulation of the same activation quantization: 1e-4 + 1e-5 (fp32);
  w8a8 vs the twin is looser by fp8's 3-bit mantissa on the activations: 6 % of max |out|.
Under the interpreter an fp8 x fp8 tl.dot is computed via fp16 (exact for fp8 values).
"""

import os
import subprocess
import sys

import pytest
import torch

import ktlite.kernels.triton as kt
from ktlite.kernels.triton.reference import fp8_dequantize, fp8_linear_torch

with kt.interpreted():
    from ktlite.kernels.triton.fp8 import fp8_linear_triton, quantize_act_fp8


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton reads it at launch too


def _expand(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[ceil(n/128), ceil(k/128)] per-block values -> [n, k]."""
    return blocks.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def fp8_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A DeepSeek-V3-style weight: float8_e4m3fn [n, k] and scale_inv [ceil(n/128), ceil(k/128)]."""
    g = torch.Generator().manual_seed(seed)
    nb, kb = -(-n // 128), -(-k // 128)
    # blocks get different magnitudes so a misplaced scale shows up
    w = torch.randn(n, k, generator=g) / k**0.5 * _expand(torch.rand(nb, kb, generator=g) + 0.5, n, k)
    padded = torch.zeros(nb * 128, kb * 128)
    padded[:n, :k] = w.abs()
    scale = padded.view(nb, 128, kb, 128).amax(dim=(1, 3)) / 448.0
    return (w / _expand(scale, n, k)).to(torch.float8_e4m3fn), scale


CASES = [  # (M, N, K): decode row, tails in N and K, several row tiles
    (1, 200, 384),
    (5, 130, 320),
    (40, 256, 256),
]


@pytest.mark.parametrize("m,n,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_matches_twin_and_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    w, s = fp8_weight(n, k)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    twin = fp8_linear_torch(x, w, s, bias)
    tri = fp8_linear_triton(x, w, s, bias, w8a8=False, block_m=32, block_n=128, block_k=128)
    assert tri.shape == (m, n) and tri.dtype == dtype
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (2e-2, 1.6e-2)
    torch.testing.assert_close(tri.float(), twin.float(), atol=atol, rtol=rtol)
    if dtype == torch.float32:
        ref = x.double() @ fp8_dequantize(w, s, torch.float64).T + bias.double()
        torch.testing.assert_close(twin.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_e4m3_bit_decode_path(dtype: torch.dtype) -> None:
    """The pre-sm89 path (weight bytes decoded with integer ops) equals the native fp8 path."""
    w, s = fp8_weight(200, 320, seed=4)
    x = torch.randn(5, 320).to(dtype)
    native = fp8_linear_triton(x, w, s, w8a8=False, e4m3_bits=False, block_m=16)
    decoded = fp8_linear_triton(x, w, s, w8a8=False, e4m3_bits=True, block_m=16)
    torch.testing.assert_close(decoded, native, atol=0, rtol=0)


def test_split_k_and_small_block_k() -> None:
    """3 K splits of 64-wide tiles (two tiles per scale block), bias added after the fp32 sum."""
    w, s = fp8_weight(130, 384, seed=1)
    x = torch.randn(3, 384)
    bias = torch.randn(130)
    tri = fp8_linear_triton(x, w, s, bias, w8a8=False, split_k=3, block_m=16, block_n=128, block_k=64)
    torch.testing.assert_close(tri, fp8_linear_torch(x, w, s, bias), atol=1e-4, rtol=1e-5)


def test_w8a8() -> None:
    m, n, k = 7, 200, 384
    w, s = fp8_weight(n, k, seed=2)
    x = torch.randn(m, k) * torch.linspace(0.1, 3, k)  # uneven groups exercise per-group scales
    tri = fp8_linear_triton(x, w, s, w8a8=True, block_m=16, block_n=128, block_k=128)
    xq, xs = quantize_act_fp8(x)
    x_deq = (xq.double().view(m, k // 128, 128) * xs.double()[..., None]).view(m, k)
    emulated = x_deq @ fp8_dequantize(w, s, torch.float64).T
    torch.testing.assert_close(tri.double(), emulated, atol=1e-4, rtol=1e-5)
    twin = fp8_linear_torch(x, w, s)
    assert (tri - twin).abs().max() < 0.06 * twin.abs().max()


def test_dispatch_routes_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    w, s = fp8_weight(130, 256)
    x = torch.randn(2, 256)
    twin = fp8_linear_torch(x, w, s)
    torch.testing.assert_close(kt.fp8_linear(x, w, s), twin, atol=1e-4, rtol=1e-5)  # Triton, weight-only on CPU
    monkeypatch.setenv("KTLITE_FORCE_TORCH_KERNELS", "1")
    torch.testing.assert_close(kt.fp8_linear(x, w, s), twin)


def test_kernels_compile_for_gpu() -> None:
    """ptxas compile of the GPU launch configurations (DeepSeek-V3 sizes) for sm80/sm90: catches
    what the interpreter accepts but a GPU rejects. Runs without TRITON_INTERPRET in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "ktlite.kernels.triton.aot_check", "--only", "fp8", "--arch", "80", "90"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
