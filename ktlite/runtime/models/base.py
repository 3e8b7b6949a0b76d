"""The decoder every family shares: embeddings, N x (norm, attention, norm, MLP/MoE), norm, lm_head.

A family supplies its attention module (anything with `forward_batch(h, cos, sin, batch, ctx,
layer_idx)` that reads and writes its caches in `ctx.kv_pool`) and its MLP/MoE per layer; the batched
forward over a `ForwardBatch` is this one loop. The runtime's `ModelRunner` is the `ctx` in serving
(it runs MoE layers through `HybridMoE` and all-reduces under tensor parallelism); `LocalContext`
is the ctx of the plain reference call `model(input_ids)`, which runs the same forward over a
temporary KV pool, so every family gets `model(ids [B, T]) -> logits [B, T, vocab]` and
`generate_greedy` for free. A CPU device's decode step runs the same loop as compiled calls where every block
has one (an attention's `compiled_residual`, the context's `compiled_feed_forward`: runtime/compiled_decode.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from ktlite.kernels.cpu.dense_linear import linear_row_weights, norm_linear_block
from ktlite.runtime import compiled_decode
from ktlite.runtime.compiled_decode import Block, DecodePlan
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.kv_cache import KVPool
from ktlite.runtime.models.layers import RMSNorm, plain_norm
from ktlite.runtime.models.rope import RotaryEmbedding
from ktlite.runtime.state_cache import StatePool


MTP_PREFIX = "mtp."  # our name of the MTP layer's tensors (`CausalLM.mtp`)


class ForwardContext(Protocol):
    kv_pool: KVPool
    state_pool: StatePool  # per-request state of recurrent layers (empty for attention-only families)
    tp: object | None  # a tp_layers.TPContext under tensor parallelism

    def reduce(self, partial: torch.Tensor) -> torch.Tensor: ...

    def feed_forward(self, layer_idx: int, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor: ...

    def compiled_feed_forward(self, layer_idx: int, mlp: nn.Module, norm: nn.Module, tokens: int) -> Block | None:
        """The layer's norm + MLP/MoE block + residual add as one compiled call on `tokens` decode tokens
        (compiled_decode.Block), or None where it has none."""

    def run_compiled(self, fn: Callable, *args):
        """fn(*args) on the calling thread with as many kernel threads as the compiled blocks expect."""


class LocalContext:
    """One process, every expert in the model itself: the reference call's context."""

    tp = None

    def __init__(self, kv_pool: KVPool, state_pool: StatePool):
        self.kv_pool, self.state_pool = kv_pool, state_pool

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def feed_forward(self, layer_idx: int, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return mlp(h)

    def compiled_feed_forward(self, layer_idx: int, mlp: nn.Module, norm: nn.Module, tokens: int) -> None:
        return None  # the reference call: the modules run

    def run_compiled(self, fn: Callable, *args):
        return fn(*args)


class PoolCache:
    """B equal-length sequences in a private KV pool: the reference call's cache."""

    def __init__(self, model: "CausalLM", batch: int, max_len: int):
        self.pool = KVPool(model.config.token_cache_specs(1, model.dtype), batch * max_len, batch, max_len,
                           model.dtype, model.device)
        self.states = StatePool(model.config.request_state_specs(), batch, model.device)
        self.rows = [self.pool.alloc_request() for _ in range(batch)]
        self.length = 0

    def batch(self, input_ids: torch.Tensor) -> ForwardBatch:
        b, t = input_ids.shape
        device = input_ids.device
        slots = torch.cat([self.pool.alloc_tokens(row, t) for row in self.rows])
        positions = torch.arange(self.length, self.length + t, device=device).repeat(b)
        return ForwardBatch(
            input_ids=input_ids.reshape(-1), positions=positions, out_cache_loc=slots.to(device),
            req_pool_indices=torch.tensor(self.rows, device=device),
            prefix_lens=torch.full((b,), self.length, device=device), extend_lens=torch.full((b,), t, device=device),
            logit_rows=torch.arange(b * t, device=device),
        )


class DecoderLayer(nn.Module):
    def __init__(self, layer_idx: int, hidden: int, eps: float, attention: nn.Module, mlp: nn.Module,
                 unit_offset_norms: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset_norms)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset_norms)
        self.mlp = mlp

    def forward_batch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                      ctx: "ForwardContext") -> torch.Tensor:
        """The residual stream x [N, hidden] through this layer's attention (over the pool) and MLP/MoE block."""
        h = self.input_layernorm(x)
        x = x + ctx.reduce(self.self_attn.forward_batch(h, cos, sin, batch, ctx, self.layer_idx))
        return x + ctx.feed_forward(self.layer_idx, self.mlp, self.post_attention_layernorm(x))


class Embedding(nn.Embedding):
    plan_component = "embeddings"


class LMHead(nn.Linear):
    plan_component = "lm_head"


class Backbone(nn.Module):
    def __init__(self, vocab: int, hidden: int, eps: float, rotary: RotaryEmbedding, layers: list[DecoderLayer],
                 unit_offset_norms: bool = False):
        super().__init__()
        self.embed_tokens = Embedding(vocab, hidden)
        self.rotary = rotary
        self.rotary.plan_component = "norms_router"  # its float32 frequency table
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps, unit_offset_norms)


