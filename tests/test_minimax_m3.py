"""MiniMax-M3 against transformers on a tiny checkpoint transformers wrote as the hub ships it (the vision-language
model: text_config, `language_model.*` beside a vision tower ktlite never reads): sparse / full / sparse attention
layers (blocks of 4 keys, 2 kept: the sparse layers drop key blocks past 8 tokens), dense / MoE / MoE MLPs, clamped
SwiGLU (limit 1) everywhere, a sigmoid router x 2 and a shared expert. The reference model's logits and greedy tokens,
the indexer's selection itself, then the Engine: CPU experts, chunked prefill with preemption and GPU experts, tensor
parallelism, MXFP8 experts, an FP8 pool, the memory plan against what is allocated; the older config fields and
`ktlite tiny-model --arch minimax_m3` against transformers' reading of them; the published config.json
(tests/data/minimax-m3, the hub file byte for byte) read as transformers reads it, and the switches it states that
neither implements refused."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from hf_checkpoints import (engine_expectations, hf_last_logits_and_greedy, hf_model, hf_step_logits,
                            served_as_transformers)
from test_gqa_engine import EXACT, GREEDY
from test_gqa_families import random_ids
from test_tensor_parallel import logits_of

from ktlite import Engine
from ktlite.runtime import models
from ktlite.runtime.models.minimax_m3 import BlockSparseAttention

TOL = 1e-4
N_EXPERTS = 8
PUBLISHED = Path(__file__).parent / "data" / "minimax-m3"


@pytest.fixture(scope="module")
def pair(tiny_minimax_m3, one_thread):
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
        kept = (ours_sel >= 0).sum(-1)  # [B, T, heads]: blocks each query attends to
        visible = torch.arange(ids.shape[1]) // 4 + 1  # blocks holding a key at or before the query
        assert (kept == visible.clamp(max=2)[None, :, None]).all()
        assert visible[-1] == 7  # the last queries drop 5 of their 7 blocks



def test_long_prefill_runs_in_query_steps_and_still_matches_transformers(pair, monkeypatch):
    """A budget of one score value makes each sparse layer take its queries one at a time (as a long prefill takes
    them a few at a time): the logits still equal transformers'."""
    from ktlite.runtime.models import minimax_m3

    ours, ref = pair
    ids = random_ids(1, 21, ours.config.vocab_size, seed=4)
    monkeypatch.setattr(minimax_m3, "SCORES_PER_STEP", 1)
    with torch.no_grad():
        expected = ref(ids).logits
    assert (ours(ids) - expected).abs().max().item() <= TOL

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
    return engine_expectations(pair[1], pair[0].config.vocab_size, GREEDY["max_tokens"])


def test_engine_cpu_experts_equal_transformers_and_plan_counts_index_keys(tiny_minimax_m3, expected):
    plan, _, allocated = served_as_transformers(tiny_minimax_m3, EXACT, expected, GREEDY, TOL)
    assert plan.mismatches(allocated) == {}
    # 3 layers x K + V x 2 kv heads x 16, plus the 2 sparse layers' index key of 16, fp32
    assert plan.kv_bytes_per_token == (3 * 2 * 2 * 16 + 2 * 16) * 4



def test_fp8_pool_packs_index_keys_beside_k_and_v_as_planned(tiny_minimax_m3, expected):
    """--kv-cache-dtype fp8_e4m3: the sparse layers' index keys are one packed row each (16 e4m3 codes + an fp32
    scale), like a kv head, and the pool is allocated as planned; serving runs (accuracy is e4m3's: not compared)."""
    batch, _, _ = expected
    with Engine(str(tiny_minimax_m3), **EXACT, kv_cache_dtype="fp8_e4m3") as eng:
        plan = eng.runtime.plan
        layout = {k: (v.dtype, tuple(v.shape[2:])) for k, v in eng.runtime.runner.kv_pool.buffers.items()}
        assert plan.mismatches(plan.allocated()) == {}
        assert all(len(r.token_ids) == GREEDY["max_tokens"]
                   for r in eng.generate(input_ids=batch, sampling_params=GREEDY))
    assert layout == {"k": (torch.uint8, (2, 20)), "v": (torch.uint8, (2, 20)), "index_key": (torch.uint8, (1, 20))}
    assert plan.kv_bytes_per_token == 3 * 2 * 2 * 20 + 2 * 20

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


