"""Gated DeltaNet kernels (gated delta rule, recurrent and chunked; causal conv1d): Triton under
TRITON_INTERPRET on CPU vs the torch twins, on packed batches with ragged lengths (1, 5, 64, 70 tokens:
one token, a partial chunk, one full chunk, a chunk and a bit), reset and continuing state rows in
scattered order, and the in-place state updates.

Tolerances (max abs error; outputs |o| < ~1):
- fp32: 2e-5. The chunked kernels solve the same triangular systems in another order (measured ~1e-7).
- bf16 activations, chunked: 1e-2 on outputs (|o| < 0.25; measured 5e-3, i.e. ~5 bf16 ulps) and 2e-2
  on states: the state kernel rounds its dot operands to bf16, as on a GPU (see gated_delta_attn).
  Recurrent bf16 only rounds the output: 1 ulp.
- conv: 1e-5 fp32 (sum order); bf16 outputs and states 1 ulp.
Interpreter pitfall (triton 3.9): its fp32 -> bf16 cast truncates (torch and the GPU round to nearest
even), so any value a kernel rounds to bf16 may be 1 ulp off here and not on a GPU.
"""

import os
import subprocess
import sys

import pytest
import torch

import ktlite.kernels.triton as kt
from ktlite.kernels import attention

with kt.interpreted():
    from ktlite.kernels.triton.causal_conv_attn import causal_conv1d_triton
    from ktlite.kernels.triton.gated_delta_attn import gated_delta_rule_triton
from ktlite.kernels.triton.reference import causal_conv1d_batch_torch, gated_delta_rule_batch_torch


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    # triton also reads TRITON_INTERPRET at launch, so it must be set while the kernels run
    monkeypatch.setenv("TRITON_INTERPRET", "1")


LENS = [1, 5, 64, 70]
ROWS = [3, 0, 5, 2]  # state rows, out of order; rows 1 and 4 belong to nobody and must stay as they were
RESET = [False, True, False, True]


def batch_meta(lens: list[int], rows: list[int], reset: list[bool]) -> tuple[torch.Tensor, ...]:
    return torch.tensor(rows), torch.tensor(lens), torch.tensor(reset)


def delta_inputs(lens: list[int], heads: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0,
                 max_decay: float = 0.7):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k = (torch.randn(n, heads, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=gen).to(dtype)
    g = -torch.rand(n, heads, generator=gen) * max_decay  # log decays
    beta = torch.rand(n, heads, generator=gen).to(dtype)
    states = torch.randn(6, heads, dk, dv, generator=gen) * 0.3
    states[1] = float("nan")  # a row nobody uses: must stay untouched (and never leak into others)
    return q, k, v, g, beta, states


def check_delta(lens: list[int], rows: list[int], reset: list[bool], heads: int, dk: int, dv: int, dtype: torch.dtype,
                mode: str, out_tol: float, state_tol: float, block_v: int | None = None) -> None:
    q, k, v, g, beta, states = delta_inputs(lens, heads, dk, dv, dtype)
    meta = batch_meta(lens, rows, reset)
    ref_states = states.clone()
    ref = gated_delta_rule_batch_torch(q, k, v, g, beta, ref_states, *meta)
    out = gated_delta_rule_triton(q, k, v, g, beta, states, *meta, mode=mode, block_v=block_v)
    assert out.dtype == v.dtype and out.shape == v.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=out_tol, rtol=0)
    torch.testing.assert_close(states, ref_states, atol=state_tol, rtol=0, equal_nan=True)


@pytest.mark.parametrize("mode", ["recurrent", "chunked"])
@pytest.mark.parametrize("heads,dk,dv", [(1, 16, 16), (2, 64, 32)])
def test_delta_rule_matches_twin_fp32(mode: str, heads: int, dk: int, dv: int) -> None:
    check_delta(LENS, ROWS, RESET, heads, dk, dv, torch.float32, mode, 2e-5, 2e-5)


@pytest.mark.parametrize("heads,dk,dv", [(4, 32, 64), (3, 16, 24)])
def test_delta_rule_chunked_more_heads_and_odd_dv(heads: int, dk: int, dv: int) -> None:
    """H up to 4; dv split over two programs (block_v 32) or not a power of two (masked columns)."""
    check_delta([70, 5], [4, 2], [False, True], heads, dk, dv, torch.float32, "chunked", 2e-5, 2e-5, block_v=32)


