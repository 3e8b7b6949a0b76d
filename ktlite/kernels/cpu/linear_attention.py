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
same two passes over S (one read, one read-modify-write). A decay per key channel (Kimi Delta Attention, g [N, H, dk])
runs that recurrent step for every token (`kda_rows`; no chunked form yet): row j of S decays by e^{g_j}.
q and k are L2-normalised (q also scaled by dk^-0.5) as they are loaded, as the twin does; all arithmetic is fp32.
q and k may carry fewer (key) heads than v: value head h reads key head h // (H / Hk), so a caller need not repeat
them. The helpers index whole arrays by row rather than slice them in the inner loops (numba reference-counts every
slice it makes).

Causal conv: each output depends only on inputs (the W-1 before it and its own), so the work items are tiles of
CONV_TOKENS tokens x CONV_BLOCK channels (prange), each reading contiguous runs of the input rows. (A walk over every
token of a 64-channel block read one 256-byte run per 32 KiB row: at 8192 channels and 4096 tokens that took 635 ms,
27x its time at 512 tokens; the tiles take 106 ms.) Per token, each of the W taps adds its weights times the input
W-1-w tokens back (the sequence's own row, or its conv state's for its first W-1 tokens), then SiLU (simd.silu_mul:
numba's np.exp is a scalar libm call); a second parallel loop, over channels, then makes each state its sequence's
last W-1 inputs.

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

CONV_BLOCK = 512  # channels per conv work item: a contiguous 2 KiB run of each of its tokens' rows
CONV_TOKENS = 32  # tokens per conv work item


@njit(nogil=True, cache=True, fastmath=True)
def _load_normalised(src, tok, head, dst, t, scale):  # pragma: no cover - compiled
    """dst[t] = src[tok, head] / sqrt(|src[tok, head]|^2 + 1e-6) * scale (the twin's _l2norm)."""
    ss = np.float32(0.0)
    for j in range(dst.shape[1]):
        ss += src[tok, head, j] * src[tok, head, j]
    inv = scale / np.sqrt(ss + np.float32(1e-6))
    for j in range(dst.shape[1]):
        dst[t, j] = src[tok, head, j] * inv


@njit(nogil=True, cache=True, fastmath=True)
def _dot_rows(a, t, b, i):  # pragma: no cover - compiled
    """a[t] . b[i]"""
    acc = np.float32(0.0)
    for j in range(a.shape[1]):
        acc += a[t, j] * b[i, j]
    return acc


@njit(nogil=True, cache=True, fastmath=True)
def _axpy_row(alpha, src, i, dst, t):  # pragma: no cover - compiled
    """dst[t] += alpha * src[i]."""
    for x in range(dst.shape[1]):
        dst[t, x] += alpha * src[i, x]


@njit(nogil=True, cache=True, fastmath=True)
def _delta_chunk(qc, kc, vc, cum, bc, m, s, u, o, decay):  # pragma: no cover - compiled
    """One chunk of m tokens of one head against its state s [dk, dv] (updated in place): qc, kc [C, dk] normalised,
    vc [C, dv], cum [C] the running log decay, bc [C] beta -> o [C, dv]; u [C, dv] and decay [C, C] are scratch."""
    dk, dv = s.shape
    for t in range(m):  # e^{G_t - G_i}, i <= t (each <= 1: no overflow, unlike e^{G_t} e^{-G_i})
        for i in range(t + 1):
            decay[t, i] = np.exp(cum[t] - cum[i])
    u[:m] = 0.0
    o[:m] = 0.0
    for j in range(dk):  # one read of each row of S for both S^T k_t and S^T q_t
        for t in range(m):
            _axpy_row(kc[t, j], s, j, u, t)
            _axpy_row(qc[t, j], s, j, o, t)
    for t in range(m):
        scale = np.exp(cum[t])
        for x in range(dv):
            u[t, x] = bc[t] * (vc[t, x] - scale * u[t, x])
            o[t, x] *= scale
        for i in range(t):  # u[i] is final: forward substitution of the unit lower-triangular system
            _axpy_row(-bc[t] * decay[t, i] * _dot_rows(kc, t, kc, i), u, i, u, t)
    for t in range(m):
        for i in range(t + 1):
            _axpy_row(decay[t, i] * _dot_rows(qc, t, kc, i), u, i, o, t)
    total = np.exp(cum[m - 1])
    for j in range(dk):  # S <- e^{G_C} S + sum_i e^{G_C - G_i} k_i u_i^T
        for x in range(dv):
            s[j, x] *= total
        for i in range(m):
            _axpy_row(kc[i, j] * decay[m - 1, i], u, i, s, j)


@njit(nogil=True, cache=True, fastmath=True)
def _work_item(item, heads, per_key, states, rows, lens, reset):  # pragma: no cover - compiled
    """(sequence, value head, key head, its state slice) of a (sequence, head) work item, the state zeroed where the
    sequence starts one and has tokens (the one slice of the shared states array the item writes)."""
    b, h = item // heads, item % heads
    s = states[rows[b], h]
    if reset[b] and lens[b] > 0:
        s[:] = 0.0
    return b, h, h // per_key, s


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def gated_delta_rows(q, k, v, g, beta, states, rows, starts, lens, reset, chunk, out):  # pragma: no cover - compiled
    """The gated delta rule over a packed batch: q, k [N, Hk, dk], v [N, H, dv], g, beta [N, H] fp32; sequence b
    is tokens starts[b] .. + lens[b] with state states[rows[b]] ([R, H, dk, dv], zeroed first where reset[b] != 0)
    -> out [N, H, dv]."""
    heads, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    per_key = heads // q.shape[1]
    scale = np.float32(dk ** -0.5)
    for item in prange(lens.shape[0] * heads):
        b, h, kh, s = _work_item(item, heads, per_key, states, rows, lens, reset)
        n = lens[b]
        if n == 0:
            continue
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
            first = starts[b] + c0
            run = np.float32(0.0)
            for t in range(m):
                _load_normalised(q, first + t, kh, qc, t, scale)
                _load_normalised(k, first + t, kh, kc, t, np.float32(1.0))
                for x in range(dv):
                    vc[t, x] = v[first + t, h, x]
                run += g[first + t, h]
                cum[t] = run
                bc[t] = beta[first + t, h]
            _delta_chunk(qc, kc, vc, cum, bc, m, s, u, o, decay)
            for t in range(m):
                for x in range(dv):
                    out[first + t, h, x] = o[t, x]


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def kda_rows(q, k, v, g, beta, states, rows, starts, lens, reset, out):  # pragma: no cover - compiled
    """The delta rule with a decay per key channel (Kimi Delta Attention), token by token: as gated_delta_rows with
    g [N, H, dk] fp32. Per (sequence, head) work item and token, two passes over S: decay row j by e^{g_j} while
    accumulating S^T k, then S += k u^T while accumulating o = S^T q."""
    heads, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    per_key = heads // q.shape[1]
    scale = np.float32(dk ** -0.5)
    for item in prange(lens.shape[0] * heads):
        b, h, kh, s = _work_item(item, heads, per_key, states, rows, lens, reset)
        n = lens[b]
        if n == 0:
            continue
        qt = np.empty((1, dk), np.float32)
        kt = np.empty((1, dk), np.float32)
        u = np.empty(dv, np.float32)
        o = np.empty(dv, np.float32)
        for t in range(starts[b], starts[b] + n):
            _load_normalised(q, t, kh, qt, 0, scale)
            _load_normalised(k, t, kh, kt, 0, np.float32(1.0))
            u[:] = 0.0
            for j in range(dk):
                decay, kj = np.exp(g[t, h, j]), kt[0, j]
                for x in range(dv):
                    s[j, x] *= decay
                    u[x] += kj * s[j, x]
            bt = beta[t, h]
            for x in range(dv):
                u[x] = bt * (v[t, h, x] - u[x])
            o[:] = 0.0
            for j in range(dk):
                kj, qj = kt[0, j], qt[0, j]
                for x in range(dv):
                    s[j, x] += kj * u[x]
                    o[x] += qj * s[j, x]
            for x in range(dv):
                out[t, h, x] = o[x]


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def causal_conv_rows(x, conv_states, weight, rows, starts, lens, reset, seq_of, out):  # pragma: no cover - compiled
    """Depthwise causal conv + SiLU over a packed batch: x [N, C], weight [C, W], conv_states [R, C, W-1] (oldest
    first, updated in place; zeros first where reset[b] != 0), seq_of [N] each token's sequence -> out [N, C]; fp32."""
    tokens, channels = x.shape
    width = weight.shape[1]
    blocks = (channels + CONV_BLOCK - 1) // CONV_BLOCK
    for item in prange(((tokens + CONV_TOKENS - 1) // CONV_TOKENS) * blocks):
        t0, c0 = (item // blocks) * CONV_TOKENS, (item % blocks) * CONV_BLOCK
        nc = min(CONV_BLOCK, channels - c0)
        taps = np.empty((width, nc), np.float32)  # transposed: each tap's weights contiguous over channels
        for c in range(nc):
            for w in range(width):
                taps[w, c] = weight[c0 + c, w]
        acc = np.zeros(-(-nc // 16) * 16, np.float32)  # padded to silu_mul's 16 lanes
        ones = np.ones(acc.shape[0], np.float32)
        for t in range(t0, min(tokens, t0 + CONV_TOKENS)):
            b = seq_of[t]
            pos = t - starts[b]
            acc[:] = 0.0
            for w in range(width):  # tap w reads the input W-1-w tokens back: the sequence's, or its state's
                back = pos - (width - 1) + w
                if back >= 0:
                    for c in range(nc):
                        acc[c] += taps[w, c] * x[t - pos + back, c0 + c]
                elif not reset[b]:
                    for c in range(nc):
                        acc[c] += taps[w, c] * conv_states[rows[b], c0 + c, width - 1 + back]
            silu_mul(acc, ones)
            for c in range(nc):
                out[t, c0 + c] = acc[c]
    # then (the conv above has read the old states) each state becomes its sequence's last W-1 inputs
    for c in prange(channels):
        for b in range(lens.shape[0]):
            n = lens[b]
            if n == 0:
                continue
            for w in range(width - 1):  # ascending: reads old entries w + n > w, not yet written
                src = n - (width - 1) + w
                if src >= 0:
                    conv_states[rows[b], c, w] = x[starts[b] + src, c]
                else:
                    conv_states[rows[b], c, w] = 0.0 if reset[b] else conv_states[rows[b], c, w + n]


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
    have fewer heads than v (the key heads; see the module docstring). A per-channel decay g [N, H, dk] (Kimi Delta
    Attention) runs kda_rows, token by token."""
    out = torch.empty(v.shape, dtype=torch.float32)
    if g.dim() == 3:
        kda_rows(_f32(q), _f32(k), _f32(v), _f32(g), _f32(beta), states.numpy(), *_layout(rows, extend_lens, reset),
                 out.numpy())
        return out.to(v.dtype)
    gated_delta_rows(_f32(q), _f32(k), _f32(v), _f32(g), _f32(beta), states.numpy(), *_layout(rows, extend_lens, reset),
                     int(chunk), out.numpy())
    return out.to(v.dtype)


def causal_conv1d(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                  extend_lens: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
    """reference.causal_conv1d_batch_torch's signature and result ([N, C] in x's dtype)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    layout = _layout(rows, extend_lens, reset)
    seq_of = torch.repeat_interleave(torch.arange(len(layout[2])), torch.from_numpy(layout[2])).numpy()
    causal_conv_rows(_f32(x), conv_states.numpy(), _f32(weight), *layout, seq_of, out.numpy())
    return out.to(x.dtype)
