"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): GQA with per-head q/k RMSNorm,
softmax top-k router (`norm_topk_prob`), no shared experts, MoE layers by `decoder_sparse_step` and
`mlp_only_layers`."""

from __future__ import annotations

from typing import Any

from ktlite.runtime.models.config import Fields, RouterSpec
from ktlite.runtime.models.gqa import GQASpec
from ktlite.runtime.models.gqa_moe import GQAMoEConfig, GQAMoEForCausalLM, moe_layer_ids

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPES = ("qwen3_moe",)
Model = GQAMoEForCausalLM


def parse_config(raw: dict[str, Any]) -> GQAMoEConfig:
    f = Fields(raw, {"max_position_embeddings": 40960, "decoder_sparse_step": 1,
                     "mlp_only_layers": [], "norm_topk_prob": True, "attention_bias": False})
    common = f.common(ARCHITECTURES[0], n_routed_experts=int(f.get("num_experts") or f.get("num_local_experts", 0)))
    heads, experts = common["num_attention_heads"], common["n_routed_experts"]
    head_dim = int(f.get("head_dim") or common["hidden_size"] // heads)
    step, dense_only = int(f.values["decoder_sparse_step"]), set(f.values["mlp_only_layers"])
    layers = common["num_hidden_layers"]
    return GQAMoEConfig(
        **common,
        attention=GQASpec(common["hidden_size"], heads, int(f.get("num_key_value_heads", heads)), head_dim,
                          common["rms_norm_eps"], bias=bool(f.values["attention_bias"]), qk_norm="per_head"),
        shared_intermediate_size=0,
        moe_layer_ids=moe_layer_ids(layers, lambda i: experts > 0 and i not in dense_only and (i + 1) % step == 0),
        router=RouterSpec(experts, common["num_experts_per_tok"], "softmax", normalize=bool(f.values["norm_topk_prob"])),
        rope=f.rope(head_dim, theta=1000000.0, interleave=False),
    )


# `ktlite tiny-model --arch qwen3_moe`: config.json fields beyond the shared tiny ones (ktlite/runtime/tiny_model.py)
TINY_CONFIGS = {"qwen3_moe": {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "attention_bias": False,
}}
