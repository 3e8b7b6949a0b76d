"""config.json parsing: both dialects, real published configs, and clear errors."""

from __future__ import annotations

import json

import pytest

from ktlite.errors import ConfigError
from ktlite.runtime.models.config import load_config, parse_config, yarn_mscale
from conftest import DATA


def test_deepseek_v3_published_config():
    cfg = load_config(DATA / "deepseek-v3")
    assert cfg.is_v3 and cfg.q_lora_rank == 1536 and cfg.fp8_block_size == (128, 128)
    assert cfg.moe_layers == list(range(3, 61))
    assert cfg.kv_latent_dim == 576  # 512 + 64 values per token per layer
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40
    # yarn: softmax scale = 1/sqrt(192) * mscale(40, 1.0)^2
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 1.0 * __import__("math").log(40) + 1) ** 2)
    assert cfg.rope.cos_sin_scale == pytest.approx(1.0)


def test_deepseek_v2_lite_published_config():
    cfg = load_config(DATA / "deepseek-v2-lite")
    assert not cfg.is_v3 and cfg.q_lora_rank is None and cfg.fp8_block_size is None
    assert cfg.n_routed_experts == 64 and cfg.num_experts_per_tok == 6 and cfg.n_shared_experts == 2
    assert cfg.moe_layers == list(range(1, 27))
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * yarn_mscale(40, 0.707) ** 2)


def test_kimi_k2_config_parses():
    cfg = load_config(DATA / "kimi-k2")
    assert cfg.n_routed_experts == 384 and cfg.num_attention_heads == 64 and cfg.moe_layers[0] == 1
    assert cfg.rope.theta == 50000.0


def test_transformers_dialect_parses_like_hub_dialect():
    hub = json.loads((DATA / "deepseek-v3" / "config.json").read_text())
    resaved = {k: v for k, v in hub.items() if k not in ("rope_scaling", "rope_theta")}
    rope = {k: v for k, v in hub["rope_scaling"].items() if k != "type"}
    resaved["rope_parameters"] = {**rope, "rope_type": "yarn", "rope_theta": hub["rope_theta"]}
    resaved["rope_interleave"] = True
    assert parse_config(resaved) == parse_config(hub)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"topk_method": "random"}, "topk_method"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_group": 7}, "n_group"),
        ({"rope_scaling": {"type": "longrope", "factor": 2}}, "rope"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
    ],
)
def test_unsupported_values_name_the_field(change, field):
    raw = {**json.loads((DATA / "deepseek-v3" / "config.json").read_text()), **change}
    if change.get("kv_lora_rank", 0) is None:
        del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match=field):
        parse_config(raw)


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path)
