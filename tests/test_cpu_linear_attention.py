"""The compiled CPU Gated DeltaNet kernels (ktlite/kernels/cpu/linear_attention.py) against the torch twins.

Ragged packed batches (requests of different lengths in one call, states at scattered rows, some continuing a state
and some reset), every chunk boundary (1, 63, 64, 65, 200 tokens), decode steps (one token per request, the
recurrent form), key heads shared by several value heads, bf16 inputs; the conv with sequences shorter than its
window; and a tiny Qwen3-Next engine's greedy tokens with these kernels equal to its tokens on the twins.
Tolerances: fp32 results within 2e-5 absolute of the twin's (values are O(1); the two differ only in summation
order), bf16 outputs within one bf16 rounding (1e-2 relative).
"""

from __future__ import annotations

import pytest
import torch

from ktlite import Engine
from ktlite.kernels.cpu import linear_attention as cpu
from ktlite.kernels.triton.reference import causal_conv1d_batch_torch, gated_delta_rule_batch_torch

ROWS = 8  # state pool rows


def _delta_inputs(lens: list[int], heads: int = 4, key_heads: int = 4, dk: int = 32, dv: int = 16,
                  dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k = (torch.randn(n, key_heads, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=gen).to(dtype)
    g = -torch.rand(n, heads, generator=gen) * 0.5  # log decay <= 0
    beta = torch.rand(n, heads, generator=gen)
    states = torch.randn(ROWS, heads, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, states


def _run_both(q, k, v, g, beta, states, rows, lens, reset):
    """(compiled output, its states, twin output, its states) from the same inputs; the twin gets q and k repeated to
    the value heads (what the model's call site does)."""
    rows, lens, reset = torch.tensor(rows), torch.tensor(lens), torch.tensor(reset)
    per_key = v.shape[1] // q.shape[1]
    ours, theirs = states.clone(), states.clone()
    got = cpu.gated_delta_rule(q, k, v, g, beta, ours, rows, lens, reset)
    want = gated_delta_rule_batch_torch(q.repeat_interleave(per_key, 1), k.repeat_interleave(per_key, 1), v, g, beta,
                                        theirs, rows, lens, reset)
    return got, ours, want, theirs


@pytest.mark.parametrize("key_heads", [4, 2], ids=["heads-equal", "key-heads-shared"])
def test_ragged_batch_matches_twin(key_heads):
    """Six requests of 1, 63, 64, 65, 200 and 0 tokens at scattered rows, three reset, three continuing."""
    lens = [1, 63, 64, 65, 200, 0]
    inputs = _delta_inputs(lens, key_heads=key_heads)
    got, ours, want, theirs = _run_both(*inputs, rows=[3, 1, 7, 0, 5, 2], lens=lens,
                                        reset=[False, True, False, True, False, True])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)
    assert torch.equal(ours[[4, 6]], inputs[-1][[4, 6]])  # rows of no request untouched
    assert torch.equal(ours[2], inputs[-1][2])  # a 0-token request's row untouched, even with reset


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
def test_chunk_boundaries(length):
    """One request continuing its state, then a second call continuing from where the first left it."""
    inputs = _delta_inputs([length, length], seed=length)
    q, k, v, g, beta, states = inputs
    ours, theirs = states.clone(), states.clone()
    for part in (slice(0, length), slice(length, 2 * length)):
        got, ours, want, theirs = _run_both(q[part], k[part], v[part], g[part], beta[part], ours, rows=[5],
                                            lens=[length], reset=[False])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)


@pytest.mark.parametrize("key_heads", [4, 2], ids=["heads-equal", "key-heads-shared"])
def test_per_channel_decay_matches_twin(key_heads):
    """Kimi Delta Attention's decay per key channel (g [N, H, dk] down to -5, GLM-5.3-Flash's bound): a ragged batch
    (prompts across chunk boundaries, a decode token, an empty request), then one decode step continuing it."""
    lens = [1, 65, 70, 0]
    q, k, v, _, beta, states = _delta_inputs(lens, key_heads=key_heads, seed=4)
    g = -5 * torch.rand(sum(lens), 4, 32, generator=torch.Generator().manual_seed(5))
    got, ours, want, theirs = _run_both(q, k, v, g, beta, states, rows=[3, 1, 7, 2], lens=lens,
                                        reset=[False, True, False, True])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)
    assert torch.equal(ours[2], states[2])  # a 0-token request's row untouched, even with reset
    idx = torch.tensor([0, 65])  # one more token for the first two requests
    got, ours, want, theirs = _run_both(q[idx], k[idx], v[idx], g[idx], beta[idx], ours, rows=[3, 1], lens=[1, 1],
                                        reset=[False, False])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)


