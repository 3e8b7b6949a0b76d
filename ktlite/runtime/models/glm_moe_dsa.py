"""GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3.2's architecture (MLA + DSA indexer + noaux_tc MoE) under
GLM's field names, with two differences: the indexer rotates adjacent pairs (interleaved rope), and
layers marked "shared" in `indexer_types` (or `index_topk_pattern` "S") have no indexer and reuse the
previous indexed layer's selection. Dense vs MoE layers follow `mlp_layer_types` (a dense prefix). Its
multi-token-prediction layer (`num_nextn_predict_layers`, stored as layer num_hidden_layers with its own indexer) is
built for NEXTN drafts as DeepSeek-V3.2's (models/mtp.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ktlite.errors import ConfigError
from ktlite.runtime.models import deepseek_v32

ARCHITECTURES = ("GlmMoeDsaForCausalLM",)
MODEL_TYPES = ("glm_moe_dsa",)
Model = deepseek_v32.DeepseekV32ForCausalLM


def indexer_types(raw: dict[str, Any], layers: int) -> list[str]:
    """The config's per-layer indexer modes ("full" / "shared"), from either spelling or the
    frequency/offset schedule transformers derives them from."""
    if raw.get("indexer_types"):
        return list(raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(raw.get("index_topk_freq", 1)), 1), int(raw.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def _first_dense(raw: dict[str, Any], layers: int) -> int:
    kinds = raw.get("mlp_layer_types")
    if not kinds:
        return int(raw.get("first_k_dense_replace", 3))
    dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), layers)
    if any(kind != "sparse" for kind in kinds[dense:]):
        raise ConfigError("config.json: mlp_layer_types must be dense layers followed by sparse (MoE) layers")
    return dense


def parse_config(raw: dict[str, Any]) -> deepseek_v32.DeepseekV32Config:
    layers = int(raw.get("num_hidden_layers", 78))
    values = {"rms_norm_eps": 1e-5, "index_n_heads": 32, "n_group": 1, "topk_group": 1, **raw,
              "first_k_dense_replace": _first_dense(raw, layers), "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    if "n_routed_experts" not in values and "num_local_experts" in values:
        values["n_routed_experts"] = values["num_local_experts"]
    cfg = deepseek_v32.parse_config(values)
    kinds = indexer_types(raw, layers)
    if kinds and kinds[0] != "full":
        raise ConfigError("config.json: the first layer must run its own indexer (indexer_types[0] == 'full')")
    shared = tuple(i for i, kind in enumerate(kinds) if kind == "shared")
    return replace(cfg, architecture=ARCHITECTURES[0], index_rope_interleave=True, shared_index_layers=shared)


# `ktlite tiny-model --arch glm_moe_dsa`: the tiny V3.2 shapes with GLM-5's indexer layout (layer 2
# reuses layer 1's selection)
TINY_CONFIGS = {"glm_moe_dsa": {
    **deepseek_v32.TINY_CONFIGS["deepseek_v32"],
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "index_topk_pattern": "FFS",
}}
