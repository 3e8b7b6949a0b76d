"""The multi-token-prediction (MTP, "NEXTN") layer checkpoints carry after their last decoder layer: DeepSeek-V3/R1,
V3.2 and GLM-5 (MLA), GLM-4.5/4.6/4.7 (GQA), Qwen3-Next and Qwen3.5-MoE (gated GQA, (1 + w) norms).

At position t it reads the target model's hidden state h_t and the embedding of the next token x_{t+1}:
    h' = eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))
then runs one full decoder layer of the family (attention with its own KV over positions, MLP/MoE) and
`shared_head.norm`; the target's lm_head turns that into logits for x_{t+2}. As in SGLang, h_t is the target's output
after its final norm, and a chain of drafts feeds the layer's own normed output back in as the next position's h.

Checkpoint names (the family's `checkpoint_name` maps them):
- DeepSeek-V3 convention (DeepSeek-V3/V3.2, GLM-4.5, GLM-5): `model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj,
  shared_head.norm, self_attn.*, mlp.*, input_layernorm, post_attention_layernorm}`; its `embed_tokens` and
  `shared_head.head` copies are not loaded (the target's are used: they are equal to them).
- Qwen3-Next / Qwen3.5 (SGLang's qwen3_next_mtp.py): `mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}` are
  enorm, hnorm, eh_proj and shared_head.norm (embedding first in the concat, as DeepSeek's), `mtp.layers.0.*` the
  decoder layer; no embedding or head copies (the target's are used).
Its attention, shared expert, router and eh_proj are on the device; its routed experts are one more MoE layer for the
runtime (ModelConfig.moe_layers): CPU expert store and GPU experts, as every other layer's.
"""

from __future__ import annotations

import torch
from torch import nn

from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.models.base import DecoderLayer, ForwardContext
from ktlite.runtime.models.layers import RMSNorm
from ktlite.runtime.models.rope import RotaryEmbedding


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.norm = RMSNorm(hidden, eps, unit_offset)


class MTPLayer(DecoderLayer):
    plan_component = "mtp"  # all its weights (routed experts included) count as the MTP layer's, norms as norms
    fp8_linears: tuple[str, ...] = ()  # block-FP8 checkpoints keep eh_proj in bf16 (its attention and MLP in FP8)

    def __init__(self, layer_idx: int, hidden: int, eps: float, attention: nn.Module, mlp: nn.Module,
                 unit_offset_norms: bool = False):
        super().__init__(layer_idx, hidden, eps, attention, mlp, unit_offset_norms)
        self.enorm = RMSNorm(hidden, eps, unit_offset_norms)
        self.hnorm = RMSNorm(hidden, eps, unit_offset_norms)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(hidden, eps, unit_offset_norms)

    @classmethod
    def around(cls, layer: DecoderLayer) -> "MTPLayer":
        """The MTP layer around one of the family's decoder layers (built at index num_hidden_layers): its
        attention and MLP/MoE, norms of the same kind."""
        norm = layer.input_layernorm
        return cls(layer.layer_idx, norm.weight.shape[0], norm.eps, layer.self_attn, layer.mlp, norm.unit_offset)

    def project(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embedded, hidden [..., hidden] -> the decoder layer's input [..., hidden]."""
        return self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden.to(embedded.dtype))), dim=-1))

    def forward_batch(self, embedded: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,  # type: ignore[override]
                      ctx: ForwardContext, rotary: RotaryEmbedding) -> torch.Tensor:
        """embedded [N, hidden] (the next tokens' embeddings), hidden [N, hidden] -> the normed output [N, hidden];
        its KV goes to the pool at layer `layer_idx`."""
        cos, sin = rotary.cos_sin(batch.positions)
        x = super().forward_batch(self.project(embedded, hidden), cos, sin, batch, ctx)
        return self.shared_head.norm(x)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whole sequences at once without a cache (the plain torch form, differentiable: tests train it):
        embedded, hidden [B, T, hidden], positions [B, T] -> the normed output [B, T, hidden]."""
        x = self.project(embedded, hidden)
        x = x + self.self_attn.causal(self.input_layernorm(x), positions)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x)
