"""Speculative decoding (NGRAM drafts, verified in one forward): lossless greedy output, the target distribution kept
under sampling, acceptance counted, every batch shape the scheduler builds.

Random tiny checkpoints rarely repeat themselves, so NGRAM drafts on them are mostly rejected (which exercises the
rollback); a "copying" checkpoint (its next token is a fixed function of the current one, cycling through blocks of
PERIOD ids) makes a prompt's continuation repeat it, and an oracle drafter (the known greedy continuation with every
third draft corrupted) gives partial acceptance, with runs ending inside the accepted tokens.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ktlite import Engine
from ktlite.cli import main
from ktlite.config import EngineConfig
from ktlite.errors import ConfigError
from ktlite.runtime.sampling import SamplerState, SamplingParams, target_probs
from ktlite.runtime.scheduler import Scheduler
from ktlite.runtime.speculative import Speculation, accept_drafts
from ktlite.runtime.speculative.ngram import NgramDrafter
from ktlite.server.metrics import Metrics

EXACT = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 512,
         "gpu_memory": "1GiB"}
GREEDY = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
# a fixed draft count: without one each step's count follows the verify cost measured at start-up (the last tests)
NGRAM = {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}
PERIOD = 8  # the copying checkpoint's cycle length
BLOCK = 40  # its first cycle starts at this id (clear of the special tokens)


def prompts(vocab: int, lengths: Sequence[int] = (5, 17, 9, 30, 1)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def cycle(block: int, n: int) -> list[int]:
    """n tokens of the copying checkpoint's cycle of ids BLOCK + PERIOD * block .. + PERIOD - 1."""
    start = BLOCK + PERIOD * block
    return [start + i % PERIOD for i in range(n)]


