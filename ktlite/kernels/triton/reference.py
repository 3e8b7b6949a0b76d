"""Plain-torch twins of the Triton kernels: same signatures, the reference in tests and the
fallback when the "GPU side" is a CPU device.

They favour clarity, but are also what a CPU-only run executes, so they avoid obvious waste
(MoE computes only experts that received tokens; matmuls run in the weights' dtype).
"""

import logging

import torch
import torch.nn.functional as F

from ktlite.kernels.expert_activation import SWIGLU, ExpertActivation
from ktlite.kernels.triton.kv_fp8 import is_packed, latent_rows, packed_head_rows
from ktlite.kernels.triton.quant import QuantizedWeight, expert_weight

logger = logging.getLogger(__name__)

FP8_BLOCK = 128  # block-FP8 checkpoints: one weight_scale_inv per 128x128 weight block


def request_spans(req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor):
    """(row, prefix, n, start) of each request with new tokens: its queries are rows start..start+n."""
    start = 0
    for row, prefix, n in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        if n:
            yield row, prefix, n, start
        start += n


def causal_mask(prefix: int, n: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """[n, prefix + n] bool: query i (absolute position prefix + i) sees keys at positions <= its own (and, when
    window > 0, > its own - window: a sliding window of `window` keys)."""
    pos_q = (torch.arange(n, device=device) + prefix)[:, None]
    pos_k = torch.arange(prefix + n, device=device)[None, :]
    seen = pos_k <= pos_q
    return seen & (pos_k > pos_q - window) if window > 0 else seen


def gather_latents(kv_buffer: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int, width: int) -> torch.Tensor:
    """float32 latents [*slots.shape, width] of pool slots, from a plain [slots, width] buffer or a packed
    FP8 one (uint8 rows, kv_fp8.latent_rows): the one place the twins read an MLA cache."""
    rows = kv_buffer[slots]
    return latent_rows(kv_lora_rank, width - kv_lora_rank).unpack(rows) if is_packed(kv_buffer) else rows.float()


def gather_heads(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """float32 K or V [*slots.shape, kv_heads, head_dim] of pool slots, from a plain [slots, kv_heads, head_dim]
    buffer or a packed FP8 one (uint8 rows, kv_fp8.head_rows): the one place the twins read a GQA cache."""
    rows = buffer[slots]
    return packed_head_rows(buffer).unpack(rows) if is_packed(buffer) else rows.float()


def mla_extend_torch(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Absorbed-MLA causal attention of new tokens over their request's prefix + themselves.

    q: [N, H, kv_lora_rank + rope] (N = sum(extend_lens), requests concatenated in order);
    kv_buffer: [slots, kv_lora_rank + rope], or packed FP8 rows [slots, bytes] uint8 (kv_fp8.latent_rows);
    req_to_token: [max_reqs, max_context] int32; req_pool_indices, prefix_lens, extend_lens: [B].
    Returns [N, H, kv_lora_rank] in q's dtype. Token i of request b sees positions 0..prefix_lens[b] + i
    (computed in fp32).
    """
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    for row, prefix, n, start in request_spans(req_pool_indices, prefix_lens, extend_lens):
        kv = gather_latents(kv_buffer, req_to_token[row, : prefix + n].long(), kv_lora_rank, q.shape[-1])  # [total, Dk]
        heads = q.shape[1]  # plain matmuls over (token, head) rows: einsum's parsing cost dominated decode on CPU
        scores = (q[start : start + n].float().flatten(0, 1) @ kv.T).view(n, heads, -1) * sm_scale
        scores.masked_fill_(~causal_mask(prefix, n, q.device)[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start : start + n] = (probs.flatten(0, 1) @ kv[:, :kv_lora_rank]).view(n, heads, -1).to(q.dtype)
    return out


def mla_decode_torch(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Absorbed-MLA decode: one new token per request, whose latent is already in the pool.

    q: [B, H, kv_lora_rank + rope]; seq_lens: [B] including the current token.
    Returns [B, H, kv_lora_rank]. Decode is extend with one token after a prefix of seq_len - 1.
    """
    return mla_extend_torch(
        q, kv_buffer, req_to_token, req_pool_indices, seq_lens - 1,
        torch.ones_like(seq_lens), sm_scale, kv_lora_rank,
    )


def local_pairs(
    topk_ids: torch.Tensor, expert_mask: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened expert ids [T*k] (int64) and which pairs this device computes: id in [0, E) and
    expert_mask[id] True. Ids outside [0, E) (e.g. -1) also mean "held elsewhere", so the runtime
    may pass a compact stack of this device's experts with ids remapped to it."""
    flat = topk_ids.reshape(-1).long()
    keep = (flat >= 0) & (flat < num_experts)
    if expert_mask is not None:
        keep &= expert_mask[flat.clamp(0, num_experts - 1)]
    return flat, keep


def fused_moe_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_mask: torch.Tensor | None = None,
    activation: ExpertActivation = SWIGLU,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * (down_e(act(gate_e x, up_e x)) over selected experts e = topk_ids[t, j]
    with expert_mask[e] True (all experts if None); the others, and ids outside [0, E), contribute 0
    (the CPU side computes them). act: the experts' activation (kernels/expert_activation.py, SiLU(gate) * up by
    default); biases (gate_up [E, 2I], down [E, H], as w13 / w2 are indexed) are added to the projections.

    hidden: [T, H]; w13: [E, 2I, H] (rows 0:I gate, I:2I up) or QuantizedWeight of that shape;
    w2: [E, H, I] or QuantizedWeight; topk_ids/topk_weights: [T, k]. Returns [T, H] in hidden's dtype.
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids, keep = local_pairs(topk_ids, expert_mask, w13.shape[0])
    flat_w = topk_weights.reshape(-1).float()
    for e in torch.unique(flat_ids[keep]).tolist():
        pairs = torch.nonzero((flat_ids == e) & keep).squeeze(1)
        tokens = pairs // top_k
        x = hidden[tokens]
        gate_up = (x @ expert_weight(w13, e, hidden.dtype).T).float()  # [n, 2I]
        if biases is not None:
            gate_up = gate_up + biases[0][e].float()
        gate, up = gate_up.chunk(2, dim=-1)
        act = activation(gate, up).to(hidden.dtype)
        y = (act @ expert_weight(w2, e, hidden.dtype).T).float()
        if biases is not None:
            y = y + biases[1][e].float()
        out.index_add_(0, tokens, y * flat_w[pairs, None])
    return out.to(hidden.dtype)


def fp8_dequantize(weight: torch.Tensor, weight_scale_inv: torch.Tensor, dtype: torch.dtype,
                   block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> torch.Tensor:
    """float8_e4m3fn [N, K] * its 128x128 block's scale_inv [ceil(N/128), ceil(K/128)] -> dtype.

    A CPU run should call this once at load time rather than per forward.
    """
    n, k = weight.shape
    scale = weight_scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (weight.float() * scale).to(dtype)


def fp8_linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K] fp8, weight_scale_inv) ^T + bias -> [M, N] in x's dtype."""
    return F.linear(x, fp8_dequantize(weight, weight_scale_inv, x.dtype), bias)


def gqa_extend_torch(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """GQA causal extend. q [N, Hq, D] (requests concatenated in order), k_buffer [slots, Hkv, D],
    v_buffer [slots, Hkv, Dv], or both packed FP8 rows [slots, Hkv, D + 4] uint8 (kv_fp8.head_rows) -> [N, Hq, Dv]
    in q's dtype. Query head h reads kv head h // (Hq // Hkv); token i of request b sees positions
    0..prefix_lens[b] + i, only the last `window` of them when window > 0 (computed in fp32). sinks [Hq]: an
    extra logit per head in the softmax's denominator that adds nothing to the output."""
    n_tokens, heads, _ = q.shape
    head_dv = packed_head_rows(v_buffer).dim if is_packed(v_buffer) else v_buffer.shape[-1]
    out = torch.empty(n_tokens, heads, head_dv, dtype=q.dtype, device=q.device)
    for row, prefix, n, start in request_spans(req_pool_indices, prefix_lens, extend_lens):
        slots = req_to_token[row, : prefix + n].long()
        seen = causal_mask(prefix, n, q.device, window)[:, None, :]
        out[start : start + n] = attend_heads(q[start : start + n], gather_heads(k_buffer, slots),
                                              gather_heads(v_buffer, slots), seen, sm_scale, sinks).to(q.dtype)
    return out


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, sm_scale: float,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of one request's queries q [n, Hq, D] over its keys k [L, Hkv, D] and values v [L, Hkv, Dv]
    (float32; query head h reads kv head h // (Hq // Hkv)) where `seen` [n, 1 or Hkv, L] allows -> float32
    [n, Hq, Dv]. sinks [Hq]: an extra logit per head in the softmax's denominator that adds nothing to the output."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
    scores = torch.einsum("nhd,lhd->nhl", q.float(), k) * sm_scale
    scores.masked_fill_(~seen.repeat_interleave(group if seen.shape[1] > 1 else 1, dim=1), float("-inf"))
    if sinks is not None:  # the sink's column joins the softmax, then is dropped
        sink_col = sinks.float()[None, :, None].expand(n, heads, 1)
        probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("nhl,lhv->nhv", probs, v)


def gqa_decode_torch(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """GQA decode: one new token per request (already in the pool). q [B, Hq, D], seq_lens [B] ->
    [B, Hq, Dv]; the extend twin with one token each."""
    ones = torch.ones_like(seq_lens)
    return gqa_extend_torch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens - 1, ones, sm_scale,
                            sinks, window)


def sparse_mla_torch(q: torch.Tensor, kv_buffer: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
                     kv_lora_rank: int, block: int = 64) -> torch.Tensor:
    """Absorbed MLA over selected tokens (DSA sparse attention). q [N, H, kv_lora_rank + rope],
    kv_buffer [slots, kv_lora_rank + rope] (or packed FP8 rows, as in mla_extend_torch), topk_slots [N, K]
    pool slots each query attends to (-1 = none; the caller has applied causality) -> [N, H, kv_lora_rank]
    in q's dtype, fp32 softmax. A query with no slot gets zeros. Queries go in blocks of `block` so the
    gathered latents stay small."""
    out = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    for s0 in range(0, q.shape[0], block):
        sel = topk_slots[s0 : s0 + block]
        valid = sel >= 0  # [n, K]
        kv = gather_latents(kv_buffer, sel.clamp(min=0), kv_lora_rank, q.shape[-1])  # [n, K, D]
        scores = torch.einsum("nhd,nkd->nhk", q[s0 : s0 + block].float(), kv) * sm_scale
        probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1).nan_to_num(0.0)
        out[s0 : s0 + block] = torch.einsum("nhk,nkc->nhc", probs, kv[..., :kv_lora_rank]).to(q.dtype)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one sequence, in chunks (the linear-attention layers of Gated DeltaNet and, with a
    per-channel decay, Kimi Delta Attention).

    q, k [T, H, dk] (L2-normalised here, q also scaled by dk^-0.5), v [T, H, dv], g [T, H] log decay (<= 0) per
    head, or [T, H, dk] per key channel (KDA), beta [T, H], state [H, dk, dv] fp32 (the recurrent state before
    token 0) -> (out [T, H, dv] in v's dtype, state after the last token). Token by token:
        S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t.
    Inside a chunk with G_t = g_1 + ... + g_t, the corrections u solve the unit lower-triangular system
        u_t + beta_t sum_{i<t} (k_t . e^{G_t - G_i} k_i) u_i = beta_t (v_t - S_0^T (e^{G_t} k_t)),
    then o_t = S_0^T (e^{G_t} q_t) + sum_{i<=t} (q_t . e^{G_t - G_i} k_i) u_i and
    S_C = e^{G_C} S_0 + sum_i (e^{G_C - G_i} k_i) u_i^T (products with e^G elementwise over the key channels; a
    per-head g is the same decay on every channel). One token is the recurrent form."""
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v, g, beta = _l2norm(k.float()), v.float(), g.float(), beta.float()
    per_channel = g.dim() == 3
    s = state.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for c0 in range(0, q.shape[0], chunk):
        qc, kc, vc = (t[c0 : c0 + chunk].transpose(0, 1) for t in (q, k, v))  # [H, C, d]
        bc = beta[c0 : c0 + chunk].t()  # [H, C]
        n = qc.shape[1]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if per_channel:
            cum = g[c0 : c0 + chunk].transpose(0, 1).cumsum(1)  # [H, C, dk]
            # e^{G_t - G_i} per channel for i <= t: [H, C, C, dk] (exponents <= 0 where used, so no overflow)
            diff = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~lower[None, :, :, None], float("-inf"))
            decay = diff.exp()
            kk = torch.einsum("htc,hic,htic->hti", kc, kc, decay)  # k_t . e^{G_t - G_i} k_i
            qk = torch.einsum("htc,hic,htic->hti", qc, kc, decay)
            k_s, q_s = (kc * cum.exp()) @ s, (qc * cum.exp()) @ s  # S_0^T (e^{G_t} k_t), S_0^T (e^{G_t} q_t)
            last = cum[:, -1]  # [H, dk]
            k_tail = kc * (last[:, None, :] - cum).exp()  # e^{G_C - G_i} k_i
            s_decay = last.exp()[..., None]  # [H, dk, 1]
        else:
            cum = g[c0 : c0 + chunk].t().cumsum(-1)  # [H, C]
            decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # e^{G_t - G_i}
            kk, qk = (kc @ kc.transpose(1, 2)) * decay, (qc @ kc.transpose(1, 2)) * decay
            k_s, q_s = cum.exp()[..., None] * (kc @ s), cum.exp()[..., None] * (qc @ s)
            k_tail = kc * (cum[:, -1:] - cum).exp()[..., None]
            s_decay = cum[:, -1].exp()[:, None, None]
        system = (bc[:, :, None] * kk).tril(-1) + torch.eye(n, device=q.device)
        rhs = bc[..., None] * (vc - k_s)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [H, C, dv]
        out[c0 : c0 + chunk] = (q_s + qk @ u).transpose(0, 1)  # qk is 0 above the diagonal (decay)
        s = s_decay * s + k_tail.transpose(1, 2) @ u
    return out.to(v.dtype), s


def causal_conv1d_torch(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence continuing from its rolling state.
    x [T, C], conv_state [C, W-1] (the previous W-1 inputs, oldest first), weight [C, W] ->
    (silu(conv) [T, C] in x's dtype, the new state [C, W-1])."""
    width = weight.shape[-1]
    full = torch.cat((conv_state.to(x.dtype), x.t()), dim=-1)  # [C, W-1+T]
    windows = full.unfold(-1, width, 1)  # [C, T, W]
    y = (windows.float() * weight.float()[:, None, :]).sum(-1).t()
    return F.silu(y).to(x.dtype), full[:, full.shape[-1] - (width - 1):].to(conv_state.dtype)


def _sequences(rows: torch.Tensor, extend_lens: torch.Tensor, reset: torch.Tensor):
    """(state row, first token, token count, start from zeros?) of each sequence of a packed batch."""
    start = 0
    for row, n, fresh in zip(rows.tolist(), extend_lens.tolist(), reset.tolist()):
        if n:
            yield row, start, n, fresh
        start += n


def gated_delta_rule_batch_torch(q, k, v, g, beta, states: torch.Tensor, rows: torch.Tensor, extend_lens: torch.Tensor,
                                 reset: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """The gated delta rule over a packed batch: sequence b is tokens of extend_lens[b] in order,
    its recurrent state is states[rows[b]] ([R, H, dk, dv] fp32, updated in place; zeros first when
    reset[b]). q, k [N, H, dk], v [N, H, dv], g [N, H] or per key channel [N, H, dk], beta [N, H] -> [N, H, dv]."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for row, s0, n, fresh in _sequences(rows, extend_lens, reset):
        state = torch.zeros_like(states[row]) if fresh else states[row]
        sl = slice(s0, s0 + n)
        out[sl], states[row] = gated_delta_rule_torch(q[sl], k[sl], v[sl], g[sl], beta[sl], state, chunk)
    return out


def causal_conv1d_batch_torch(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                              extend_lens: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over a packed batch; conv_states [R, C, W-1] updated in place (zeros
    first when reset). x [N, C] -> [N, C]."""
    out = torch.empty_like(x)
    for row, s0, n, fresh in _sequences(rows, extend_lens, reset):
        state = torch.zeros_like(conv_states[row]) if fresh else conv_states[row]
        out[s0 : s0 + n], conv_states[row] = causal_conv1d_torch(x[s0 : s0 + n], state, weight)
    return out
