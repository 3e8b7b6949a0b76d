"""Gated DeltaNet's kernels compiled for a CPU device: the gated delta rule and the causal depthwise conv + SiLU
(the twins reference.gated_delta_rule_batch_torch / causal_conv1d_batch_torch are the spec).

On a CPU device the twins run a Python loop over requests and chunks of ~25 small torch ops each (and a decode step,
one token per request, pays all of them per layer for a few kFLOP). Here each is one parallel call over the packed
batch, updating the per-request states in place at their rows.

Gated delta rule, per (request, value head) work item (prange), in chunks of `chunk` tokens (the structure of fla's
chunked gated delta rule: the intra-chunk terms against one read of the state, then one state update per chunk).
With G_t the running sum of g inside the chunk and S the state before it:
    pass over S:  a_t = S^T k_t,  b_t = S^T q_t                    (both from one read of each row of S)
    u_t = beta_t (v_t - e^{G_t} a_t) - beta_t sum_{i<t} e^{G_t - G_i} (k_t . k_i) u_i     (forward substitution:
          the unit lower-triangular system of the twin, i.e. the WY/UT transform applied to the right-hand side)
    o_t = e^{G_t} b_t + sum_{i<=t} e^{G_t - G_i} (q_t . k_i) u_i
    S  <- e^{G_C} S + sum_i e^{G_C - G_i} k_i u_i^T                (in place)
One token (a decode step) is the recurrent step: S <- e^g S; u = beta (v - S^T k); S += k u^T; o = S^T q, with the
same two passes over S (one read, one read-modify-write). q and k are L2-normalised (q also scaled by dk^-0.5) as
they are loaded, as the twin does; all arithmetic is fp32. q and k may carry fewer (key) heads than v: value head h
reads key head h // (H / Hk), so a caller need not repeat them.

Causal conv: channels in blocks of CONV_BLOCK (prange); per token, each of the W taps adds its weights times the
input W-1-w tokens back (the sequence's own rows, or its conv state's for the first W-1 tokens) over the block's
channels, then SiLU (simd.silu_mul: numba's np.exp is a scalar libm call); the last W-1 inputs become the new state.

Inputs of any float dtype are converted to fp32 for the kernels (numba has no bf16) and the outputs back; the states
must be fp32 (as the state pool keeps them). Every argument reaches the kernels with one fixed type, so each kernel
has exactly one compiled specialisation, which a warm-up call compiles (or loads from numba's cache) for all shapes.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from ktlite.kernels.cpu.simd import silu_mul
from ktlite.kernels.cpu.threads import ensure_threadsafe_layer

ensure_threadsafe_layer()  # before the first parallel region of the process

CONV_BLOCK = 64  # channels per conv work item: one contiguous 256-byte run of each token's row


@njit(nogil=True, cache=True, fastmath=True)
def _load_normalised(src, dst, scale):  # pragma: no cover - compiled
    """dst = src / sqrt(|src|^2 + 1e-6) * scale (the twin's _l2norm)."""
    ss = np.float32(0.0)
    for j in range(src.shape[0]):
        ss += src[j] * src[j]
    inv = scale / np.sqrt(ss + np.float32(1e-6))
    for j in range(src.shape[0]):
        dst[j] = src[j] * inv


@njit(nogil=True, cache=True, fastmath=True)
def _dot(a, b):  # pragma: no cover - compiled
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@njit(nogil=True, cache=True, fastmath=True)
def _axpy(alpha, x, y):  # pragma: no cover - compiled
    """y += alpha * x."""
    for j in range(y.shape[0]):
        y[j] += alpha * x[j]


@njit(nogil=True, cache=True, fastmath=True)
def _delta_chunk(qc, kc, vc, cum, bc, m, s, u, o, decay):  # pragma: no cover - compiled
    """One chunk of m tokens of one head against its state s [dk, dv] (updated in place): qc, kc [C, dk] normalised,
    vc [C, dv], cum [C] the running log decay, bc [C] beta -> o [C, dv]; u [C, dv] and decay [C, C] are scratch."""
    dk = s.shape[0]
    for t in range(m):  # e^{G_t - G_i}, i <= t (each <= 1: no overflow, unlike e^{G_t} e^{-G_i})
        for i in range(t + 1):
            decay[t, i] = np.exp(cum[t] - cum[i])
    u[:m] = 0.0
    o[:m] = 0.0
    for j in range(dk):  # one read of each row of S for both S^T k_t and S^T q_t
        row = s[j]
        for t in range(m):
            _axpy(kc[t, j], row, u[t])
            _axpy(qc[t, j], row, o[t])
    for t in range(m):
        scale = np.exp(cum[t])
        for x in range(u.shape[1]):
            u[t, x] = bc[t] * (vc[t, x] - scale * u[t, x])
            o[t, x] *= scale
        for i in range(t):  # u[i] is final: forward substitution of the unit lower-triangular system
            _axpy(-bc[t] * decay[t, i] * _dot(kc[t], kc[i]), u[i], u[t])
    for t in range(m):
        for i in range(t + 1):
            _axpy(decay[t, i] * _dot(qc[t], kc[i]), u[i], o[t])
    total = np.exp(cum[m - 1])
    for j in range(dk):  # S <- e^{G_C} S + sum_i e^{G_C - G_i} k_i u_i^T
        row = s[j]
        for x in range(row.shape[0]):
            row[x] *= total
        for i in range(m):
            _axpy(kc[i, j] * decay[m - 1, i], u[i], row)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def gated_delta_rows(q, k, v, g, beta, states, rows, starts, lens, reset, chunk, out):  # pragma: no cover - compiled
    """The gated delta rule over a packed batch: q, k [N, Hk, dk], v [N, H, dv], g, beta [N, H] fp32; sequence b
    is tokens starts[b] .. + lens[b] with state states[rows[b]] ([R, H, dk, dv], zeroed first where reset[b] != 0)
    -> out [N, H, dv]."""
    heads, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    per_key = heads // q.shape[1]
    scale = np.float32(dk ** -0.5)
    for item in prange(lens.shape[0] * heads):
        b, h = item // heads, item % heads
        n = lens[b]
        if n == 0:
            continue
        kh = h // per_key
        s = states[rows[b], h]
        if reset[b]:
            s[:] = 0.0
        width = min(chunk, n)
        qc = np.empty((width, dk), np.float32)
        kc = np.empty((width, dk), np.float32)
        vc = np.empty((width, dv), np.float32)
        u = np.empty((width, dv), np.float32)
        o = np.empty((width, dv), np.float32)
        decay = np.empty((width, width), np.float32)
        cum = np.empty(width, np.float32)
        bc = np.empty(width, np.float32)
        for c0 in range(0, n, width):
            m = min(width, n - c0)
            run = np.float32(0.0)
            for t in range(m):
                tok = starts[b] + c0 + t
                _load_normalised(q[tok, kh], qc[t], scale)
                _load_normalised(k[tok, kh], kc[t], np.float32(1.0))
                vc[t] = v[tok, h]
                run += g[tok, h]
                cum[t] = run
                bc[t] = beta[tok, h]
            _delta_chunk(qc, kc, vc, cum, bc, m, s, u, o, decay)
            for t in range(m):
                out[starts[b] + c0 + t, h] = o[t]


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def causal_conv_rows(x, conv_states, weight, rows, starts, lens, reset, out):  # pragma: no cover - compiled
    """Depthwise causal conv + SiLU over a packed batch: x [N, C], weight [C, W], conv_states [R, C, W-1] (oldest
    first, updated in place; zeros first where reset[b] != 0) -> out [N, C]; fp32."""
    channels, width = weight.shape
    for blk in prange((channels + CONV_BLOCK - 1) // CONV_BLOCK):
        c0 = blk * CONV_BLOCK
        nc = min(CONV_BLOCK, channels - c0)
        taps = np.empty((width, nc), np.float32)  # transposed: each tap's weights contiguous over channels
        for c in range(nc):
            for w in range(width):
                taps[w, c] = weight[c0 + c, w]
        hist = np.empty((width - 1, nc), np.float32)  # the W-1 inputs before the sequence's first token
        acc = np.zeros(-(-nc // 16) * 16, np.float32)  # padded to silu_mul's 16 lanes
        ones = np.ones(acc.shape[0], np.float32)
        for b in range(lens.shape[0]):
            n, first = lens[b], starts[b]
            if n == 0:
                continue
            state = conv_states[rows[b]]
            for w in range(width - 1):
                for c in range(nc):
                    hist[w, c] = 0.0 if reset[b] else state[c0 + c, w]
            for t in range(n):
                acc[:] = 0.0
                for w in range(width):  # tap w reads the input W-1-w tokens back: the state's or this sequence's
                    src = t - (width - 1) + w
                    row = x[first + src, c0 : c0 + nc] if src >= 0 else hist[width - 1 + src]
                    for c in range(nc):
                        acc[c] += taps[w, c] * row[c]
                silu_mul(acc, ones)
                out[first + t, c0 : c0 + nc] = acc[:nc]
            for w in range(width - 1):  # the new state: the last W-1 inputs (hist keeps the old ones)
                src = n - (width - 1) + w
                for c in range(nc):
                    state[c0 + c, w] = x[first + src, c0 + c] if src >= 0 else hist[width - 1 + src, c]


def _takes_states(states: torch.Tensor) -> bool:
    return states.device.type == "cpu" and states.dtype == torch.float32 and states.is_contiguous()


def accepts_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             states: torch.Tensor, *_: object) -> bool:
    """Whether gated_delta_rule takes these inputs (else the twin does; the attention registry asks): CPU tensors and
    contiguous fp32 states."""
    return q.device.type == "cpu" and _takes_states(states)


def accepts_causal_conv1d(x: torch.Tensor, conv_states: torch.Tensor, *_: object) -> bool:
    """Whether causal_conv1d takes these inputs (else the twin does): CPU tensors and contiguous fp32 states."""
    return x.device.type == "cpu" and _takes_states(conv_states)


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).contiguous().numpy()


def _layout(rows: torch.Tensor, extend_lens: torch.Tensor, reset: torch.Tensor):
    """(rows, first token, token count, reset as uint8) of each sequence, the kernels' fixed types."""
    lens = extend_lens.to(torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    return (rows.to(torch.int64).contiguous().numpy(), starts.numpy(), lens.contiguous().numpy(),
            reset.to(torch.uint8).contiguous().numpy())


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, rows: torch.Tensor, extend_lens: torch.Tensor, reset: torch.Tensor,
                     chunk: int = 64) -> torch.Tensor:
    """reference.gated_delta_rule_batch_torch's signature and result ([N, H, dv] in v's dtype); q and k may also
    have fewer heads than v (the key heads; see the module docstring)."""
    out = torch.empty(v.shape, dtype=torch.float32)
    gated_delta_rows(_f32(q), _f32(k), _f32(v), _f32(g), _f32(beta), states.numpy(), *_layout(rows, extend_lens, reset),
                     int(chunk), out.numpy())
    return out.to(v.dtype)


def causal_conv1d(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                  extend_lens: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
    """reference.causal_conv1d_batch_torch's signature and result ([N, C] in x's dtype)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    causal_conv_rows(_f32(x), conv_states.numpy(), _f32(weight), *_layout(rows, extend_lens, reset), out.numpy())
    return out.to(x.dtype)