def test_delta_rule_bf16() -> None:
    check_delta(LENS, ROWS, RESET, 2, 32, 16, torch.bfloat16, "chunked", 1e-2, 2e-2)
    check_delta([1, 5, 9], [3, 0, 5], [False, True, False], 2, 32, 16, torch.bfloat16, "recurrent", 2e-3, 2e-5)


def test_delta_rule_strong_decay_stays_finite() -> None:
    """Log decays down to -8 per token: e^G of a 64-token chunk underflows and e^-G would overflow;
    every exponent the kernels take must stay <= 0, as in the twin."""
    q, k, v, g, beta, states = delta_inputs([70, 40], 2, 16, 16, torch.float32, seed=9, max_decay=8.0)
    meta = batch_meta([70, 40], [0, 2], [False, False])
    ref_states = states.clone()
    ref = gated_delta_rule_batch_torch(q, k, v, g, beta, ref_states, *meta)
    out = gated_delta_rule_triton(q, k, v, g, beta, states, *meta, mode="chunked")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(states, ref_states, atol=2e-5, rtol=0, equal_nan=True)


def test_delta_rule_decode_batch_is_recurrent_and_skips_empty_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """One token per sequence picks the recurrent path (no host sync); an empty sequence leaves its
    state as it was even when flagged reset, like the twin."""
    from ktlite.kernels.triton import gated_delta_attn

    monkeypatch.setattr(gated_delta_attn, "_chunk_prep_kernel", None)  # the chunked path would fail
    lens, rows, reset = [1, 0, 1, 1], [5, 4, 0, 3], [False, True, True, False]
    q, k, v, g, beta, states = delta_inputs(lens, 2, 16, 16, torch.float32, seed=3)
    meta = batch_meta(lens, rows, reset)
    ref_states = states.clone()
    ref = gated_delta_rule_batch_torch(q, k, v, g, beta, ref_states, *meta)
    before = states[4].clone()
    out = attention.gated_delta_rule(q, k, v, g, beta, states, *meta)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(states, ref_states, atol=2e-5, rtol=0, equal_nan=True)
    assert torch.equal(states[4], before)


def test_delta_rule_prefill_then_decode_continues_state() -> None:
    """A 70-token prefill (chunked) then two decode steps (recurrent) equal the twin on all 72 tokens."""
    q, k, v, g, beta, states = delta_inputs([72], 1, 16, 16, torch.float32, seed=5)
    ref_states = states.clone()
    ref = gated_delta_rule_batch_torch(q, k, v, g, beta, ref_states, *batch_meta([72], [2], [True]))
    parts = [gated_delta_rule_triton(q[:70], k[:70], v[:70], g[:70], beta[:70], states, *batch_meta([70], [2], [True]))]
    for t in (70, 71):
        sl = slice(t, t + 1)
        parts.append(gated_delta_rule_triton(q[sl], k[sl], v[sl], g[sl], beta[sl], states, *batch_meta([1], [2], [False])))
    torch.testing.assert_close(torch.cat(parts), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(states[2], ref_states[2], atol=2e-5, rtol=0)


def test_per_channel_decay_runs_recurrent_and_matches_twin() -> None:
    """Kimi Delta Attention's decay per key channel (g [N, H, dk], down to -5 per token as GLM-5.3-Flash's bound):
    the recurrent kernel by default, over prompts and decode steps alike, equal to the twin's chunked form; the
    chunked kernel, which has no per-channel form, refuses it."""
    lens, rows, reset = [1, 5, 70], [3, 0, 5], [False, True, False]
    q, k, v, _, beta, states = delta_inputs(lens, 2, 16, 16, torch.float32, seed=11)
    g = -5 * torch.rand(q.shape, generator=torch.Generator().manual_seed(12))
    meta = batch_meta(lens, rows, reset)
    ref_states = states.clone()
    ref = gated_delta_rule_batch_torch(q, k, v, g, beta, ref_states, *meta)
    out = attention.gated_delta_rule(q, k, v, g, beta, states, *meta)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(states, ref_states, atol=2e-5, rtol=0, equal_nan=True)
    with pytest.raises(ValueError, match="recurrent"):
        gated_delta_rule_triton(q, k, v, g, beta, states, *meta, mode="chunked")


def conv_inputs(lens: list[int], channels: int, width: int, dtype: torch.dtype, state_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(lens), channels, generator=gen).to(dtype)
    weight = (torch.randn(channels, width, generator=gen) * 0.5).to(dtype)
    states = torch.randn(6, channels, width - 1, generator=gen).to(state_dtype)
    states[1] = float("nan")
    return x, weight, states


@pytest.mark.parametrize("dtype,state_dtype,width,tol", [
    (torch.float32, torch.float32, 4, 1e-5),
    (torch.bfloat16, torch.float32, 4, 8e-3),  # fp32 state rows pass through bf16, as in the twin
    (torch.float32, torch.float32, 2, 1e-5),
    (torch.bfloat16, torch.bfloat16, 3, 8e-3),
])
def test_conv_matches_twin(dtype: torch.dtype, state_dtype: torch.dtype, width: int, tol: float) -> None:
    """Lengths 1 and 2 (< W-1 = 3) keep part of the old state in the new one; C = 40 spans a partial
    channel block (block_c 32) and 70 tokens several token blocks."""
    lens = [1, 2, 5, 70]
    x, weight, states = conv_inputs(lens, 40, width, dtype, state_dtype)
    meta = batch_meta(lens, ROWS, RESET)
    ref_states = states.clone()
    ref = causal_conv1d_batch_torch(x, ref_states, weight, *meta)
    out = causal_conv1d_triton(x, states, weight, *meta, block_c=32)
    assert out.dtype == x.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)  # bf16: 1 ulp (2^-7 relative)
    torch.testing.assert_close(states.float(), ref_states.float(), atol=tol, rtol=tol, equal_nan=True)


