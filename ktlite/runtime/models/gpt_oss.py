"""gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b).

Attention: GQA with biases on q/k/v/o and a learned sink logit per query head; `layer_types` alternates
sliding-window attention (`sliding_window` keys, the query's own included, as transformers' mask) and full
attention; YaRN rope over halves. Every layer is MoE: the router is a linear layer with a bias, top-k of the logits
then softmax over the k (RouterSpec's softmax + normalize); no shared experts. The experts are stacked per layer as
the checkpoints store them, transposed: `gate_up_proj` [E, H, 2I] with gate and up *interleaved* (gate = columns
0::2, up = 1::2) and `down_proj` [E, I, H], each with a bias; their activation is the clamped SwiGLU of
`swiglu_limit` / `swiglu_alpha` (kernels/expert_activation.py "swiglu_oai"). The runtime reads an expert's
matrices de-interleaved into ktlite's [gate rows; up rows] order (`stacked_expert`), so the expert kernels see
their usual layout; the biases stay on the device with the router (`GptOssExperts`).

Weights: bf16/fp32 experts (transformers' save_pretrained writes the names above). The published checkpoints'
MXFP4 experts (`*_blocks`, `*_scales`) need an MXFP4 expert source: without one the CPU store finds no
`gate_up_proj` and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ktlite.errors import ConfigError
from ktlite.kernels.expert_activation import ExpertActivation
from ktlite.runtime.models.base import Backbone, CausalLM, DecoderLayer
from ktlite.runtime.models.config import Fields, RouterSpec, StackedExpert
from ktlite.runtime.models.gqa import GQASpec, GQAttention
from ktlite.runtime.models.gqa_moe import GQAMoEConfig
from ktlite.runtime.models.layers import MoE
from ktlite.runtime.models.rope import RotaryEmbedding

ARCHITECTURES = ("GptOssForCausalLM",)
MODEL_TYPES = ("gpt_oss",)
LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' rope for a gpt-oss config without rope_parameters / rope_scaling (GptOssConfig's default): YaRN x32
# over 4096 (a top-level rope_theta still applies)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass(frozen=True, kw_only=True)
class GptOssConfig(GQAMoEConfig):
    windows: tuple[int, ...]  # per layer: the sliding window, 0 for full attention
    activation: ExpertActivation

    def expert_weight_name(self, layer: int, expert: int, proj: str) -> str:
        return self.stacked_expert(layer, expert, proj).name

    def stacked_expert(self, layer: int, expert: int, proj: str) -> StackedExpert:
        prefix = f"model.layers.{layer}.mlp.experts."
        if proj == "down":
            return StackedExpert(prefix + "down_proj")
        return StackedExpert(prefix + "gate_up_proj", start=0 if proj == "gate" else 1, step=2)


def parse_config(raw: dict[str, Any]) -> GptOssConfig:
    quant = raw.get("quantization_config") or {}
    if quant.get("quant_method") == "mxfp4":  # the experts' format, the expert source's business; the rest is bf16
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:  # as GptOssConfig.__post_init__
        raw = {**raw, "rope_parameters": DEFAULT_ROPE}
    f = Fields(raw, {"max_position_embeddings": 131072, "attention_bias": True, "sliding_window": 128,
                     "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "rms_norm_eps": 1e-5})
    common = f.common(ARCHITECTURES[0], intermediate_size=0,  # no dense layers
                      moe_intermediate_size=int(f.need("intermediate_size")),  # gpt-oss names the expert width so
                      n_routed_experts=int(f.need("num_local_experts")))
    layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    head_dim = int(f.get("head_dim") or common["hidden_size"] // heads)
    # transformers' default: even layers slide, odd layers see everything
    kinds = f.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= set(LAYER_TYPES):
        raise ConfigError(f"config.json: layer_types must name {layers} layers, each one of {LAYER_TYPES}")
    window = int(f.values["sliding_window"])
    bias = bool(f.values["attention_bias"])
    return GptOssConfig(
        **common,
        attention=GQASpec(common["hidden_size"], heads, int(f.get("num_key_value_heads", heads)), head_dim,
                          common["rms_norm_eps"], bias=bias, o_bias=bias, sinks=True),
        shared_intermediate_size=0,
        moe_layer_ids=tuple(range(layers)),
        router=RouterSpec(common["n_routed_experts"], common["num_experts_per_tok"], "softmax", normalize=True,
                          logit_bias=True),
        rope=f.rope(head_dim, theta=150000.0, interleave=False),
        windows=tuple(window if kind == "sliding_attention" else 0 for kind in kinds),
        activation=ExpertActivation("swiglu_oai", limit=float(f.values["swiglu_limit"]),
                                    alpha=float(f.values["swiglu_alpha"])),
    )


class GptOssExperts(nn.Module):
    """A layer's routed experts under the checkpoint's names: the biases always (the device adds them, wherever the
    expert runs: they are small), the stacked weights only in the reference model (routed_experts)."""

    plan_component = "norms_router"

    def __init__(self, experts: int, hidden: int, inter: int, weights: bool):
        super().__init__()
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))  # interleaved as gate_up_proj
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        if weights:
            self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
            self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))


class GptOssMoE(MoE):
    def __init__(self, cfg: GptOssConfig, routed_experts: bool):
        super().__init__(cfg.router, cfg.hidden_size, cfg.moe_intermediate_size, 0, routed_experts=False)
        self.experts = GptOssExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, routed_experts)
        self.activation = cfg.activation

    def expert_biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = self.experts.gate_up_proj_bias
        return torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1).detach(), self.experts.down_proj_bias.detach()

    def routed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The reference: each chosen expert on its tokens, from the stacked weights."""
        ex = self.experts
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in topk_ids.unique().tolist():
            token_idx, slot = (topk_ids == e).nonzero(as_tuple=True)
            gate_up = x[token_idx] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
            act = self.activation(gate_up[:, 0::2], gate_up[:, 1::2])
            y = act @ ex.down_proj[e] + ex.down_proj_bias[e]
            out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None])
        return out.to(x.dtype)


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: GptOssConfig, routed_experts: bool = True):
        rotary = RotaryEmbedding(cfg.rope)
        layers = [DecoderLayer(i, cfg.hidden_size, cfg.rms_norm_eps, GQAttention(cfg.attention, rotary, cfg.windows[i]),
                               GptOssMoE(cfg, routed_experts)) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, Backbone(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, rotary, layers))

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".mlp.gate.", ".mlp.router.")  # the MoE block's router is `gate` in ktlite


Model = GptOssForCausalLM

# `ktlite tiny-model --arch gpt_oss`: config.json fields beyond the shared tiny ones (ktlite/runtime/tiny_model.py);
# a window of 4 drops keys in any prompt longer than that, and a limit of 1 clamps many gate/up values
TINY_CONFIGS = {"gpt_oss": {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "intermediate_size": 32,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "attention_bias": True,
    "swiglu_limit": 1.0,
    "swiglu_alpha": 1.702,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                        "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False},
}}
