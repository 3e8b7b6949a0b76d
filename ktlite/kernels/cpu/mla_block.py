"""A decode step's absorbed-MLA attention on a CPU device in one compiled call, from the layer's normalised input
to its output projection.

Through the torch modules the block is ~40 Python-side operations per layer and decode step (projections, splits,
RMSNorm, RoPE, the pool write, the per-head W_UK / W_UV, the attention) and five kernel calls, each a parallel
region whose worker thread has gone to sleep in the Python between two and must be woken first (~20 us on a
2-core VM, longer than a small projection's work): at tiny widths ~0.55 ms of a layer's ~1 ms. Here the same steps
run back to back inside one call, so the worker wakes once and the Python is one call.

It computes what MLAttention.forward_batch does for a decode batch (the torch path is the spec, and the tests'
reference) from the same stored weights, through the same kernels (kernels.linear_rows, attention._decode): every
projection a QuantizedLinear / QuantizedHeads on its row path, fp32 activations and a plain fp32 latent pool.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit

import torch

from ktlite.kernels.cpu.attention import MIN_SPLIT, _decode
from ktlite.kernels.cpu.dense_linear import RowWeights
from ktlite.kernels.cpu.kernels import project_rows
from ktlite.kernels.triton import forced_torch, use_triton

@njit(nogil=True, cache=True)
def _rms_scaled(x, weight, eps, out):  # pragma: no cover - compiled
    """out = weight * x / rms(x), in fp32 (RMSNorm without unit offset)."""
    total = 0.0  # float64: a sum closer to torch's pairwise fp32 one than a running fp32 sum
    for i in range(x.shape[0]):
        total += np.float64(x[i]) * x[i]
    inv = np.float32(1.0 / np.sqrt(np.float32(total / x.shape[0]) + eps))
    for i in range(x.shape[0]):
        out[i] = weight[i] * (x[i] * inv)


@njit(nogil=True, cache=True)
def _rotated(x, cos, sin, interleave, out):  # pragma: no cover - compiled
    """out = x rotated by cos/sin [rot // 2] (rope.apply_rope over all of x: pairs (2i, 2i+1) or halves)."""
    half = cos.shape[0]
    for i in range(half):
        a, b = (x[2 * i], x[2 * i + 1]) if interleave else (x[i], x[i + half])
        first, second = a * cos[i] - b * sin[i], b * cos[i] + a * sin[i]
        if interleave:
            out[2 * i], out[2 * i + 1] = first, second
        else:
            out[i], out[i + half] = first, second


@njit(nogil=True, cache=True)
def _block(h, q_kv_a, q_a_norm, q_b, uk, uv, o_proj, kv_norm, eps, cos, sin, interleave, dims, kv, slots,
           req_to_token, rows, prefix_lens, sm_scale, threads):  # pragma: no cover - compiled
    tokens = h.shape[0]
    heads, nope, rope, kv_lora = dims
    qk = nope + rope
    both = project_rows(h.reshape(tokens, 1, h.shape[1]), q_kv_a, threads)[:, 0]  # [T, q width + kv_lora + rope]
    q_width = both.shape[1] - kv_lora - rope
    for t in range(tokens):  # the new latents, straight into the pool
        entry = kv[slots[t]]
        _rms_scaled(both[t, q_width:q_width + kv_lora], kv_norm, eps, entry[:kv_lora])
        _rotated(both[t, q_width + kv_lora:], cos[t], sin[t], interleave, entry[kv_lora:])
    if q_a_norm.shape[0]:  # a query LoRA: q = q_b_proj(q_a_layernorm(q_a))
        q_a = np.empty((tokens, 1, q_width), np.float32)
        for t in range(tokens):
            _rms_scaled(both[t, :q_width], q_a_norm, eps, q_a[t, 0])
        q = project_rows(q_a, q_b, threads)[:, 0]
    else:
        q = both[:, :q_width]
    q_nope = np.empty((tokens, heads, nope), np.float32)
    q_abs = np.empty((tokens, heads, kv_lora + rope), np.float32)
    for t in range(tokens):
        for g in range(heads):
            q_nope[t, g] = q[t, g * qk:g * qk + nope]
            _rotated(q[t, g * qk + nope:(g + 1) * qk], cos[t], sin[t], interleave, q_abs[t, g, kv_lora:])
    q_abs[:, :, :kv_lora] = project_rows(q_nope, uk, threads)
    lens = prefix_lens + 1
    runs = max(1, min((threads + tokens - 1) // tokens, lens.max() // MIN_SPLIT))  # attention.default_splits
    attn = np.empty((tokens, heads, kv_lora), np.float32)
    _decode(q_abs, kv, req_to_token, rows, lens, sm_scale, kv_lora, runs, attn)
    v = project_rows(attn, uv, threads)  # [T, heads, v_head]
    return project_rows(v.reshape(tokens, 1, heads * v.shape[2]), o_proj, threads)[:, 0]


def runs(h: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the compiled block takes a decode batch with normalised input h and latent pool kv: fp32 on a CPU
    device, where neither Triton's interpreter nor KTLITE_FORCE_TORCH_KERNELS claims the attention (use_triton)."""
    return (h.device.type == "cpu" and h.dtype == torch.float32 and kv.dtype == torch.float32
            and not use_triton(h) and not forced_torch())


def mla_decode_block(h: np.ndarray, q_kv_a: RowWeights, q_a_norm: np.ndarray, q_b: RowWeights, uk: RowWeights,
                     uv: RowWeights, o_proj: RowWeights, kv_norm: np.ndarray, eps: float, cos: np.ndarray,
                     sin: np.ndarray, interleave: bool, heads: int, nope: int, rope: int, kv_lora: int,
                     kv: np.ndarray, slots: np.ndarray, req_to_token: np.ndarray, rows: np.ndarray,
                     prefix_lens: np.ndarray, sm_scale: float) -> np.ndarray:
    """h [B, hidden] fp32 (one new token per request, normalised) -> the attention output [B, hidden] before
    any tensor-parallel reduction; writes the new tokens' latents into kv [slots, kv_lora + rope] at `slots`.
    q_kv_a: the query's first projection's rows stacked over kv_a_proj_with_mqa's; q_a_norm: q_a_layernorm's
    weight, empty without a query LoRA (q_b is then not read); uk / uv: W_UK [heads, kv_lora, nope] and W_UV
    [heads, v_head, kv_lora]; cos / sin [B, rope // 2]; slots, rows, prefix_lens int64 [B]."""
    return _block(h, q_kv_a, q_a_norm, q_b, uk, uv, o_proj, kv_norm, np.float32(eps), cos, sin, interleave,
                  (heads, nope, rope, kv_lora), kv, slots, req_to_token, rows, prefix_lens, np.float32(sm_scale),
                  numba.config.NUMBA_NUM_THREADS)


__all__ = ["RowWeights", "mla_decode_block", "runs"]
