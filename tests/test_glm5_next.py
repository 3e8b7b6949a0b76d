"""GLM-5.3-Flash (glm5_next) against transformers on a tiny checkpoint transformers wrote as the hub ships it (the
vision-language model: text_config, `model.language_model.*` beside a vision tower ktlite never reads): a Kimi Delta
Attention layer (per-channel decay), an indexed MLA layer (no rope; its indexer keeps 2 pools of 4 tokens plus the
query's incomplete pool), an indexed MLA layer reusing that selection, another KDA layer; a dense MLP then MoE layers
(DeepSeek-V3 router, shared expert), SwiGLU clamped at 1 everywhere, mHC over 4 streams. ~30-token prompts drop pools.
The reference model's logits (one prefill, chunks, one-token steps), the indexer's selection itself and greedy tokens;
then the Engine: CPU experts with the caches planned exactly, chunks of 5 with preemption and half the experts on the
device, tensor parallelism, speculative decoding rewinding the KDA state, a next turn from a state snapshot; the
published config read as transformers reads it (and its switches that neither implements refused), its plan, and
`ktlite tiny-model --arch glm5_next`."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from hf_checkpoints import (chunked_error, hf_greedy_each, hf_greedy_with_logits, hf_model, served_as_transformers,
                            stepwise_logits)
from test_deepseek_v4 import EXACT, GREEDY, engine_expected  # noqa: F401 (a fixture)
from test_gqa_families import random_ids
from test_tensor_parallel import logits_of

from ktlite import Engine
from ktlite.runtime import models
from ktlite.runtime.models.glm5_next import INDEXED, LINEAR
from ktlite.runtime.plan_components import allocated_by_component

TOL = 1e-4
LENGTH = 30
VL = transformers.AutoModelForImageTextToText


@pytest.fixture(scope="module")
def pair(tiny_glm5_next, one_thread):
    return models.load(tiny_glm5_next), hf_model(tiny_glm5_next, VL)


@pytest.fixture(scope="module")
def ids(pair):
    return random_ids(2, LENGTH, pair[0].config.vocab_size, seed=1)


def test_config_reads_the_text_model_of_the_vl_checkpoint(tiny_glm5_next):
    cfg = models.load_config(tiny_glm5_next)
    assert cfg.vision_skipped and cfg.layer_kinds == (LINEAR, INDEXED, INDEXED, LINEAR)
    assert (cfg.attention_layers, cfg.indexed_layers, cfg.shared_index_layers, cfg.moe_layers) == ((1, 2), (1,), (2,),
                                                                                                   [1, 2, 3])
    assert (cfg.index_kpool, cfg.index_topk, cfg.index_tail, cfg.index_width) == (4, 8, True, 11)
    assert cfg.linear.decay_lower_bound == -5.0 and (cfg.linear.key_heads, cfg.linear.key_dim) == (2, 16)
    assert cfg.activation.limit == 1.0 and cfg.router.scoring == "sigmoid" and cfg.router.correction_bias
    assert (cfg.qk_rope_head_dim, cfg.kv_latent_dim, cfg.softmax_scale) == (0, 32, 16**-0.5)
    # the prompts really drop: more whole pools than the indexer keeps
    assert LENGTH // cfg.index_kpool > cfg.index_topk // cfg.index_kpool


@pytest.mark.parametrize("linear", [
    {"num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 3, "gate_lower_bound": -3.0},
    {"num_heads": 4, "head_dim": 8, "gate_lower_bound": None},  # safe_gate (default): the bound comes back as -5
    {"num_heads": 4, "head_dim": 8, "gate_lower_bound": None, "safe_gate": False},  # no bound: -exp(A_log) softplus
])
def test_linear_attn_config_and_decay_read_as_transformers_reads_them(tiny_glm5_next, linear):
    """The nested `linear_attn_config` some files state (transformers' reading of it), and the forget gate's decay of
    the resulting spec against transformers' Glm5NextTextForgetGate on the same weights."""
    import json

    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate

    from ktlite.runtime.models.gated_deltanet import KimiDeltaAttention

    raw = json.loads((tiny_glm5_next / "config.json").read_text())
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if not k.startswith("linear_")}
    raw["text_config"]["linear_attn_config"] = linear
    theirs = transformers.Glm5NextConfig(**raw).text_config
    spec = models.parse_config(raw).linear
    assert (spec.key_heads, spec.key_dim, spec.conv_width, spec.decay_lower_bound) == (
        theirs.linear_num_heads, theirs.linear_head_dim, theirs.linear_conv_kernel_dim, theirs.linear_lower_bound)
    gate, ours = Glm5NextTextForgetGate(theirs), KimiDeltaAttention(spec)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
            value = torch.randn(ours.get_parameter(name).shape, generator=gen)
            ours.get_parameter(name).copy_(value)
            gate.get_parameter(name).copy_(value)
        h = torch.randn(1, 5, spec.hidden, generator=gen)
        want = gate(h)[0]  # [5, heads, head_dim]
        got = ours._decay(ours.f_b_proj(ours.f_a_proj(h[0])))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _positions(slots: torch.Tensor, req_to_token: torch.Tensor, rows: list[int], length: int) -> list[set[int]]:
    """Our selection [B * T, width] of pool slots -> per query the positions it attends to."""
    out = []
    for b, row in enumerate(rows):
        position = {int(s): p for p, s in enumerate(req_to_token[row, :length].tolist())}
        out += [{position[int(s)] for s in q if s >= 0} for q in slots[b * length : (b + 1) * length]]
    return out


