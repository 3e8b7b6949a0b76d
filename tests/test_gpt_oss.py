"""gpt-oss against transformers on a tiny checkpoint transformers wrote (sliding window 4 and full attention layers,
sinks, q/k/v/o biases, router bias, interleaved gate/up experts with biases and a clamp limit of 1): the reference
model's logits and greedy tokens, then the Engine with CPU and GPU experts, chunked prefill, preemption and tensor
parallelism."""

from __future__ import annotations

import pytest
import torch
from hf_checkpoints import hf_last_logits_and_greedy, hf_model

from ktlite.runtime import models

TOL = 1e-4


def random_ids(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair(tiny_gpt_oss):
    return models.load(tiny_gpt_oss), hf_model(tiny_gpt_oss)


def test_config_windows_sinks_and_activation(tiny_gpt_oss):
    cfg = models.load_config(tiny_gpt_oss)
    assert cfg.windows == (4, 0, 4)
    assert cfg.attention.sinks and cfg.attention.o_bias and cfg.attention.bias
    assert (cfg.activation.kind, cfg.activation.limit, cfg.activation.alpha) == ("swiglu_oai", 1.0, 1.702)
    assert cfg.router.logit_bias and cfg.router.normalize and cfg.moe_layers == [0, 1, 2]


def test_prefill_logits_match_transformers(pair):
    ours, ref = pair
    ids = random_ids(3, 23, ours.config.vocab_size)  # 23 tokens: the window of 4 drops most keys
    with torch.no_grad():
        expected = ref(ids).logits
    got = ours(ids)
    assert (got - expected).abs().max().item() <= TOL


def test_decode_step_by_step_matches_transformers(pair):
    ours, ref = pair
    ids = random_ids(2, 21, ours.config.vocab_size, seed=2)
    with torch.no_grad():
        expected = ref(ids).logits
    cache = ours.new_cache(2, 21)
    got = [ours(ids[:, :6], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(6, 21)]
    assert (torch.cat(got, dim=1) - expected).abs().max().item() <= TOL


def test_greedy_32_equals_generate(pair):
    ours, ref = pair
    ids = random_ids(2, 7, ours.config.vocab_size, seed=3)
    _, expected = hf_last_logits_and_greedy(ref, ids.tolist(), 32)
    assert ours.generate_greedy(ids, 32).tolist() == expected
