"""The config and model the GQA MoE families share (Qwen3-MoE, MiniMax-M2, GLM-4.5): GQA attention
(`gqa.py`), dense layers and MoE layers (`layers.py`). Each family's module parses its own
config.json into `GQAMoEConfig` and maps checkpoint names; the model is this one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ktlite.runtime.kv_cache import TokenCacheSpec
from ktlite.runtime.models.base import Backbone, CausalLM, DecoderLayer
from ktlite.runtime.models.config import ModelConfig, RouterSpec
from ktlite.runtime.models.gqa import GQASpec, GQAttention
from ktlite.runtime.models.layers import MLP, MoE
from ktlite.runtime.models.mtp import MTPLayer
from ktlite.runtime.models.rope import RotaryEmbedding


@dataclass(frozen=True)
class GQAMoEConfig(ModelConfig):
    attention: GQASpec
    shared_intermediate_size: int
    moe_layer_ids: tuple[int, ...]
    router: RouterSpec
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # checkpoint names of gate/up/down
    moe_prefix: str = "mlp"  # the checkpoint's name of the MoE block inside a layer

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.moe_layer_ids or self.mtp_moe_layer(layer_idx)

    def token_cache_specs(self, tp_size: int = 1, kv_dtype: torch.dtype | None = None) -> list[TokenCacheSpec]:
        return self.attention.cache_specs(tuple(self.decoder_and_mtp_layers), tp_size, kv_dtype)

    def request_state_specs(self, tp_size: int = 1) -> list:
        return []  # attention only: everything is cached per token

    def attention_workspace(self, tp_size: int) -> int:
        return self.attention.workspace(tp_size)

    def check_tensor_parallel(self, tp_size: int) -> None:
        self.attention.check_tensor_parallel(tp_size)

    def expert_weight_name(self, layer: int, expert: int, proj: str) -> str:
        name = self.expert_names[("gate", "up", "down").index(proj)]
        return f"model.layers.{layer}.{self.moe_prefix}.experts.{expert}.{name}.weight"


def moe_layer_ids(num_layers: int, is_moe: Callable[[int], bool]) -> tuple[int, ...]:
    return tuple(i for i in range(num_layers) if is_moe(i))


def _layer(cfg: GQAMoEConfig, i: int, rotary: RotaryEmbedding, routed_experts: bool) -> DecoderLayer:
    if cfg.is_moe_layer(i):
        mlp = MoE(cfg.router, cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size, routed_experts)
    else:
        mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
    return DecoderLayer(i, cfg.hidden_size, cfg.rms_norm_eps, GQAttention(cfg.attention, rotary), mlp)


class GQAMoEForCausalLM(CausalLM):
    def __init__(self, cfg: GQAMoEConfig, routed_experts: bool = True):
        rotary = RotaryEmbedding(cfg.rope)
        layers = [_layer(cfg, i, rotary, routed_experts) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, Backbone(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, rotary, layers))
        if cfg.mtp_layer:  # GLM-4.5's: one more decoder layer, its routed experts the runtime's as every MoE layer's
            self.mtp = MTPLayer.around(_layer(cfg, cfg.num_hidden_layers, rotary, routed_experts))

    def checkpoint_name(self, name: str) -> str:
        cfg = self.config
        name = self.mtp_as_last_layer(name)  # the families that build one store it as GLM-4.5 does
        if cfg.moe_prefix != "mlp" and ".mlp." in name and any(name.startswith(f"model.layers.{i}.") for i in cfg.moe_layers):
            name = name.replace(".mlp.", f".{cfg.moe_prefix}.", 1)
            name = name.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")
        if cfg.expert_names != ("gate_proj", "up_proj", "down_proj") and ".experts." in name:
            for ours, theirs in zip(("gate_proj", "up_proj", "down_proj"), cfg.expert_names):
                name = name.replace(f".{ours}.", f".{theirs}.")
        return name
