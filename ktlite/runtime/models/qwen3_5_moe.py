"""Qwen3.5-MoE / Qwen3.6-MoE (`Qwen3_5MoeForConditionalGeneration`, text model `qwen3_5_moe_text`): Qwen3-Next's
hybrid (`qwen3_next.py`: Gated DeltaNet + gated attention + MoE with a gated shared expert) with the Gated DeltaNet
projections split in four (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and a MoE in every layer.

The hub checkpoints are the vision-language model: config.json nests the text model in `text_config`, the weights
name it `model.language_model.*` beside `lm_head.*`, the vision tower (`model.visual.*`, not read: the text path
only) and the multi-token-prediction layer (`mtp.*`, read for NEXTN drafts as Qwen3-Next's). transformers' text-only
`Qwen3_5MoeForCausalLM` writes a flat config and `model.*` names. The rope is interleaved mRoPE over
(temporal, height, width) positions; for text the three are equal, so it is the partial rotary ktlite has and
`mrope_section` / `mrope_interleaved` change nothing.
"""

from __future__ import annotations

from typing import Any

from ktlite.errors import ConfigError
from ktlite.runtime.models import qwen3_next
from ktlite.runtime.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM, parse_hybrid
from ktlite.runtime.models.wrapper import text_config

VL_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
ARCHITECTURES = (VL_ARCHITECTURE, "Qwen3_5MoeForCausalLM")
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
Model = Qwen3NextForCausalLM


def parse_config(raw: dict[str, Any]) -> Qwen3NextConfig:
    """A flat config (the text model's) or the VL model's file (the text model nested in `text_config`)."""
    archs = raw.get("architectures") or [ARCHITECTURES[1]]
    raw = text_config(raw)
    if archs[0] not in ARCHITECTURES:
        raise ConfigError(f"config.json: architectures={archs!r} is not a Qwen3.5-MoE model ({', '.join(ARCHITECTURES)})")
    if not raw.get("num_experts"):
        raise ConfigError("config.json: num_experts is required (every Qwen3.5-MoE layer is a MoE)")
    prefix = "model.language_model." if archs[0] == VL_ARCHITECTURE else "model."
    # transformers' Qwen3.5 router renormalises the top-k weights whatever norm_topk_prob says
    return parse_hybrid({**raw, "norm_topk_prob": True}, archs[0], split_projections=True, every_layer_moe=True,
                        text_prefix=prefix)


# `ktlite tiny-model --arch qwen3_5_moe`: Qwen3-Next's tiny shapes in the text model's layout and fields (a MoE in
# every layer, the full-attention layer placed by layer_types, mRoPE rope_parameters)
_NEXT_ONLY = ("decoder_sparse_step", "mlp_only_layers", "full_attention_interval", "partial_rotary_factor", "norm_topk_prob")
TINY_CONFIGS = {"qwen3_5_moe": {
    **{k: v for k, v in qwen3_next.TINY_CONFIGS["qwen3_next"].items() if k not in _NEXT_ONLY},
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
}}