def test_decode_steps_match_twin():
    """Three requests, eight decode steps of one token each (the recurrent step), states carried in place."""
    q, k, v, g, beta, states = _delta_inputs([8] * 3, key_heads=2)
    ours, theirs = states.clone(), states.clone()
    for step in range(8):
        idx = torch.arange(3) * 8 + step
        got, ours, want, theirs = _run_both(q[idx], k[idx], v[idx], g[idx], beta[idx], ours, rows=[6, 0, 3],
                                            lens=[1, 1, 1], reset=[step == 0, False, False])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)


def test_bf16_inputs():
    """bf16 q, k, v (a bf16 model's activations): fp32 arithmetic, the output in bf16 like the twin's."""
    lens = [70, 3]
    got, ours, want, theirs = _run_both(*_delta_inputs(lens, dtype=torch.bfloat16), rows=[1, 2], lens=lens,
                                        reset=[True, False])
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)


@pytest.mark.parametrize("width", [4, 2])
def test_causal_conv_matches_twin(width):
    """130 channels (two full blocks and a partial one), sequences shorter and longer than the window, states
    continued and reset, a 0-token request; then one decode token each, continuing the new states."""
    gen = torch.Generator().manual_seed(width)
    lens, rows, reset = [1, 2, 5, 64, 0], [4, 0, 6, 2, 1], [False, False, True, False, True]
    channels = 130
    weight = torch.randn(channels, width, generator=gen)
    states = torch.randn(ROWS, channels, width - 1, generator=gen)
    ours, theirs = states.clone(), states.clone()
    for step_lens, step_reset in ((lens, reset), ([1] * len(lens), [False] * len(lens))):
        x = torch.randn(sum(step_lens), channels, generator=gen)
        args = (torch.tensor(rows), torch.tensor(step_lens), torch.tensor(step_reset))
        got = cpu.causal_conv1d(x, ours, weight, *args)
        want = causal_conv1d_batch_torch(x, theirs, weight, *args)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)  # the states are copies of inputs: exact
    assert torch.equal(ours[[3, 5, 7]], states[[3, 5, 7]])


def test_tiny_qwen3_next_greedy_tokens_equal_the_twins(tiny_qwen3_next, monkeypatch):
    """Prompts of 3, 40 and 150 tokens in prefill chunks of 32 (a long prompt's later chunks continue its states),
    then decoded together: the same greedy tokens with the compiled kernels (counted: they ran) as with
    KTLITE_FORCE_TORCH_KERNELS=1 (the twins)."""
    calls = {"gated_delta_rule": 0, "causal_conv1d": 0}

    def counted(name):
        kernel = getattr(cpu, name)

        def run(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)
        return run

    for name in calls:
        monkeypatch.setattr(cpu, name, counted(name))  # the registry looks its target up on each call
    gen = torch.Generator().manual_seed(5)
    flags = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 32,
             "gpu_memory": "1GiB", "max_running_requests": 4}
    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    tokens = {}
    for forced in ("0", "1"):
        monkeypatch.setenv("KTLITE_FORCE_TORCH_KERNELS", forced)
        with Engine(str(tiny_qwen3_next), **flags) as eng:
            prompts = [torch.randint(4, eng.runtime.vocab_size, (n,), generator=gen.manual_seed(n)).tolist()
                       for n in (3, 40, 150)]
            before = dict(calls)
            tokens[forced] = [r.token_ids for r in eng.generate(input_ids=prompts, sampling_params=params)]
            ran = {name: calls[name] - before[name] for name in calls}
        assert all(ran.values()) if forced == "0" else not any(ran.values()), ran
    assert tokens["0"] == tokens["1"]
