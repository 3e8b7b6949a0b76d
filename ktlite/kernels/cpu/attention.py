"""Absorbed-MLA decode attention compiled for a CPU device (the twin reference.mla_decode_torch is the spec).

On a CPU-only run the torch twin spends ~10 small torch ops per layer and decode step (gather, two
matmuls, mask, softmax, copies): per-op dispatch, not arithmetic, at decode's few tokens. This is one
compiled call. Each request's positions are split into `splits` runs so that batch-1 decode still
uses every thread (flash-decoding: each run keeps its max, exp-sum and weighted sum per head, and a
second pass merges the runs); a run reads each cached latent once for all heads.

Takes fp32 q and a plain fp32 latent cache (what a CPU device holds with the default fp32 dtype);
anything else (bf16, packed FP8 rows) stays with the twin.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange

MIN_SPLIT = 64  # positions per run below which splitting a request costs more than it spreads


def handles(q: torch.Tensor, kv_buffer: torch.Tensor) -> bool:
    """Whether mla_decode takes these inputs (else the torch twin does)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and kv_buffer.dtype == torch.float32


def default_splits(batch: int, longest: int) -> int:
    """Runs per request: enough (batch x runs) work items for every numba thread, none shorter than MIN_SPLIT.
    From the process's thread count, not the calling thread's (which callers change): the split sets the
    summation order, so the same inputs give the same bits whichever thread decodes."""
    threads = numba.config.NUMBA_NUM_THREADS
    return max(1, min(math.ceil(threads / batch), longest // MIN_SPLIT))


def mla_decode(q: torch.Tensor, kv_buffer: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, sm_scale: float, kv_lora_rank: int, splits: int | None = None) -> torch.Tensor:
    """reference.mla_decode_torch's signature and result ([B, H, kv_lora_rank]); `splits` overrides
    default_splits (tests)."""
    lens = seq_lens.to(torch.int64).numpy()
    runs = splits or default_splits(q.shape[0], int(lens.max()) if lens.size else 1)
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank)
    _decode(q.contiguous().numpy(), kv_buffer.numpy(), req_to_token.numpy(), req_pool_indices.to(torch.int64).numpy(),
            lens, np.float32(sm_scale), kv_lora_rank, runs, out.numpy())
    return out


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _decode(q, kv, req_to_token, rows, lens, sm_scale, kv_lora, runs, out):  # pragma: no cover - compiled
    batch, heads, width = q.shape
    run_max = np.full((batch, runs, heads), -np.inf, np.float32)
    run_sum = np.zeros((batch, runs, heads), np.float32)
    run_out = np.zeros((batch, runs, heads, kv_lora), np.float32)
    for item in prange(batch * runs):
        b, r = item // runs, item % runs
        length = (lens[b] + runs - 1) // runs
        lo, hi = r * length, min(lens[b], (r + 1) * length)
        if lo >= hi:
            continue
        scores = np.empty((heads, hi - lo), np.float32)
        for i in range(lo, hi):
            slot = req_to_token[rows[b], i]
            for h in range(heads):
                acc = np.float32(0.0)
                for d in range(width):
                    acc += q[b, h, d] * kv[slot, d]
                scores[h, i - lo] = acc * sm_scale
        for h in range(heads):
            top = scores[h].max()
            total = np.float32(0.0)
            for i in range(hi - lo):
                scores[h, i] = np.exp(scores[h, i] - top)
                total += scores[h, i]
            run_max[b, r, h], run_sum[b, r, h] = top, total
        for i in range(lo, hi):
            slot = req_to_token[rows[b], i]
            for h in range(heads):
                p = scores[h, i - lo]
                for d in range(kv_lora):
                    run_out[b, r, h, d] += p * kv[slot, d]
    for item in prange(batch * heads):  # merge the runs: rescale each to the overall max
        b, h = item // heads, item % heads
        top = run_max[b, :, h].max()
        total = np.float32(0.0)
        for d in range(kv_lora):
            out[b, h, d] = 0.0
        for r in range(runs):
            if run_sum[b, r, h] == 0.0:
                continue
            scale = np.exp(run_max[b, r, h] - top)
            total += scale * run_sum[b, r, h]
            for d in range(kv_lora):
                out[b, h, d] += scale * run_out[b, r, h, d]
        for d in range(kv_lora):
            out[b, h, d] /= total