def test_prefill_logits_and_the_pooled_selection_match_transformers(pair, ids):
    """One prefill of 30 tokens: the logits, and the positions each query of the indexed layer attends to (its top
    2 whole pools and its incomplete pool's tokens) equal transformers' indexer output; later queries drop pools."""
    ours, ref = pair
    captured = {}
    hook = ref.model.language_model.layers[1].self_attn.indexer.register_forward_hook(
        lambda m, args, out: captured.__setitem__("topk", out))
    try:
        with torch.no_grad():
            want = ref(ids).logits
    finally:
        hook.remove()
    cache = ours.new_cache(*ids.shape)
    got = ours(ids, cache)
    assert (got - want).abs().max().item() <= TOL
    ours_sel = _positions(ours.model.layers[1].self_attn.last_slots, cache.pool.req_to_token, cache.rows, LENGTH)
    theirs = [{int(p) for p in q if p >= 0} for q in captured["topk"].flatten(0, 1)]
    assert ours_sel == theirs
    assert max(len(s) for s in theirs) <= 8 + 3 and len(theirs[LENGTH - 1]) < LENGTH  # pools dropped


def test_chunked_prefill_matches_transformers_chunked(pair, ids):
    """Chunks of 7 through both caches: the KDA conv and recurrent state continue, pools close across chunks."""
    ours, ref = pair
    assert chunked_error(ours, ref, ids, 7, ref.config.text_config) <= TOL


@pytest.fixture(scope="module")
def generated(pair):
    """transformers' greedy 32 tokens after 7-token prompts, with the logits of each step of its cached decode."""
    prompt = random_ids(2, 7, pair[0].config.vocab_size, seed=3)
    return prompt, *hf_greedy_with_logits(pair[1], prompt, 32)


def test_decode_step_by_step_matches_transformers(pair, generated):
    """The prompt at once, then transformers' tokens one at a time (the recurrent form of the rule, pools closing)."""
    prompt, tokens, logits = generated
    assert (stepwise_logits(pair[0], prompt, tokens) - logits).abs().max().item() <= TOL


def test_greedy_32_equals_generate(pair, generated):
    prompt, tokens, _ = generated
    assert pair[0].generate_greedy(prompt, 32).tolist() == tokens.tolist()


