"""NEXTN (MTP) drafts on the families beyond DeepSeek-V3 whose hub checkpoints carry an MTP layer: GLM-4.5 (GQA),
GLM-5 (MLA + DSA indexer), Qwen3-Next and Qwen3.5-MoE (a gated-attention MoE layer beside Gated DeltaNet layers,
whose state rewinds after a verify). Each tiny checkpoint is transformers' own with an MTP layer added under the hub's names
(test_mtp.HUB_MTP); a trained copy learned the model's greedy continuations (test_mtp's fixture, shared). Greedy output
with drafts equals plain decoding's token for token (batch, chunked prefill, preemption; 1 and 3 drafts a step), and
the trained layer is accepted where a random one is not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_checkpoints import UNIT_OFFSET_NORMS, write_hf_vl_checkpoint
from safetensors.torch import load_file
from test_mtp import (EXACT, GREEDY, HUB_MTP, NEXTN, assert_drafts_are_the_plain_torch_predictions,
                      assert_drafts_compile_nothing_after_start_up, generate, prompts, tokens, with_random_mtp_layer,
                      write_mtp_checkpoints)

from ktlite import Engine
from ktlite.errors import ConfigError

from ktlite.runtime.memory import make_plan
from ktlite.runtime.models import load, load_config
from ktlite.runtime.plan_components import allocated_by_component
from ktlite.runtime.plan_inputs import PlanInputs
from ktlite.runtime.tiny_model import write_tiny_model

FAMILIES = ("glm4_moe", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe")
TRAIN_STEPS = 40  # the loss is ~0.01 by 40 on these (a random layer's ~ln(vocab) = 6.9 or more)
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoints(family, tmp_path_factory) -> dict[str, Path]:
    return write_mtp_checkpoints(tmp_path_factory.mktemp(family), family, TRAIN_STEPS)


@pytest.fixture(scope="module")
def plain(checkpoints) -> list:
    """Greedy output without drafts (the trained checkpoint's decoder is the random one's)."""
    return tokens(generate(checkpoints["trained"], prompts(1024), GREEDY)[0])


CHUNKS = {"chunked_prefill_size": 5, "enable_mixed_chunk": True}  # the MTP layer's KV built over chunks


def test_nextn_greedy_output_equals_plain_decoding(checkpoints, plain):
    """3 drafts a step, chunked prefill and preemption (the preempted requests recompute the MTP layer's KV); 1 draft a
    step: below, with the acceptance rates."""
    got, eng = generate(checkpoints["trained"], prompts(1024), GREEDY, speculative_algorithm="NEXTN",
                        speculative_num_steps=3, max_total_tokens=48, **CHUNKS)
    assert tokens(got) == plain
    sched = eng.scheduler
    assert sched.drafted_tokens > 0 and sched.accepted_tokens > 0 and sched.preemptions > 0


def test_a_trained_mtp_layer_is_accepted_and_a_random_one_is_not(checkpoints, plain):
    """One draft a step; greedy output as plain decoding's either way (measured: trained 1.0, random 0.0; with 3
    drafts a step, which the layer was not trained for, 0.52-0.60 and 0.0)."""
    rates = {}
    for name in ("random", "trained"):
        got, eng = generate(checkpoints[name], prompts(1024), GREEDY, speculative_algorithm="EAGLE",
                            speculative_num_steps=1, **CHUNKS)
        assert tokens(got) == plain
        rates[name] = eng.scheduler.accepted_tokens / eng.scheduler.drafted_tokens
    assert rates["trained"] > 0.8 and rates["random"] < 0.1, rates


def test_the_mtp_layer_reads_the_hub_tensors_as_sglang_does(family, checkpoints):
    """Its input is eh_proj(cat(enorm(embedding), hnorm(hidden))), embedding first, its output goes through the final
    norm, each from the tensor HUB_MTP names (for Qwen: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm, the
    norms in the (1 + w) form), computed here from the stored tensors."""
    path = checkpoints["trained"]
    model, stored = load(path, mtp=True), load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    eps, unit_offset = config["rms_norm_eps"], family in UNIT_OFFSET_NORMS
    eh_proj, enorm, hnorm, final = (stored[name.format(n=config["num_hidden_layers"])].float()
                                    for name in HUB_MTP[family].glue)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w if unit_offset else w)

    embedded, hidden = torch.randn(2, 5, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.mtp.project(embedded, hidden),
                                   torch.cat((norm(embedded, enorm), norm(hidden, hnorm)), dim=-1) @ eh_proj.T)
        torch.testing.assert_close(model.mtp.shared_head.norm(hidden), norm(hidden, final))


def test_drafts_are_the_plain_torch_mtp_layers_predictions(family, checkpoints):
    """Every chain of drafts (chunked prefill of 5; on the hybrids, verifies rewinding the Gated DeltaNet state; on
    GLM-5, the MTP layer's indexer keeping 6 keys a query) is the argmax of the plain torch layer over whole
    sequences (the attention's causal())."""
    assert_drafts_are_the_plain_torch_predictions(checkpoints["random"])


def test_nextn_drafts_compile_nothing_after_start_up(checkpoints):
    """The demo's flags (quantized CPU dense layers): the MTP layer's paths are warmed at start-up."""
    assert_drafts_compile_nothing_after_start_up(checkpoints["trained"])


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


def test_deepseek_v32_plan_with_its_mtp_layer():
    """The hub config (61 layers + 1 MTP layer with its own indexer, as GLM-5's): one more latent and index key per
    token; its sparse attention (the indexer's weights too), shared expert and eh_proj on the device."""
    cfg = load_config(DATA / "deepseek-v3.2")
    inputs = PlanInputs(gpu_memory="640GiB", dtype="bfloat16", kt_num_gpu_experts=2, max_total_tokens=8192)
    plain, mtp = make_plan(cfg, inputs), make_plan(cfg.with_mtp(), inputs)
    assert (plain.kv_bytes_per_token, mtp.kv_bytes_per_token) == (61 * (576 + 128) * 2, 62 * (576 + 128) * 2)
    expert = 3 * 7168 * 2048 * 2
    assert (plain.bytes("gpu_experts"), mtp.bytes("gpu_experts")) == (58 * 2 * expert, 59 * 2 * expert)
    assert (plain.bytes("mtp"), mtp.bytes("mtp")) == (0, plain.bytes("attention") // 61 + expert + 2 * 7168 * 7168 * 2)


def test_qwen35_plan_with_its_mtp_layer():
    """The hub's VL config (40 layers, every 4th full attention, + 1 MTP layer: `mtp_num_hidden_layers` in its
    text_config): one more full-attention layer's K and V per token and no more recurrent state; the layer's gated
    attention, gated shared expert and fc on the device, its routed experts one more MoE layer's."""
    cfg = load_config(DATA / "qwen3.5-35b-a3b")
    inputs = PlanInputs(gpu_memory="640GiB", dtype="bfloat16", kt_num_gpu_experts=2, max_total_tokens=8192)
    plain, mtp = make_plan(cfg, inputs), make_plan(cfg.with_mtp(), inputs)
    kv_layer = 2 * 2 * 256 * 2  # K and V of 2 kv heads of 256, bf16
    assert (plain.kv_bytes_per_token, mtp.kv_bytes_per_token) == (10 * kv_layer, 11 * kv_layer)
    assert mtp.bytes("state_pool") == plain.bytes("state_pool")
    expert = 3 * 2048 * 512 * 2
    assert (plain.bytes("gpu_experts"), mtp.bytes("gpu_experts")) == (40 * 2 * expert, 41 * 2 * expert)
    h, d = 2048, 256
    attention = (h * 16 * d * 2 + 2 * h * 2 * d + 16 * d * h) * 2  # q_proj emits a gate per head; 16 heads, 2 kv
    shared_expert = (3 * h * 512 + h) * 2  # and its sigmoid gate
    assert (plain.bytes("mtp"), mtp.bytes("mtp")) == (0, attention + shared_expert + 2 * h * h * 2)


def test_a_qwen35_vl_checkpoint_drafts_with_its_top_level_mtp_layer(tmp_path):
    """The hub's Qwen3.5 files are the vision-language model's: the decoder under `model.language_model.`, the MTP
    layer at top level (`mtp.*`), mtp_num_hidden_layers in text_config. Its layer loads from there, and drafting with
    it (random: drafts rejected) keeps the greedy output."""
    base = write_hf_vl_checkpoint(tmp_path / "base", "qwen3_5_moe", seed=5)
    path = with_random_mtp_layer(base, tmp_path / "mtp", "qwen3_5_moe", seed=6)
    model, stored = load(path, mtp=True), load_file(path / "model.safetensors")
    assert torch.equal(model.mtp.eh_proj.weight, stored["mtp.fc.weight"].float())
    assert torch.equal(model.mtp.self_attn.q_proj.weight, stored["mtp.layers.0.self_attn.q_proj.weight"].float())
    batch = prompts(1024)[:3]
    want = tokens(generate(path, batch, GREEDY)[0])
    got, eng = generate(path, batch, GREEDY, speculative_algorithm="NEXTN", speculative_num_steps=2)
    assert tokens(got) == want and eng.scheduler.drafted_tokens > 0


def test_a_qwen3_next_checkpoint_without_an_mtp_layer_is_refused(tmp_path):
    path = write_tiny_model(tmp_path / "qwen3_next", "qwen3_next", seed=1)  # its config.json has no mtp_num_hidden_layers
    with pytest.raises(ConfigError, match="--speculative-algorithm NEXTN.*mtp_num_hidden_layers is 0 or absent"):
        Engine(str(path), **EXACT, speculative_algorithm="NEXTN")
