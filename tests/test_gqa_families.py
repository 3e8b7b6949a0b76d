"""Qwen3-MoE, MiniMax-M2 and GLM-4.5 against transformers on tiny checkpoints transformers wrote."""

from __future__ import annotations

import torch
from hf_checkpoints import hf_model

from ktlite.runtime import models

TOL = 1e-4


def random_ids(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_transformers(tiny_gqa):
    ours, ref = models.load(tiny_gqa), hf_model(tiny_gqa)
    ids = random_ids(3, 29, ours.config.vocab_size)
    with torch.no_grad():
        expected = ref(ids).logits
    got = ours(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


def test_decode_step_by_step_matches_transformers(tiny_gqa):
    ours, ref = models.load(tiny_gqa), hf_model(tiny_gqa)
    ids = random_ids(2, 16, ours.config.vocab_size, seed=2)
    with torch.no_grad():
        expected = ref(ids).logits
    cache = ours.new_cache(2, 16)
    got = [ours(ids[:, :5], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(5, 16)]
    assert (torch.cat(got, dim=1) - expected).abs().max().item() <= TOL


def test_greedy_tokens_equal_generate(tiny_gqa):
    ours, ref = models.load(tiny_gqa), hf_model(tiny_gqa)
    ids = random_ids(2, 7, ours.config.vocab_size, seed=3)
    with torch.no_grad():
        expected = ref.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[:, ids.shape[1]:]
    assert torch.equal(ours.generate_greedy(ids, 32), expected)