def test_mxfp8_experts_equal_transformers_on_their_dequantized_twin(tiny_minimax_m3, tmp_path):
    """MiniMax-M3's experts are one tensor each (`w1` / `w3` / `w2`), so its MXFP8 checkpoints fit the per-expert
    layout (e4m3 `weight` + e8m0 `weight_scale_inv` per 32): served as stored, 3 experts a layer in the device's MX
    stacks, the logits and greedy tokens equal transformers' on the weights transformers dequantized."""
    from test_mx_experts import write_mx_twins

    packed, plain = write_mx_twins(tiny_minimax_m3, tmp_path, ("MXFP8",))["MXFP8"]
    assert_mxfp8_served_as_transformers(packed, plain, (5, 26), gpu_experts=3)


def assert_mxfp8_served_as_transformers(packed: Path, plain: Path, lengths: tuple[int, ...], gpu_experts: int) -> None:
    """The MXFP8 checkpoint served with its experts as stored (`gpu_experts` a layer in the device's MX stacks): last
    logits within TOL and greedy tokens equal to transformers' on its dequantized twin."""
    ref = hf_model(plain, transformers.AutoModelForImageTextToText)
    g = torch.Generator().manual_seed(len(lengths) + sum(lengths))
    batch = [torch.randint(4, ref.config.text_config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    with Engine(str(packed), **{**EXACT, "kt_method": "MXFP8"}, kt_num_gpu_experts=gpu_experts) as eng:
        layer = next(iter(eng.runtime.cpu_moe.layers.values()))
        assert (layer.gate_up.method, layer.down.method) == ("MXFP8", "MXFP8")
        got = logits_of(eng, batch)
        tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    want, expected = hf_last_logits_and_greedy(ref, batch, GREEDY["max_tokens"])
    assert (got - want).abs().max().item() <= TOL
    assert tokens == expected


def hub_mxfp8_pair(checkpoint: Path, root: Path) -> tuple[Path, Path]:
    """MiniMax-M3-MXFP8's layout of a tiny checkpoint, and its dequantized twin for transformers: every language-model
    linear but the routers (the hub file's `ignored_layers`), the embedding and lm_head stored by transformers'
    mxfp8 quantizer (e4m3 `weight` + e8m0 `weight_scale_inv` per [1, 32]) under the hub file's quantization_config
    (its ignored_layers naming this model's routers); the twin holds transformers' dequantization of each."""
    from safetensors.torch import load_file, save_file
    from test_mx_experts import mxfp8_quantize, transformers_fp8_path

    cfg = models.load_config(checkpoint)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    routers = [f"language_model.model.layers.{layer}.block_sparse_moe.gate" for layer in cfg.moe_layers]
    quant = json.loads((PUBLISHED.parent / "minimax-m3-mxfp8" / "config.json").read_text())["quantization_config"]
    quant = {**quant, "ignored_layers": [*quant["ignored_layers"][:5], *routers]}
    packed, plain = {}, {}
    for name, t in tensors.items():
        if (name.startswith("language_model.model.layers.") and t.ndim == 2
                and name.removesuffix(".weight") not in routers):
            codes = mxfp8_quantize(name, t)
            packed.update(codes)
            plain[name] = transformers_fp8_path(codes[name], codes[name + "_scale_inv"])
        else:
            packed[name] = plain[name] = t
    config = json.loads((checkpoint / "config.json").read_text())
    for folder, weights, more in ((root / "mxfp8", packed, {"quantization_config": quant}), (root / "plain", plain, {})):
        folder.mkdir()
        save_file(weights, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **more}))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(checkpoint / f, folder / f)
    return root / "mxfp8", root / "plain"


def test_hub_mxfp8_checkpoint_serves_with_its_other_linears_dequantized(tiny_minimax_m3, tmp_path):
    """MiniMax-M3-MXFP8 quantizes attention, indexer, dense and shared-expert linears too: the routed experts stay
    MXFP8 (--kt-method MXFP8), the rest is dequantized at load into the model's dtype (exact: an e4m3 code times a
    power of two), and the logits and greedy tokens equal transformers' on the dequantized weights."""
    from safetensors import safe_open

    packed, plain = hub_mxfp8_pair(tiny_minimax_m3, tmp_path)
    cfg = models.load_config(packed)
    assert cfg.fp8_block_size is None and cfg.stored_fp8_block == (1, 32)
    with safe_open(str(packed / "model.safetensors"), "pt") as stored:
        for linear in ("self_attn.q_proj", "self_attn.index_k_proj", "mlp.down_proj"):
            assert stored.get_slice(f"language_model.model.layers.0.{linear}.weight").get_dtype() == "F8_E4M3"
    assert_mxfp8_served_as_transformers(packed, plain, (7, 19), gpu_experts=2)


