"""The Engine end to end on the tiny checkpoints: batching, chunking, preemption, placement.

Every run uses kt_method="BF16" and fp32 activations: the tiny checkpoints store bf16 weights, so
CPU experts, GPU experts and the HF reference all compute with identical weights and greedy
outputs must agree token for token.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import transformers

from ktlite import Engine
from ktlite.errors import PlanError, RequestError

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
EXACT = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 512,
         "gpu_memory": "1GiB"}


def prompts(vocab: int, lengths=(5, 17, 9, 30, 1)) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_greedy(tiny_v3):
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_v3, dtype=torch.float32).eval()

    def run(ids: list[int], n: int = GREEDY["max_tokens"]) -> list[int]:
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    return run


@pytest.fixture(scope="module")
def engine(tiny_v3):
    with Engine(str(tiny_v3), **EXACT) as eng:
        yield eng


@pytest.fixture(scope="module")
def batch(engine):
    return prompts(engine.runtime.vocab_size)


@pytest.fixture(scope="module")
def expected(batch, hf_greedy):
    return [hf_greedy(p) for p in batch]


def test_batch_equals_alone_equals_transformers(engine, batch, expected):
    together = engine.generate(input_ids=batch, sampling_params=GREEDY)
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in batch]
    assert [r.token_ids for r in together] == expected
    assert [r.token_ids for r in alone] == expected
    assert all(r.finish_reason == "length" and r.completion_tokens == 12 for r in together)
    assert engine.runtime.runner.kv_pool.used_tokens == 0


@pytest.mark.parametrize("flags", [
    {"chunked_prefill_size": 7},
    {"chunked_prefill_size": 7, "enable_mixed_chunk": True},
    {"enable_mixed_chunk": True},
])
def test_chunked_and_mixed_prefill_give_the_same_tokens(tiny_v3, batch, expected, flags):
    with Engine(str(tiny_v3), **{**EXACT, **flags}) as eng:
        got = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert [r.token_ids for r in got] == expected


def test_tiny_kv_pool_preempts_and_still_finishes_everything(tiny_v3, batch, expected):
    # 5 requests need 62 + 60 tokens at the end; 50 slots force preemption mid-decode
    with Engine(str(tiny_v3), **{**EXACT, "max_total_tokens": 50, "chunked_prefill_size": 16}) as eng:
        got = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert eng.scheduler.preemptions > 0
        assert eng.runtime.runner.kv_pool.free_tokens == 50
    assert [r.token_ids for r in got] == expected


def test_fifty_concurrent_requests_complete_and_free_the_pool(engine):
    many = prompts(engine.runtime.vocab_size, lengths=[3 + (i * 7) % 23 for i in range(50)])

    async def run_all():
        return await asyncio.gather(*(engine.async_generate(input_ids=p, sampling_params={**GREEDY, "max_tokens": 6})
                                      for p in many))

    results = asyncio.run(run_all())
    assert len(results) == 50 and all(r.completion_tokens == 6 for r in results)
    alone = engine.generate(input_ids=many[7], sampling_params={**GREEDY, "max_tokens": 6})
    assert results[7].token_ids == alone.token_ids
    pool = engine.runtime.runner.kv_pool
    assert pool.free_tokens == pool.num_slots and pool.free_rows == pool.max_requests


@pytest.mark.parametrize("flags", [
    {"kt_gpu_experts_ratio": 0.5},
    {"kt_gpu_experts_ratio": 1.0},
    {"kt_num_gpu_experts": 4, "kt_expert_placement_strategy": "random"},
    {"kt_num_gpu_experts": 4, "kt_enable_dynamic_expert_update": True, "kt_expert_update_interval": 3},
    {"kt_num_gpu_experts": 2, "kt_gpu_prefill_token_threshold": 8},
])
def test_any_expert_placement_gives_the_same_greedy_output(tiny_v3, batch, expected, flags):
    with Engine(str(tiny_v3), **{**EXACT, **flags}) as eng:
        before = eng.runtime.placement()
        got = eng.generate(input_ids=batch, sampling_params=GREEDY)
        if flags.get("kt_enable_dynamic_expert_update"):
            assert eng.runtime.placement() != before  # experts really moved mid-run
    assert [r.token_ids for r in got] == expected


def test_planned_bytes_equal_allocated_bytes(tiny_v3):
    from ktlite.runtime.plan_components import allocated_by_component

    with Engine(str(tiny_v3), **{**EXACT, "kt_num_gpu_experts": 6, "kt_gpu_prefill_token_threshold": 64}) as eng:
        plan = eng.runtime.plan
        allocated = allocated_by_component(eng.runtime.runner.model)
        allocated.update(plan.allocated())
    for component in ("embeddings", "lm_head", "attention", "dense_mlp", "shared_experts", "norms_router",
                      "gpu_experts", "kv_pool", "request_table", "layerwise_buffer"):
        assert allocated.get(component, 0) > 0, component
    assert plan.mismatches(allocated) == {}


def test_impossible_plan_fails_before_allocating_and_names_the_knob(tiny_v3):
    with pytest.raises(PlanError, match="--max-total-tokens <= "):
        Engine(str(tiny_v3), **{**EXACT, "gpu_memory": "64MiB", "max_total_tokens": 10**6})


def test_stream_deltas_concatenate_to_generate(engine, batch):
    params = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}

    async def collect():
        parts, ids = [], []
        async for event in engine.stream(input_ids=batch[1], sampling_params=params):
            parts.append(event.text)
            ids.extend(event.token_ids)
        return "".join(parts), ids

    text, ids = asyncio.run(collect())
    full = engine.generate(input_ids=batch[1], sampling_params=params)
    assert (text, ids) == (full.text, full.token_ids)


def test_seeded_sampling_is_reproducible_and_chat_works(engine):
    params = {"temperature": 0.9, "top_p": 0.9, "seed": 1234, "max_tokens": 8, "ignore_eos": True}
    a = engine.chat([{"role": "user", "content": "Hello there"}], params)
    b = engine.chat([{"role": "user", "content": "Hello there"}], params)
    assert a.token_ids == b.token_ids and a.prompt_tokens > 3
    c = engine.chat([{"role": "user", "content": "Hello there"}], {**params, "seed": 99})
    assert c.token_ids != a.token_ids


def test_bad_requests_are_rejected_clearly(engine):
    with pytest.raises(RequestError, match="context"):
        engine.generate(input_ids=[5] * 600)
    with pytest.raises(RequestError, match="out of range"):
        engine.generate(input_ids=[10**7])
    with pytest.raises(RequestError, match="temperature"):
        engine.generate("hi", {"temperature": -1})


def test_abort_while_streaming_frees_the_request(engine):
    async def start_and_abandon():
        stream = engine.stream(input_ids=[5, 6, 7], sampling_params={"max_tokens": 400, "ignore_eos": True})
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(start_and_abandon())
    for _ in range(200):
        if engine.scheduler.num_running == 0:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert engine.scheduler.num_running == 0
    assert engine.runtime.runner.kv_pool.used_tokens == 0


def test_fp8_weights_kept_on_device_match_dequantized(tiny_v3_fp8):
    """weight_dtype="fp8" keeps block-FP8 projections (the CUDA default) through fp8_linear."""
    ids = prompts(1024, lengths=(7, 13))
    # FP8 weights pair with bf16 activations, as on a GPU; the CPU dense path off: the same layers in both runs
    bf16 = {**EXACT, "dtype": "bfloat16", "cpu_dense_method": "none"}
    with Engine(str(tiny_v3_fp8), **bf16) as eng:
        dense = eng.generate(input_ids=ids, sampling_params=GREEDY)
    with Engine(str(tiny_v3_fp8), **bf16, weight_dtype="fp8") as eng:
        attn = eng.runtime.runner.model.model.layers[0].self_attn
        assert attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
        kept = eng.generate(input_ids=ids, sampling_params=GREEDY)
        plan = eng.runtime.plan
        from ktlite.runtime.plan_components import allocated_by_component

        allocated = allocated_by_component(eng.runtime.runner.model)
        allocated.update(plan.allocated())
        assert plan.weight_dtype == "fp8" and plan.mismatches(allocated) == {}
    assert [r.token_ids for r in kept] == [r.token_ids for r in dense]


def test_converted_experts_via_kt_weight_path(tiny_v3, tmp_path, batch, expected):
    from ktlite.errors import CheckpointError
    from ktlite.runtime.convert import convert_checkpoint

    convert_checkpoint(tiny_v3, tmp_path / "experts", "BF16")
    with Engine(str(tiny_v3), **EXACT, kt_weight_path=str(tmp_path / "experts"), kt_num_gpu_experts=3) as eng:
        got = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert [r.token_ids for r in got] == expected
    with pytest.raises(CheckpointError, match="method"):
        Engine(str(tiny_v3), **{**EXACT, "kt_method": "INT8"}, kt_weight_path=str(tmp_path / "experts"))


def test_recorded_distribution_drives_frequency_placement(tiny_v3, tmp_path, batch, expected):
    import json

    record = tmp_path / "experts.json"
    with Engine(str(tiny_v3), **EXACT, record_expert_distribution=str(record)) as eng:
        eng.generate(input_ids=batch, sampling_params=GREEDY)
    data = json.loads(record.read_text())
    top_k = 4  # tiny V3: num_experts_per_tok
    tokens = sum(len(p) + GREEDY["max_tokens"] - 1 for p in batch)  # every prompt token and decoded input
    assert {int(l) for l in data["layers"]} == {1, 2}
    assert all(sum(c) == tokens * top_k for c in data["layers"].values())
    with Engine(str(tiny_v3), **EXACT, kt_num_gpu_experts=4, kt_expert_placement_strategy="frequency",
                init_expert_location=str(record)) as eng:
        counts = data["layers"]["1"]
        hottest = sorted(sorted(range(16), key=lambda e: (-counts[e], e))[:4])
        assert eng.runtime.placement()[1] == hottest
        assert [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)] == expected


def test_deferred_experts_run_and_stay_close(tiny_v3, batch):
    """Deferral changes outputs slightly by design (documented); it must still run every request."""
    probe = {"temperature": 0.0, "max_tokens": 1}
    with Engine(str(tiny_v3), **EXACT) as eng:
        exact = eng.generate(input_ids=batch, sampling_params=GREEDY)
    with Engine(str(tiny_v3), **EXACT, kt_max_deferred_experts_per_token=1) as eng:
        deferred = eng.generate(input_ids=batch, sampling_params=GREEDY)
        assert eng.runtime.runner.deferred_experts == 1
        first = eng.generate(input_ids=batch, sampling_params=probe)
    assert all(r.completion_tokens == GREEDY["max_tokens"] for r in deferred)
    # the first token depends only on the prompt: most agree with the exact run
    assert sum(f.token_ids[0] == e.token_ids[0] for f, e in zip(first, exact)) >= len(batch) - 2


def test_sync_generate_works_inside_a_running_event_loop(engine, batch):
    async def caller():
        return engine.generate(input_ids=batch[0], sampling_params=GREEDY)  # blocking call from a coroutine

    assert asyncio.run(caller()).completion_tokens == GREEDY["max_tokens"]
