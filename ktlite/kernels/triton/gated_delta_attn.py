"""Gated delta rule (Gated DeltaNet linear attention) over a packed batch: Triton twin of
reference.gated_delta_rule_batch_torch (the math is in reference.gated_delta_rule_torch's docstring).

Two paths with the same result:
- recurrent (decode): one program per (sequence, head, dv tile) keeps its [dk, BLOCK_V] state tile in
  registers and walks the tokens: decay, delta, update, output. No host sync (CUDA-graph friendly).
- chunked (prefill): chunks of CHUNK = 64 tokens in two launches.
  1. _chunk_prep_kernel, one program per (chunk, head), all chunks in parallel: solves the chunk's
     unit lower-triangular system (I + L) T = I, L_ti = beta_t e^{G_t - G_i} (k_t . k_i) for i < t, as
     4 x 4 blocks of 16: the diagonal blocks by forward substitution in registers, the others by
     block substitution with tl.dot. It stores W = T (beta e^G k) and U = T (beta v), so that the
     corrections of the reference are u = U - W S_0 for whatever state S_0 enters the chunk.
  2. _chunk_state_kernel, one program per (sequence, head, dv tile), walks its chunks in order with
     the state tile in registers: u = U - W S, o = e^G q S + (q k^T * decay, causal) u,
     S <- e^{G_C} S + (k e^{G_C - G})^T u.
  The chunk length of the reference (its `chunk` argument) does not change the result, so the
  Triton path keeps its own.
q and k are L2-normalised on load (q also scaled by dk^-0.5), as in the reference.

Precision: states, decays and sums are fp32, and so is the triangular solve ("tf32x3" dots on a GPU:
fp32-grade on tensor cores; plain tf32 loses ~1e-3 relative there). The state kernel rounds its dot
operands (q, k, W, U, the state tile, the scores) to the activations' dtype, as fla/SGLang do (fp32
operands there needed ~200 KB of shared memory at dk = dv = 128). So bf16 outputs differ from the fp32
twin by a few bf16 ulps; fp32 inputs keep fp32-grade products everywhere.
"""

import logging

import torch
import triton
import triton.language as tl

from ktlite.kernels.triton.common import dot, dot_width

logger = logging.getLogger(__name__)

CHUNK = 64  # tokens per chunk in the chunked path (4 sub-blocks of 16 in the triangular solve)
_SUB: tl.constexpr = tl.constexpr(16)
_PRECISION: tl.constexpr = tl.constexpr("tf32x3")
_EPS: tl.constexpr = tl.constexpr(1e-6)  # inside the L2 norm's rsqrt, as in the reference


@triton.jit
def _mm(a, b):
    """fp32 a @ b with fp32-grade products on a GPU (the triangular solve amplifies tf32's error)."""
    return tl.dot(a, b, input_precision=_PRECISION)


@triton.jit
def _mm_in(a, b, DT: tl.constexpr):
    """a @ b in fp32 with both operands rounded to DT, the activations' dtype: bf16/fp16 products run
    at tensor-core rate and stay in shared memory's budget (as fla/SGLang do); fp32 inputs keep _mm."""
    if DT == tl.float32:
        return _mm(a, b)
    else:
        return dot(a.to(DT), b.to(DT), tl.zeros((a.shape[0], b.shape[1]), tl.float32))


@triton.jit
def _l2norm_rows(x):
    return x * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + _EPS)