def test_legacy_fields_read_as_transformers_reads_them():
    """The older field names (`sparse_attention_config`, `moe_layer_freq`) place the sparse and dense layers as
    transformers' config does, and the plan counts each sparse layer's index key."""
    from ktlite.runtime.memory import make_plan
    from ktlite.runtime.models import parse_config
    from ktlite.runtime.plan_inputs import PlanInputs
    from ktlite.runtime.tiny_model import tiny_config

    raw = tiny_config("minimax_m3", vocab_size=1024)
    text = {k: v for k, v in raw["text_config"].items()
            if k not in ("layer_types", "mlp_layer_types") and not k.startswith("index_")}
    text.update(moe_layer_freq=[0, 1, 1], sparse_attention_config={
        "sparse_attention_freq": [1, 0, 1], "sparse_num_index_heads": 2, "sparse_index_dim": 16,
        "sparse_block_size": 4, "sparse_topk_blocks": 2, "sparse_local_block": 1})
    theirs = transformers.MiniMaxM3VLTextConfig(**text)
    cfg = parse_config({**raw, "text_config": text})
    assert [i for i, t in enumerate(theirs.layer_types) if t == "minimax_m3_sparse"] == list(cfg.sparse_layer_ids)
    assert [i for i, t in enumerate(theirs.mlp_layer_types) if t == "sparse"] == cfg.moe_layers
    assert (cfg.index.heads, cfg.index.head_dim, cfg.index.block, cfg.index.topk, cfg.index.local) == (
        theirs.index_n_heads, theirs.index_head_dim, theirs.index_block_size, theirs.index_topk_blocks,
        theirs.index_local_blocks)
    plan = make_plan(cfg, PlanInputs(gpu_memory="1GiB", dtype="bfloat16"))
    assert plan.kv_bytes_per_token == (3 * 2 * 2 * 16 + 2 * 16) * 2


def test_tiny_model_cli_writes_what_transformers_reads(tmp_path, one_thread):
    """`ktlite tiny-model --arch minimax_m3` writes the VL checkpoint's names and fields transformers reads (its
    vision tower, absent from the file, is left at transformers' initialisation): its logits equal ktlite's."""
    from click.testing import CliRunner

    from ktlite.cli import main

    result = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "m"), "--arch", "minimax_m3"])
    assert result.exit_code == 0, result.output
    ours, ref = models.load(tmp_path / "m"), hf_model(tmp_path / "m", transformers.AutoModelForImageTextToText)
    assert ours.config.sparse_layer_ids == (0, 2) and ref.config.text_config.layer_types[0] == "minimax_m3_sparse"
    ids = random_ids(1, 20, ours.config.vocab_size, seed=5)
    with torch.no_grad():
        expected = ref(ids).logits
    assert (ours(ids) - expected).abs().max().item() <= TOL


# ---- the published config.json (MiniMaxAI/MiniMax-M3, tests/data/minimax-m3/README.md) -----------------------------


def published_text() -> tuple[dict, dict]:
    raw = json.loads((PUBLISHED / "config.json").read_text())
    return raw, raw["text_config"]


