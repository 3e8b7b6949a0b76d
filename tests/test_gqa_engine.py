"""The Engine on the GQA families (transformers-written tiny checkpoints): greedy output equals
transformers with CPU experts, with half the experts on the device, chunked prefill of 5 and a KV
pool small enough to force preemption; tensor parallelism over 2 ranks equals one process and each
rank allocates exactly its plan."""

from __future__ import annotations

import pytest
import torch
from hf_checkpoints import hf_greedy_each, hf_model
from test_tensor_parallel import logits_of

from ktlite import Engine

GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
EXACT = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 256,
         "gpu_memory": "1GiB", "max_running_requests": 8}


def prompts(vocab: int, lengths=(5, 17, 9, 30)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(path, batch: list[list[int]], n: int) -> list[list[int]]:
    return hf_greedy_each(hf_model(path), batch, n)


@pytest.fixture(scope="module")
def expected(tiny_gqa):
    from ktlite.runtime.models import load_config

    batch = prompts(load_config(tiny_gqa).vocab_size)
    return batch, hf_greedy(tiny_gqa, batch, GREEDY["max_tokens"])


def test_engine_equals_transformers_with_cpu_experts(tiny_gqa, expected):
    batch, want = expected
    with Engine(str(tiny_gqa), **EXACT) as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    assert got == want


def test_half_gpu_experts_chunk_5_and_preemption(tiny_gqa, expected):
    batch, want = expected
    n_experts = 16
    # 4 requests need 15..40 tokens each at the end (101 in all); 48 slots force preemption
    flags = {**EXACT, "kt_num_gpu_experts": n_experts // 2, "chunked_prefill_size": 5, "max_total_tokens": 48}
    with Engine(str(tiny_gqa), **flags) as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        assert eng.scheduler.preemptions > 0
        assert all(len(v) == n_experts // 2 for v in eng.runtime.placement().values())
        assert eng.runtime.runner.kv_pool.used_tokens == 0
    assert got == want


def test_tp2_equals_tp1_and_each_rank_allocates_its_plan(tiny_gqa, expected):
    batch, want = expected
    flags = {**EXACT, "kt_num_gpu_experts": 3}
    results = {}
    for tp in (1, 2):
        with Engine(str(tiny_gqa), **flags, tensor_parallel_size=tp) as eng:
            tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
            results[tp] = (tokens, logits_of(eng, batch), eng.runtime.plan,
                           getattr(eng.runtime, "allocated_per_rank", {}))
    assert results[1][0] == results[2][0] == want
    torch.testing.assert_close(results[2][1], results[1][1], atol=1e-4, rtol=1e-4)
    plan, allocated = results[2][2], results[2][3]
    assert sorted(allocated) == [0, 1]
    for rank, got in allocated.items():
        assert plan.mismatches(got, rank) == {}, rank
        for component in ("embeddings", "lm_head", "attention", "kv_pool"):
            assert got[component] == plan.bytes(component, rank) > 0, (rank, component)
    # kv heads split: each rank caches 1 of the 2 kv heads (K and V, 3 layers, head_dim 16, fp32)
    assert plan.kv_bytes_per_token == 3 * 2 * 1 * 16 * 4


def test_layerwise_prefill_dynamic_placement_and_deferred_experts(tiny_gqa, expected):
    """Long chunks run every expert on the device; placement moves mid-run; deferral changes outputs
    slightly, so that run is only checked to finish whole."""
    batch, want = expected
    flags = {**EXACT, "kt_num_gpu_experts": 4, "kt_gpu_prefill_token_threshold": 8,
             "kt_enable_dynamic_expert_update": True, "kt_expert_update_interval": 2}
    with Engine(str(tiny_gqa), **flags) as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    assert got == want
    with Engine(str(tiny_gqa), **EXACT, kt_num_gpu_experts=4, kt_max_deferred_experts_per_token=1) as eng:
        deferred = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert [len(r.token_ids) for r in deferred] == [GREEDY["max_tokens"]] * len(batch)


@pytest.mark.parametrize("arch", ["qwen3_moe", "minimax_m2", "glm4_moe"])
def test_fp8_checkpoint_kept_fp8_equals_dequantized_reference(arch, tmp_path):
    """Block-FP8 GQA checkpoints load like DeepSeek-V3's: projections stay FP8 on the device and give
    the logits of the reference model on the dequantized weights."""
    from ktlite.runtime import models
    from ktlite.runtime.models.fp8 import FP8Linear
    from ktlite.runtime.tiny_model import write_tiny_model

    path = write_tiny_model(tmp_path / arch, arch, fp8=True, seed=4)
    ref = models.load(path)
    batch = prompts(ref.config.vocab_size, lengths=(6, 11))
    # every expert on the device (dequantized in fp32 like the reference's; BF16 CPU experts would round)
    with Engine(str(path), **EXACT, weight_dtype="fp8", kt_num_gpu_experts=16) as eng:
        assert any(isinstance(m, FP8Linear) for m in eng.runtime.runner.model.modules())
        got = logits_of(eng, batch)
    want = torch.cat([ref(torch.tensor([ids]))[0, -1:] for ids in batch])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_convert_and_kt_weight_path(tiny_gqa, expected, tmp_path):
    """`ktlite convert` reads the family's expert names (MiniMax's w1/w3/w2 too); serving the converted
    INT8 experts with --kt-weight-path equals quantizing them at load."""
    from ktlite.runtime.convert import convert_checkpoint

    batch, _ = expected
    convert_checkpoint(tiny_gqa, tmp_path / "int8", "INT8", progress=False)
    flags = {**EXACT, "kt_method": "INT8"}
    with Engine(str(tiny_gqa), **flags, kt_weight_path=str(tmp_path / "int8")) as eng:
        converted = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    with Engine(str(tiny_gqa), **flags) as eng:
        at_load = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    assert converted == at_load