@triton.jit
def _recurrent_kernel(
    Q, K, V, Gate, Beta, States, Rows, Starts, Lens, Reset, Out, scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_gh, stride_gk, stride_bn,
    stride_bh, stride_sr, stride_sh, stride_sk, stride_on, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(Lens + b)
    if n > 0:  # an empty sequence leaves its state alone, reset or not (like the reference)
        start = tl.load(Starts + b).to(tl.int64)
        row = tl.load(Rows + b).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_k = offs_k < DK
        # a reset row starts from zeros; a bound rather than `mask & flag` (the interpreter turns a
        # tensor & scalar-bool into ints, which it then refuses as a mask)
        keep_k = offs_k < tl.where(tl.load(Reset + b) == 0, DK, 0)
        mask_v = offs_v < DV
        s_ptr = States + row * stride_sr + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
        s_mask = mask_k[:, None] & mask_v[None, :]
        state = tl.load(s_ptr, mask=keep_k[:, None] & mask_v[None, :], other=0.0)  # [BK, BV] fp32
        for t in range(start, start + n):
            q = tl.load(Q + t * stride_qn + h * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            k = tl.load(K + t * stride_kn + h * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            v = tl.load(V + t * stride_vn + h * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            beta = tl.load(Beta + t * stride_bn + h * stride_bh).to(tl.float32)
            q = _l2norm_rows(q) * scale
            k = _l2norm_rows(k)
            if PER_CHANNEL:  # Kimi Delta Attention: one decay per key channel, i.e. per row of the state
                g = tl.load(Gate + t * stride_gn + h * stride_gh + offs_k * stride_gk, mask=mask_k, other=0.0)
                state = state * tl.exp(g.to(tl.float32))[:, None]
            else:
                g = tl.load(Gate + t * stride_gn + h * stride_gh).to(tl.float32)
                state = state * tl.exp(g)
            u = beta * (v - tl.sum(state * k[:, None], axis=0))  # the delta: what S predicts for k, corrected
            state = state + k[:, None] * u[None, :]
            o = tl.sum(state * q[:, None], axis=0)
            tl.store(Out + t * stride_on + h * stride_oh + offs_v, o.to(Out.dtype.element_ty), mask=mask_v)
        tl.store(s_ptr, state, mask=s_mask)


@triton.jit
def _sub_block(K, Gate, Beta, tok0, n, h, sub: tl.constexpr, stride_kn, stride_kh, stride_gn, stride_gh,
               stride_bn, stride_bh, DK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Sub-block `sub` (16 tokens) of a chunk: normalised keys [16, BK], beta [16], raw log decays [16];
    zeros past the chunk's end, so those rows drop out of every product."""
    offs = sub * _SUB + tl.arange(0, _SUB)
    valid = offs < n
    tok = tok0 + offs
    offs_k = tl.arange(0, BLOCK_K)
    k = tl.load(K + tok[:, None] * stride_kn + h * stride_kh + offs_k[None, :],
                mask=valid[:, None] & (offs_k < DK)[None, :], other=0.0).to(tl.float32)
    g = tl.load(Gate + tok * stride_gn + h * stride_gh, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(Beta + tok * stride_bn + h * stride_bh, mask=valid, other=0.0).to(tl.float32)
    return _l2norm_rows(k), beta, g


@triton.jit
def _decayed_kkt(k_t, beta_t, g_t, k_i, g_i):
    """L block: beta_t e^{G_t - G_i} (k_t . k_i) for rows t of a later sub-block than columns i."""
    return beta_t[:, None] * _mm(k_t, tl.trans(k_i)) * tl.exp(g_t[:, None] - g_i[None, :])


@triton.jit
def _inv_diag_block(k, beta, g):
    """(I + L)^-1 of a diagonal 16-block (L strictly lower), by forward substitution: row t of the inverse
    is e_t - sum_{i<t} L_ti (row i of the inverse), i.e. row t of (inverse - L @ inverse) once rows < t are
    final. A 16x16 tl.dot per row keeps the loop free of cross-thread reductions."""
    r = tl.arange(0, _SUB)
    lower = r[:, None] > r[None, :]
    low = tl.where(lower, beta[:, None] * _mm(k, tl.trans(k)) * tl.exp(tl.where(lower, g[:, None] - g[None, :], 0.0)),
                   0.0)
    inv = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for t in range(1, _SUB):
        inv = tl.where(r[:, None] == t, inv - tl.dot(low, inv, input_precision=_PRECISION), inv)
    return inv


@triton.jit
def _store_sub(Ptr, tok0, n, h, sub: tl.constexpr, x, stride_n, stride_h, D: tl.constexpr, BLOCK_D: tl.constexpr):
    offs = sub * _SUB + tl.arange(0, _SUB)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(Ptr + (tok0 + offs)[:, None] * stride_n + h * stride_h + offs_d[None, :], x.to(Ptr.dtype.element_ty),
             mask=(offs < n)[:, None] & (offs_d < D)[None, :])


@triton.jit
def _load_sub(Ptr, tok0, n, h, sub: tl.constexpr, stride_n, stride_h, D: tl.constexpr, BLOCK_D: tl.constexpr):
    offs = sub * _SUB + tl.arange(0, _SUB)
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(Ptr + (tok0 + offs)[:, None] * stride_n + h * stride_h + offs_d[None, :],
                   mask=(offs < n)[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _chunk_prep_kernel(
    K, V, Gate, Beta, ChunkStart, ChunkLen, W, U, Gcum,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_gh, stride_bn, stride_bh,
    stride_wn, stride_wh, stride_un, stride_uh, stride_cn, stride_ch,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    tok0 = tl.load(ChunkStart + c).to(tl.int64)
    n = tl.load(ChunkLen + c)
    k0, b0, g0 = _sub_block(K, Gate, Beta, tok0, n, h, 0, stride_kn, stride_kh, stride_gn, stride_gh,
                            stride_bn, stride_bh, DK, BLOCK_K)
    k1, b1, g1 = _sub_block(K, Gate, Beta, tok0, n, h, 1, stride_kn, stride_kh, stride_gn, stride_gh,
                            stride_bn, stride_bh, DK, BLOCK_K)
    k2, b2, g2 = _sub_block(K, Gate, Beta, tok0, n, h, 2, stride_kn, stride_kh, stride_gn, stride_gh,
                            stride_bn, stride_bh, DK, BLOCK_K)
    k3, b3, g3 = _sub_block(K, Gate, Beta, tok0, n, h, 3, stride_kn, stride_kh, stride_gn, stride_gh,
                            stride_bn, stride_bh, DK, BLOCK_K)
    # cumulative log decay G from the chunk's start (padded rows add 0)
    off1 = tl.sum(g0, axis=0)
    off2 = off1 + tl.sum(g1, axis=0)
    off3 = off2 + tl.sum(g2, axis=0)
    g0 = tl.cumsum(g0, axis=0)
    g1 = tl.cumsum(g1, axis=0) + off1
    g2 = tl.cumsum(g2, axis=0) + off2
    g3 = tl.cumsum(g3, axis=0) + off3
    _store_sub(Gcum, tok0, n, h, 0, g0[:, None], stride_cn, stride_ch, 1, 1)
    _store_sub(Gcum, tok0, n, h, 1, g1[:, None], stride_cn, stride_ch, 1, 1)
    _store_sub(Gcum, tok0, n, h, 2, g2[:, None], stride_cn, stride_ch, 1, 1)
    _store_sub(Gcum, tok0, n, h, 3, g3[:, None], stride_cn, stride_ch, 1, 1)

    # T = (I + L)^-1 block by block: T_ab = -T_aa sum_{b <= j < a} L_aj T_jb (a > b)
    t00 = _inv_diag_block(k0, b0, g0)
    t11 = _inv_diag_block(k1, b1, g1)
    t22 = _inv_diag_block(k2, b2, g2)
    t33 = _inv_diag_block(k3, b3, g3)
    l10 = _decayed_kkt(k1, b1, g1, k0, g0)
    l20 = _decayed_kkt(k2, b2, g2, k0, g0)
    l21 = _decayed_kkt(k2, b2, g2, k1, g1)
    l30 = _decayed_kkt(k3, b3, g3, k0, g0)
    l31 = _decayed_kkt(k3, b3, g3, k1, g1)
    l32 = _decayed_kkt(k3, b3, g3, k2, g2)
    t10 = -_mm(t11, _mm(l10, t00))
    t21 = -_mm(t22, _mm(l21, t11))
    t20 = -_mm(t22, _mm(l20, t00) + _mm(l21, t10))
    t32 = -_mm(t33, _mm(l32, t22))
    t31 = -_mm(t33, _mm(l31, t11) + _mm(l32, t21))
    t30 = -_mm(t33, _mm(l30, t00) + _mm(l31, t10) + _mm(l32, t20))

    # W = T (beta e^G k)
    r0 = (b0 * tl.exp(g0))[:, None] * k0
    r1 = (b1 * tl.exp(g1))[:, None] * k1
    r2 = (b2 * tl.exp(g2))[:, None] * k2
    r3 = (b3 * tl.exp(g3))[:, None] * k3
    _store_sub(W, tok0, n, h, 0, _mm(t00, r0), stride_wn, stride_wh, DK, BLOCK_K)
    _store_sub(W, tok0, n, h, 1, _mm(t10, r0) + _mm(t11, r1), stride_wn, stride_wh, DK, BLOCK_K)
    _store_sub(W, tok0, n, h, 2, _mm(t20, r0) + _mm(t21, r1) + _mm(t22, r2), stride_wn, stride_wh, DK, BLOCK_K)
    _store_sub(W, tok0, n, h, 3, _mm(t30, r0) + _mm(t31, r1) + _mm(t32, r2) + _mm(t33, r3),
               stride_wn, stride_wh, DK, BLOCK_K)
    # U = T (beta v)
    r0 = b0[:, None] * _load_sub(V, tok0, n, h, 0, stride_vn, stride_vh, DV, BLOCK_DV)
    r1 = b1[:, None] * _load_sub(V, tok0, n, h, 1, stride_vn, stride_vh, DV, BLOCK_DV)
    r2 = b2[:, None] * _load_sub(V, tok0, n, h, 2, stride_vn, stride_vh, DV, BLOCK_DV)
    r3 = b3[:, None] * _load_sub(V, tok0, n, h, 3, stride_vn, stride_vh, DV, BLOCK_DV)
    _store_sub(U, tok0, n, h, 0, _mm(t00, r0), stride_un, stride_uh, DV, BLOCK_DV)
    _store_sub(U, tok0, n, h, 1, _mm(t10, r0) + _mm(t11, r1), stride_un, stride_uh, DV, BLOCK_DV)
    _store_sub(U, tok0, n, h, 2, _mm(t20, r0) + _mm(t21, r1) + _mm(t22, r2), stride_un, stride_uh, DV, BLOCK_DV)
    _store_sub(U, tok0, n, h, 3, _mm(t30, r0) + _mm(t31, r1) + _mm(t32, r2) + _mm(t33, r3),
               stride_un, stride_uh, DV, BLOCK_DV)


@triton.jit
def _chunk_state_kernel(
    Q, K, W, U, Gcum, States, Rows, Starts, Lens, Reset, Out, scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_wn, stride_wh, stride_un, stride_uh, stride_cn, stride_ch,
    stride_sr, stride_sh, stride_sk, stride_on, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(Lens + b)
    if n > 0:
        start = tl.load(Starts + b).to(tl.int64)
        row = tl.load(Rows + b).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_k = offs_k < DK
        # a reset row starts from zeros; a bound rather than `mask & flag` (the interpreter turns a
        # tensor & scalar-bool into ints, which it then refuses as a mask)
        keep_k = offs_k < tl.where(tl.load(Reset + b) == 0, DK, 0)
        mask_v = offs_v < DV
        DT: tl.constexpr = Q.dtype.element_ty
        offs_c = tl.arange(0, BLOCK_C)
        causal = offs_c[:, None] >= offs_c[None, :]
        s_ptr = States + row * stride_sr + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
        s_mask = mask_k[:, None] & mask_v[None, :]
        state = tl.load(s_ptr, mask=keep_k[:, None] & mask_v[None, :], other=0.0)  # [BK, BV] fp32, the state entering the chunk
        for c0 in range(0, n, BLOCK_C):
            valid = c0 + offs_c < n
            tok = start + c0 + offs_c
            mk = valid[:, None] & mask_k[None, :]
            mv = valid[:, None] & mask_v[None, :]
            q = tl.load(Q + tok[:, None] * stride_qn + h * stride_qh + offs_k[None, :], mask=mk, other=0.0)
            k = tl.load(K + tok[:, None] * stride_kn + h * stride_kh + offs_k[None, :], mask=mk, other=0.0)
            q = _l2norm_rows(q.to(tl.float32)) * scale
            k = _l2norm_rows(k.to(tl.float32))
            w = tl.load(W + tok[:, None] * stride_wn + h * stride_wh + offs_k[None, :], mask=mk, other=0.0)
            u = tl.load(U + tok[:, None] * stride_un + h * stride_uh + offs_v[None, :], mask=mv, other=0.0)
            g = tl.load(Gcum + tok * stride_cn + h * stride_ch, mask=valid, other=0.0)
            u = u - _mm_in(w, state, DT)  # the chunk's corrections given the entering state
            # padded rows have G = 0: keep them out of the exponent (e^{0 - G_i} can overflow; NaN rows, never stored)
            attend = causal & valid[:, None]
            scores = _mm_in(q, tl.trans(k), DT) * tl.exp(tl.where(attend, g[:, None] - g[None, :], float("-inf")))
            o = tl.exp(g)[:, None] * _mm_in(q, state, DT) + _mm_in(scores, u, DT)
            tl.store(Out + tok[:, None] * stride_on + h * stride_oh + offs_v[None, :], o.to(Out.dtype.element_ty),
                     mask=mv)
            g_last = tl.sum(tl.where(c0 + offs_c == tl.minimum(c0 + BLOCK_C, n) - 1, g, 0.0), axis=0)
            k = k * tl.exp(g_last - g)[:, None]  # padded rows are zero keys
            state = state * tl.exp(g_last) + _mm_in(tl.trans(k), u, DT)
        tl.store(s_ptr, state, mask=s_mask)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  states: torch.Tensor) -> None:
    n, heads, dk = q.shape
    assert k.shape == q.shape and v.shape[:2] == (n, heads) and beta.shape == (n, heads), \
        f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)}"
    assert g.shape in ((n, heads), (n, heads, dk)), \
        f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)}"
    assert states.shape[1:] == (heads, dk, v.shape[2]) and states.dtype == torch.float32, \
        f"states must be fp32 [R, {heads}, {dk}, {v.shape[2]}], got {states.dtype} {tuple(states.shape)}"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and states.stride(3) == 1


def gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor, rows: torch.Tensor, extend_lens: torch.Tensor, reset: torch.Tensor,
                            mode: str | None = None, block_v: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Triton twin of reference.gated_delta_rule_batch_torch (shapes there); returns [N, H, dv] in v's dtype and
    updates states[rows] in place.

    mode: "recurrent" (token by token; no host sync) or "chunked" (64-token chunks; one host sync for the
    chunk table; bf16/fp16 on a GPU). Default: recurrent when the batch has at most one token per sequence
    (decode) or holds fp32 CUDA tensors, else chunked. A per-channel decay g [N, H, dk] (Kimi Delta Attention)
    runs recurrent only (no chunked kernel for it yet: a prompt walks its tokens in one program per head and
    dv tile).
    block_v: dv columns per program (default: dv as a power of two, between 16 and 64)."""
    _check_inputs(q, k, v, g, beta, states)
    num_tokens, heads, dk = q.shape
    dv = v.shape[2]
    batch = extend_lens.shape[0]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_tokens == 0 or batch == 0:
        return out
    # fp32 activations on a GPU run token by token: the state kernel's fp32 dot operands need more
    # shared memory than an SM has (~230 KB at dk = dv = 128, any block_v)
    fp32_gpu = q.is_cuda and q.dtype == torch.float32
    per_channel = g.dim() == 3
    mode = mode or ("recurrent" if num_tokens <= batch or fp32_gpu or per_channel else "chunked")
    if per_channel and mode != "recurrent":
        raise ValueError("a per-channel decay (g [N, H, dk]) runs in mode 'recurrent' only")
    block_k = dot_width(dk)
    block_v = block_v or min(64, max(16, triton.next_power_of_2(dv)))
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    reset_i = reset.to(torch.int32)
    grid = (batch, heads, triton.cdiv(dv, block_v))
    scale = dk**-0.5
    state_strides = (states.stride(0), states.stride(1), states.stride(2), out.stride(0), out.stride(1))
    if mode == "recurrent":
        _recurrent_kernel[grid](
            q, k, v, g, beta, states, rows, starts, extend_lens, reset_i, out, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
            g.stride(2) if per_channel else 0, beta.stride(0), beta.stride(1), *state_strides,
            DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, PER_CHANNEL=per_channel, num_warps=num_warps,
        )
        return out
    if mode != "chunked":
        raise ValueError(f"mode must be 'recurrent' or 'chunked', got {mode!r}")
    chunk_start, chunk_len, s0 = [], [], 0
    for n in extend_lens.tolist():
        for c0 in range(0, n, CHUNK):
            chunk_start.append(s0 + c0)
            chunk_len.append(min(CHUNK, n - c0))
        s0 += n
    if not chunk_start:
        return out
    chunk_start_t = torch.tensor(chunk_start, dtype=torch.int64, device=q.device)
    chunk_len_t = torch.tensor(chunk_len, dtype=torch.int32, device=q.device)
    # W and U in the activations' dtype: the state kernel rounds its dot operands to it anyway
    w = torch.empty(num_tokens, heads, dk, dtype=q.dtype, device=q.device)
    u = torch.empty(num_tokens, heads, dv, dtype=q.dtype, device=q.device)
    gcum = torch.empty(num_tokens, heads, dtype=torch.float32, device=q.device)
    _chunk_prep_kernel[(len(chunk_start), heads)](
        k, v, g, beta, chunk_start_t, chunk_len_t, w, u, gcum,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), gcum.stride(0), gcum.stride(1),
        DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_DV=triton.next_power_of_2(dv), num_warps=num_warps,
    )
    _chunk_state_kernel[grid](
        q, k, w, u, gcum, states, rows, starts, extend_lens, reset_i, out, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        gcum.stride(0), gcum.stride(1), *state_strides,
        # 8 warps: q, k [64, dk] and the state tile live in registers (unmeasured guess; 50 KB shared at 128/64)
        DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_C=CHUNK, num_warps=2 * num_warps,
    )
    return out
