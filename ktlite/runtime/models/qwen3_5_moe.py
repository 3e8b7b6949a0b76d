"""Qwen3.5-MoE / Qwen3.6-MoE (`Qwen3_5MoeForConditionalGeneration`, text model `qwen3_5_moe_text`): Qwen3-Next's
hybrid (`qwen3_next.py`: Gated DeltaNet + gated attention + MoE with a gated shared expert) with the Gated DeltaNet
projections split in four (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and a MoE in every layer.

The hub checkpoints are the vision-language model: config.json nests the text model in `text_config`, the weights
name it `model.language_model.*` beside `lm_head.*`, the vision tower (`model.visual.*`) and the multi-token
prediction layers (`mtp.*`), which are not read (the text path only). transformers' text-only
`Qwen3_5MoeForCausalLM` writes a flat config and `model.*` names. The rope is interleaved mRoPE over
(temporal, height, width) positions; for text the three are equal, so it is the partial rotary ktlite has and
`mrope_section` / `mrope_interleaved` change nothing.
"""

from __future__ import annotations

from typing import Any

from ktlite.errors import ConfigError
from ktlite.runtime.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM, parse_hybrid

VL_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
ARCHITECTURES = (VL_ARCHITECTURE, "Qwen3_5MoeForCausalLM")
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
Model = Qwen3NextForCausalLM


def parse_config(raw: dict[str, Any]) -> Qwen3NextConfig:
    """A flat config (the text model's) or a VL one's `text_config` with its `wrapper_architectures` (registry.py)."""
    archs = raw.get("wrapper_architectures") or raw.get("architectures") or [ARCHITECTURES[1]]
    if archs[0] not in ARCHITECTURES:
        raise ConfigError(f"config.json: architectures={archs!r} is not a Qwen3.5-MoE model ({', '.join(ARCHITECTURES)})")
    if not raw.get("num_experts"):
        raise ConfigError("config.json: num_experts is required (every Qwen3.5-MoE layer is a MoE)")
    prefix = "model.language_model." if archs[0] == VL_ARCHITECTURE else "model."
    return parse_hybrid(raw, archs[0], split_projections=True, every_layer_moe=True, text_prefix=prefix)


# `ktlite tiny-model --arch qwen3_5_moe`: the text model's layout, 4 layers (3 linear + 1 full attention)
TINY_CONFIGS = {"qwen3_5_moe": {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}}
