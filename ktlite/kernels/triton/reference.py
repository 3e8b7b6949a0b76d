"""Plain-torch twins of the Triton kernels: same signatures, the reference in tests and the
fallback when the "GPU side" is a CPU device.

They favour clarity, but are also what a CPU-only run executes, so they avoid obvious waste
(MoE computes only experts that received tokens; matmuls run in the weights' dtype).
"""

import logging

import torch
import torch.nn.functional as F

from ktlite.kernels.triton.quant import QuantizedWeight, dequantize_expert

logger = logging.getLogger(__name__)

FP8_BLOCK = 128  # block-FP8 checkpoints: one weight_scale_inv per 128x128 weight block


def request_spans(req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor):
    """(row, prefix, n, start) of each request with new tokens: its queries are rows start..start+n."""
    start = 0
    for row, prefix, n in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        if n:
            yield row, prefix, n, start
        start += n


def causal_mask(prefix: int, n: int, device: torch.device) -> torch.Tensor:
    """[n, prefix + n] bool: query i (absolute position prefix + i) sees keys at positions <= its own."""
    pos_q = torch.arange(n, device=device) + prefix
    return torch.arange(prefix + n, device=device)[None, :] <= pos_q[:, None]


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
    kv_buffer: [slots, kv_lora_rank + rope]; req_to_token: [max_reqs, max_context] int32;
    req_pool_indices, prefix_lens, extend_lens: [B]. Returns [N, H, kv_lora_rank] in q's dtype.
    Token i of request b sees positions 0..prefix_lens[b] + i (computed in fp32).
    """
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    for row, prefix, n, start in request_spans(req_pool_indices, prefix_lens, extend_lens):
        kv = kv_buffer[req_to_token[row, : prefix + n].long()].float()  # [total, Dk]
        scores = torch.einsum("nhd,ld->nhl", q[start : start + n].float(), kv) * sm_scale
        scores.masked_fill_(~causal_mask(prefix, n, q.device)[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start : start + n] = torch.einsum("nhl,lc->nhc", probs, kv[:, :kv_lora_rank]).to(q.dtype)
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


def _expert_weight(w: torch.Tensor | QuantizedWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, QuantizedWeight):
        return dequantize_expert(w, e, dtype)
    return w[e].to(dtype)


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
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e x) * up_e x) over selected experts e = topk_ids[t, j]
    with expert_mask[e] True (all experts if None); the others, and ids outside [0, E), contribute 0
    (the CPU side computes them).

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
        gate_up = x @ _expert_weight(w13, e, hidden.dtype).T  # [n, 2I]
        gate, up = gate_up.float().chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(hidden.dtype)
        y = (act @ _expert_weight(w2, e, hidden.dtype).T).float() * flat_w[pairs, None]
        out.index_add_(0, tokens, y)
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """GQA causal extend. q [N, Hq, D] (requests concatenated in order), k_buffer [slots, Hkv, D],
    v_buffer [slots, Hkv, Dv] -> [N, Hq, Dv] in q's dtype. Query head h reads kv head h // (Hq // Hkv);
    token i of request b sees positions 0..prefix_lens[b] + i (computed in fp32). k_scale/v_scale: stored
    value * scale = real value (float8_e4m3fn pools with a per-tensor scale; 1.0 otherwise)."""
    n_tokens, heads, _ = q.shape
    group = heads // k_buffer.shape[1]
    out = torch.empty(n_tokens, heads, v_buffer.shape[-1], dtype=q.dtype, device=q.device)
    for row, prefix, n, start in request_spans(req_pool_indices, prefix_lens, extend_lens):
        slots = req_to_token[row, : prefix + n].long()
        k = (k_buffer[slots].float() * k_scale).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = (v_buffer[slots].float() * v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->nhl", q[start : start + n].float(), k) * sm_scale
        scores.masked_fill_(~causal_mask(prefix, n, q.device)[:, None, :], float("-inf"))
        out[start : start + n] = torch.einsum("nhl,lhv->nhv", scores.softmax(-1), v).to(q.dtype)
    return out


def gqa_decode_torch(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """GQA decode: one new token per request (already in the pool). q [B, Hq, D], seq_lens [B] ->
    [B, Hq, Dv]; the extend twin with one token each."""
    ones = torch.ones_like(seq_lens)
    return gqa_extend_torch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens - 1, ones, sm_scale,
                            k_scale, v_scale)


def sparse_mla_torch(q: torch.Tensor, kv_buffer: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
                     kv_lora_rank: int, block: int = 64) -> torch.Tensor:
    """Absorbed MLA over selected tokens (DeepSeek Sparse Attention). q [N, H, kv_lora_rank + rope],
    kv_buffer [slots, kv_lora_rank + rope], topk_slots [N, K] pool slots each query attends to (-1 = none;
    the caller has applied causality) -> [N, H, kv_lora_rank] in q's dtype, fp32 softmax. A query with
    no slot gets zeros. Queries go in blocks of `block` so the gathered latents stay small."""
    out = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    for s0 in range(0, q.shape[0], block):
        sel = topk_slots[s0 : s0 + block]
        valid = sel >= 0  # [n, K]
        kv = kv_buffer[sel.clamp(min=0)].float()  # [n, K, D]
        scores = torch.einsum("nhd,nkd->nhk", q[s0 : s0 + block].float(), kv) * sm_scale
        probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1).nan_to_num(0.0)
        out[s0 : s0 + block] = torch.einsum("nhk,nkc->nhc", probs, kv[..., :kv_lora_rank]).to(q.dtype)
    return out
