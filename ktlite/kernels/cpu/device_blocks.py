"""A CPU device's decode step runs whole blocks as one call each, so the parallel regions inside follow each other
with the worker threads still awake (one woken after Python code waits ~20 us on a 2-core VM): `mla_attention_rows`
(MLA attention from normalised input to o_proj, mla_block.py; its attention is latent_attention.mla_decode_latents),
`swiglu_rows` (a quantized SwiGLU MLP, dense_linear.py), `moe_block_rows` (a MoE layer's block from the residual
stream back to it: RMSNorm, router (`router_logits`, `route_rows`), routed experts (moe_kernels.moe_rows_routed)
and shared experts, moe_block.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ktlite.kernels.cpu.latent_attention import mla_decode_latents
from ktlite.kernels.cpu.linear_kernels import project_rows
from ktlite.kernels.cpu.moe_kernels import moe_rows_routed
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

ensure_threadsafe_layer()  # before the first parallel region of the process

# ---- a decode step's blocks in one call each (a CPU device: attention.py, moe.py, dense_linear.py) ----

MIN_SPLIT = 64  # positions per run below which splitting a request's attention costs more than it spreads


@njit(nogil=True, cache=True)
def decode_splits(batch, longest, threads):
    """Runs per request of mla_decode_latents: enough (batch x runs) work items for `threads` threads, none shorter
    than MIN_SPLIT. One rule for both callers: the split sets the summation order."""
    return max(1, min((threads + batch - 1) // batch, longest // MIN_SPLIT))


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def router_logits(h, w):  # pragma: no cover - compiled
    """h [T, H] @ w [E, H].T in fp32: a MoE router's logits."""
    out = np.empty((h.shape[0], w.shape[0]), np.float32)
    for e in prange(w.shape[0]):
        for t in range(h.shape[0]):
            acc = np.float32(0.0)
            for i in range(h.shape[1]):
                acc += h[t, i] * w[e, i]
            out[t, e] = acc
    return out


@njit(nogil=True, cache=True)
def _largest(values, out):
    """The indices of the out.size largest values into out, largest first (the first index among equal values)."""
    taken = np.zeros(values.shape[0], np.bool_)
    for j in range(out.shape[0]):
        best = -1
        for e in range(values.shape[0]):
            if not taken[e] and (best < 0 or values[e] > values[best]):
                best = e
        taken[best] = True
        out[j] = best


@njit(nogil=True, cache=True)
def route_rows(logits, bias, route):  # pragma: no cover - compiled
    """select_experts (runtime/models/router.py) of logits [T, E] in fp32 -> (ids int64 [T, k], weights fp32 [T, k]).
    route = (sigmoid, method, n_group, topk_group, top_k, normalize, scaling_factor), method 0 greedy, 1
    group_limited_greedy, 2 noaux_tc (router.route_args); bias: the correction bias, empty without one."""
    sigmoid, method, n_group, topk_group, top_k, normalize, scaling = route
    tokens, experts = logits.shape
    per_group = experts // n_group
    ids = np.empty((tokens, top_k), np.int64)
    weights = np.empty((tokens, top_k), np.float32)
    scores = np.empty(experts, np.float32)
    choice = np.empty(experts, np.float32)
    group_scores = np.empty(n_group, np.float32)
    kept = np.empty(topk_group, np.int64)
    for t in range(tokens):
        row = logits[t]
        if sigmoid:
            for e in range(experts):
                scores[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-row[e]))
        else:
            top = row.max()
            total = np.float32(0.0)
            for e in range(experts):
                scores[e] = np.exp(row[e] - top)
                total += scores[e]
            for e in range(experts):
                scores[e] /= total
        for e in range(experts):  # the bias steers the choice only
            choice[e] = scores[e] + bias[e] if bias.size else scores[e]
        if method > 0:  # the best topk_group groups only: noaux_tc scores a group by its top-2, else by its best
            for g in range(n_group):
                group = choice[g * per_group:(g + 1) * per_group]
                first = np.argmax(group)
                second = -np.inf
                for i in range(per_group):
                    if i != first and group[i] > second:
                        second = group[i]
                group_scores[g] = group[first] + second if method == 2 else group[first]
            _largest(group_scores, kept)
            for g in range(n_group):
                if not (kept == g).any():
                    choice[g * per_group:(g + 1) * per_group] = -np.inf if method == 2 else np.float32(0.0)
        _largest(choice, ids[t])
        for j in range(top_k):
            weights[t, j] = scores[ids[t, j]]
        if normalize:
            weights[t] /= weights[t].sum() + np.float32(1e-20)
        if scaling != 1.0:
            weights[t] *= scaling
    return ids, weights


