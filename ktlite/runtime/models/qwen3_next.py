"""Qwen3-Next / Qwen3-Coder-Next (`Qwen3NextForCausalLM`): a hybrid of Gated DeltaNet linear attention
(three of every four layers) and gated full attention (GQA whose q_proj also emits a per-head output
gate, q/k norms and every layer norm in the (1 + w) form, partial rotary 0.25), with a MoE of many
small experts (softmax top-k, `norm_topk_prob`) plus one shared expert scaled by
sigmoid(shared_expert_gate(x)).

Full-attention layers cache K and V per token in the KV pool; linear layers keep per-request conv and
recurrent state in the state pool (`state_cache.py`). A token prefix cannot restore that state, so
these models skip the prefix cache.

The checkpoints' multi-token-prediction layer (`mtp.*`, `mtp_num_hidden_layers`) is a full-attention MoE decoder layer
behind `mtp.fc` and its two (1 + w) norms (SGLang's qwen3_next_mtp.py), built for NEXTN drafts (models/mtp.py): K and
V per token at layer index num_hidden_layers, no recurrent state.

Qwen3.5-MoE (`qwen3_5_moe.py`) is this model with the Gated DeltaNet projections split and a MoE in every layer
(`parse_hybrid`), its text model named under `model.language_model.` in the hub's VL checkpoints (`text_prefix`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ktlite.errors import ConfigError
from ktlite.runtime.kv_cache import TokenCacheSpec
from ktlite.runtime.models.base import MTP_PREFIX, Backbone, CausalLM, DecoderLayer
from ktlite.runtime.models.config import Fields, ModelConfig, RouterSpec
from ktlite.runtime.models.gated_deltanet import GatedDeltaNet, LinearAttentionSpec
from ktlite.runtime.models.gqa import GQASpec, GQAttention
from ktlite.runtime.models.layers import MLP, MoE
from ktlite.runtime.models.mtp import MTPLayer
from ktlite.runtime.models.rope import RotaryEmbedding
from ktlite.runtime.state_cache import RequestStateSpec

ARCHITECTURES = ("Qwen3NextForCausalLM",)
MODEL_TYPES = ("qwen3_next",)


@dataclass(frozen=True)
class Qwen3NextConfig(ModelConfig):
    attention: GQASpec
    linear: LinearAttentionSpec
    full_attention_layers: tuple[int, ...]
    shared_intermediate_size: int
    moe_layer_ids: tuple[int, ...]
    router: RouterSpec
    text_prefix: str = "model."  # the decoder's checkpoint names ("model.language_model." in a VL checkpoint)

    builds_mtp = True  # `mtp.*`: a full-attention decoder layer with the family's MoE (models/mtp.py)
    mtp_config_field = "mtp_num_hidden_layers"

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.moe_layer_ids or self.mtp_moe_layer(layer_idx)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with K and V per token: the full-attention ones, and a served MTP layer (num_hidden_layers)."""
        return self.full_attention_layers + ((self.num_hidden_layers,) if self.mtp_layer else ())

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.full_attention_layers)

    def token_cache_specs(self, tp_size: int = 1, kv_dtype: torch.dtype | None = None) -> list[TokenCacheSpec]:
        return self.attention.cache_specs(self.attention_layers, tp_size, kv_dtype)

    def request_state_specs(self, tp_size: int = 1) -> list[RequestStateSpec]:
        return self.linear.state_specs(self.linear_layers)  # replicated on every rank

    def attention_workspace(self, tp_size: int) -> int:
        return max(self.attention.workspace(tp_size), self.linear.workspace())

    def check_tensor_parallel(self, tp_size: int) -> None:
        self.attention.check_tensor_parallel(tp_size)

    def expert_weight_name(self, layer: int, expert: int, proj: str) -> str:
        prefix = MTP_LAYER if layer == self.num_hidden_layers else f"{self.text_prefix}layers.{layer}."
        return f"{prefix}mlp.experts.{expert}.{proj}_proj.weight"


def _full_attention_layers(f: Fields, layers: int) -> tuple[int, ...]:
    kinds = f.get("layer_types")
    if kinds:
        unknown = set(kinds) - {"linear_attention", "full_attention"}
        if unknown:
            raise ConfigError(f"config.json: layer_types {sorted(unknown)} are not supported")
        return tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    interval = int(f.get("full_attention_interval", 4))
    return tuple(i for i in range(layers) if (i + 1) % interval == 0)


def parse_config(raw: dict[str, Any]) -> Qwen3NextConfig:
    return parse_hybrid(raw, ARCHITECTURES[0])


