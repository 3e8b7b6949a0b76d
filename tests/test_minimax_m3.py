"""MiniMax-M3 against transformers on a tiny checkpoint transformers wrote as the hub ships it (the vision-language
model: text_config, `language_model.*` beside a vision tower ktlite never reads): sparse / full / sparse attention
layers (blocks of 4 keys, 2 kept: the sparse layers drop key blocks past 8 tokens), dense / MoE / MoE MLPs, clamped
SwiGLU (limit 1) everywhere, a sigmoid router x 2 and a shared expert. The reference model's logits and greedy tokens,
the indexer's selection itself, then the Engine: CPU experts, chunked prefill with preemption and GPU experts, tensor
parallelism, the memory plan against what is allocated."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_checkpoints import hf_last_logits_and_greedy, hf_model, hf_step_logits
from test_gqa_families import random_ids
from test_tensor_parallel import logits_of

from ktlite import Engine
from ktlite.runtime import models
from ktlite.runtime.models.minimax_m3 import BlockSparseAttention
from ktlite.runtime.plan_components import allocated_by_component

TOL = 1e-4
GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
EXACT = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 256,
         "gpu_memory": "1GiB", "max_running_requests": 8}
N_EXPERTS = 8


@pytest.fixture(scope="module")
def pair(tiny_minimax_m3):
    return models.load(tiny_minimax_m3), hf_model(tiny_minimax_m3, transformers.AutoModelForImageTextToText)


def test_config_reads_the_text_model_of_the_vl_checkpoint(tiny_minimax_m3):
    cfg = models.load_config(tiny_minimax_m3)
    assert cfg.vision_skipped and cfg.sparse_layer_ids == (0, 2) and cfg.moe_layers == [1, 2]
    assert (cfg.activation.kind, cfg.activation.limit, cfg.activation.alpha) == ("swiglu_oai", 1.0, 1.702)
    assert cfg.router.scoring == "sigmoid" and cfg.router.correction_bias and cfg.router.scaling_factor == 2.0
    assert cfg.rope.head_dim == 8 and cfg.attention.qk_norm == "per_head" and cfg.attention.unit_offset_norms
    assert cfg.expert_weight_name(1, 3, "up") == "model.layers.1.block_sparse_moe.experts.3.w3.weight"


def test_prefill_logits_match_transformers_and_sparse_layers_drop_key_blocks(pair):
    """25 tokens: 7 blocks of 4 keys, 2 kept per query and kv head. The selection (compared with transformers'
    indexer on the same hidden states) leaves key blocks out for the later queries."""
    ours, ref = pair
    ids = random_ids(2, 25, ours.config.vocab_size)
    captured: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda m, args, out, i=i: captured.__setitem__(i, out))
        for i, layer in enumerate(ref.model.language_model.layers) if layer.self_attn.indexer is not None]
    with torch.no_grad():
        expected = ref(ids).logits
    for hook in hooks:
        hook.remove()
    got = ours(ids)
    assert (got - expected).abs().max().item() <= TOL
    for i in ours.config.sparse_layer_ids:
        attn = ours.model.layers[i].self_attn
        assert isinstance(attn, BlockSparseAttention)
        ours_sel = torch.stack(attn.last_selection)  # [B, T, kv heads, k]
        theirs = captured[i].permute(0, 2, 1, 3)  # [B, index heads, T, k] -> [B, T, heads, k]
        assert torch.equal(ours_sel.sort(-1).values, theirs.sort(-1).values), i
        kept = (ours_sel >= 0).sum(-1)  # blocks each query sees
        assert kept[:, -1].max().item() == 2 and (ids.shape[1] - 1) // 4 + 1 == 7  # 2 of 7 blocks at the end


def test_decode_step_by_step_matches_transformers(pair):
    ours, ref = pair
    ids = random_ids(2, 23, ours.config.vocab_size, seed=2)
    expected = hf_step_logits(ref, ids, 6)
    cache = ours.new_cache(2, 23)
    got = [ours(ids[:, :6], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(6, 23)]
    assert (torch.cat(got, dim=1) - expected).abs().max().item() <= TOL


def test_greedy_32_equals_generate(pair):
    ours, ref = pair
    ids = random_ids(2, 9, ours.config.vocab_size, seed=3)
    _, expected = hf_last_logits_and_greedy(ref, ids.tolist(), 32)
    assert ours.generate_greedy(ids, 32).tolist() == expected


# ---- the Engine -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected(pair):
    """Prompts of 5..30 tokens (the sparse layers drop key blocks in all but the first) and transformers' greedy tokens
    and last-token logits."""
    g = torch.Generator().manual_seed(7)
    batch = [torch.randint(4, pair[0].config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    logits, tokens = hf_last_logits_and_greedy(pair[1], batch, GREEDY["max_tokens"])
    return batch, tokens, logits


def test_engine_cpu_experts_equal_transformers_and_plan_counts_index_keys(tiny_minimax_m3, expected):
    batch, tokens, logits = expected
    with Engine(str(tiny_minimax_m3), **EXACT) as eng:
        assert [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)] == tokens
        assert (logits_of(eng, batch) - logits).abs().max().item() <= TOL
        plan = eng.runtime.plan
        allocated = allocated_by_component(eng.runtime.runner.model)
        allocated.update(plan.allocated())
        assert plan.mismatches(allocated) == {}
    # 3 layers x K + V x 2 kv heads x 16, plus the 2 sparse layers' index key of 16, fp32
    assert plan.kv_bytes_per_token == (3 * 2 * 2 * 16 + 2 * 16) * 4


def test_half_gpu_experts_chunk_5_and_preemption(tiny_minimax_m3, expected):
    """Chunks of 5 tokens (the indexer scores each chunk against the cached index keys), half the experts on the
    device side and 48 KV slots, which force preemption."""
    batch, tokens, _ = expected
    flags = {**EXACT, "kt_num_gpu_experts": N_EXPERTS // 2, "chunked_prefill_size": 5, "max_total_tokens": 48}
    with Engine(str(tiny_minimax_m3), **flags) as eng:
        assert [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)] == tokens
        assert eng.scheduler.preemptions > 0


def test_tp2_equals_transformers_and_each_rank_allocates_its_plan(tiny_minimax_m3, expected):
    """Heads split over 2 ranks (one kv head each: each rank keeps its kv head's block selection), the indexer and its
    keys replicated, GPU experts split."""
    batch, tokens, logits = expected
    with Engine(str(tiny_minimax_m3), **EXACT, kt_num_gpu_experts=3, tensor_parallel_size=2) as eng:
        assert [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)] == tokens
        torch.testing.assert_close(logits_of(eng, batch), logits, atol=TOL, rtol=TOL)
        plan, allocated = eng.runtime.plan, eng.runtime.allocated_per_rank
    assert sorted(allocated) == [0, 1]
    for rank, got in allocated.items():
        assert plan.mismatches(got, rank) == {}, rank
    assert plan.kv_bytes_per_token == (3 * 2 * 1 * 16 + 2 * 16) * 4  # each rank: 1 of the 2 kv heads, all index keys
