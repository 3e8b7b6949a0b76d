"""The GPU fused MoE on MX experts (MXFP4 / FP4 e2m1 and MXFP8 e4m3 codes, e8m0 scales per 32), Triton under
TRITON_INTERPRET against its torch twin, and the twin's dequantization against transformers' bit for bit.
Tolerances are test_triton_moe's: both sides decode the same exact weights."""

import pytest
import torch

import ktlite.kernels.triton as kt

with kt.interpreted():  # before the imports below: they reach kernel modules (fp8.py) that moe.py's kernel calls
    from ktlite.kernels.triton.moe import fused_moe_triton

from ktlite.kernels.triton.quant import QuantizedWeight, dequantize_expert
from ktlite.kernels.triton.reference import fused_moe_torch
from test_mx_experts import fp4_quantize, mxfp8_quantize, transformers_fp8_path
from test_triton_moe import BLOCKS, MASK, TOL, make_moe


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton reads it at launch too


def mx_stack(w: torch.Tensor, bits: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """w [E, N, K] -> (its MX QuantizedWeight, transformers' dequantization of those codes [E, N, K] fp32)."""
    codes, scales, dense = [], [], []
    for e in range(w.shape[0]):
        if bits == 4:
            c, s = fp4_quantize(w[e])
            dense.append(transformers_fp8_path(c.view(torch.int8), s.view(torch.float8_e8m0fnu)))
        else:
            parts = mxfp8_quantize("w.weight", w[e].float())
            c, s = parts["w.weight"].view(torch.uint8), parts["w.weight_scale_inv"].view(torch.uint8)
            dense.append(transformers_fp8_path(parts["w.weight"], parts["w.weight_scale_inv"]))
        codes.append(c)
        scales.append(s)
    return QuantizedWeight(torch.stack(codes), torch.stack(scales), bits, 32, mx=True), torch.stack(dense)


@pytest.mark.parametrize("bits,dtype", [(4, torch.float32), (4, torch.bfloat16), (8, torch.bfloat16)],
                         ids=["mxfp4-fp32", "mxfp4-bf16", "mxfp8-bf16"])
def test_mx_experts_match_twin(bits: int, dtype: torch.dtype) -> None:
    hidden, w13, w2, ids, weights = make_moe(dtype, seed=2)
    q13, d13 = mx_stack(w13.float(), bits)
    q2, d2 = mx_stack(w2.float(), bits)
    for q, d in ((q13, d13), (q2, d2)):  # the twin decodes transformers' values exactly
        assert all(torch.equal(dequantize_expert(q, e, torch.float32), d[e]) for e in range(d.shape[0]))
    twin = fused_moe_torch(hidden, q13, q2, ids, weights, MASK)
    tri = fused_moe_triton(hidden, q13, q2, ids, weights, MASK, **BLOCKS)
    torch.testing.assert_close(tri.float(), twin.float(), atol=TOL[dtype], rtol=0)
    dense = fused_moe_torch(hidden, d13.to(dtype), d2.to(dtype), ids, weights, MASK)
    torch.testing.assert_close(twin.float(), dense.float(), atol=TOL[dtype], rtol=0)