def test_tiny_model_cli_writes_what_transformers_reads(tmp_path, one_thread):
    """`ktlite tiny-model --arch glm5_next` writes the hub's layout of the language model (hc_attn_fn, q_conv1d, ...):
    transformers loads it with no unexpected or mismatched tensor and nothing missing but the vision tower (not
    written; left at transformers' initialisation), and its logits equal ktlite's."""
    from click.testing import CliRunner

    from ktlite.cli import main

    result = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "m"), "--arch", "glm5_next"])
    assert result.exit_code == 0, result.output
    ref, info = VL.from_pretrained(tmp_path / "m", dtype=torch.float32, output_loading_info=True)
    assert all(name.startswith("model.visual.") for name in info.pop("missing_keys")) and not any(info.values()), info
    ours = models.load(tmp_path / "m")
    ids = random_ids(2, 21, ours.config.vocab_size, seed=5)
    with torch.no_grad():
        # 3e-4: tiny-model's wider weight spread makes its last KDA layer amplify fp32 rounding ~10x (measured: the
        # layer alone on transformers' own input agrees to 2e-6; the inputs differ by 2e-5 from the layers before)
        assert (ours(ids) - ref.eval()(ids).logits).abs().max().item() <= 3e-4


# ---- the Engine -------------------------------------------------------------------------------------------------

# the Engine tests below take DeepSeek-V4's flags and its `engine_expected` fixture (run on this module's `pair`)


def test_engine_cpu_experts_equal_transformers_and_the_caches_are_planned_exactly(tiny_glm5_next, engine_expected):
    """Every routed expert on the CPU (the clamp in its kernel); the KV pool (latents, index keys + pool gates) and the
    state pool (KDA conv + recurrent state per running request and per prefix-cache snapshot) are allocated as
    planned, and the plan's arithmetic is the config's."""
    plan, states, allocated = served_as_transformers(tiny_glm5_next, EXACT, engine_expected, GREEDY, TOL)
    rows = EXACT["max_running_requests"] + len(states.snapshot_rows)
    assert plan.mismatches(allocated) == {} and allocated["kv_pool"] > 0 and allocated["state_pool"] > 0
    # per token, fp32: the latent (32) on both indexed layers, the index key + pool-gate logits (2 x 32) on layer 1
    assert plan.kv_bytes_per_token == (2 * 32 + 2 * 32) * 4
    # per state row, fp32, on 2 KDA layers: conv (q, k, v: 3 x 2 heads x 16) x (width 4 - 1), recurrent 2 x 16 x 16
    assert plan.bytes("state_pool") == rows * 2 * (3 * 32 * 3 + 2 * 16 * 16) * 4


def test_half_gpu_experts_chunk_5_and_preemption(tiny_glm5_next, engine_expected):
    """Chunks of 5 tokens (mixed with other requests' decode tokens) continue the KDA state and close pools across
    chunks; 48 KV slots force preemption (a preempted request recomputes from fresh state); decode runs half the
    experts on the device (the clamp in the fused MoE), prefill chunks all of them there (layerwise)."""
    batch, tokens, _ = engine_expected
    flags = {**EXACT, "kt_num_gpu_experts": 4, "chunked_prefill_size": 5, "max_total_tokens": 48,
             "enable_mixed_chunk": True, "kt_gpu_prefill_token_threshold": 4}
    with Engine(str(tiny_glm5_next), **flags) as eng:
        assert [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)] == tokens
        assert eng.scheduler.preemptions > 0
        assert eng.runtime.runner.kv_pool.used_tokens == 0


def test_engine_tp2_equals_transformers(tiny_glm5_next, engine_expected):
    """Two ranks: MLA heads split, the latents, indexer, KDA layers (and their states) and mHC replicated; every
    rank's plan equals what it allocated."""
    batch, tokens, _ = engine_expected
    with Engine(str(tiny_glm5_next), **EXACT, kt_num_gpu_experts=3, tensor_parallel_size=2) as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        plan, allocated = eng.runtime.plan, eng.runtime.allocated_per_rank
    assert got == tokens
    assert len(allocated) == 2 and all(plan.mismatches(used, rank) == {} for rank, used in allocated.items())


