"""Absorbed-MLA attention compiled for a CPU device: decode, extend and sparse (DSA), with the twins'
signatures (reference.mla_decode_torch / mla_extend_torch / sparse_mla_torch are the spec).

On a CPU-only run the twins spend their time in fp32 sgemms over the whole [tokens x context] score matrix, a
mask multiply and a softmax per request (78 % of a 512-token prefill), or, at decode's few tokens, in ~10 small
torch ops per layer. Here each is one compiled call (latent_attention.py: flash-style, parallel over work items,
the pool read in place). Inputs: q in any float dtype (computed in fp32, returned in q's dtype) and a latent pool
of fp32, bf16 or packed FP8 rows (kv_fp8.latent_rows) on the CPU; `accepts` says which calls these take. Registered
as the "cpu" mla_decode, mla_extend and sparse_mla in ktlite/kernels/attention.py.

Decode splits each request's positions into runs so that batch-1 decode still uses every thread
(device_blocks.decode_splits, the rule the compiled MLA block uses too).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from ktlite.kernels.cpu import device_blocks, latent_attention
from ktlite.kernels.triton.kv_fp8 import is_packed, latent_rows

_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)


def accepts(q: torch.Tensor, kv_buffer: torch.Tensor, *_: object) -> bool:
    """Whether these kernels take a call with query q over pool kv_buffer (else the torch twin does); the attention
    registry calls it with the kind's arguments."""
    return q.device.type == "cpu" and q.is_floating_point() and kv_buffer.dtype in _POOL_DTYPES


def pool_arrays(kv_buffer: torch.Tensor, kv_lora_rank: int, width: int) -> np.ndarray | tuple:
    """The pool as the kernels read it in place (latent_attention.latent_row): fp32 rows, bf16 rows as their
    uint16 bits, or packed FP8 rows as (e4m3 bytes, fp32 scales, bf16 bits of the rope part, values per scale)."""
    if is_packed(kv_buffer):
        layout = latent_rows(kv_lora_rank, width - kv_lora_rank)
        values, scales, tail = layout.views(kv_buffer)
        return (values.view(torch.uint8).numpy(), scales.numpy(), tail.view(torch.int16).numpy().view(np.uint16),
                layout.group)
    if kv_buffer.dtype == torch.bfloat16:
        return kv_buffer.view(torch.int16).numpy().view(np.uint16)
    return kv_buffer.numpy()


def _queries(q: torch.Tensor) -> np.ndarray:
    return q.float().contiguous().numpy()


def default_splits(batch: int, longest: int) -> int:
    """Runs per request, from the process's thread count, not the calling thread's (which callers change): the
    split sets the summation order, so the same inputs give the same bits whichever thread decodes."""
    return device_blocks.decode_splits(batch, longest, numba.config.NUMBA_NUM_THREADS)


def mla_decode(q: torch.Tensor, kv_buffer: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, sm_scale: float, kv_lora_rank: int, splits: int | None = None) -> torch.Tensor:
    """reference.mla_decode_torch's signature and result ([B, H, kv_lora_rank]); `splits` overrides
    default_splits (tests)."""
    lens = seq_lens.to(torch.int64).numpy()
    runs = splits or default_splits(q.shape[0], int(lens.max()) if lens.size else 1)
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank)
    latent_attention.mla_decode_latents(
        _queries(q), pool_arrays(kv_buffer, kv_lora_rank, q.shape[-1]), req_to_token.numpy(),
        req_pool_indices.to(torch.int64).numpy(), lens, np.float32(sm_scale), kv_lora_rank, runs, out.numpy())
    return out.to(q.dtype)


def mla_extend(q: torch.Tensor, kv_buffer: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               prefix_lens: torch.Tensor, extend_lens: torch.Tensor, sm_scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """reference.mla_extend_torch's signature and result ([N, H, kv_lora_rank])."""
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank)
    latent_attention.mla_extend_latents(
        _queries(q), pool_arrays(kv_buffer, kv_lora_rank, q.shape[-1]), req_to_token.numpy(),
        req_pool_indices.to(torch.int64).numpy(), prefix_lens.to(torch.int64).numpy(),
        extend_lens.to(torch.int64).numpy(), np.float32(sm_scale), kv_lora_rank, numba.get_num_threads(), out.numpy())
    return out.to(q.dtype)


def sparse_mla(q: torch.Tensor, kv_buffer: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """reference.sparse_mla_torch's signature and result ([N, H, kv_lora_rank])."""
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank)
    latent_attention.sparse_mla_latents(
        _queries(q), pool_arrays(kv_buffer, kv_lora_rank, q.shape[-1]), topk_slots.to(torch.int64).numpy(),
        np.float32(sm_scale), kv_lora_rank, out.numpy())
    return out.to(q.dtype)
