"""The multi-token-prediction (MTP, "NEXTN") layer DeepSeek-V3-style checkpoints carry after their last decoder layer.

At position t it reads the target model's hidden state h_t and the embedding of the next token x_{t+1}:
    h' = eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))
then runs one full decoder layer (attention with its own KV over positions, MLP/MoE) and `shared_head.norm`; the
target's lm_head turns that into logits for x_{t+2}. As in SGLang, h_t is the target's output after its final norm,
and a chain of drafts feeds the layer's own normed output back in as the next position's h.

Checkpoint names: `model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj, shared_head.norm, self_attn.*, mlp.*,
input_layernorm, post_attention_layernorm}`; its `embed_tokens` and `shared_head.head` copies are not loaded (the
target's are used: DeepSeek-V3's are equal to them). Its attention, shared expert, router and eh_proj are on the
device; its routed experts are one more MoE layer for the runtime (ModelConfig.moe_layers): CPU expert store and GPU
experts, as every other layer's.
"""

from __future__ import annotations

import torch
from torch import nn

from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.models.base import DecoderLayer, ForwardContext
from ktlite.runtime.models.layers import RMSNorm
from ktlite.runtime.models.rope import RotaryEmbedding


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class MTPLayer(DecoderLayer):
    plan_component = "mtp"  # all its weights (routed experts included) count as the MTP layer's, norms as norms
    fp8_linears: tuple[str, ...] = ()  # block-FP8 checkpoints keep eh_proj in bf16 (its attention and MLP in FP8)

    def __init__(self, layer_idx: int, hidden: int, eps: float, attention: nn.Module, mlp: nn.Module):
        super().__init__(layer_idx, hidden, eps, attention, mlp)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(hidden, eps)

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
        x = x + self.self_attn(self.input_layernorm(x), positions, None, self.layer_idx, False)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x)