@njit(nogil=True, cache=True)
def rms_scaled(x, weight, eps, out):  # pragma: no cover - compiled
    """out = weight * x / rms(x), in fp32 (RMSNorm without unit offset)."""
    total = 0.0  # float64: a sum closer to torch's pairwise fp32 one than a running fp32 sum
    for i in range(x.shape[0]):
        total += np.float64(x[i]) * x[i]
    inv = np.float32(1.0 / np.sqrt(np.float32(total / x.shape[0]) + eps))
    for i in range(x.shape[0]):
        out[i] = weight[i] * (x[i] * inv)


def store_row(src, dst):  # pragma: no cover - replaced by the overload in jit code
    """dst <- src (fp32): as fp32, or as bf16 bits (uint16) rounded to nearest even, as the pool's torch write."""


@overload(store_row, inline="always")
def _store_row(src, dst):
    if dst.dtype == types.uint16:
        def bf16(src, dst):
            bits = src.view(np.uint32)
            for d in range(src.shape[0]):
                b = bits[d]
                dst[d] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return bf16

    def fp32(src, dst):
        for d in range(src.shape[0]):
            dst[d] = src[d]
    return fp32


@njit(nogil=True, cache=True)
def rope_rotated(x, cos, sin, interleave, out):  # pragma: no cover - compiled
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
def mla_attention_rows(h, block, kv, cos, sin, slots, req_to_token, rows, prefix_lens):  # pragma: no cover - compiled
    """A decode batch's absorbed-MLA attention from normalised input to output projection (mla_block.py: the
    arguments, and when this runs); block = (q_kv_a, q_a_norm, q_b, uk, uv, o_proj, kv_norm, eps, interleave, dims,
    sm_scale, threads), dims = (heads, nope, rope, kv_lora)."""
    q_kv_a, q_a_norm, q_b, uk, uv, o_proj, kv_norm, eps, interleave, dims, sm_scale, threads = block
    tokens = h.shape[0]
    heads, nope, rope, kv_lora = dims
    qk = nope + rope
    both = project_rows(h.reshape(tokens, 1, h.shape[1]), q_kv_a, threads)[:, 0]  # [T, q width + kv_lora + rope]
    q_width = both.shape[1] - kv_lora - rope
    latent = np.empty(kv_lora + rope, np.float32)
    for t in range(tokens):  # the new latents into the pool
        rms_scaled(both[t, q_width:q_width + kv_lora], kv_norm, eps, latent[:kv_lora])
        rope_rotated(both[t, q_width + kv_lora:], cos[t], sin[t], interleave, latent[kv_lora:])
        store_row(latent, kv[slots[t]])
    if q_a_norm.shape[0]:  # a query LoRA: q = q_b_proj(q_a_layernorm(q_a))
        q_a = np.empty((tokens, 1, q_width), np.float32)
        for t in range(tokens):
            rms_scaled(both[t, :q_width], q_a_norm, eps, q_a[t, 0])
        q = project_rows(q_a, q_b, threads)[:, 0]
    else:
        q = both[:, :q_width]
    q_nope = np.empty((tokens, heads, nope), np.float32)
    q_abs = np.empty((tokens, heads, kv_lora + rope), np.float32)
    for t in range(tokens):
        for g in range(heads):
            q_nope[t, g] = q[t, g * qk:g * qk + nope]
            rope_rotated(q[t, g * qk + nope:(g + 1) * qk], cos[t], sin[t], interleave, q_abs[t, g, kv_lora:])
    q_abs[:, :, :kv_lora] = project_rows(q_nope, uk, threads)
    lens = prefix_lens + 1
    runs = decode_splits(tokens, lens.max(), threads)
    attn = np.empty((tokens, heads, kv_lora), np.float32)
    mla_decode_latents(q_abs, kv, req_to_token, rows, lens, sm_scale, kv_lora, runs, attn)
    v = project_rows(attn, uv, threads)  # [T, heads, v_head]
    return project_rows(v.reshape(tokens, 1, heads * v.shape[2]), o_proj, threads)[:, 0]


