"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): GQA with bias on q/k/v, optional per-head q/k norm,
partial rotary (0.5), sigmoid group-limited router with correction bias (DeepSeek-V3's noaux_tc),
one shared expert, `first_k_dense_replace` dense layers. The multi-token-prediction layer after the
last decoder layer (`num_nextn_predict_layers`, DeepSeek-V3's layout: models/mtp.py) is built and loaded for NEXTN
drafts (`with_mtp`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ktlite.runtime.models.config import Fields, RouterSpec
from ktlite.runtime.models.gqa import GQASpec
from ktlite.runtime.models.gqa_moe import GQAMoEConfig, GQAMoEForCausalLM, moe_layer_ids

ARCHITECTURES = ("Glm4MoeForCausalLM",)
MODEL_TYPES = ("glm4_moe",)
Model = GQAMoEForCausalLM


@dataclass(frozen=True)
class Glm4MoeConfig(GQAMoEConfig):
    builds_mtp = True  # its MTP layer is a MoE decoder layer like the others (GQAMoEForCausalLM builds it)


def parse_config(raw: dict[str, Any]) -> Glm4MoeConfig:
    f = Fields(raw, {"max_position_embeddings": 131072, "attention_bias": True,
                     "use_qk_norm": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                     "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "n_shared_experts": 1})
    common = f.common(ARCHITECTURES[0])
    heads = common["num_attention_heads"]
    head_dim = int(f.get("head_dim") or common["hidden_size"] // heads)
    experts, top_k, moe_inter = common["n_routed_experts"], common["num_experts_per_tok"], common["moe_intermediate_size"]
    first_dense = int(f.values["first_k_dense_replace"])
    return Glm4MoeConfig(
        **common,
        nextn_predict_layers=int(f.get("num_nextn_predict_layers", 0)),
        attention=GQASpec(common["hidden_size"], heads, int(f.get("num_key_value_heads", heads)), head_dim,
                          common["rms_norm_eps"], bias=bool(f.values["attention_bias"]),
                          qk_norm="per_head" if f.values["use_qk_norm"] else None),
        shared_intermediate_size=moe_inter * int(f.values["n_shared_experts"]),
        moe_layer_ids=moe_layer_ids(common["num_hidden_layers"], lambda i: experts > 0 and i >= first_dense),
        router=RouterSpec(experts, top_k, "sigmoid", "noaux_tc", int(f.values["n_group"]), int(f.values["topk_group"]),
                          normalize=bool(f.values["norm_topk_prob"]),
                          scaling_factor=float(f.values["routed_scaling_factor"]), correction_bias=True),
        rope=f.rope(head_dim, theta=1000000.0, interleave=False, partial_rotary_factor=0.5),
    )


# `ktlite tiny-model --arch glm4_moe`: config.json fields beyond the shared tiny ones (ktlite/runtime/tiny_model.py)
TINY_CONFIGS = {"glm4_moe": {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "num_key_value_heads": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": True,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
}}