@pytest.fixture(scope="module")
def copying(tiny_v3, tmp_path_factory) -> Path:
    """tiny_v3 with its layers' outputs scaled down and lm_head rows set to the (permuted) embeddings: the argmax
    after token t is its successor in t's cycle, while attention and experts still run (and add a little)."""
    path = tmp_path_factory.mktemp("spec") / "copying"
    shutil.copytree(tiny_v3, path)
    tensors = load_file(path / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = t * 0.02
    embed = tensors["model.embed_tokens.weight"]
    ids = torch.arange(embed.shape[0])
    successor = ids.clone()
    cyclic = ids[BLOCK:BLOCK + PERIOD * ((embed.shape[0] - BLOCK) // PERIOD)]
    successor[cyclic] = BLOCK + (cyclic - BLOCK) // PERIOD * PERIOD + (cyclic - BLOCK + 1) % PERIOD
    head = torch.zeros_like(embed)
    head[successor] = embed / embed.norm(dim=1, keepdim=True)  # row successor(t) points along t's embedding
    tensors["lm_head.weight"] = head.contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


class OracleDrafter:
    """Proposes the known continuation of whichever expected sequence its tokens begin, every third draft corrupted."""

    def __init__(self, sequences: list[list[int]], vocab: int):
        self.sequences, self.vocab, self.tokens = sequences, vocab, []

    @property
    def seen(self) -> int:
        return len(self.tokens)

    def propose(self, new_tokens: Sequence[int], k: int) -> list[int]:
        self.tokens += new_tokens
        n = len(self.tokens)
        seq = next(s for s in self.sequences if s[:n] == self.tokens)
        drafts = seq[n:n + k]
        return [(t + 1) % self.vocab if (n + i) % 3 == 2 else t for i, t in enumerate(drafts)]


@dataclass
class Run:
    results: list
    scheduler: Scheduler
    metrics: str  # its /metrics page
    mixed_drafts: int  # steps that verified drafts beside a prefill chunk


def run(path: Path, batch: list[list[int]], params: dict, oracle: bool = False, **flags) -> Run:
    """One engine with NGRAM drafts (with `oracle`, drafts from plain decoding's output) on the batch."""
    expected = None
    if oracle:
        with Engine(str(path), **EXACT) as eng:
            expected = [p + r.token_ids for p, r in zip(batch, eng.generate(input_ids=batch, sampling_params=params))]
    with Engine(str(path), **{**EXACT, **NGRAM, **flags}) as eng:
        if oracle:
            vocab = eng.runtime.vocab_size
            eng.scheduler.speculation = Speculation(eng.scheduler.speculation.num_drafts,
                                                    lambda: OracleDrafter(expected, vocab))
        mixed, build = [0], eng.scheduler._build_batch

        def spy(plan):
            mixed[0] += any(r.drafts for r, _ in plan) and any(r.remaining > 1 for r, _ in plan)
            return build(plan)

        eng.scheduler._build_batch = spy
        results = eng.generate(input_ids=batch, sampling_params=params)
        pool = eng.runtime.runner.kv_pool
        assert pool.free_tokens == pool.num_slots and pool.free_rows == pool.max_requests  # rejected slots freed
        return Run(results, eng.scheduler, Metrics("tiny").render(eng), mixed[0])


def plain(path: Path, batch: list[list[int]], params: dict):
    with Engine(str(path), **EXACT) as eng:
        return eng.generate(input_ids=batch, sampling_params=params)


def same(a, b) -> None:
    assert [(r.token_ids, r.text, r.finish_reason) for r in a] == [(r.token_ids, r.text, r.finish_reason) for r in b]


# ---- drafter and verifier units ---------------------------------------------------------------------------------
def test_ngram_drafts_follow_the_latest_longest_match():
    d = NgramDrafter(max_match=3, min_match=1)
    assert d.propose([5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 5, 6], 2) == [7, 9]  # "5 6" last followed by 7 9
    assert d.seen == 12
    assert d.propose([7], 3) == [9, 5, 6]  # "5 6 7" matches: its latest occurrence wins over the first
    assert d.propose([1, 2, 3], 2) == []  # "3" occurred nowhere before
    assert d.propose([], 0) == []


def test_ngram_drafts_run_past_the_end_of_a_periodic_sequence():
    d = NgramDrafter()
    assert d.propose([1, 2, 3, 1, 2, 3, 1], 5) == [2, 3, 1, 2, 3]


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    logits = torch.full((4, 6), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 5] = 1.0
    params, state = SamplingParams(temperature=0.0), SamplerState([0])
    assert accept_drafts(logits, [2, 4, 1], params, state) == [2, 4, 1, 5]
    assert accept_drafts(logits, [2, 3, 1], params, state) == [2, 4]
    assert accept_drafts(logits, [0, 4, 1], params, state) == [2]


def test_rejection_sampling_keeps_the_target_distribution():
    """Chi-square over the first two output tokens of 6000 verifies on a 4-token vocabulary: each drawn as the target
    distribution says (the second conditioned on the first being the accepted draft)."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.6], [0.1, 0.9, 0.3, -1.0], [0.0, 0.0, 0.4, 1.2]])
    params = SamplingParams(temperature=0.8, top_k=3, seed=5)
    state = SamplerState([0], params.seed)
    p = target_probs(logits, [params] * 3)
    assert p[0, 2] == 0 and torch.allclose(p.sum(dim=1), torch.ones(3))  # top_k dropped token 2 of row 0
    drafts, n = [3, 1], 6000
    first, second = torch.zeros(4), torch.zeros(4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # rows of 4 values: OpenMP's wake-ups would cost ms per call on a loaded machine
    try:
        for _ in range(n):
            out = accept_drafts(logits, drafts, params, state)
            first[out[0]] += 1
            if out[0] == drafts[0]:
                second[out[1]] += 1
    finally:
        torch.set_num_threads(threads)

    def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
        keep = probs > 0
        assert counts[~keep].sum() == 0  # nothing outside the target's support
        expected = probs[keep] * counts.sum()
        return float(((counts[keep] - expected) ** 2 / expected).sum())

    # 99.9th percentiles of chi-square with 2 and 3 degrees of freedom: 13.8 and 16.3
    assert chi2(first, p[0]) < 13.8
    assert chi2(second, p[1]) < 16.3
    assert 0.2 < second.sum() / n < 0.5  # the first draft was accepted with p[0, 3] (~0.3)


# ---- flags ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, match", [
    ({"speculative_algorithm": "MEDUSA"}, "must be one of"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}, "only 1"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 2, "speculative_num_draft_tokens": 5}, r"\+ 1 \(3\)"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, ">= 2"),
    ({"speculative_num_steps": 3}, "give --speculative-algorithm NGRAM"),
])
def test_speculative_flags_are_checked(tmp_path, flags, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs(str(tmp_path), **flags)


@pytest.mark.parametrize("flags, drafts", [
    ({}, 0),
    ({"speculative_algorithm": "ngram"}, 4),  # the most: each step's count is chosen (auto_k.py)
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 5, "speculative_eagle_topk": 1}, 5),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 2}, 1),
    ({"speculative_algorithm": "eagle", "speculative_num_steps": 2}, 2),
])
def test_drafts_per_step_follow_the_flags(tmp_path, flags, drafts):
    config = EngineConfig.from_kwargs(str(tmp_path), **flags)
    assert config.speculative_drafts == drafts
    assert config.speculative_drafts_auto == (flags == {"speculative_algorithm": "ngram"})


def test_cli_flags_reach_the_engine(tiny_v3):
    result = CliRunner().invoke(main, ["generate", "Hello", "--model-path", str(tiny_v3), "--max-tokens", "2",
                                       "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2"])
    # tiny_v3 carries no MTP layer (tests/test_mtp.py serves one)
    assert result.exit_code == 1 and "num_nextn_predict_layers is 0 or absent" in result.output


def test_recurrent_models_refuse_speculation_under_tensor_parallelism(tiny_qwen3_next):
    with pytest.raises(ConfigError, match="recurrent.*--tensor-parallel-size 1"):
        Engine(str(tiny_qwen3_next), **EXACT, speculative_algorithm="NGRAM", tensor_parallel_size=2)


# ---- engine: greedy output unchanged ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def newer_checkpoints(tmp_path_factory) -> dict[str, Path]:
    from hf_checkpoints import write_hf_checkpoint

    root = tmp_path_factory.mktemp("spec_families")
    return {family: write_hf_checkpoint(root / family, family, seed=5) for family in ("qwen3_5_moe", "gpt_oss")}


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe", "minimax_m2", "glm4_moe", "deepseek_v32",
                                    "glm_moe_dsa", "qwen3_next", "qwen3_5_moe", "gpt_oss"])
def test_random_checkpoints_of_every_family_give_the_same_greedy_output(family, tiny_v2, hf_gqa_checkpoints,
                                                                        newer_checkpoints):
    """Mostly rejected drafts; on Qwen3-Next and Qwen3.5 each rejection rewinds the Gated DeltaNet states."""
    path = tiny_v2 if family == "deepseek_v2" else {**hf_gqa_checkpoints, **newer_checkpoints}[family]
    batch = prompts(1000) + [list(range(4, 304))]  # a third of the ids: outputs often match one of them
    got = run(path, batch, GREEDY)
    same(got.results, plain(path, batch, GREEDY))
    assert got.scheduler.drafted_tokens > 0  # drafts were verified (and mostly rejected)


@pytest.mark.parametrize("flags", [
    {},
    {"chunked_prefill_size": 7, "enable_mixed_chunk": True},
    {"max_total_tokens": 60, "chunked_prefill_size": 16},
])
@pytest.mark.parametrize("model", ["tiny_v3", "tiny_qwen3_next"])
def test_oracle_drafts_in_batches_chunks_and_preemption_give_the_same_greedy_output(model, flags, request):
    """Drafts accepted up to a corrupted one, in every position of the chain (on Qwen3-Next: rewinds to each)."""
    path = request.getfixturevalue(model)
    batch = prompts(1000)
    got = run(path, batch, GREEDY, oracle=True, **flags)
    same(got.results, plain(path, batch, GREEDY))
    assert 0.4 < got.scheduler.accepted_tokens / got.scheduler.drafted_tokens < 0.9  # partial acceptance
    if "max_total_tokens" in flags:
        assert got.scheduler.preemptions > 0
    if flags.get("enable_mixed_chunk"):
        assert got.mixed_drafts > 0


def test_a_continuation_that_repeats_the_prompt_is_accepted(copying):
    batch = [cycle(0, 2 * PERIOD), cycle(1, 2 * PERIOD + 3), prompts(1000, [11])[0]]
    got = run(copying, batch, {**GREEDY, "max_tokens": 40})
    assert got.results[0].token_ids == cycle(0, 2 * PERIOD + 40)[2 * PERIOD:]  # the checkpoint copies as built
    same(got.results, plain(copying, batch, {**GREEDY, "max_tokens": 40}))
    sched = got.scheduler
    assert sched.accepted_tokens / sched.drafted_tokens > 0.8
    assert f"ktlite_spec_draft_tokens_total {sched.drafted_tokens}" in got.metrics
    assert f"ktlite_spec_accepted_tokens_total {sched.accepted_tokens}" in got.metrics


def test_endings_inside_an_accepted_run_are_honoured(copying):
    """max_tokens, stop_token_ids, EOS-like ids and stop strings landing inside a run of accepted drafts end the
    output exactly where plain decoding ends it."""
    prompt = cycle(2, 2 * PERIOD)
    with Engine(str(copying), **EXACT) as eng:
        text = eng.generate(input_ids=prompt, sampling_params=GREEDY).text
        stop_text = text[len(text) // 2:len(text) // 2 + 2]
        variants = [{**GREEDY, **v} for v in ({"max_tokens": 13}, {"stop_token_ids": [cycle(2, PERIOD)[5]]},
                                               {"stop": [stop_text]})]
        expected = [eng.generate(input_ids=prompt, sampling_params=v) for v in variants]
    with Engine(str(copying), **EXACT, **NGRAM) as eng:
        got = [eng.generate(input_ids=prompt, sampling_params=v) for v in variants]
        assert eng.scheduler.accepted_tokens > 0
    same(got, expected)
    assert [r.finish_reason for r in got] == ["length", "stop", "stop"]


def test_sampling_with_drafts_finishes_and_frees_the_pool(copying):
    params = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 30, "ignore_eos": True, "seed": 3}
    batch = [cycle(3, 2 * PERIOD), cycle(4, 2 * PERIOD)]
    got, again = run(copying, batch, params), run(copying, batch, params)
    assert [r.token_ids for r in got.results] == [r.token_ids for r in again.results]  # seeded: reproducible
    assert all(r.completion_tokens == 30 for r in got.results) and got.scheduler.accepted_tokens > 0


def test_verifying_drafts_compiles_nothing_after_start_up(copying):
    """The verify forwards (an extend of 1 + k tokens after the computed ones) are among those warmed at start-up."""
    from test_warm_start import FLAGS, specialisations

    with Engine(str(copying), **FLAGS, **NGRAM) as eng:
        before = specialisations()
        eng.generate(input_ids=[cycle(0, 12), cycle(1, 20), [9]], sampling_params={**GREEDY, "max_tokens": 8})
        after = specialisations()
        assert eng.scheduler.drafted_tokens > 0
    grown = {name: (before.get(name, 0), n) for name, n in after.items() if n != before.get(name, 0)}
    assert grown == {}, f"compiled or loaded during the requests: {grown}"


def test_requests_that_cannot_draft_share_the_batch(copying):
    """A json_schema request (grammar mask rows) and a logprobs request decode plainly beside drafting ones."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    asks = [(cycle(5, 2 * PERIOD), GREEDY), (cycle(6, 12), {**GREEDY, "json_schema": schema, "max_tokens": 12}),
            (cycle(7, 2 * PERIOD), {**GREEDY, "logprobs": True}), (cycle(8, 2 * PERIOD), GREEDY)]

    def together(eng: Engine) -> list:
        async def all_at_once():
            return await asyncio.gather(*(eng.async_generate(input_ids=p, sampling_params=s) for p, s in asks))

        return asyncio.run(all_at_once())

    with Engine(str(copying), **EXACT) as eng:
        expected = together(eng)
    with Engine(str(copying), **EXACT, **NGRAM) as eng:
        got = together(eng)
        assert eng.scheduler.accepted_tokens > 0
    same(got, expected)
    assert got[1].text.startswith('{"a":')  # the grammar held


# ---- the draft count chosen from the cost curve (auto_k.py) -----------------------------------------------------

def simulated_tokens_per_time(acceptance: float, k: int, cost: float, steps: int = 20000) -> float:
    """Tokens per plain step's time of a chain of k drafts, each right with probability `acceptance`, by drawing."""
    g = torch.Generator().manual_seed(k)
    hits = torch.rand(steps, k, generator=g) < acceptance
    accepted = hits.int().cumprod(dim=1).sum(dim=1)  # drafts up to the first miss
    return (accepted.float().mean().item() + 1) / cost


@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.6, 0.8, 0.95])
@pytest.mark.parametrize("cost", [{1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}, {1: 1.6, 2: 2.2, 3: 2.8, 4: 3.4},
                                  {1: 1.0, 2: 5.0, 3: 9.0, 4: 13.0}, {1: 2.5, 2: 3.5, 3: 4.5, 4: 5.5}])
