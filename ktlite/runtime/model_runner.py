"""One forward pass of a batch of requests over the token-level KV pool.

Every request in a batch contributes `extend_len` new tokens after `prefix_len` cached ones: a
decode step is the case extend_len == 1, a (chunked) prefill has more; a mixed batch holds both.
Attention reads the MLA latent pool through `req_to_token` (decode kernel when every request adds
one token, extend kernel otherwise); MoE layers run through `HybridMoE`.

Under tensor parallelism (`tp`, see ktlite/runtime/parallel.py) every rank runs this same forward
on its shard: the attention output and each MLP/MoE block's output are partial sums that are
all-reduced once each (rank 0 adds deferred CPU experts to its partial before the all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ktlite.kernels.triton import mla_decode, mla_extend
from ktlite.runtime.hybrid_moe import HybridMoE
from ktlite.runtime.kv_cache import KVPool
from ktlite.runtime.models.deepseek import DeepseekForCausalLM


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N] new tokens of all requests, concatenated in request order
    positions: torch.Tensor  # [N]
    out_cache_loc: torch.Tensor  # [N] pool slots of the new tokens
    req_pool_indices: torch.Tensor  # [B] rows of req_to_token
    prefix_lens: torch.Tensor  # [B] tokens already in the pool before this step
    extend_lens: torch.Tensor  # [B] new tokens per request
    logit_rows: torch.Tensor  # [R] indices into N whose next-token logits are wanted

    @property
    def is_decode(self) -> bool:
        return bool((self.extend_lens == 1).all())

    @classmethod
    def build(
        cls,
        token_chunks: list[list[int]],
        prefix_lens: list[int],
        rows: list[int],
        slots: list[torch.Tensor],
        want_logits: list[bool],
        device: torch.device,
    ) -> "ForwardBatch":
        """From per-request new tokens, prefix lengths, pool rows and freshly allocated slots."""
        extend = [len(c) for c in token_chunks]
        positions = [p + i for p, n in zip(prefix_lens, extend) for i in range(n)]
        ends = torch.tensor(extend).cumsum(0) - 1
        logit_rows = ends[torch.tensor(want_logits, dtype=torch.bool)] if any(want_logits) else ends[:0]

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            input_ids=tensor([t for c in token_chunks for t in c]),
            positions=tensor(positions),
            out_cache_loc=torch.cat(slots).to(device),
            req_pool_indices=tensor(rows),
            prefix_lens=tensor(prefix_lens),
            extend_lens=tensor(extend),
            logit_rows=logit_rows.to(device),
        )


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, kv_pool: KVPool, moe_layers: dict[int, HybridMoE],
                 deferred_experts: int = 0, tp=None):
        self.model, self.kv_pool, self.moe_layers = model, kv_pool, moe_layers
        self.tp = tp  # a tp_layers.TPContext, or None for one process
        self.config = model.config
        self.deferred_experts = deferred_experts
        # a layer may defer CPU experts only if a later MoE layer can absorb their result
        self._last_moe = max(moe_layers, default=-1)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> float32 logits [R, vocab] for the tokens in batch.logit_rows."""
        cfg, backbone, pool = self.config, self.model.model, self.kv_pool
        x = backbone.embed_tokens(batch.input_ids)  # [N, hidden]
        cos, sin = backbone.rotary.cos_sin(batch.positions)  # [N, rope/2]
        decode = batch.is_decode
        pending = None  # CPU experts deferred by the previous MoE layer
        for layer in backbone.layers:
            i = layer.layer_idx
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            pool.write(i, batch.out_cache_loc, attn.latent(h, cos, sin))
            q = attn.absorbed_query(attn.query(h), cos, sin)  # [N, heads, kv_lora_rank + rope]
            if decode:
                o = mla_decode(q, pool.layer(i), pool.req_to_token, batch.req_pool_indices,
                               batch.prefix_lens + 1, cfg.softmax_scale, cfg.kv_lora_rank)
            else:
                o = mla_extend(q, pool.layer(i), pool.req_to_token, batch.req_pool_indices,
                               batch.prefix_lens, batch.extend_lens, cfg.softmax_scale, cfg.kv_lora_rank)
            x = x + self._reduce(attn.output(o))
            h = layer.post_attention_layernorm(x)
            if i not in self.moe_layers:
                x = x + self._reduce(layer.mlp(h))
                continue
            out, deferred = self.moe_layers[i](h, self.deferred_experts if i < self._last_moe else 0)
            if self.tp is not None and pending is not None:  # joins this rank's partial sum
                out, pending = out + pending.wait().to(out.device, out.dtype), None
            x = x + self._reduce(out)
            if pending is not None:
                x = x + pending.wait().to(x.device, x.dtype)
            pending = deferred
        last = backbone.norm(x[batch.logit_rows])
        return self.model.lm_head(last).float()

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel partial over the ranks (the identity in one process)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)