def test_published_config_reads_as_transformers_reads_it(tmp_path):
    """The hub file's older layout (sparse_attention_config, moe_layer_freq, top-level rope_theta /
    partial_rotary_factor / rotary_dim, hidden_act "swigluoai") through transformers' MiniMaxM3VLConfig and through
    ktlite's load_config: the same layer structure, index shape, rope and widths, field by field; and the file
    transformers re-saves from it (layer_types, index_*, rope_parameters) reads the same."""
    loaded = transformers.AutoConfig.from_pretrained(PUBLISHED)
    theirs = loaded.text_config
    cfg = models.load_config(PUBLISHED)
    loaded.save_pretrained(tmp_path)
    assert "layer_types" in json.loads((tmp_path / "config.json").read_text())["text_config"]
    assert models.load_config(tmp_path) == cfg
    assert [i for i, t in enumerate(theirs.layer_types) if t == "minimax_m3_sparse"] == list(cfg.sparse_layer_ids)
    assert set(theirs.layer_types) <= {"minimax_m3_sparse", "full_attention"}
    assert [i for i, t in enumerate(theirs.mlp_layer_types) if t == "sparse"] == cfg.moe_layers
    assert (cfg.index.heads, cfg.index.head_dim, cfg.index.block, cfg.index.topk, cfg.index.local) == (
        theirs.index_n_heads, theirs.index_head_dim, theirs.index_block_size, theirs.index_topk_blocks,
        theirs.index_local_blocks)
    rope = theirs.rope_parameters
    assert rope.get("rope_type", "default") == "default" and cfg.rope.kind == "default"
    assert cfg.rope.theta == rope["rope_theta"] and not cfg.rope.interleave
    assert cfg.rope.head_dim == int(theirs.head_dim * rope.get("partial_rotary_factor", 1.0))
    a = cfg.attention
    assert (cfg.hidden_size, cfg.num_hidden_layers, a.heads, a.kv_heads, a.head_dim, cfg.vocab_size) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads,
        theirs.head_dim, theirs.vocab_size)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        theirs.rms_norm_eps, theirs.max_position_embeddings, theirs.tie_word_embeddings)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (theirs.bos_token_id, (theirs.eos_token_id,))
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size,
            cfg.shared_intermediate_size, cfg.router.scaling_factor) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.intermediate_size, theirs.dense_intermediate_size,
        theirs.shared_intermediate_size, theirs.routed_scaling_factor)
    assert (cfg.activation.kind, cfg.activation.alpha, cfg.activation.limit) == (
        "swiglu_oai", theirs.swiglu_alpha, theirs.swiglu_limit)
    # what the file pins, in numbers: 3 full-attention dense layers, then 57 sparse MoE layers; 64 of 128 values rotated
    assert cfg.sparse_layer_ids == tuple(range(3, 60)) == tuple(cfg.moe_layers)
    assert (cfg.rope.head_dim, cfg.rope.theta, cfg.max_position_embeddings) == (64, 5e6, 1048576)
    assert cfg.index == type(cfg.index)(heads=4, head_dim=128, block=128, topk=16, local=1) and cfg.vision_skipped


def _set(raw: dict, path: str, value) -> dict:
    raw = copy.deepcopy(raw)
    *outer, last = path.split(".")
    node = raw["text_config"]
    for key in outer:
        node = node[key]
    node[last] = value
    return raw


@pytest.mark.parametrize("path, value", [
    ("use_gemma_norm", False), ("use_qk_norm", False), ("qk_norm_type", "per_layer"),
    ("attention_output_gate", True), ("scoring_func", "softmax"), ("use_routing_bias", False),
    ("n_shared_experts", 2), ("sparse_attention_config.use_sparse_attention", False),
    ("sparse_attention_config.sparse_score_type", "sum"), ("sparse_attention_config.sparse_init_block", 1),
])
def test_published_switches_are_refused_when_they_name_what_is_not_implemented(path, value):
    """The published file's switches that transformers does not read (its model is the variant the file states):
    another value would change the numerics, and the error names the field."""
    from ktlite.errors import ConfigError

    raw, _ = published_text()
    models.parse_config(raw)  # as published: accepted
    with pytest.raises(ConfigError, match=path.split(".")[-1]):
        models.parse_config(_set(raw, path, value))


def test_published_index_value_branch_and_rotary_dim_are_checked():
    """`sparse_disable_index_value` is 1 on every sparse layer of the hub file (no index-value branch, none in
    transformers either): a sparse layer with it 0 is refused, a non-sparse one may say anything. `rotary_dim` 64
    agrees with partial_rotary_factor 0.5; without the factor transformers would rotate the whole head, so that file
    is refused (a rotary_dim as wide as the head, or wider, as transformers' inert default 64 on a small head, is
    not partial rotary and is ignored, as transformers ignores it)."""
    from ktlite.errors import ConfigError

    raw, text = published_text()
    flags = text["sparse_attention_config"]["sparse_disable_index_value"]
    assert flags == text["sparse_attention_config"]["sparse_attention_freq"]
    models.parse_config(_set(raw, "sparse_attention_config.sparse_disable_index_value", [0] * 3 + flags[3:]))
    with pytest.raises(ConfigError, match=r"sparse_disable_index_value is 0 on sparse layer\(s\) \[7\]"):
        models.parse_config(_set(raw, "sparse_attention_config.sparse_disable_index_value",
                                 flags[:7] + [0] + flags[8:]))
    no_factor = copy.deepcopy(raw)
    del no_factor["text_config"]["partial_rotary_factor"]
    with pytest.raises(ConfigError, match="rotary_dim=64 but no partial_rotary_factor"):
        models.parse_config(no_factor)
    for width in (128, 256):
        assert models.parse_config(_set(no_factor, "rotary_dim", width)).rope.head_dim == 128
