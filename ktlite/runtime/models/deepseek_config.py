"""Parse a DeepSeek-V2/V3-family `config.json` (also Kimi-K2, which is the V3 architecture)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ktlite.errors import ConfigError
from ktlite.kernels.triton.kv_fp8 import Fp8Rows, latent_rows, packs_fp8
from ktlite.runtime.kv_cache import TokenCacheSpec
from ktlite.runtime.models.config import Fields, ModelConfig, RouterSpec

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


@dataclass(frozen=True)
class DeepseekConfig(ModelConfig):
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Values cached per token per layer in absorbed MLA: the latent plus the rope'd key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_scale_factor

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def is_v3(self) -> bool:
        return self.architecture == "DeepseekV3ForCausalLM"

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def router(self) -> RouterSpec:
        # V3 normalises when asked and always scales; V2 normalises only for top-k > 1 and scales
        # only when it did not normalise.
        normalize = self.norm_topk_prob and (self.is_v3 or self.num_experts_per_tok > 1)
        scale = self.routed_scaling_factor if self.is_v3 or not normalize else 1.0
        return RouterSpec(self.n_routed_experts, self.num_experts_per_tok, self.scoring_func, self.topk_method,
                          self.n_group, self.topk_group, normalize, scale,
                          correction_bias=self.topk_method == "noaux_tc")

    def fp8_rows(self, name: str) -> Fp8Rows:
        """The packed layout of cache kind `name` in an FP8 pool (kv_fp8): the latent's fp8 values with a
        scale per 128 and the rope'd key in bf16."""
        return latent_rows(self.kv_lora_rank, self.qk_rope_head_dim)

    def cache_spec(self, name: str, layers: tuple[int, ...], values: int,
                   kv_dtype: torch.dtype | None) -> TokenCacheSpec:
        """`values` per token in the pool's dtype, or in an FP8 pool one packed uint8 row with its scales."""
        if packs_fp8(kv_dtype):
            return TokenCacheSpec(name, layers, (self.fp8_rows(name).row_bytes,), torch.uint8)
        return TokenCacheSpec(name, layers, (values,))

    builds_mtp = True

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with a latent per token: the decoder's, and the MTP layer's (index num_hidden_layers) when served."""
        return tuple(self.decoder_and_mtp_layers)

    def token_cache_specs(self, tp_size: int = 1, kv_dtype: torch.dtype | None = None) -> list[TokenCacheSpec]:
        # the latent is shared by all heads, so every tensor-parallel rank keeps all of it
        return [self.cache_spec("latent", self.attention_layers, self.kv_latent_dim, kv_dtype)]

    def request_state_specs(self, tp_size: int = 1) -> list:
        return []  # attention only: everything is cached per token

    def attention_workspace(self, tp_size: int) -> int:
        """q_a, q, new latent, absorbed q, latent output, W_UV output (values per token)."""
        heads = self.num_attention_heads // tp_size
        return ((self.q_lora_rank or 0) + heads * self.qk_head_dim + self.kv_latent_dim + heads * self.kv_latent_dim
                + heads * self.kv_lora_rank + heads * self.v_head_dim)

    def check_tensor_parallel(self, tp_size: int) -> None:
        if self.num_attention_heads % tp_size:
            raise ConfigError(f"--tensor-parallel-size {tp_size}: the model's {self.num_attention_heads} attention "
                              "heads must split evenly across the GPUs")

    def expert_weight_name(self, layer: int, expert: int, proj: str) -> str:
        return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


_V3 = ARCHITECTURES[1]


def _defaults(arch: str) -> dict[str, Any]:
    v3 = arch == _V3
    return {
        "q_lora_rank": 1536 if v3 else None,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 3 if v3 else 0,
        "routed_scaling_factor": 2.5 if v3 else 1.0,
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else "greedy",
        "n_group": 8 if v3 else 1,
        "topk_group": 4 if v3 else 1,
        "norm_topk_prob": bool(v3),
        "n_shared_experts": 1 if v3 else 2,
        "max_position_embeddings": 4096 if v3 else 2048,
        "attention_bias": False,
        "moe_intermediate_size": 0,
        "n_routed_experts": 0,
        "num_experts_per_tok": 0,
    }


def architecture_of(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:  # kimi_k2 and friends name the V3 architecture by model_type only
        arch = ARCHITECTURES[0] if raw.get("model_type") == "deepseek_v2" else _V3
    return arch


def parse_config(raw: dict[str, Any]) -> DeepseekConfig:
    """Validate a config.json dict; unsupported values name the field."""
    arch = architecture_of(raw)
    f = Fields(raw, _defaults(arch), keep_none=("q_lora_rank",))
    if f.values["attention_bias"]:
        raise ConfigError("config.json: attention_bias=true is not supported (DeepSeek models have none)")
    q_lora = f.values.get("q_lora_rank")
    qk_rope = int(f.need("qk_rope_head_dim"))
    if qk_rope % 2:
        raise ConfigError(f"config.json: qk_rope_head_dim={qk_rope} must be even")
    rope = f.rope(qk_rope, theta=10000.0, interleave=True)
    if rope.head_dim != qk_rope:
        raise ConfigError(f"config.json: partial_rotary_factor rotates {rope.head_dim} of qk_rope_head_dim={qk_rope}; "
                          "MLA rotates all of it")
    cfg = DeepseekConfig(
        **f.common(arch),
        rope=rope,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(f.need("kv_lora_rank")),
        qk_nope_head_dim=int(f.need("qk_nope_head_dim")),
        qk_rope_head_dim=qk_rope,
        v_head_dim=int(f.need("v_head_dim")),
        n_shared_experts=int(f.get("n_shared_experts", 0)),
        first_k_dense_replace=int(f.values["first_k_dense_replace"]),
        moe_layer_freq=int(f.values["moe_layer_freq"]),
        routed_scaling_factor=float(f.values["routed_scaling_factor"]),
        scoring_func=f.values["scoring_func"],
        topk_method=f.values["topk_method"],
        n_group=int(f.values["n_group"]),
        topk_group=int(f.values["topk_group"]),
        norm_topk_prob=bool(f.values["norm_topk_prob"]),
        nextn_predict_layers=int(f.get("num_nextn_predict_layers", 0) or 0),
    )
    cfg.router  # validates the routing fields
    return cfg


# `ktlite tiny-model --arch NAME`: config.json fields beyond the shared tiny ones (hidden 64, 3 layers,
# 4 heads; see ktlite/runtime/tiny_model.py)
_TINY_MLA = {
    "moe_intermediate_size": 32,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "attention_bias": False,
}
TINY_CONFIGS = {
    "deepseek_v3": {
        **_TINY_MLA,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "q_lora_rank": 48,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    "deepseek_v2": {
        **_TINY_MLA,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "group_limited_greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
}
