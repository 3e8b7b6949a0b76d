"""`ktlite plan` for the published configs of every family, from config.json alone, and the errors
a config that ktlite cannot serve gets before anything is allocated."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ktlite.cli import main
from ktlite.errors import ConfigError
from ktlite.runtime.memory import make_plan
from ktlite.runtime.plan_inputs import PlanInputs
from ktlite.runtime.models import load_config, parse_config, supported
from ktlite.runtime.models.registry import tiny_configs

DATA = Path(__file__).parent / "data"

# layers x (K + V) x kv heads x head_dim x 2 bytes (bf16), as the config implies
KV_BYTES = {
    "qwen3-30b-a3b": 48 * 2 * 4 * 128 * 2,
    "qwen3-235b-a22b": 94 * 2 * 4 * 128 * 2,
    "minimax-m2": 62 * 2 * 8 * 128 * 2,
    "glm-4.5": 92 * 2 * 8 * 128 * 2,
    "deepseek-v3": 61 * 576 * 2,
    "gpt-oss-120b": 36 * 2 * 8 * 64 * 2,  # sliding layers keep every token too (tests/data/gpt-oss-120b/README.md)
    # the hub file: K and V on all 60 layers, plus one index key (128 values) on the 57 sparse layers its
    # sparse_attention_config.sparse_attention_freq marks (tests/data/minimax-m3/README.md)
    "minimax-m3": 60 * 2 * 4 * 128 * 2 + 57 * 128 * 2,
}
# per rank at --tensor-parallel-size 2: half the kv heads; MiniMax-M3's index keys (one per token) are replicated
KV_BYTES_TP2 = {**{name: kv // 2 for name, kv in KV_BYTES.items()},
                "minimax-m3": 60 * 2 * 2 * 128 * 2 + 57 * 128 * 2}


@pytest.mark.parametrize("name", list(KV_BYTES))
def test_kv_bytes_per_token_is_what_the_config_implies(name):
    plan = make_plan(load_config(DATA / name), PlanInputs(gpu_memory="200GiB", dtype="bfloat16"))
    assert plan.kv_bytes_per_token == KV_BYTES[name]
    assert plan.bytes("kv_pool") == plan.kv_pool_tokens * KV_BYTES[name]


def test_kv_heads_split_over_ranks_and_replicate_below_one_per_rank():
    cfg = load_config(DATA / "qwen3-30b-a3b")  # 4 kv heads
    for tp, heads in ((2, 2), (4, 1), (8, 1)):
        plan = make_plan(cfg, PlanInputs(gpu_memory="80GiB", dtype="bfloat16", tensor_parallel_size=tp))
        assert plan.kv_bytes_per_token == 48 * 2 * heads * 128 * 2, tp


@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "minimax-m2", "glm-4.5", "gpt-oss-120b", "minimax-m3"])
def test_cli_plan_answers_from_config_alone(name, tmp_path):
    result = CliRunner().invoke(main, ["plan", "--model", str(DATA / name), "--gpu-memory", "16GiB",
                                       "--tensor-parallel-size", "2"])
    assert "kv_pool" in result.output and f"{KV_BYTES_TP2[name]:,} B" in result.output, result.output


def test_glm_mtp_layer_is_not_part_of_the_model():
    cfg = load_config(DATA / "glm-4.5")
    assert cfg.num_hidden_layers == 92 and cfg.moe_layers[0] == 3 and len(cfg.moe_layers) == 89


def test_unknown_architecture_lists_the_supported_ones():
    raw = json.loads((DATA / "qwen3-30b-a3b" / "config.json").read_text())
    with pytest.raises(ConfigError) as info:
        parse_config({**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    for arch in supported():
        assert arch in str(info.value)
    assert {"Qwen3MoeForCausalLM", "MiniMaxM2ForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"} <= set(supported())


@pytest.mark.parametrize("name, field", [("qwen3-30b-a3b", "moe_intermediate_size"), ("minimax-m2", "num_local_experts"),
                                         ("glm-4.5", "n_routed_experts"), ("qwen3-30b-a3b", "vocab_size")])
def test_missing_field_is_named(name, field):
    raw = json.loads((DATA / name / "config.json").read_text())
    del raw[field]
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)


def test_tiny_model_cli_writes_every_family(tmp_path):
    shown = CliRunner().invoke(main, ["tiny-model", "--help"]).output
    assert "|".join(tiny_configs()) in shown  # every family's tiny configs, from the registry
    refused = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "x"), "--arch", "llama"])
    assert refused.exit_code == 2 and all(name in refused.output for name in tiny_configs()), refused.output
    for arch in ("qwen3_moe", "minimax_m2", "glm4_moe"):
        result = CliRunner().invoke(main, ["tiny-model", str(tmp_path / arch), "--arch", arch, "--fp8"])
        assert result.exit_code == 0, result.output
        cfg = load_config(tmp_path / arch)
        assert cfg.fp8_block_size == (128, 128) and cfg.architecture in supported()


def _rows_hold_what_they_name(cfg) -> None:
    """The dense_mlp row holds the dense layers' MLPs and the shared_experts row the MoE layers' shared
    experts, per the config (bf16: 2 bytes a value; a shared expert may add a one-row gate per layer)."""
    plan = make_plan(cfg, PlanInputs(gpu_memory="4096GiB", dtype="bfloat16", max_total_tokens=64,
                                     chunked_prefill_size=64, max_running_requests=1, context_length=64))
    h, moe = cfg.hidden_size, len(cfg.moe_layers)
    dense = cfg.num_hidden_layers - moe
    rows = {r.component: r for r in plan.rows()}
    assert rows["dense_mlp"].bytes == dense * 3 * h * cfg.intermediate_size * 2
    assert rows["dense_mlp"].note.startswith(f"{dense} layers")
    shared = moe * 3 * h * cfg.shared_intermediate_size * 2
    assert shared <= rows["shared_experts"].bytes <= shared + (moe * h * 2 if shared else 0)


@pytest.mark.parametrize("arch", sorted(tiny_configs()))
def test_every_family_plan_rows_name_what_they_hold(arch):
    from ktlite.runtime.tiny_model import tiny_config

    _rows_hold_what_they_name(parse_config(tiny_config(arch, vocab_size=1024)))


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.iterdir() if (p / "config.json").is_file()))
def test_published_config_plan_rows_name_what_they_hold(name):
    _rows_hold_what_they_name(load_config(DATA / name))


def test_minimax_m3_needs_two_24gib_gpus():
    """The hub file on one 24 GiB GPU: the bf16 attention (60 x 6144 x (64 + 2 x 4 + 64) x 128 x 2 B = 11.95 GiB, and
    the 57 sparse layers' indexers 57 x 6144 x (4 + 1) x 128 x 2 B = 0.42 GiB), embeddings and lm_head (2 x 2.29 GiB),
    the 3 dense MLPs (3 x 3 x 6144 x 12288 x 2 B = 1.27 GiB) and 57 shared experts (57 x 3 x 6144 x 3072 x 2 B =
    6.01 GiB) pass even 0.95 of it; two split the heads and fit, each caching its 2 of the 4 kv heads and every
    index key: 60 x 2 x 2 x 128 x 2 + 57 x 128 x 2 = 76,032 B a token."""
    args = ["plan", "--model", str(DATA / "minimax-m3"), "--gpu-memory", "24GiB"]
    over = CliRunner().invoke(main, args + ["--mem-fraction-static", "0.95"])
    assert over.exit_code == 1 and "--tensor-parallel-size 2" in over.output, over.output
    fits = CliRunner().invoke(main, args + ["--tensor-parallel-size", "2"])
    assert fits.exit_code == 0 and "verdict: fits" in fits.output and "76,032 B" in fits.output, fits.output


def test_minimax_m3_mxfp8_plans_its_experts_as_stored_and_the_other_linears_in_bf16():
    """MiniMaxAI/MiniMax-M3-MXFP8's config.json (tests/data/minimax-m3-mxfp8/README.md): `quant_method` "mxfp8" stores
    every linear but its `ignored_layers` (embeddings, lm_head, vision, routers) as e4m3 codes with e8m0 scales per
    [1, 32]. The routed experts stay MXFP8 on the CPU (--kt-method MXFP8): 57 layers x 128 experts x 3 x 6144 x 3072
    x 8.25 / 8 B = 396.77 GiB; the other linears are dequantized at load into bf16 (exactly), so the GPU side is the
    BF16 file's plan: two 24 GiB GPUs, 76,032 B of KV a token each. Another MX block than [1, 32] is refused."""
    raw = json.loads((DATA / "minimax-m3-mxfp8" / "config.json").read_text())
    cfg = parse_config(raw)
    assert cfg.fp8_block_size is None and cfg.stored_fp8_block == (1, 32)
    assert dataclasses.replace(cfg, stored_fp8_block=None) == load_config(DATA / "minimax-m3")
    result = CliRunner().invoke(main, ["plan", "--model", str(DATA / "minimax-m3-mxfp8"), "--gpu-memory", "24GiB",
                                       "--kt-method", "MXFP8", "--tensor-parallel-size", "2"])
    assert result.exit_code == 0, result.output
    assert "396.77 GiB in MXFP8" in result.output and "GPU weights bfloat16" in result.output
    assert "verdict: fits" in result.output and "76,032 B" in result.output
    auto = CliRunner().invoke(main, ["plan", "--model", str(DATA / "minimax-m3-mxfp8"), "--gpu-memory", "24GiB",
                                     "--tensor-parallel-size", "2"])  # no --kt-method: the stored format
    assert "MXFP8  chosen: the checkpoint's routed experts are MXFP8 codes" in auto.output, auto.output
    raw["quantization_config"]["weight_block_size"] = [128, 128]
    with pytest.raises(ConfigError, match=r"mxfp8 weight_block_size \[128, 128\]"):
        parse_config(raw)