class CausalLM(nn.Module):
    """`model(input_ids [B, T]) -> logits [B, T, vocab]` (float32); `forward_batch` for the runtime."""

    def __init__(self, config, backbone: Backbone):
        super().__init__()
        self.config = config
        self.model = backbone
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        # the multi-token-prediction layer (models/mtp.py) where the family builds one and the config serves it
        self.mtp: nn.Module | None = None
        self._decode_plans: dict[int, DecodePlan] = {}  # decode batch size -> its plan (_decode_plan)

    # from the embedding rows, which stay torch tensors when a CPU-only run quantizes the linear layers
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    supports_prefix_cache = True  # False for families with per-request recurrent state

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of one of this model's tensors (families with other names override)."""
        return name

    def mtp_as_last_layer(self, name: str) -> str:
        """checkpoint_name of families whose checkpoints store the MTP layer as layer num_hidden_layers (the
        DeepSeek-V3 convention: DeepSeek-V3/V3.2, GLM-4.5, GLM-5), its parts under our names."""
        if name.startswith(MTP_PREFIX):
            return f"model.layers.{self.config.num_hidden_layers}.{name.removeprefix(MTP_PREFIX)}"
        return name

    def layer(self, layer_idx: int) -> DecoderLayer:
        """Decoder layer layer_idx, or the MTP layer at index num_hidden_layers."""
        if self.mtp is not None and layer_idx == len(self.model.layers):
            return self.mtp
        return self.model.layers[layer_idx]

    def forward_batch(self, batch: ForwardBatch, ctx: ForwardContext) -> torch.Tensor:
        """-> float32 logits [R, vocab] for the tokens in batch.logit_rows."""
        backbone = self.model
        x = backbone.embed_tokens(batch.input_ids)  # [N, hidden]
        plan = self._decode_plan(x, batch, ctx)
        if plan is not None:
            x, logits = plan.run(x, batch)
        else:
            logits = None
            cos, sin = backbone.rotary.cos_sin(batch.positions)  # [N, rope/2]
            for layer in backbone.layers:
                x = layer.forward_batch(x, cos, sin, batch, ctx)
        if batch.capture_hidden:
            batch.hidden_states = x
        if logits is not None:
            return logits
        return self.lm_head(backbone.norm(x[batch.logit_rows])).float()

    def draft_forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                      ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over batch (its input_ids are the tokens after the positions of `hidden` [N, hidden], the
        target's final-normed hidden states or the layer's own previous output) -> (its normed output [N, hidden],
        float32 logits [R, vocab] of batch.logit_rows: the token after batch.input_ids). Embeddings and the head
        are the target's (the copies DeepSeek-V3-layout checkpoints keep beside the layer equal them; Qwen3-Next's
        have none, as SGLang shares the target's)."""
        out = self.mtp.forward_batch(self.model.embed_tokens(batch.input_ids), hidden, batch, ctx, self.model.rotary)
        return out, self.lm_head(out[batch.logit_rows]).float()

    def _decode_plan(self, x: torch.Tensor, batch: ForwardBatch, ctx: ForwardContext) -> DecodePlan | None:
        """This decode step as compiled calls (compiled_decode.py) where every layer's attention offers
        `compiled_residual` and the context a compiled feed-forward block; None: the modules run."""
        if ctx.tp is not None or not compiled_decode.takes(x, batch):
            return None
        tokens = x.shape[0]
        plan = self._decode_plans.get(tokens)
        if plan is not None and plan.current(ctx.kv_pool):
            return plan
        blocks = []
        for layer in self.model.layers:
            compiled_residual = getattr(layer.self_attn, "compiled_residual", None)
            attention = None if compiled_residual is None else compiled_residual(
                layer.input_layernorm, ctx.kv_pool, layer.layer_idx, tokens)
            if attention is None:
                return None
            feed_forward = ctx.compiled_feed_forward(layer.layer_idx, layer.mlp, layer.post_attention_layernorm, tokens)
            if feed_forward is None:
                return None
            blocks += [attention, feed_forward]
        head = None
        lm_head = linear_row_weights(self.lm_head, tokens)
        if lm_head is not None and plain_norm(self.model.norm):
            head = norm_linear_block(self.model.norm.weight.detach().numpy(), self.model.norm.eps, lm_head)
        plan = self._decode_plans[tokens] = DecodePlan(blocks, head, ctx.kv_pool, ctx.run_compiled)
        return plan

    def new_cache(self, batch: int, max_len: int):
        return PoolCache(self, batch, max_len)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: PoolCache | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        cache = cache or self.new_cache(b, t)
        logits = self.forward_batch(cache.batch(input_ids), LocalContext(cache.pool, cache.states))
        cache.length += t
        return logits.view(b, t, -1)

    @torch.inference_mode()
    def generate_greedy(self, input_ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...] = (),
                        **forward_kwargs) -> torch.Tensor:
        """Prefill then token-by-token decode with the cache; returns new ids [B, <= max_new_tokens].

        Stops early only when every sequence has produced a stop id (like HF generate's EOS handling
        for a batch, later tokens of finished rows are still computed but are not meaningful).
        """
        b, t = input_ids.shape
        cache = self.new_cache(b, t + max_new_tokens)
        logits = self(input_ids, cache, **forward_kwargs)
        out: list[torch.Tensor] = []
        done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        stops = torch.tensor(stop_ids, dtype=torch.long, device=input_ids.device)
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1)
            out.append(nxt)
            done |= torch.isin(nxt, stops)
            if bool(done.all()) or len(out) == max_new_tokens:
                break
            logits = self(nxt[:, None], cache, **forward_kwargs)
        return torch.stack(out, dim=1)