def test_speculative_decoding_rewinds_the_kda_state(tiny_glm5_next, engine_expected):
    """NGRAM verifies with drafts that are partly rejected (an oracle of the plain output with every third draft
    corrupted): each rejection rewinds the KDA layers' states to the accepted tokens; the greedy tokens still equal
    transformers'."""
    from test_speculative import run

    batch, tokens, _ = engine_expected
    got = run(tiny_glm5_next, batch, GREEDY, oracle=True)
    assert [r.token_ids for r in got.results] == tokens
    assert 0 < got.scheduler.accepted_tokens < got.scheduler.drafted_tokens  # accepted and rejected drafts


def test_next_turn_starts_from_the_last_reply_snapshot(tiny_glm5_next, pair):
    """The prefix cache of a recurrent model: the second turn resumes from the KDA state where the first reply
    ended (the indexed layers' per-token caches are the prefix's), and both turns equal transformers'."""
    from test_hybrid_prefix_cache import FLAGS, NEW, _prompts, _turns

    vocab = pair[0].config.vocab_size
    first, added = _prompts(vocab, 1, 23, seed=5)[0], _prompts(vocab, 1, 9, seed=6)[0]
    with Engine(str(tiny_glm5_next), **FLAGS) as eng:
        (p1, r1), (p2, r2) = _turns(eng, [first], [(0, []), (0, added)])
    assert r2.cached_tokens == len(p1) + NEW - 1
    assert [r1.token_ids, r2.token_ids] == hf_greedy_each(pair[1], [p1, p2], NEW)


def test_bf16_cpu_device_is_as_close_as_transformers_own_bf16_run(tiny_glm5_next, pair, engine_expected):
    """bf16 activations on a CPU device (dense layers kept bf16): A_log, dt_bias, the KDA convs, the mHC weights and
    the routers stay fp32 as transformers keeps them, allocated as planned; the last-token logits are about as far
    from transformers' fp32 ones as transformers' own bf16 run (measured 10.8 % and 8.7 %: this random model's KDA
    layers amplify rounding; a wrong layout is ~100 %)."""
    batch, _, logits = engine_expected
    import copy

    ref = copy.deepcopy(pair[1]).to(torch.bfloat16)
    with torch.no_grad():
        ref_bf16 = torch.cat([ref(torch.tensor([ids])).logits[0, -1:].float() for ids in batch])
    flags = {**EXACT, "dtype": "bfloat16", "cpu_dense_method": "none"}
    with Engine(str(tiny_glm5_next), **flags, kt_num_gpu_experts=3) as eng:
        model, plan = eng.runtime.runner.model, eng.runtime.plan
        kda, mla = model.model.layers[0], model.model.layers[1]
        assert {kda.self_attn.A_log.dtype, kda.self_attn.dt_bias.dtype, kda.self_attn.q_conv1d.weight.dtype,
                kda.attn_hc.fn.dtype, mla.mlp.gate.weight.dtype} == {torch.float32}
        assert mla.self_attn.q_b_proj.weight.dtype == torch.bfloat16
        got = logits_of(eng, batch)
        allocated = {**allocated_by_component(model), **plan.allocated()}
    rel = lambda x: (torch.linalg.norm(x - logits) / torch.linalg.norm(logits)).item()  # noqa: E731
    assert 0 < rel(got) < 2 * rel(ref_bf16), (rel(got), rel(ref_bf16))
    assert plan.mismatches(allocated) == {}


# ---- the published shape's plan -----------------------------------------------------------------------------------

FLASH = Path(__file__).parent / "data" / "glm-5.3-flash"
FLASH_KV = 11 * (512 + 2 * 128) * 2  # bf16: 11 indexed layers x (latent + index key + pool gates)
FLASH_STATE = 34 * (3 * 64 * 128 * 3 + 64 * 128 * 128) * 4  # fp32 per state row: 34 KDA layers x (conv + recurrent)


