"""A decode step's absorbed-MLA attention on a CPU device in one compiled call, from the layer's normalised input
to its output projection.

Through the torch modules the block is ~40 Python-side operations per layer and decode step (projections, splits,
RMSNorm, RoPE, the pool write, the per-head W_UK / W_UV, the attention) and five kernel calls, each a parallel
region whose worker thread has gone to sleep in the Python between two and must be woken first (~20 us on a
2-core VM, longer than a small projection's work): at tiny widths ~0.55 ms of a layer's ~1 ms. Here the same steps
run back to back inside one call, so the worker wakes once and the Python is one call.

It computes what MLAttention.forward_batch does for a decode batch (the torch path is the spec, and the tests'
reference) from the same stored weights, through the same kernels (linear_kernels.linear_rows,
latent_attention.mla_decode_latents): every projection a QuantizedLinear / QuantizedHeads on its row path, fp32
activations and a plain fp32 latent pool.
Where nothing sits between the attention and the residual stream (no tensor parallelism) the call also takes the
layer's input RMSNorm and the residual add (residual_block, MLAttention.compiled_residual).
The compiled code is device_blocks.mla_attention_rows; this module decides when it runs and hands it the arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import torch

from ktlite.kernels.cpu import device_blocks
from ktlite.kernels.cpu.dense_linear import RowWeights
from ktlite.kernels.triton import forced_torch, use_triton


def runs(h: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the compiled block takes a decode batch with normalised input h and latent pool kv: fp32 input and an
    fp32 or bf16 pool (read and written as attention.pool_arrays gives it) on a CPU device, where neither Triton's
    interpreter nor KTLITE_FORCE_TORCH_KERNELS claims the attention (use_triton)."""
    return (h.device.type == "cpu" and h.dtype == torch.float32 and kv.dtype in (torch.float32, torch.bfloat16)
            and not use_triton(h) and not forced_torch())


def block_weights(q_kv_a: RowWeights, q_a_norm: np.ndarray, q_b: RowWeights, uk: RowWeights, uv: RowWeights,
                  o_proj: RowWeights, kv_norm: np.ndarray, eps: float, interleave: bool, heads: int, nope: int,
                  rope: int, kv_lora: int, sm_scale: float) -> tuple:
    """A layer's fixed arguments of the block, built once (MLAttention.compiled_decode_block). q_kv_a: the query's
    first projection's rows stacked over kv_a_proj_with_mqa's; q_a_norm: q_a_layernorm's weight, empty without a
    query LoRA (q_b is then not read); uk / uv: W_UK [heads, kv_lora, nope] and W_UV [heads, v_head, kv_lora];
    kv_norm, eps: kv_a_layernorm's."""
    return (q_kv_a, q_a_norm, q_b, uk, uv, o_proj, kv_norm, np.float32(eps), interleave, (heads, nope, rope, kv_lora),
            np.float32(sm_scale), numba.config.NUMBA_NUM_THREADS)


def mla_decode_block(h: np.ndarray, block: tuple, kv: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                     slots: np.ndarray, req_to_token: np.ndarray, rows: np.ndarray,
                     prefix_lens: np.ndarray) -> np.ndarray:
    """h [B, hidden] fp32 (one new token per request, normalised) -> the attention output [B, hidden] before
    any tensor-parallel reduction; writes the new tokens' latents into kv [slots, kv_lora + rope] (fp32, or bf16 as
    uint16 bits: attention.pool_arrays) at `slots`. block: block_weights; cos / sin [B, rope // 2]; slots, rows,
    prefix_lens int64 [B]."""
    return device_blocks.mla_attention_rows(h, block, kv, cos, sin, slots, req_to_token, rows, prefix_lens)


def residual_block(norm: np.ndarray, eps: float, block: tuple, kv: np.ndarray, inv_freq: np.ndarray,
                   rope_scale: float) -> Callable:
    """The attention with the layer's input RMSNorm (weight norm, eps) and the residual add as a compiled decode
    step's block (runtime/compiled_decode.py): x -> x + the attention output of RMSNorm(x)
    (device_blocks.mla_attention_residual); inv_freq, rope_scale: RotaryEmbedding's; step = (positions, slots,
    req_to_token, rows, prefix_lens), int64."""
    eps, rope_scale = np.float32(eps), np.float32(rope_scale)

    def run(x: np.ndarray, step: tuple) -> np.ndarray:
        return device_blocks.mla_attention_residual(x, norm, eps, block, kv, inv_freq, rope_scale, *step)
    return run


__all__ = ["RowWeights", "block_weights", "mla_decode_block", "residual_block", "runs"]