def test_the_chosen_draft_count_is_the_fastest_by_simulation(acceptance, cost):
    """The chosen k is the fastest by simulation, or 0 where none beats plain decoding (rate 1)."""
    from ktlite.runtime.speculative.auto_k import best_drafts, expected_tokens

    rates = {k: simulated_tokens_per_time(acceptance, k, c) for k, c in cost.items()}
    chosen = best_drafts(acceptance, cost)
    if chosen == 0:
        assert max(rates.values()) <= 1.02  # the simulation's noise
    else:
        assert rates[chosen] >= max(rates.values()) * 0.98 and rates[chosen] > 0.98
    for k in cost:
        assert expected_tokens(acceptance, k) / cost[k] == pytest.approx(rates[k], rel=0.03)


def test_a_request_that_drafts_nothing_still_probes():
    from ktlite.runtime.speculative.auto_k import PROBE_INTERVAL, Acceptance

    acceptance, dear, cheap = Acceptance(), {1: 2.5, 2: 3.5}, {1: 1.0, 2: 1.05}
    counts = [acceptance.drafts(dear) for _ in range(2 * PROBE_INTERVAL)]
    assert counts == ([0] * (PROBE_INTERVAL - 1) + [1]) * 2
    assert acceptance.drafts(cheap) == 2 and acceptance.idle == 0


