"""Parse a DeepSeek-V2/V3-family `config.json` into a validated, typed config.

Two dialects exist in the wild: hub folders (`rope_scaling` with `type`, top-level `rope_theta`) and
folders re-saved by recent transformers (`rope_parameters` with `rope_type` and `rope_theta` inside,
plus `rope_interleave`). Both parse to the same `DeepseekConfig`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ktlite.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    head_dim: int  # = qk_rope_head_dim: only that slice of q/k is rotated
    interleave: bool  # DeepSeek rotates adjacent pairs (x0, x1), (x2, x3), ...
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None

    @property
    def cos_sin_scale(self) -> float:
        """Factor applied to cos/sin (YaRN's `attention_factor`); 1 for plain RoPE."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """Multiplier on 1/sqrt(head_dim): DeepSeek squares mscale(factor, mscale_all_dim)."""
        if self.kind == "yarn" and self.mscale_all_dim:
            m = yarn_mscale(self.factor, self.mscale_all_dim)
            return m * m
        return 1.0


@dataclass(frozen=True)
class DeepseekConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    tie_word_embeddings: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    fp8_block_size: tuple[int, int] | None  # DeepSeek-V3 FP8 checkpoints: (128, 128)

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
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def is_v3(self) -> bool:
        return self.architecture == "DeepseekV3ForCausalLM"


_V3 = SUPPORTED_ARCHITECTURES[1]


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
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 if v3 else 2048,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
    }


def _rope_config(raw: dict[str, Any], head_dim: int, theta_default: float) -> RopeConfig:
    # Recent transformers: `rope_parameters` holds rope_type and rope_theta; hub: `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config.json: rope_scaling/rope_parameters must be an object, got {params!r}")
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", raw.get("rope_theta", theta_default)))
    interleave = bool(raw.get("rope_interleave", True))
    if kind == "default":
        return RopeConfig(theta=theta, head_dim=head_dim, interleave=interleave)
    if kind != "yarn":
        raise ConfigError(f"config.json: rope type {kind!r} is not supported (supported: default, yarn)")
    return RopeConfig(
        theta=theta,
        head_dim=head_dim,
        interleave=interleave,
        kind="yarn",
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 4096)),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
    )


def _fp8_block_size(raw: dict[str, Any]) -> tuple[int, int] | None:
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"config.json: quantization_config.quant_method {method!r} is not supported "
            "(ktlite reads bf16/fp16/fp32 checkpoints and DeepSeek's block-scaled fp8)"
        )
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_config(raw: dict[str, Any]) -> DeepseekConfig:
    """Validate a config.json dict; unknown architectures or unsupported values name the field."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(
            f"config.json: architectures={archs!r} is not supported; ktlite serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    values = {**_defaults(arch), **{k: v for k, v in raw.items() if v is not None or k == "q_lora_rank"}}

    def need(name: str) -> Any:
        if name not in values:
            raise ConfigError(f"config.json: required field {name!r} is missing")
        return values[name]

    if values["hidden_act"] != "silu":
        raise ConfigError(f"config.json: hidden_act={values['hidden_act']!r} is not supported (only 'silu')")
    if values["attention_bias"]:
        raise ConfigError("config.json: attention_bias=true is not supported (DeepSeek models have none)")
    scoring = values["scoring_func"]
    if scoring not in SCORING_FUNCS:
        raise ConfigError(f"config.json: scoring_func={scoring!r} is not supported (one of {SCORING_FUNCS})")
    method = values["topk_method"]
    if method not in TOPK_METHODS:
        raise ConfigError(f"config.json: topk_method={method!r} is not supported (one of {TOPK_METHODS})")

    n_experts = int(values.get("n_routed_experts") or 0)
    n_group, topk_group = int(values["n_group"]), int(values["topk_group"])
    top_k = int(values.get("num_experts_per_tok") or 0)
    if n_experts:
        if n_experts % n_group:
            raise ConfigError(f"config.json: n_routed_experts={n_experts} is not divisible by n_group={n_group}")
        if not 1 <= topk_group <= n_group:
            raise ConfigError(f"config.json: topk_group={topk_group} must be in 1..n_group={n_group}")
        if not 1 <= top_k <= n_experts:
            raise ConfigError(f"config.json: num_experts_per_tok={top_k} must be in 1..n_routed_experts={n_experts}")
        if method == "noaux_tc" and n_experts // n_group < 2:
            raise ConfigError("config.json: topk_method='noaux_tc' scores groups by their top-2, needs >= 2 experts per group")
    q_lora = values.get("q_lora_rank")
    qk_rope = int(need("qk_rope_head_dim"))
    if qk_rope % 2:
        raise ConfigError(f"config.json: qk_rope_head_dim={qk_rope} must be even")

    return DeepseekConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=int(need("num_attention_heads")),
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=int(need("qk_nope_head_dim")),
        qk_rope_head_dim=qk_rope,
        v_head_dim=int(need("v_head_dim")),
        moe_intermediate_size=int(values.get("moe_intermediate_size") or 0),
        n_routed_experts=n_experts,
        n_shared_experts=int(values["n_shared_experts"] or 0),
        num_experts_per_tok=top_k,
        first_k_dense_replace=int(values["first_k_dense_replace"]),
        moe_layer_freq=int(values["moe_layer_freq"]),
        routed_scaling_factor=float(values["routed_scaling_factor"]),
        scoring_func=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(values["norm_topk_prob"]),
        tie_word_embeddings=bool(values["tie_word_embeddings"]),
        rms_norm_eps=float(values["rms_norm_eps"]),
        max_position_embeddings=int(values["max_position_embeddings"]),
        rope=_rope_config(values, qk_rope, float(values["rope_theta"])),
        bos_token_id=values.get("bos_token_id"),
        eos_token_ids=_eos_ids(values.get("eos_token_id")),
        torch_dtype=str(values.get("dtype") or values["torch_dtype"]),
        fp8_block_size=_fp8_block_size(values),
    )


def load_config(model_dir: str | Path) -> DeepseekConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: --model must be a folder with config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    return parse_config(raw)