def test_conv_empty_sequence_keeps_state() -> None:
    x, weight, states = conv_inputs([1, 0], 8, 4, torch.float32, torch.float32)
    before = states.clone()
    attention.causal_conv1d(x, states, weight, *batch_meta([1, 0], [0, 3], [False, True]))
    assert torch.equal(states[3], before[3]) and not torch.equal(states[0], before[0])


def test_dispatch_runs_no_triton_on_cpu_and_triton_under_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from ktlite.kernels.triton import causal_conv_attn, gated_delta_attn

    calls = []
    for module, name in ((gated_delta_attn, "gated_delta_rule_triton"), (causal_conv_attn, "causal_conv1d_triton")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    q, k, v, g, beta, states = delta_inputs([3], 1, 16, 16, torch.float32)
    x, weight, conv_states = conv_inputs([3], 8, 4, torch.float32, torch.float32)
    meta = batch_meta([3], [0], [False])
    ref = gated_delta_rule_batch_torch(q, k, v, g, beta, states.clone(), *meta)
    ref_conv = causal_conv1d_batch_torch(x, conv_states.clone(), weight, *meta)
    monkeypatch.delenv("TRITON_INTERPRET")
    # a CPU tensor runs the compiled CPU kernels (tests/test_cpu_linear_attention.py), never Triton
    torch.testing.assert_close(attention.gated_delta_rule(q, k, v, g, beta, states.clone(), *meta), ref, atol=2e-5,
                               rtol=0)
    torch.testing.assert_close(attention.causal_conv1d(x, conv_states.clone(), weight, *meta), ref_conv, atol=1e-5,
                               rtol=0)
    assert calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.testing.assert_close(attention.gated_delta_rule(q, k, v, g, beta, states, *meta), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(attention.causal_conv1d(x, conv_states, weight, *meta), ref_conv, atol=1e-5, rtol=0)
    assert calls == ["gated_delta_rule_triton", "causal_conv1d_triton"]


def test_kernels_compile_for_gpu() -> None:
    """ptxas compile of the linear-attention kernels at Gated DeltaNet sizes (dk = dv = 128) for sm90:
    catches what the interpreter accepts but a GPU rejects (e.g. shared memory). Runs without
    TRITON_INTERPRET in a subprocess; `aot_check --only linear` also covers sm80."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "ktlite.kernels.triton.aot_check", "--only", "linear", "--arch", "90"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
