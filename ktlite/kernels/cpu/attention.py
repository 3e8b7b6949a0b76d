"""Absorbed-MLA decode attention compiled for a CPU device (the twin reference.mla_decode_torch is the spec).

On a CPU-only run the torch twin spends ~10 small torch ops per layer and decode step (gather, two
matmuls, mask, softmax, copies): per-op dispatch, not arithmetic, at decode's few tokens. This is one
compiled call (device_blocks.mla_decode_latents, which the compiled MLA block calls too). Each request's positions are split into `splits` runs so that batch-1 decode still
uses every thread (flash-decoding: each run keeps its max, exp-sum and weighted sum per head, and a
second pass merges the runs); a run reads each cached latent once for all heads.

Takes fp32 q and a plain fp32 latent cache (what a CPU device holds with the default fp32 dtype);
anything else (bf16, packed FP8 rows) stays with the twin. Registered as the "cpu" mla_decode in
ktlite/kernels/attention.py.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ktlite.kernels.cpu import device_blocks


def accepts(q: torch.Tensor, kv_buffer: torch.Tensor, *_: object) -> bool:
    """Whether mla_decode takes these inputs (else the torch twin does); the attention registry calls it with
    mla_decode's arguments."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and kv_buffer.dtype == torch.float32


def default_splits(batch: int, longest: int) -> int:
    """Runs per request (device_blocks.decode_splits, which the compiled MLA block uses too), from the process's thread
    count, not the calling thread's (which callers change): the split sets the summation order, so the same inputs
    give the same bits whichever thread decodes."""
    return device_blocks.decode_splits(batch, longest, numba.config.NUMBA_NUM_THREADS)


def mla_decode(q: torch.Tensor, kv_buffer: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, sm_scale: float, kv_lora_rank: int, splits: int | None = None) -> torch.Tensor:
    """reference.mla_decode_torch's signature and result ([B, H, kv_lora_rank]); `splits` overrides
    default_splits (tests)."""
    lens = seq_lens.to(torch.int64).numpy()
    runs = splits or default_splits(q.shape[0], int(lens.max()) if lens.size else 1)
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank)
    device_blocks.mla_decode_latents(q.contiguous().numpy(), kv_buffer.numpy(), req_to_token.numpy(),
                               req_pool_indices.to(torch.int64).numpy(), lens, np.float32(sm_scale), kv_lora_rank, runs,
                               out.numpy())
    return out