def test_plan_of_the_published_shape_on_one_24gib_gpu():
    """The published GLM-5.3-Flash config (tests/data/glm-5.3-flash/README.md: its text_config as published, the
    quantization_config without its skip list): 34 KDA and 11 indexed MLA layers, pools of 4 tokens, FP8 weights in
    128 x 128 blocks; `ktlite plan` on one 24 GiB GPU with 8 running requests."""
    from click.testing import CliRunner

    from ktlite.cli import main
    from ktlite.runtime.memory import make_plan
    from ktlite.runtime.plan_inputs import PlanInputs

    cfg = models.load_config(FLASH)
    assert (len(cfg.linear_layers), cfg.attention_layers[:3], len(cfg.moe_layers)) == (34, (3, 7, 11), 42)
    assert (cfg.index_kpool, cfg.index_topk, cfg.fp8_block_size, cfg.shared_index_layers) == (4, 2048, (128, 128), ())
    plan = make_plan(cfg, PlanInputs(gpu_memory="24GiB", max_running_requests=8, state_snapshots=0))
    assert plan.kv_bytes_per_token == FLASH_KV == 16_896
    assert plan.bytes("kv_pool") == plan.kv_pool_tokens * FLASH_KV
    assert plan.bytes("state_pool") == 8 * FLASH_STATE and FLASH_STATE == 152_633_344
    result = CliRunner().invoke(main, ["plan", "--model", str(FLASH), "--gpu-memory", "24GiB",
                                       "--max-running-requests", "8"])
    assert result.exit_code == 0, result.output
    assert "verdict: fits" in result.stdout and f"x {FLASH_KV:,} B" in result.stdout
    # the default 64 running requests' state (+ snapshots) does not fit: the plan says so and what would, and
    # proposes no FP8 KV pool, which this family refuses
    over = CliRunner().invoke(main, ["plan", "--model", str(FLASH), "--gpu-memory", "24GiB"])
    assert over.exit_code == 1 and "does not fit" in over.output and "state_pool" in over.output, over.output
    assert "fp8_e4m3" not in over.output


def test_published_config_reads_as_transformers_reads_it(tmp_path):
    """The published file's layout (`linear_attn_config` {num_heads, head_dim, short_conv_kernel_size,
    gate_lower_bound, ...}, `deepseek_sparse_attention` layer names, `index_kpool` 4, `head_dim` 0 beside
    `qk_rope_head_dim` 0) through transformers' Glm5NextConfig and through ktlite's load_config: the same per-layer
    structure and shapes, field by field; and the file transformers re-saves from it (linear_* fields) reads the
    same."""
    loaded = transformers.AutoConfig.from_pretrained(FLASH)
    theirs = loaded.text_config
    cfg = models.load_config(FLASH)
    assert cfg.layer_kinds == tuple(theirs.layer_types) and set(cfg.layer_kinds) == {LINEAR, INDEXED}
    assert cfg.moe_layers == [i for i, t in enumerate(theirs.mlp_layer_types) if t == "sparse"]
    assert cfg.shared_index_layers == tuple(i for i, t in enumerate(theirs.indexer_types)
                                            if t == "shared" and theirs.layer_types[i] == INDEXED)
    lin = cfg.linear
    assert (lin.key_heads, lin.value_heads, lin.key_dim, lin.value_dim, lin.conv_width, lin.decay_lower_bound) == (
        theirs.linear_num_heads, theirs.linear_num_heads, theirs.linear_head_dim, theirs.linear_head_dim,
        theirs.linear_conv_kernel_dim, theirs.linear_lower_bound)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.index_kpool, cfg.index_tail) == (
        theirs.index_n_heads, theirs.index_head_dim, theirs.index_topk, theirs.index_kpool,
        theirs.index_kpool_always_select_tail)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        theirs.q_lora_rank, theirs.kv_lora_rank, theirs.qk_nope_head_dim, theirs.qk_rope_head_dim, theirs.v_head_dim)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size, cfg.rms_norm_eps) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads, theirs.vocab_size,
        theirs.rms_norm_eps)
    assert (cfg.max_position_embeddings, cfg.tie_word_embeddings, cfg.eos_token_ids) == (
        theirs.max_position_embeddings, loaded.tie_word_embeddings, tuple(theirs.eos_token_id))
    r = cfg.router
    assert (r.num_experts, r.top_k, r.n_group, r.topk_group, r.normalize, r.scaling_factor) == (
        theirs.n_routed_experts, theirs.num_experts_per_tok, theirs.n_group, theirs.topk_group,
        theirs.norm_topk_prob, theirs.routed_scaling_factor)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size, cfg.n_shared_experts, cfg.activation.limit) == (
        theirs.moe_intermediate_size, theirs.intermediate_size, theirs.n_shared_experts, theirs.swiglu_limit)
    assert (cfg.hc_mult, cfg.hc_iters, cfg.hc_eps) == (theirs.hc_mult, theirs.hc_sinkhorn_iters, theirs.hc_eps)
    assert cfg.fp8_block_size == tuple(loaded.quantization_config["weight_block_size"])
    # what the file pins, in numbers: every 4th layer (3, 7, ..., 43) indexed MLA, the rest KDA; 3 dense MLPs
    assert cfg.attention_layers == tuple(range(3, 45, 4)) and cfg.moe_layers == list(range(3, 45))
    assert (cfg.index_kpool, lin.key_heads, lin.key_dim, lin.conv_width) == (4, 64, 128, 4)
    loaded.save_pretrained(tmp_path)
    resaved = json.loads((tmp_path / "config.json").read_text())["text_config"]
    assert resaved["linear_num_heads"] == 64 and resaved["index_kpool"] == 4
    assert models.load_config(tmp_path) == cfg


