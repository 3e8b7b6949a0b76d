"""Readable torch forward of DeepSeek-V2/V3 (MLA attention + routed/shared experts).

This is the reference the fast paths are tested against, so it favours clarity over speed. Parameter
names follow the HF checkpoints (`model.layers.{i}.self_attn.kv_b_proj.weight`, ...) so loading is a
name-for-name copy.

MLA caches one latent vector per token per layer: `kv_lora_rank` values of the normalised compressed
KV followed by `qk_rope_head_dim` values of the rotated shared key. Attention runs in two forms that
must agree:
- naive: decompress the cached latents with kv_b_proj into per-head K and V, then standard attention;
- absorbed: fold W_UK (the key half of kv_b_proj) into the query, attend over the latents directly and
  apply W_UV (the value half) after. This is the form the KV pool and kernels use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ktlite.runtime.models.config import DeepseekConfig
from ktlite.runtime.models.fp8 import linear_weight
from ktlite.runtime.models.rope import RotaryEmbedding
from ktlite.runtime.models.router import select_experts


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU MLP: dense layers, each routed expert and the shared experts."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class LatentCache:
    """Contiguous per-layer latent cache for B equal-length sequences (the reference's KV cache)."""

    layers: list[torch.Tensor]  # each [B, max_len, kv_latent_dim]
    length: int = 0

    @classmethod
    def allocate(cls, cfg: DeepseekConfig, batch: int, max_len: int, dtype: torch.dtype, device) -> "LatentCache":
        shape = (batch, max_len, cfg.kv_latent_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)])

    def write(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """Store latent [B, T, D] after the cached tokens; return all latents [B, length + T, D]."""
        end = self.length + latent.shape[1]
        self.layers[layer][:, self.length : end] = latent
        return self.layers[layer][:, :end]


class MLAttention(nn.Module):
    def __init__(self, cfg: DeepseekConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = heads  # the heads this module computes (fewer on a tensor-parallel rank)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=False)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> q [..., heads, qk_head_dim] (rope part not yet rotated)."""
        q = self.q_proj(x) if self.cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:-1], self.num_heads, self.cfg.qk_head_dim)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> the per-token cache entry [..., kv_lora_rank + qk_rope_head_dim]."""
        c = self.cfg
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pe = self.rotary(k_pe.unsqueeze(-2), cos, sin).squeeze(-2)
        return torch.cat((self.kv_a_layernorm(compressed), k_pe), dim=-1)

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Split kv_b_proj into W_UK [heads, qk_nope, kv_lora_rank] and W_UV [heads, v_head, kv_lora_rank]."""
        c = self.cfg
        w = linear_weight(self.kv_b_proj, self.kv_a_layernorm.weight.dtype)
        w = w.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def absorbed_query(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q [..., heads, qk_head_dim] -> [..., heads, kv_lora_rank + qk_rope_head_dim] (W_UK folded in)."""
        c = self.cfg
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        w_uk, _ = self.w_uk_uv()
        q_latent = torch.einsum("...hd,hdc->...hc", q_nope, w_uk)
        return torch.cat((q_latent, self.rotary(q_pe, cos, sin)), dim=-1)

    def output(self, attn_latent: torch.Tensor) -> torch.Tensor:
        """attn_latent [..., heads, kv_lora_rank] -> [..., hidden] (W_UV then o_proj)."""
        _, w_uv = self.w_uk_uv()
        v = torch.einsum("...hc,hvc->...hv", attn_latent, w_uv)
        return self.o_proj(v.flatten(-2))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: LatentCache | None,
        layer_idx: int,
        absorbed: bool,
    ) -> torch.Tensor:
        """x [B, T, hidden] at positions [B, T] (the cache holds positions 0..cache.length-1)."""
        c = self.cfg
        cos, sin = self.rotary.cos_sin(positions)  # [B, T, rope/2]
        q = self.query(x)  # [B, T, heads, qk_head_dim]
        new_latent = self.latent(x, cos, sin)  # [B, T, D]
        past = cache.length if cache is not None else 0
        latents = cache.write(layer_idx, new_latent) if cache is not None else new_latent  # [B, S, D]
        t, s = x.shape[1], latents.shape[1]
        # query i sits at position past + i and may see keys 0..past + i
        causal = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=past)

        if absorbed:
            q_abs = self.absorbed_query(q, cos, sin)  # [B, T, heads, D]
            scores = torch.einsum("bthd,bsd->bhts", q_abs.float(), latents.float()) * c.softmax_scale
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            attn = torch.einsum("bhts,bsc->bthc", probs, latents[..., : c.kv_lora_rank].float())
            return self.output(attn.to(x.dtype))

        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_full = torch.cat((q_nope, self.rotary(q_pe, cos, sin)), dim=-1)
        compressed, k_pe = latents.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(compressed).view(*compressed.shape[:2], self.num_heads, -1)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.num_heads, -1)), dim=-1)
        scores = torch.einsum("bthd,bshd->bhts", q_full.float(), k.float()) * c.softmax_scale
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("bhts,bshv->bthv", probs, v.float()).to(x.dtype)
        return self.o_proj(attn.flatten(-2))


class Router(nn.Module):
    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> topk_ids [N, k], topk_weights [N, k] (router math in float32)."""
        logits = F.linear(x.float(), self.weight.float())
        return select_experts(logits, self.cfg, self.e_score_correction_bias)


class MoE(nn.Module):
    """Router + routed experts + shared experts. Without `routed_experts` the expert weights are left
    out: the runtime keeps them elsewhere (CPU store, GPU expert buffers) and runs them itself."""

    def __init__(self, cfg: DeepseekConfig, routed_experts: bool = True):
        super().__init__()
        self.gate = Router(cfg)
        count = cfg.n_routed_experts if routed_experts else 0
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(count))
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def routed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]: sum over each token's chosen experts of weight * expert(x)."""
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in topk_ids.unique().tolist():
            token_idx, slot = (topk_ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[token_idx]).float() * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y)
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        topk_ids, topk_weights = self.gate(flat)
        out = self.routed(flat, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_idx: int, rotary: RotaryEmbedding, routed_experts: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, routed_experts) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, cache, absorbed: bool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, self.layer_idx, absorbed)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekBackbone(nn.Module):
    def __init__(self, cfg: DeepseekConfig, routed_experts: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary, routed_experts) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """`model(input_ids [B, T]) -> logits [B, T, vocab]` (float32); pass a LatentCache to decode."""

    def __init__(self, cfg: DeepseekConfig, routed_experts: bool = True):
        super().__init__()
        self.config = cfg
        self.model = DeepseekBackbone(cfg, routed_experts)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, cache: LatentCache | None = None, absorbed: bool = True
    ) -> torch.Tensor:
        b, t = input_ids.shape
        past = cache.length if cache is not None else 0
        positions = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, cache, absorbed)
        if cache is not None:
            cache.length += t
        return self.lm_head(self.model.norm(x)).float()

    def new_cache(self, batch: int, max_len: int) -> LatentCache:
        return LatentCache.allocate(self.config, batch, max_len, self.dtype, self.device)

    @torch.inference_mode()
    def generate_greedy(
        self, input_ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...] = (), absorbed: bool = True
    ) -> torch.Tensor:
        """Prefill then token-by-token decode with the latent cache; returns new ids [B, <= max_new_tokens].

        Stops early only when every sequence has produced a stop id (like HF generate's EOS handling
        for a batch, later tokens of finished rows are still computed but are not meaningful).
        """
        b, t = input_ids.shape
        cache = self.new_cache(b, t + max_new_tokens)
        logits = self(input_ids, cache, absorbed)
        out: list[torch.Tensor] = []
        done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        stops = torch.tensor(stop_ids, dtype=torch.long, device=input_ids.device)
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1)
            out.append(nxt)
            done |= torch.isin(nxt, stops)
            if bool(done.all()) or len(out) == max_new_tokens:
                break
            logits = self(nxt[:, None], cache, absorbed)
        return torch.stack(out, dim=1)
