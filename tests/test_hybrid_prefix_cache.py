"""The prefix cache on a model with per-request recurrent state (Qwen3-Next's Gated DeltaNet layers, the
shape of Qwen3-Coder-Next): a conversation's next turn starts from a snapshot of the recurrent state where
the previous turn's prompt or reply ended, and its greedy tokens equal transformers' on the whole prompt."""

from __future__ import annotations

import pytest
import torch
from test_gqa_engine import EXACT, GREEDY, hf_greedy

from ktlite import Engine
from ktlite.config import DEFAULT_STATE_SNAPSHOTS, EngineConfig
from ktlite.runtime.memory import make_plan
from ktlite.runtime.models import load_config
from ktlite.runtime.plan_inputs import PlanInputs
from test_qwen3_next import DATA

NEW = 6  # tokens per reply
FLAGS = {**EXACT, "chunked_prefill_size": 16}  # prompts cross chunk boundaries


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _turns(engine: Engine, conversations: list[list[int]], turns: list[tuple[int, list[int]]]):
    """Play turns one request at a time: (conversation, its new user tokens) sends that conversation so far
    plus the new tokens, and appends the reply to it. -> [(prompt, result)] per turn."""
    played = []
    for c, added in turns:
        prompt = conversations[c] + added
        result = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_tokens": NEW})
        conversations[c] = prompt + result.token_ids
        played.append((prompt, result))
    return played


@pytest.fixture(scope="module")
def vocab(tiny_qwen3_next) -> int:
    return load_config(tiny_qwen3_next).vocab_size


def test_next_turn_starts_from_the_last_reply_and_matches_transformers(tiny_qwen3_next, vocab):
    first, added = _prompts(vocab, 1, 37, seed=5)[0], _prompts(vocab, 1, 9, seed=6)[0]
    with Engine(str(tiny_qwen3_next), **FLAGS) as eng:
        assert eng.scheduler.cache is not None and eng.scheduler.cache.snapshots is not None
        (p1, r1), (p2, r2) = _turns(eng, [first], [(0, []), (0, added)])
    assert r1.cached_tokens == 0
    # the first reply's computed tokens (its last one was sampled, never run) carry a snapshot
    assert r2.cached_tokens == len(p1) + NEW - 1
    assert [r1.token_ids, r2.token_ids] == hf_greedy(tiny_qwen3_next, [p1, p2], NEW)


def test_bounded_snapshots_drop_the_least_recently_used(tiny_qwen3_next, vocab):
    """One snapshot row: each turn's end replaces the last snapshot, so only the conversation that went last
    finds its state; every turn still equals transformers."""
    starts = _prompts(vocab, 2, 21, seed=8)
    added = _prompts(vocab, 3, 5, seed=9)
    turns = [(0, []), (1, []), (0, added[0]), (1, added[1]), (1, added[2])]
    with Engine(str(tiny_qwen3_next), **FLAGS, max_mamba_cache_size=1) as eng:
        played = _turns(eng, starts, turns)
        assert eng.scheduler.cache.snapshots.free == [] and len(eng.runtime.runner.state_pool.snapshot_rows) == 1
    cached = [r.cached_tokens for _, r in played]
    assert cached[:4] == [0, 0, 0, 0]  # each turn's snapshot was replaced by the other conversation's
    assert cached[4] == len(played[3][0]) + NEW - 1  # straight after its own turn: the reply's end
    assert [r.token_ids for _, r in played] == hf_greedy(tiny_qwen3_next, [p for p, _ in played], NEW)


def test_snapshots_are_planned_and_zero_turns_the_cache_off(tiny_qwen3_next):
    cfg = load_config(DATA / "qwen3-next-80b-a3b")
    per_request = 36 * ((2 * 16 * 128 + 32 * 128) * 3 * 4 + 32 * 128 * 128 * 4)  # conv + recurrent, 36 layers
    inputs = dict(gpu_memory="24GiB", max_total_tokens=256000, max_running_requests=4, chunked_prefill_size=16384,
                  dtype="bfloat16")
    assert make_plan(cfg, PlanInputs(**inputs, state_snapshots=3)).bytes("state_pool") == (4 + 3) * per_request
    config = EngineConfig.from_kwargs(str(tiny_qwen3_next), max_running_requests=4)
    assert config.state_snapshots(recurrent=True) == min(DEFAULT_STATE_SNAPSHOTS, 4)
    assert config.state_snapshots(recurrent=False) == 0
    for off in ({"disable_radix_cache": True}, {"tensor_parallel_size": 2}, {"max_mamba_cache_size": 0}):
        assert EngineConfig.from_kwargs(str(tiny_qwen3_next), **off).state_snapshots(recurrent=True) == 0
    with Engine(str(tiny_qwen3_next), **EXACT, max_mamba_cache_size=0) as eng:
        assert eng.scheduler.cache is None
        assert not eng.runtime.runner.state_pool.snapshot_rows
