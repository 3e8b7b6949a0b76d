"""One forward pass of a batch of requests over the KV pool, for any model family.

The family's `forward_batch` owns the layer loop and its attention over the pool; the runner is its
context: it runs MoE layers through `HybridMoE` (GPU experts + CPU experts, optionally deferring the
lowest-weighted CPU experts to join one layer later) and all-reduces partial sums under tensor
parallelism (`tp`, see ktlite/runtime/parallel.py): every rank runs this same forward on its shard;
the attention output and each MLP/MoE block's output are all-reduced once each (rank 0 adds
deferred CPU experts to its partial before the all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ktlite.kernels.cpu.dense_linear import swiglu_residual_block, swiglu_weights
from ktlite.runtime.compiled_decode import Block
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.hybrid_moe import HybridMoE
from ktlite.runtime.kv_cache import KVPool
from ktlite.runtime.models.base import CausalLM
from ktlite.runtime.models.layers import MLP, plain_norm
from ktlite.runtime.state_cache import StatePool

__all__ = ["ForwardBatch", "ModelRunner"]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_pool: KVPool, moe_layers: dict[int, HybridMoE],
                 deferred_experts: int = 0, tp=None, state_pool: StatePool | None = None):
        self.model, self.kv_pool, self.moe_layers = model, kv_pool, moe_layers
        self.state_pool = state_pool or StatePool([], kv_pool.max_requests, kv_pool.device)
        self.tp = tp  # a tp_layers.TPContext, or None for one process
        self.config = model.config
        self.deferred_experts = deferred_experts
        # a layer may defer CPU experts only if a later MoE layer can absorb their result
        # (of the decoder: an MTP layer runs in its own forward, after this one)
        self._last_moe = max((l for l in moe_layers if l < model.config.num_hidden_layers), default=-1)
        self._pending = None  # CPU experts deferred by the previous MoE layer of this forward
        self._cpu = next((moe.cpu for moe in moe_layers.values() if moe.cpu is not None), None)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> float32 logits [R, vocab] for the tokens in batch.logit_rows."""
        self._pending = None
        return self.model.forward_batch(batch, self)

    @torch.inference_mode()
    def rewind_states(self, row: int, keep: int) -> None:
        """After a speculative verify that rejected drafts: request row `row`'s recurrent states (Gated DeltaNet)
        as if only the first `keep` tokens of the verify had run (StatePool's verify rows)."""
        for layer in self.model.model.layers:
            if hasattr(layer.self_attn, "rewind"):
                layer.self_attn.rewind(self.state_pool, layer.layer_idx, row, keep)

    def feed_forward(self, layer_idx: int, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The MLP/MoE block's contribution to the residual stream (summed over ranks)."""
        moe = self.moe_layers.get(layer_idx)
        if moe is None:
            return self.reduce(mlp(h))
        out, deferred = moe(h, self.deferred_experts if layer_idx < self._last_moe else 0)
        pending, self._pending = self._pending, deferred
        if pending is None:
            return self.reduce(out)
        if self.tp is not None:  # joins this rank's partial sum
            return self.reduce(out + pending.wait().to(out.device, out.dtype))
        return self.reduce(out) + pending.wait().to(out.device, out.dtype)

    def compiled_feed_forward(self, layer_idx: int, mlp: nn.Module, norm: nn.Module, tokens: int) -> Block | None:
        """The layer's norm + MLP/MoE block + residual add as one compiled call (HybridMoE.compiled_residual, a dense
        MLP's swiglu_residual_block), or None: under tensor parallelism or with CPU experts deferred (their partial
        sums join elsewhere), and where the block's modules have no compiled form."""
        if self.tp is not None or self.deferred_experts:
            return None
        moe = self.moe_layers.get(layer_idx)
        if moe is not None:
            return moe.compiled_residual(norm, tokens)
        if isinstance(mlp, MLP) and mlp.gate_up_proj is not None and mlp.activation.plain and plain_norm(norm):
            weights = swiglu_weights(mlp.gate_up_proj, mlp.down_proj, tokens)
            return None if weights is None else swiglu_residual_block(norm.weight.detach().numpy(), norm.eps, *weights)
        return None

    def run_compiled(self, fn: Callable, *args):
        return fn(*args) if self._cpu is None else self._cpu.run_here(fn, *args)  # the CPU experts' thread count

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel partial over the ranks (the identity in one process)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)