@njit(nogil=True, cache=True)
def mla_attention_residual(x, norm, norm_eps, block, kv, inv_freq, rope_scale, positions, slots, req_to_token, rows,
                           prefix_lens):  # pragma: no cover - compiled
    """x + mla_attention_rows(RMSNorm(x)) for the residual stream x [T, hidden] (norm: the layer's input norm), with
    cos / sin of the tokens' positions from the rotary frequencies (RotaryEmbedding.cos_sin)."""
    angles = positions.astype(np.float32).reshape(-1, 1) * inv_freq.reshape(1, -1)
    cos, sin = np.cos(angles) * rope_scale, np.sin(angles) * rope_scale
    return x + mla_attention_rows(_rms_rows(x, norm, norm_eps), block, kv, cos, sin, slots, req_to_token, rows,
                                  prefix_lens)


@njit(nogil=True, cache=True)
def _rms_rows(x, norm, eps):  # pragma: no cover - compiled
    """RMSNorm (rms_scaled) of each row of x [T, K] into a new array."""
    h = np.empty_like(x)
    for t in range(x.shape[0]):
        rms_scaled(x[t], norm, eps, h[t])
    return h


@njit(nogil=True, cache=True)
def swiglu_rows(x, gate_up, down, threads):  # pragma: no cover - compiled
    """down(SiLU(gate) * up) for x [T, K] through stored matrices (project_rows' w): gate_up stacks gate's rows over
    up's (dense_linear.swiglu_rows decides when this runs)."""
    tokens = x.shape[0]
    both = project_rows(x.reshape(tokens, 1, x.shape[1]), gate_up, threads)
    inter = both.shape[2] // 2
    act = np.empty((tokens, 1, inter), np.float32)
    for t in range(tokens):
        for i in range(inter):
            gate = both[t, 0, i]
            act[t, 0, i] = gate / (np.float32(1.0) + np.exp(-gate)) * both[t, 0, inter + i]
    return project_rows(act, down, threads)[:, 0]


@njit(nogil=True, cache=True)
def moe_block_rows(x, norm, eps, router, bias, route, skip, experts, shared_gate_up, shared_down,
                   threads):  # pragma: no cover - compiled
    """A decode batch's MoE block from the residual stream back to it (moe_block.py: the arguments, and when this
    runs): h = RMSNorm(x), the router on h (router_logits, route_rows), the routed experts (moe_rows_routed) and the
    shared experts (swiglu_rows; none where shared_gate_up has no rows) -> (x + their sum, the chosen ids [T, k],
    missing as moe_rows_routed's: x unchanged where an expert is missing)."""
    h = _rms_rows(x, norm, eps)
    ids, weights = route_rows(router_logits(h, router), bias, route)
    out, missing = moe_rows_routed(h, ids, weights, skip, experts)
    if missing >= 0:
        return x, ids, missing
    if shared_gate_up[0].shape[1]:
        out += swiglu_rows(h, shared_gate_up, shared_down, threads)
    return x + out, ids, missing


@njit(nogil=True, cache=True)
def swiglu_residual(x, norm, eps, gate_up, down, threads):  # pragma: no cover - compiled
    """x + swiglu_rows(RMSNorm(x)) for the residual stream x [T, hidden] (a dense layer's MLP block)."""
    return x + swiglu_rows(_rms_rows(x, norm, eps), gate_up, down, threads)


@njit(nogil=True, cache=True)
def norm_project_rows(x, rows, norm, eps, w, threads):  # pragma: no cover - compiled
    """project_rows(RMSNorm(x[rows])) for x [T, K]: the final norm and a stored lm_head -> [len(rows), N] fp32."""
    picked = np.empty((rows.shape[0], x.shape[1]), np.float32)
    for i in range(rows.shape[0]):
        rms_scaled(x[rows[i]], norm, eps, picked[i])
    return project_rows(picked.reshape(rows.shape[0], 1, x.shape[1]), w, threads)[:, 0]
