"""NEXTN (MTP) drafts on the families beyond DeepSeek-V3 whose hub checkpoints carry an MTP layer: GLM-4.5 (GQA),
GLM-5 (MLA + DSA indexer). Each tiny checkpoint is transformers' own with an MTP layer added under the hub's names
(test_mtp.HUB_MTP); a trained copy learned the model's greedy continuations (test_mtp's fixture, shared). Greedy output
with drafts equals plain decoding's token for token (batch, chunked prefill, preemption; 1 and 3 drafts a step), and
the trained layer is accepted where a random one is not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_mtp import EXACT, GREEDY, NEXTN, generate, prompts, tokens, write_mtp_checkpoints

from ktlite import Engine

from ktlite.runtime.memory import make_plan
from ktlite.runtime.models import load_config
from ktlite.runtime.plan_components import allocated_by_component
from ktlite.runtime.plan_inputs import PlanInputs

FAMILIES = ("glm4_moe", "glm_moe_dsa")
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoints(request, tmp_path_factory) -> dict[str, Path]:
    return write_mtp_checkpoints(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def plain(checkpoints) -> list:
    """Greedy output without drafts (the trained checkpoint's decoder is the random one's)."""
    return tokens(generate(checkpoints["trained"], prompts(1024), GREEDY)[0])


@pytest.mark.parametrize("steps, flags", [
    (1, {"chunked_prefill_size": 5, "enable_mixed_chunk": True}),  # the MTP layer's KV built over chunks
    (3, {"max_total_tokens": 48, "chunked_prefill_size": 16}),  # preempted requests recompute it
])
def test_nextn_greedy_output_equals_plain_decoding(checkpoints, plain, steps, flags):
    got, eng = generate(checkpoints["trained"], prompts(1024), GREEDY, speculative_algorithm="NEXTN",
                        speculative_num_steps=steps, **flags)
    assert tokens(got) == plain
    sched = eng.scheduler
    assert sched.drafted_tokens > 0 and sched.accepted_tokens > 0
    if "max_total_tokens" in flags:
        assert sched.preemptions > 0


def test_a_trained_mtp_layer_is_accepted_and_a_random_one_is_not(checkpoints, plain):
    """One draft a step (measured: trained 0.89-1.0, random 0.0)."""
    rates = {}
    for name in ("random", "trained"):
        got, eng = generate(checkpoints[name], prompts(1024), GREEDY, speculative_algorithm="EAGLE",
                            speculative_num_steps=1)
        assert tokens(got) == plain
        rates[name] = eng.scheduler.accepted_tokens / eng.scheduler.drafted_tokens
    assert rates["trained"] > 0.8 and rates["random"] < 0.1, rates


def test_the_plan_counts_the_mtp_layer(checkpoints):
    """Its weights are the plan's `mtp` row, its routed experts one more MoE layer's, its KV one more layer's in every
    cache the family keeps per token; what the engine allocated is what the plan planned."""
    with Engine(str(checkpoints["random"]), **EXACT, **NEXTN, kt_num_gpu_experts=4) as eng:
        plan, model = eng.runtime.plan, eng.runtime.runner.model
        layer = model.config.num_hidden_layers  # the MTP layer's index
        assert layer in eng.runtime.moe_layers and len(eng.runtime.placement()[layer]) == 4
        allocated = allocated_by_component(model)
        allocated.update(plan.allocated())
        caches = {spec.name: spec.layers for spec in model.config.token_cache_specs()}
    assert allocated["mtp"] > 0 and plan.mismatches(allocated) == {}
    assert all(layer in layers for layers in caches.values()), caches


def test_glm45_plan_with_its_mtp_layer():
    """The hub config (92 layers + 1 MTP layer): one more layer's K and V per token; the layer's attention, shared
    expert and eh_proj on the device, its routed experts one more MoE layer's (GPU experts per layer)."""
    cfg = load_config(DATA / "glm-4.5")
    inputs = PlanInputs(gpu_memory="640GiB", dtype="bfloat16", kt_num_gpu_experts=2, max_total_tokens=8192)
    plain, mtp = make_plan(cfg, inputs), make_plan(cfg.with_mtp(), inputs)
    kv_layer = 2 * 8 * 128 * 2  # K and V of 8 kv heads of 128, bf16
    assert (plain.kv_bytes_per_token, mtp.kv_bytes_per_token) == (92 * kv_layer, 93 * kv_layer)
    expert = 3 * 5120 * 1536 * 2
    assert (plain.bytes("gpu_experts"), mtp.bytes("gpu_experts")) == (89 * 2 * expert, 90 * 2 * expert)
    assert plain.bytes("mtp") == 0
    assert mtp.bytes("mtp") == plain.bytes("attention") // 92 + expert + 2 * 5120 * 5120 * 2
    assert {c: mtp.bytes(c) for c in ("attention", "shared_experts", "embeddings", "lm_head")} == {
        c: plain.bytes(c) for c in ("attention", "shared_experts", "embeddings", "lm_head")}
