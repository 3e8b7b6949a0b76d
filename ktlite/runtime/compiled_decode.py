"""A CPU device's decode step as one list of compiled calls, built once and reused.

Python between a decode step's kernels runs with cold caches (the experts' weights have just streamed through
them): an RMSNorm that takes 9 us alone took 61 us there, and the modules' way through a layer (norms, the router,
the attention and MoE wrappers, residual adds) cost ~0.5 ms a layer at V2-Lite widths on a 2-core VM. Where every
block of every layer has a compiled form taking the residual stream and returning it (`Block`: MLA attention with
the layer's input norm, mla_block; a MoE layer's norm, router, routed and shared experts, moe_block; a dense SwiGLU
MLP with its norm, dense_linear), the step is those calls back to back on one numpy array (`DecodePlan`), and the
Python per layer is one call per block.

A plan is built per batch size (the modules decide per token count which path their weights take) and kept while
its KV pool and every module stay the same: torch's global registration hooks count each module, parameter or
buffer assigned anywhere (`module_generation`), so swapping a layer's modules after a step (as tests do) rebuilds
the plan. Weights changed in place need nothing: the plan holds views of them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.nn.modules import module as torch_module

from ktlite.kernels.triton import forced_torch
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.kv_cache import KVPool

# (positions, slots, req_to_token, rows, prefix_lens): what a step's blocks read besides the residual stream (MLA's
# attention blocks; the others ignore it)
StepArrays = tuple[np.ndarray, ...]
# the residual stream x [T, hidden] fp32 -> x plus the block's output (a new array)
Block = Callable[[np.ndarray, StepArrays], np.ndarray]

_generation = 0


def _registered(*_) -> None:
    global _generation
    _generation += 1


for _register in (torch_module.register_module_module_registration_hook,
                  torch_module.register_module_parameter_registration_hook,
                  torch_module.register_module_buffer_registration_hook):
    _register(_registered)


def module_generation() -> int:
    """How many modules, parameters and buffers have been assigned in this process so far."""
    return _generation


def takes(x: torch.Tensor, batch: ForwardBatch) -> bool:
    """Whether a plan may run this step: a decode batch of fp32 tokens on the CPU, KTLITE_FORCE_TORCH_KERNELS unset."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not forced_torch() and batch.is_decode


def step_arrays(batch: ForwardBatch, pool: KVPool) -> StepArrays:
    return (batch.positions.numpy(), batch.out_cache_loc.numpy(), pool.req_to_token.numpy(),
            batch.req_pool_indices.numpy(), batch.prefix_lens.numpy())


# (the residual stream after the last layer, the rows whose logits are wanted) -> logits [rows, vocab] fp32
Head = Callable[[np.ndarray, np.ndarray], np.ndarray]


class DecodePlan:
    """The compiled blocks of every layer, in order, for one batch size over one KV pool; with `head` (the final norm
    and the lm_head as one call) the step's logits, else the last layer's output."""

    def __init__(self, blocks: list[Block], head: Head | None, pool: KVPool, run_here: Callable):
        self.blocks, self.head, self.pool, self.run_here = blocks, head, pool, run_here
        self.generation = module_generation()

    def current(self, pool: KVPool) -> bool:
        """Whether the plan still describes the model and runs over `pool`."""
        return pool is self.pool and self.generation == module_generation()

    def run(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream x [T, hidden] (the embeddings) -> (the last layer's output [T, hidden], the logits of
        batch.logit_rows where the plan has a head, else None)."""
        step = step_arrays(batch, self.pool)
        hidden, logits = self.run_here(self._run, x.contiguous().numpy(), step, batch.logit_rows.numpy())
        return torch.from_numpy(hidden), None if logits is None else torch.from_numpy(logits)

    def _run(self, x: np.ndarray, step: StepArrays, logit_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        for block in self.blocks:
            x = block(x, step)
        return x, None if self.head is None else self.head(x, logit_rows)
