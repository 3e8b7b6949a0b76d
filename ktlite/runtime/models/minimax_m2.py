"""MiniMax-M2 (M2, M2.1, M2.5): GQA with q/k RMSNorm over all heads together (`qk_norm_type:
per_layer`), partial rotary (`rotary_dim`), sigmoid router whose `e_score_correction_bias` steers the
choice only, weights normalised then scaled by `routed_scaling_factor`; every layer is MoE, no
shared experts. Hub checkpoints name the MoE block `block_sparse_moe` and the experts w1/w3/w2."""

from __future__ import annotations

from typing import Any

from ktlite.errors import ConfigError
from ktlite.runtime.models.config import Fields, RouterSpec
from ktlite.runtime.models.gqa import GQASpec
from ktlite.runtime.models.gqa_moe import GQAMoEConfig, GQAMoEForCausalLM

ARCHITECTURES = ("MiniMaxM2ForCausalLM",)
MODEL_TYPES = ("minimax_m2",)
Model = GQAMoEForCausalLM


def parse_config(raw: dict[str, Any]) -> GQAMoEConfig:
    f = Fields(raw, {"max_position_embeddings": 196608, "use_qk_norm": True,
                     "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
                     "routed_scaling_factor": 1.0})
    common = f.common(ARCHITECTURES[0], intermediate_size=0,  # no dense layers
                      moe_intermediate_size=int(f.need("intermediate_size")),  # MiniMax names the expert size this way
                      n_routed_experts=int(f.need("num_local_experts")))
    heads, experts, top_k = common["num_attention_heads"], common["n_routed_experts"], common["num_experts_per_tok"]
    head_dim = int(f.get("head_dim") or common["hidden_size"] // heads)
    norm = f.values["qk_norm_type"] if f.values["use_qk_norm"] else None
    if norm not in (None, "per_layer", "per_head"):
        raise ConfigError(f"config.json: qk_norm_type={norm!r} is not supported (per_layer or per_head)")
    return GQAMoEConfig(
        **common,
        attention=GQASpec(common["hidden_size"], heads, int(f.get("num_key_value_heads", heads)), head_dim,
                          common["rms_norm_eps"], qk_norm=norm),
        shared_intermediate_size=0,
        moe_layer_ids=tuple(range(common["num_hidden_layers"])),
        router=RouterSpec(experts, top_k, f.values["scoring_func"], normalize=True,
                          scaling_factor=float(f.values["routed_scaling_factor"]),
                          correction_bias=bool(f.values["use_routing_bias"])),
        rope=f.rope(head_dim, theta=5000000.0, interleave=False, rotary_dim_field=True),
        expert_names=("w1", "w3", "w2"),
        moe_prefix="block_sparse_moe",
    )


# `ktlite tiny-model --arch minimax_m2`: config.json fields beyond the shared tiny ones (ktlite/runtime/tiny_model.py)
TINY_CONFIGS = {"minimax_m2": {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "intermediate_size": 32,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,
    "num_local_experts": 16,
    "num_experts_per_tok": 4,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "routed_scaling_factor": 1.0,
}}
