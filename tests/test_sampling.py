"""Sampling: params validation, the batched sampler, penalties, finish reasons, stop strings."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from ktlite.errors import RequestError
from ktlite.runtime.sampling import SamplerState, SamplingParams, apply_penalties, sample
from ktlite.runtime.stop import StopStringMatcher, finish_reason

EOS = 3


def draw(logits: torch.Tensor, params: SamplingParams, n: int, steps: int = 1) -> torch.Tensor:
    """n independent requests (seeds 0..n-1) on the same logits row, `steps` draws each -> [n * steps]."""
    states = [SamplerState([], seed=i) for i in range(n)]
    batch = logits.expand(n, -1)
    return torch.cat([sample(batch, [params] * n, states) for _ in range(steps)])


# --- params -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 10, "min_tokens": 11}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"seed": "7"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ],
)
def test_validation_names_the_param(kwargs, param):
    with pytest.raises(RequestError) as err:
        SamplingParams.from_dict(kwargs)
    assert err.value.param == param
    assert param in str(err.value)


def test_validate_catches_later_mutation():
    p = SamplingParams()
    p.top_p = 2.0
    with pytest.raises(RequestError) as err:
        p.validate()
    assert err.value.param == "top_p"


def test_from_dict():
    p = SamplingParams.from_dict({"stop": "###", "temperature": None, "seed": -5, "top_k": 0, "max_tokens": 10**30})
    assert p.stop == ["###"] and p.temperature == 1.0 and p.seed == -5
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    with pytest.raises(RequestError) as err:
        SamplingParams.from_dict({"temperature": 0.5, "n_beams": 2, "best_of": 3})
    assert err.value.param == "best_of" and "n_beams" in str(err.value)
    with pytest.raises(RequestError):
        SamplingParams.from_dict([("temperature", 0.5)])


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy


# --- greedy and filters -------------------------------------------------------------------------


def test_greedy_temperature_to_zero_and_top_k_1_are_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=gen) * 3
    argmax = logits.argmax(-1)
    states = [SamplerState([], seed=i) for i in range(16)]
    for params in (SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=1e-7)):
        assert torch.equal(sample(logits, [params] * 16, states), argmax)
    # Sampled path with a tiny temperature: gaps of ~1e-2 over T=1e-4 make the argmax certain.
    assert torch.equal(sample(logits, [SamplingParams(temperature=1e-4)] * 16, states), argmax)


def test_sample_leaves_logits_alone_and_accepts_bf16():
    logits = torch.randn(2, 50)
    before = logits.clone()
    states = [SamplerState([1, 2]), SamplerState([3])]
    params = [SamplingParams(repetition_penalty=1.5, min_tokens=2), SamplingParams(temperature=0.5, top_p=0.5)]
    out = sample(logits, params, states, eos_token_ids=[EOS])
    assert torch.equal(logits, before)
    assert out.dtype == torch.int64 and out.shape == (2,)
    assert sample(logits.bfloat16(), params, states).shape == (2,)


# probabilities 0.5, 0.3, 0.15, 0.05
FOUR = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(), {0, 1, 2, 3}),
        (SamplingParams(top_p=1e-6), {0}),
        (SamplingParams(top_p=0.8), {0, 1}),  # 0.5 + 0.3 reaches 0.8: no third token
        (SamplingParams(top_p=0.81), {0, 1, 2}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=2, top_p=0.6), {0}),  # renormalised over top 2: 0.625 >= 0.6
        (SamplingParams(min_p=0.5), {0, 1}),  # keep p >= 0.25
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # keep p >= 0.1
    ],
)
def test_filters_keep_exactly_the_allowed_tokens(params, allowed):
    seen = set(draw(FOUR, params, 400).tolist())
    assert seen == allowed


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_match_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])
    n = 20_000
    tokens = draw(logits, SamplingParams(temperature=temperature), 2000, steps=10)
    observed = torch.bincount(tokens, minlength=8).double()
    expected = (logits.double() / temperature).softmax(-1) * n
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 30  # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4


# --- seeds and batch invariance -----------------------------------------------------------------

VOCAB = 64
TRANSITIONS = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(5)) * 2


def generate(target: SamplingParams, others: list[SamplingParams], position: int, steps: int = 24) -> list[int]:
    """Toy model (logits = TRANSITIONS[last token]); `target` decodes inside a batch of `others`."""
    params = others[:position] + [target] + others[position:]
    states = [SamplerState([7, 8, 9], seed=p.seed) for p in params]
    for _ in range(steps):
        logits = TRANSITIONS[[(s.output_ids or s.prompt_ids)[-1] for s in states]]
        for s, t in zip(states, sample(logits, params, states).tolist()):
            s.append(t)
    return states[position].output_ids


TARGETS = [
    SamplingParams(seed=11),
    SamplingParams(seed=11, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05),
    SamplingParams(seed=11, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
]
OTHERS = [
    SamplingParams(temperature=0),
    SamplingParams(seed=3, top_k=5),
    SamplingParams(top_p=0.5, presence_penalty=1.0),  # unseeded
    SamplingParams(temperature=1.5, min_p=0.1, repetition_penalty=0.8),
]


@pytest.mark.parametrize("target", TARGETS)
def test_seed_reproducible_alone_and_in_any_batch(target):
    alone = generate(target, [], 0)
    assert generate(target, [], 0) == alone
    for position in (0, 2, 4):
        assert generate(target, OTHERS, position) == alone
    other_seed = dataclasses.replace(target, seed=12)
    assert generate(other_seed, [], 0) != alone


def test_unseeded_requests_differ():
    params = SamplingParams()
    assert generate(params, [], 0) != generate(params, [], 0)


# --- penalties ----------------------------------------------------------------------------------

LOGITS = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])


def penalised(params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    state = SamplerState(prompt)
    for t in output:
        state.append(t)
    return apply_penalties(LOGITS, [params], [state])[0].tolist()


def test_repetition_penalty_hf_style():
    # prompt + output tokens {0, 1, 2, 5}: positive / 2, negative * 2, zero stays zero
    assert penalised(SamplingParams(repetition_penalty=2.0), [0, 1], [2, 5]) == [1.0, -2.0, 0.25, -3.0, 1.0, 0.0]
    assert penalised(SamplingParams(repetition_penalty=0.5), [0, 1], []) == [4.0, -0.5, 0.5, -3.0, 1.0, 0.0]


def test_frequency_and_presence_penalties_openai_style():
    # output counts: token 1 once, token 2 twice; prompt token 0 is not penalised
    expected = [2.0, -1.0 - 0.5 - 0.25, 0.5 - 1.0 - 0.25, -3.0, 1.0, 0.0]
    got = penalised(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [0], [1, 2, 2])
    assert got == pytest.approx(expected, abs=1e-6)
    assert penalised(SamplingParams(frequency_penalty=-1.0), [], [4, 4]) == [2.0, -1.0, 0.5, -3.0, 3.0, 0.0]


def test_penalties_combined_and_updated_incrementally():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    state = SamplerState([0])
    assert apply_penalties(LOGITS, [params], [state])[0].tolist() == [1.0, -1.0, 0.5, -3.0, 1.0, 0.0]
    state.append(4)
    state.append(4)
    assert apply_penalties(LOGITS, [params], [state])[0].tolist() == [1.0, -1.0, 0.5, -3.0, 0.5 - 2.0, 0.0]
    # a batch: only the penalised row changes
    rows = apply_penalties(LOGITS.expand(2, -1), [SamplingParams(), params], [SamplerState([0]), state])
    assert torch.equal(rows[0], LOGITS[0])


def test_greedy_uses_penalised_logits():
    state = SamplerState([0])
    assert sample(LOGITS, [SamplingParams(temperature=0, repetition_penalty=4.0)], [state]).item() == 4


# --- finish reasons -----------------------------------------------------------------------------


def test_finish_reasons():
    p = SamplingParams(max_tokens=5, stop_token_ids=[9])
    assert finish_reason(p, EOS, 1, [EOS]) == "stop"
    assert finish_reason(p, 9, 2, [EOS]) == "stop"
    assert finish_reason(p, 4, 2, [EOS]) is None
    assert finish_reason(p, 4, 5, [EOS]) == "length"
    assert finish_reason(p, EOS, 5, [EOS]) == "stop"  # the model ended on its last allowed token
    ignore = SamplingParams(max_tokens=5, stop_token_ids=[9], ignore_eos=True)
    assert finish_reason(ignore, EOS, 1, [EOS]) is None
    assert finish_reason(ignore, 9, 1, [EOS]) == "stop"  # explicit stop ids still stop
    assert finish_reason(ignore, EOS, 5, [EOS]) == "length"
    early = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[9])
    assert finish_reason(early, EOS, 2, [EOS]) is None
    assert finish_reason(early, 9, 2, [EOS]) is None
    assert finish_reason(early, EOS, 3, [EOS]) == "stop"


def run_until_finished(params: SamplingParams, logits: torch.Tensor) -> tuple[list[int], str]:
    state = SamplerState([0], seed=params.seed)
    while True:
        token = sample(logits, [params], [state], eos_token_ids=[EOS]).item()
        state.append(token)
        reason = finish_reason(params, token, len(state.output_ids), [EOS])
        if reason:
            return state.output_ids, reason


def test_min_tokens_suppresses_ending_ids_then_allows_them():
    eos_first = torch.tensor([[0.0, 1.0, 2.0, 10.0, 0.0, 0.0, 5.0, 0.0, 0.0, 9.0]])  # EOS, then 9, then 6
    assert run_until_finished(SamplingParams(temperature=0), eos_first) == ([EOS], "stop")
    assert run_until_finished(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9]), eos_first) == (
        [6, 6, 6, EOS],
        "stop",
    )
    assert run_until_finished(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), eos_first) == (
        [EOS] * 4,
        "length",
    )
    # sampled rows are suppressed too
    hot = SamplingParams(seed=1, min_tokens=5, temperature=2.0, stop_token_ids=[9])
    tokens, _ = run_until_finished(hot, eos_first)
    assert len(tokens) >= 6 and EOS not in tokens[:5] and 9 not in tokens[:5]


# --- stop strings -------------------------------------------------------------------------------


def expected_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def safe_prefix(text: str, stops: list[str]) -> str:
    """Longest prefix after which no stop string can still start (text has no full stop in it)."""
    j = next(j for j in range(len(text) + 1) if any(s.startswith(text[j:]) for s in stops) or j == len(text))
    return text[:j]


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 8)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]  # may contain empty deltas


def test_stop_strings_random_texts_and_splits():
    """Generation ends at the delta that completes a stop string, so the reference is the text
    fed so far, cut before its earliest stop occurrence."""
    rng = random.Random(0)
    hits = 0
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abc", "ab \n", "xé你"])
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
        matcher = StopStringMatcher(stops)
        emitted, fed, hit = "", "", False
        for delta in random_split(rng, text):
            out, hit = matcher.feed(delta)
            emitted += out
            fed += delta
            if hit:
                break
            assert not any(s in fed for s in stops)  # no stop missed
            assert emitted == safe_prefix(fed, stops)  # nothing that could start a stop, no more held
        if not hit:
            emitted += matcher.flush()
        assert (emitted, hit) == expected_cut(fed, stops), (text, stops)
        hits += hit
    assert 1000 < hits < 2900  # both outcomes well covered


def test_stop_string_spanning_deltas_and_overlapping():
    m = StopStringMatcher(["</end>", "nd!"])
    assert m.feed("text </e") == ("text ", False)
    assert m.feed("n") == ("", False)  # "</en" still a prefix of "</end>"
    assert m.feed("d!") == ("</e", True)  # "nd!" starts earlier than "</end>" completes
    assert m.feed("more") == ("", True)
    assert m.flush() == ""

    m = StopStringMatcher(["abcd", "bc"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("c") == ("a", True)  # "bc" completes first, "abcd" never can


def test_stop_matcher_flush_and_no_stops():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello ST") == ("hello ", False)
    assert m.flush() == "ST"
    assert StopStringMatcher([]).feed("anything") == ("anything", False)
    with pytest.raises(ValueError):
        StopStringMatcher([""])