def parse_hybrid(raw: dict[str, Any], architecture: str, split_projections: bool = False, every_layer_moe: bool = False,
                 text_prefix: str = "model.") -> Qwen3NextConfig:
    """The config of this hybrid in its variants: Qwen3.5 splits the Gated DeltaNet projections
    (`split_projections`) and has a MoE in every layer (no `decoder_sparse_step` / `mlp_only_layers`)."""
    f = Fields(raw, {"max_position_embeddings": 262144, "decoder_sparse_step": 1,
                     "mlp_only_layers": [], "norm_topk_prob": True, "attention_bias": False,
                     "linear_conv_kernel_dim": 4})
    # a MoE in every layer: no dense MLP, and Qwen3.5's files state no intermediate_size
    dense = {"intermediate_size": int(f.get("intermediate_size", 0))} if every_layer_moe else {}
    common = f.common(architecture, n_routed_experts=int(f.get("num_experts", 0)), **dense)
    heads, layers, hidden = common["num_attention_heads"], common["num_hidden_layers"], common["hidden_size"]
    head_dim = int(f.get("head_dim") or hidden // heads)
    experts, top_k = common["n_routed_experts"], common["num_experts_per_tok"]
    step, dense_only = int(f.values["decoder_sparse_step"]), set(f.values["mlp_only_layers"])
    linear = LinearAttentionSpec(hidden, int(f.need("linear_num_key_heads")), int(f.need("linear_num_value_heads")),
                                 int(f.need("linear_key_head_dim")), int(f.need("linear_value_head_dim")),
                                 int(f.values["linear_conv_kernel_dim"]), common["rms_norm_eps"], split_projections)
    if linear.value_heads % linear.key_heads:
        raise ConfigError("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads")
    return Qwen3NextConfig(
        **common,
        attention=GQASpec(hidden, heads, int(f.get("num_key_value_heads", heads)), head_dim, common["rms_norm_eps"],
                          bias=bool(f.values["attention_bias"]), qk_norm="per_head", output_gate=True,
                          unit_offset_norms=True),
        linear=linear,
        full_attention_layers=_full_attention_layers(f, layers),
        shared_intermediate_size=int(f.get("shared_expert_intermediate_size", 0)),
        moe_layer_ids=tuple(i for i in range(layers) if experts and (every_layer_moe or (
            i not in dense_only and (i + 1) % step == 0))),
        router=RouterSpec(experts, top_k, "softmax", normalize=bool(f.values["norm_topk_prob"])),
        rope=f.rope(head_dim, theta=10000000.0, interleave=False, partial_rotary_factor=0.25),
        text_prefix=text_prefix,
        nextn_predict_layers=int(f.get("mtp_num_hidden_layers", 0)),
    )


class GatedSharedExpert(nn.Module):
    """The shared expert, scaled per token by sigmoid(gate(x))."""

    plan_component = "shared_experts"

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.expert = MLP(hidden, intermediate)
        self.gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.expert(x)


def _layer(cfg: Qwen3NextConfig, i: int, rotary: RotaryEmbedding, routed_experts: bool) -> DecoderLayer:
    if i in cfg.attention_layers:
        mixer: nn.Module = GQAttention(cfg.attention, rotary)
    else:
        mixer = GatedDeltaNet(cfg.linear)
    if cfg.is_moe_layer(i):
        mlp: nn.Module = MoE(cfg.router, cfg.hidden_size, cfg.moe_intermediate_size, 0, routed_experts)
        if cfg.shared_intermediate_size:
            mlp.shared_experts = GatedSharedExpert(cfg.hidden_size, cfg.shared_intermediate_size)
    else:
        mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
    return DecoderLayer(i, cfg.hidden_size, cfg.rms_norm_eps, mixer, mlp, unit_offset_norms=True)


MTP_LAYER = "mtp.layers.0."  # the checkpoint's MTP decoder layer (config.json: mtp_num_hidden_layers)
# the MTP layer's own tensors: ours -> the checkpoint's (SGLang's qwen3_next_mtp.py / qwen3_5_mtp.py read these)
MTP_GLUE = {"eh_proj.": "fc.", "enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden.",
            "shared_head.norm.": "norm."}


class Qwen3NextForCausalLM(CausalLM):
    def __init__(self, cfg: Qwen3NextConfig, routed_experts: bool = True):
        rotary = RotaryEmbedding(cfg.rope)
        layers = [_layer(cfg, i, rotary, routed_experts) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, Backbone(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, rotary, layers,
                                       unit_offset_norms=True))
        if cfg.mtp_layer:  # a full-attention MoE layer; its routed experts the runtime's as every MoE layer's
            self.mtp = MTPLayer.around(_layer(cfg, cfg.num_hidden_layers, rotary, routed_experts))
        self.supports_prefix_cache = False  # per-request recurrent state: a token prefix cannot restore it

    def checkpoint_name(self, name: str) -> str:
        if name.startswith(MTP_PREFIX):  # top-level `mtp.*` in the text-only and the VL checkpoints alike
            part = name.removeprefix(MTP_PREFIX)
            glue = next((k for k in MTP_GLUE if part.startswith(k)), None)
            if glue is not None:
                return MTP_PREFIX + MTP_GLUE[glue] + part.removeprefix(glue)
            return self._shared_expert_name(MTP_LAYER + part)
        m = re.match(r"model\.layers\.(\d+)\.self_attn\.", name)
        if m and int(m.group(1)) not in self.config.full_attention_layers:
            name = name.replace(".self_attn.", ".linear_attn.", 1)
        name = self._shared_expert_name(name)
        return self.config.text_prefix + name.removeprefix("model.") if name.startswith("model.") else name

    @staticmethod
    def _shared_expert_name(name: str) -> str:
        return name.replace(".mlp.shared_experts.expert.", ".mlp.shared_expert.").replace(
            ".mlp.shared_experts.gate.", ".mlp.shared_expert_gate.")


Model = Qwen3NextForCausalLM

# `ktlite tiny-model --arch qwen3_next`: 4 layers (3 linear + 1 full attention)
TINY_CONFIGS = {"qwen3_next": {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}}