def _published_with(**change) -> dict:
    raw = json.loads((FLASH / "config.json").read_text())
    raw["text_config"].update(change)
    return raw


@pytest.mark.parametrize("field, value", [
    ("mla_use_nope", False), ("index_kpool_compress", False), ("mhc", False), ("topk_method", "greedy"),
    ("scoring_func", "softmax"), ("moe_router_dtype", "bfloat16"), ("first_k_dense_replace", 1),
])
def test_published_switches_are_refused_when_they_name_what_is_not_implemented(field, value):
    """Fields of the published text_config that transformers does not read (its model is the variant the file
    states): another value would change the numerics or contradict the layer pattern, and the error names it."""
    from ktlite.errors import ConfigError

    models.parse_config(_published_with())  # as published: accepted
    with pytest.raises(ConfigError, match=field):
        models.parse_config(_published_with(**{field: value}))


def test_published_linear_attn_layer_lists_must_agree_with_layer_types():
    """`linear_attn_config.kda_layers` / `full_attn_layers` restate the pattern (0-based, as published); transformers
    reads `layer_types`. A list that disagrees (e.g. Kimi-Linear's 1-based numbering) is refused."""
    from ktlite.errors import ConfigError

    raw = _published_with()
    lac = raw["text_config"]["linear_attn_config"]
    assert lac["full_attn_layers"] == list(range(3, 45, 4)) and len(lac["kda_layers"]) == 34
    shifted = copy.deepcopy(raw)
    shifted["text_config"]["linear_attn_config"]["full_attn_layers"] = list(range(4, 45, 4))
    with pytest.raises(ConfigError, match="full_attn_layers"):
        models.parse_config(shifted)


def test_fp8_kv_cache_is_refused_before_allocating():
    from ktlite.errors import ConfigError
    from ktlite.runtime.memory import make_plan
    from ktlite.runtime.plan_inputs import PlanInputs

    with pytest.raises(ConfigError, match="FP8 KV cache is not supported yet"):
        make_plan(models.load_config(FLASH), PlanInputs(gpu_memory="24GiB", kv_cache_dtype="fp8_e4m3"))
