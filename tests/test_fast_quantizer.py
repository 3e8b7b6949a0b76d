"""The numba INT4/INT8 quantizer (kernels/cpu/quantizer.py) gives the same codes and scales as the torch
quantizer it replaced, which is kept here, as it was, as the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ktlite.kernels.cpu.quant import empty_quantized, quantize, quantize_into

_INT4_DIVISORS = (7.0, 7.5, 8.0, 8.5, 9.0, 9.5, 10.0)


def torch_quantize(w: torch.Tensor, method: str, gsz: int) -> tuple[np.ndarray, np.ndarray]:
    """The torch formulation ktlite used before the numba quantizer: (qweight, scales)."""
    w = w.detach().to(torch.float32)
    step = max(gsz, 128 if method == "INT4" else 64)
    kp = -(-w.shape[-1] // step) * step
    w = torch.nn.functional.pad(w, (0, kp - w.shape[-1]))
    g = w.reshape(*w.shape[:-1], kp // gsz, gsz)
    if method == "INT8":
        s = g.abs().amax(-1, keepdim=True) / 127.0
        q = (g / torch.where(s == 0, torch.ones_like(s), s)).round().clamp(-127, 127).to(torch.int8)
        return q.reshape(w.shape).numpy(), s.squeeze(-1).numpy()
    peak = g.gather(-1, g.abs().argmax(-1, keepdim=True))
    s, best = None, None
    for d in _INT4_DIVISORS:
        cand = peak / -d
        safe = torch.where(cand == 0, torch.ones_like(cand), cand)
        err = ((g / safe).round().clamp(-8, 7) * cand - g).square().sum(-1, keepdim=True)
        if best is None:
            s, best = cand, err
        else:
            better = err < best
            s, best = torch.where(better, cand, s), torch.where(better, err, best)
    s = _row_multiples(s)
    q = (g / torch.where(s == 0, torch.ones_like(s), s)).round().clamp(-8, 7).to(torch.int32) + 8
    q = q.reshape(*w.shape[:-1], kp // 128, 2, 64)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).to(torch.uint8)
    return packed.reshape(*w.shape[:-1], kp // 2).numpy(), s.squeeze(-1).numpy()


def _row_multiples(s: torch.Tensor) -> torch.Tensor:
    """The scales s [..., groups, 1] of each row as whole multiples m (1 <= |m| <= 15) of its step max |s| / 15 with
    20 significant bits (added with the AMX tiles' folded scales; written here from that rule, not from the code)."""
    step = s.abs().amax(-2, keepdim=True) / 15
    step = ((step.view(torch.int32) + 8) & ~15).view(torch.float32)
    m = (s.abs() / torch.where(step == 0, torch.ones_like(step), step)).round().clamp(1, 15)
    return torch.where(s == 0, s, torch.sign(s) * step * m)


def weights(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[..., :3, 5:40] = 0.0  # all-zero groups and zero runs
    w[..., 4, 7] = 1.0  # an outlier
    w[..., 5, 66], w[..., 5, 73] = -0.2, 0.2  # +m and -m in one group: the first one is the peak
    return w


@pytest.mark.parametrize("method", ["INT4", "INT8"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_codes_and_scales_as_the_torch_quantizer(method, group, dtype):
    w = weights((3, 96, 704), seed=group).to(dtype)  # K = 704: padded to 768 (INT4) / a group multiple
    got = quantize(w, method, group)
    q, s = torch_quantize(w, method, group)
    assert np.array_equal(got.scales, s)
    assert np.array_equal(got.qweight, q)


def test_many_groups_agree_up_to_fp32_ties():
    """~229k INT4 groups of bf16 gaussian weights. The two sum the candidates' squared errors in fp32 in
    different orders, so where two candidates' errors tie to ~1e-7 either may win (a handful of groups
    here), and a group's other choice changes its scale, or, the row's largest, the step of all the row's scales;
    every row whose scales differ is checked to hold a group whose two best candidates tie in exact arithmetic,
    and all other rows (and the codes of all groups with the same scale) are identical."""
    w = weights((1024, 7168), seed=7).bfloat16()
    got = quantize(w, "INT4", 32)
    q, s = torch_quantize(w, "INT4", 32)
    differ = np.unique(np.argwhere(got.scales != s)[:, 0])
    assert len(differ) <= 10
    groups = w.float().reshape(1024, 224, 32).double()
    for r in differ:
        g = groups[r]
        peak = g.gather(-1, g.abs().argmax(-1, keepdim=True))
        cands = torch.cat([peak / -d for d in _INT4_DIVISORS], -1)  # [224, 7]
        safe = torch.where(cands == 0, torch.ones_like(cands), cands)
        codes = (g[:, None, :] / safe[..., None]).round().clamp(-8, 7)
        err = (codes * cands[..., None] - g[:, None, :]).square().sum(-1)
        best2 = err.sort(-1).values[:, :2]
        assert ((best2[:, 1] - best2[:, 0]) <= 1e-6 * best2[:, 1]).any()
    byte = np.arange(q.shape[1])
    k_low = byte // 64 * 128 + byte % 64  # byte j of a chunk holds k = j and k = j + 64
    same = (got.scales == s)[:, k_low // 32] & (got.scales == s)[:, (k_low + 64) // 32]
    assert np.array_equal(got.qweight[same], q[same])


def test_quantize_into_row_slices_of_a_stack():
    """Gate and up quantized straight into their halves of the gate_up stack (no concatenated copy)."""
    g, u = weights((16, 256), seed=1), weights((16, 256), seed=2)
    stack = empty_quantized("INT4", 64, (2,), 32, 256)
    quantize_into(stack, (1, slice(0, 16)), g.bfloat16())
    quantize_into(stack, (1, slice(16, 32)), u.bfloat16())
    whole = quantize(torch.cat([g, u]).bfloat16(), "INT4", 64)
    assert np.array_equal(stack.qweight[1], whole.qweight) and np.array_equal(stack.scales[1], whole.scales)
    assert (stack.qweight[0] == 0x88).all()  # the other slot untouched