def test_acceptance_estimate_moves_from_its_prior_with_the_verifies():
    from ktlite.runtime.speculative.auto_k import PRIOR_ACCEPTANCE, Acceptance

    hitting, missing = Acceptance(), Acceptance()
    assert hitting.estimate() == PRIOR_ACCEPTANCE
    for _ in range(20):
        hitting.record(4, 4)
        missing.record(4, 0)
    assert hitting.estimate() > 0.97 and missing.estimate() < 0.1


@pytest.mark.parametrize("cost, most", [({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15}, 4), ({1: 1.0, 2: 5.0, 3: 9.0, 4: 13.0}, 1),
                                        ({1: 2.5, 2: 3.5, 3: 4.5, 4: 5.5}, 1)])
def test_without_a_draft_count_each_step_drafts_what_the_cost_curve_favours(copying, cost, most):
    """With no --speculative-num-steps the engine measures c(k) at start-up; a request that keeps copying its prompt
    drafts the most when verifying is cheap, one token when each draft costs a whole step, and only a probe every
    PROBE_INTERVAL steps when no k pays; the output is plain decoding's either way."""
    from ktlite.runtime.speculative.auto_k import PROBE_INTERVAL

    batch = [cycle(5, 2 * PERIOD)]
    params = {**GREEDY, "max_tokens": 30}
    with Engine(str(copying), **EXACT, speculative_algorithm="NGRAM") as eng:
        spec = eng.scheduler.speculation
        assert spec.auto and sorted(spec.cost) == [1, 2, 3, 4] and all(c > 0 for c in spec.cost.values())
        eng.scheduler.speculation = replace(spec, cost=cost)
        drafted, build = [], eng.scheduler._build_batch

        def spy(plan):
            drafted.extend(len(r.drafts) for r, _ in plan if r.drafts)
            return build(plan)

        eng.scheduler._build_batch = spy
        got = eng.generate(input_ids=batch, sampling_params=params)
    assert max(drafted) == most and eng.scheduler.accepted_tokens > 0
    if cost[1] > 2:  # no k pays even at acceptance 1: probes only
        assert len(drafted) <= params["max_tokens"] // PROBE_INTERVAL
    same(got, plain(copying, batch, params))


def test_recurrent_states_from_before_a_verify_are_planned(tiny_qwen3_next):
    """Speculation on a model with recurrent layers adds one state row per running request (the state from before
    a verify), planned and allocated alike."""
    flags = {**EXACT, "max_running_requests": 3, "max_mamba_cache_size": 2}
    with Engine(str(tiny_qwen3_next), **flags) as eng:
        plain_rows = eng.runtime.plan.bytes("state_pool")
    with Engine(str(tiny_qwen3_next), **flags, **NGRAM) as eng:
        plan, states = eng.runtime.plan, eng.runtime.runner.state_pool
        assert plan.allocated()["state_pool"] == plan.bytes("state_pool") == plain_rows * (3 + 2 + 3) // (3 + 2)
        assert states.verify_rows == 3
