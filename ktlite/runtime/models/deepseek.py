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
On a CPU device an extend batch picks the form with fewer multiply-adds (`decompressed_cheaper`): per query-key
pair the absorbed form does 2 kv_lora_rank + rope (1,088 at V2/V3 dims) and the decompressed one nope + rope + v
(320), but decompressing costs kv_lora_rank (nope + v) per visible position where absorbing costs as much per
new token; so a prompt or a long chunk decompresses (its K / V handed to attention.gqa_extend), decode and short
chunks after a long prefix stay absorbed. That pays only where gqa_extend runs compiled on the CPU: its torch twin
materialises the [tokens x heads x context] scores and was slower than the compiled absorbed kernel (V2-Lite
dims, 2 shared cores: 0.5 vs 0.2 s at 512 tokens, 23 vs 15 s at 4k), so without a "cpu" gqa_extend registered
(kernels/attention.py) every extend stays absorbed. The GPU path stays absorbed (its Triton extend kernel).
With `--kv-cache-dtype fp8_e4m3` the pool stores each latent as a packed FP8 row (fp8 values with a
scale per 128, the rope'd key in bf16; kernels/triton/kv_fp8.py): `store` quantizes on write and the
kernels dequantize as they read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ktlite.kernels.cpu import mla_block
from ktlite.kernels.cpu.attention import pool_arrays
from ktlite.kernels.cpu.dense_linear import QuantizedHeads
from ktlite.kernels.cpu.target import bf16_gemm_wins
from ktlite.kernels.attention import gqa_extend, implementations, mla_decode, mla_extend
from ktlite.kernels.triton.reference import gather_latents
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.models.base import Backbone, CausalLM, DecoderLayer
from ktlite.runtime.models.deepseek_config import ARCHITECTURES, MODEL_TYPES, TINY_CONFIGS, DeepseekConfig, parse_config
from ktlite.runtime.models.fp8 import linear_weight
from ktlite.runtime.models.layers import MLP, MoE, RMSNorm, plain_norm
from ktlite.runtime.models.mtp import MTPLayer
from ktlite.runtime.models.rope import RotaryEmbedding


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


# the decompressed K and V (counted at 4 bytes a value) of an extend batch above which it stays absorbed: they are
# temporaries
DECOMPRESS_BYTES = 1 << 30


def decompressed_cheaper(cfg: DeepseekConfig, prefix_lens: list[int], extend_lens: list[int]) -> bool:
    """Whether the decompressed form costs fewer multiply-adds per head than the absorbed one for an extend batch
    (P prefix and N new tokens per request, pairs = N P + N (N + 1) / 2): absorbed = pairs (2 kv_lora_rank + rope)
    + N kv_lora_rank (nope + v) (absorbing the query, W_UV on the output); decompressed = (P + N) kv_lora_rank
    (nope + v) (K and V of every visible position) + pairs (nope + rope + v). At V2/V3 dims: pairs > 170 P."""
    lora, rope, nope, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    absorbed = decompressed = 0
    for p, n in zip(prefix_lens, extend_lens):
        pairs = n * p + n * (n + 1) // 2
        absorbed += pairs * (2 * lora + rope) + n * lora * (nope + v)
        decompressed += (p + n) * lora * (nope + v) + pairs * (nope + rope + v)
    return decompressed < absorbed


def decompressed_dtype(latents: torch.Tensor) -> torch.dtype:
    """dtype of the decompressed K and V: bf16 where the latent pool is bf16 (a bf16 model's precision; on a CPU
    with AMX-BF16 or AVX512-BF16 the attention then runs in bf16 products), else fp32. An FP8 pool keeps them fp32: its attention is
    then exactly that of an fp32 pool holding the rounded latents, whatever the chunking (tests/test_kv_fp8.py), where
    bf16 K / V would differ between a long chunk's decompressed form and a short one's absorbed form, and each
    layer's e4m3 storage (steps of 1/8) magnifies such differences into different tokens."""
    return torch.bfloat16 if latents.dtype == torch.bfloat16 else torch.float32


def compiled_gqa_extend() -> bool:
    """Whether a CPU device runs attention.gqa_extend compiled (a "cpu" implementation is registered)."""
    return "cpu" in implementations("gqa_extend")


def per_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., heads, a] times w [heads, a, b], head by head -> [..., heads, b], as one batched matmul
    (torch.einsum spent ~0.1 ms a call parsing, the largest share of a CPU decode step's overhead)."""
    *lead, heads, a = x.shape
    y = torch.bmm(x.reshape(-1, heads, a).transpose(0, 1), w)  # [heads, M, b]
    return y.transpose(0, 1).reshape(*lead, heads, w.shape[-1])


class MLAttention(nn.Module):
    plan_component = "attention"
    keep_linears = ("kv_b_proj",)  # read as the W_UK / W_UV matrices, not called: see head_matrices

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
        # W_UK / W_UV as modules applying them per head, once the CPU dense path has stored them quantized
        # (head_matrices); until then they are read from kv_b_proj
        self.uk_heads: nn.Module | None = None
        self.uv_heads: nn.Module | None = None
        # the query's first projection and kv_a_proj_with_mqa both read the layer input: a CPU device stores them
        # as one matrix (cpu_dense.py), one kernel call
        first = "q_proj" if cfg.q_lora_rank is None else "q_a_proj"
        self.fused_linears = {"q_kv_a_proj": (first, "kv_a_proj_with_mqa")}
        self.q_kv_a_proj: nn.Module | None = None
        self._compiled_blocks: dict[int, tuple] = {}  # tokens -> (projection modules, compiled_decode_block)

    def shard(self, prefix: str, tp, shards: dict) -> None:
        """Tensor parallel: heads split (q / kv_b column-parallel, o_proj row-parallel); q_a_proj,
        kv_a_proj_with_mqa and the norms replicated, so every rank computes the same full latent."""
        from ktlite.runtime.models.tp_layers import column, row

        c, heads = self.cfg, self.cfg.num_attention_heads
        self.num_heads = heads // tp.size
        column(self, "q_proj" if c.q_lora_rank is None else "q_b_proj", prefix, heads * c.qk_head_dim, tp, shards)
        column(self, "kv_b_proj", prefix, heads * (c.qk_nope_head_dim + c.v_head_dim), tp, shards)
        row(self, "o_proj", prefix, heads * c.v_head_dim, tp, shards)

    def input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> (q_proj(x), or q_a_proj(x) with a query LoRA; kv_a_proj_with_mqa(x))."""
        if self.q_kv_a_proj is None:
            first = self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj
            return first(x), self.kv_a_proj_with_mqa(x)
        both = self.q_kv_a_proj(x)
        return both.split([both.shape[-1] - self.cfg.kv_latent_dim, self.cfg.kv_latent_dim], dim=-1)

    def query(self, q_in: torch.Tensor) -> torch.Tensor:
        """input_projections' first output [..., ·] -> q [..., heads, qk_head_dim] (rope part not yet rotated)."""
        q = q_in if self.cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(q_in))
        return q.view(*q_in.shape[:-1], self.num_heads, self.cfg.qk_head_dim)

    def latent(self, kv_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """input_projections' second output [..., kv_latent_dim] -> the per-token cache entry
        [..., kv_lora_rank + qk_rope_head_dim] (the compressed KV normalised, the shared key rotated)."""
        c = self.cfg
        compressed, k_pe = kv_in.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pe = self.rotary(k_pe.unsqueeze(-2), cos, sin).squeeze(-2)
        return torch.cat((self.kv_a_layernorm(compressed), k_pe), dim=-1)

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Split kv_b_proj into W_UK [heads, qk_nope, kv_lora_rank] and W_UV [heads, v_head, kv_lora_rank]."""
        c = self.cfg
        w = linear_weight(self.kv_b_proj, self.kv_a_layernorm.weight.dtype)
        w = w.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def head_matrices(self) -> dict[str, torch.Tensor]:
        """The CPU dense path's protocol (cpu_dense.py): attribute -> per-head matrices [heads, N, K] (y = x @ W.T
        per head) to be stored quantized as that attribute, replacing the keep_linears; {} where kv_b_proj is
        not a plain Linear (FP8 weights stay FP8)."""
        if not isinstance(self.kv_b_proj, nn.Linear):
            return {}
        w_uk, w_uv = self.w_uk_uv()
        return {"uk_heads": w_uk.transpose(1, 2), "uv_heads": w_uv}

    def absorbed_query(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q [..., heads, qk_head_dim] -> [..., heads, kv_lora_rank + qk_rope_head_dim] (W_UK folded in)."""
        c = self.cfg
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        if self.uk_heads is None:
            q_latent = per_head_matmul(q_nope, self.w_uk_uv()[0])
        else:
            q_latent = self.uk_heads(q_nope)
        return torch.cat((q_latent, self.rotary(q_pe, cos, sin)), dim=-1)

    def output(self, attn_latent: torch.Tensor) -> torch.Tensor:
        """attn_latent [..., heads, kv_lora_rank] -> [..., hidden] (W_UV then o_proj)."""
        if self.uv_heads is None:
            v = per_head_matmul(attn_latent, self.w_uk_uv()[1].transpose(1, 2))
        else:
            v = self.uv_heads(attn_latent)
        return self.o_proj(v.flatten(-2))

    def store(self, pool, name: str, layer_idx: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write new tokens' entries [n, values] of cache kind `name`, packed (quantized) when the pool's
        buffer holds FP8 rows."""
        pool.write(name, layer_idx, slots, values, self.cfg.fp8_rows(name))

    def forward_batch(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, ctx,
                      layer_idx: int) -> torch.Tensor:
        """Absorbed MLA over the KV pool's latents: h [N, hidden] -> this rank's partial output [N, hidden]."""
        c, pool = self.cfg, ctx.kv_pool
        latents, decode = pool.buffer("latent", layer_idx), batch.is_decode
        if decode and mla_block.runs(h, latents):
            block = self.compiled_decode_block(h.shape[0])
            if block is not None:
                return self.compiled_decode(h, cos, sin, batch, latents, pool.req_to_token, block)
        q_in, kv_in = self.input_projections(h)
        self.store(pool, "latent", layer_idx, batch.out_cache_loc, self.latent(kv_in, cos, sin))
        if not decode and self.decompresses(h, batch):
            v = self.decompressed_extend(self.query(q_in), cos, sin, latents, pool.req_to_token, batch)
            return self.o_proj(v.flatten(-2))
        q = self.absorbed_query(self.query(q_in), cos, sin)  # [N, heads, kv_lora_rank + rope]
        if decode:
            o = mla_decode(q, latents, pool.req_to_token, batch.req_pool_indices, batch.prefix_lens + 1,
                           c.softmax_scale, c.kv_lora_rank)
        else:
            o = mla_extend(q, latents, pool.req_to_token, batch.req_pool_indices, batch.prefix_lens,
                           batch.extend_lens, c.softmax_scale, c.kv_lora_rank)
        return self.output(o)

    def decompresses(self, h: torch.Tensor, batch: ForwardBatch) -> bool:
        """Whether an extend batch runs in the decompressed form: on a CPU device with a compiled gqa_extend, where
        it costs less (decompressed_cheaper) and its K and V stay within DECOMPRESS_BYTES."""
        c = self.cfg
        prefix, extend = batch.prefix_lens.tolist(), batch.extend_lens.tolist()
        seen = sum(p + n for p, n in zip(prefix, extend) if n)
        kv_bytes = 4 * seen * self.num_heads * (c.qk_head_dim + c.v_head_dim)
        return (h.device.type == "cpu" and compiled_gqa_extend() and kv_bytes <= DECOMPRESS_BYTES
                and decompressed_cheaper(c, prefix, extend))

    def kv_b_matrix(self) -> torch.Tensor:
        """kv_b_proj's weight [heads * (nope + v), kv_lora_rank] in fp32, from the modules holding W_UK / W_UV where a
        CPU device stored them (head_matrices; their `dequantized()` matrices)."""
        if self.uk_heads is None:
            return torch.cat(self.w_uk_uv(), dim=1).flatten(0, 1).float()
        w_uk = self.uk_heads.dequantized().transpose(1, 2)  # [heads, nope, kv_lora]
        return torch.cat((w_uk, self.uv_heads.dequantized()), dim=1).flatten(0, 1)

    def decompressed_extend(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, latents: torch.Tensor,
                            req_to_token: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [N, heads, qk_head_dim] (rope part not yet rotated) -> the attention output [N, heads, v_head] in the
        decompressed form: each request's visible latents through kv_b_proj into per-head K = [k_nope, k_pe] and
        V, then causal GQA attention with one K / V head per query head over them (attention.gqa_extend)."""
        c, heads = self.cfg, self.num_heads
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_full = torch.cat((q_nope, self.rotary(q_pe, cos, sin)), dim=-1).float()
        kv_dtype = decompressed_dtype(latents)
        # bf16 K and V from a bf16 GEMM where it beats fp32's (AMX: ~3x; the 16k-token prefill of V2-Lite-8L in
        # 512-token chunks decompresses 270k positions a layer)
        gemm_dtype = torch.bfloat16 if kv_dtype == torch.bfloat16 and bf16_gemm_wins() else torch.float32
        w = self.kv_b_matrix().to(gemm_dtype)
        lens = (batch.prefix_lens + batch.extend_lens) * (batch.extend_lens > 0)
        rows = torch.zeros(len(lens), max(int(lens.max()), 1), dtype=torch.int32)  # request b's K / V rows
        keys, values, start = [], [], 0
        for b, (row, seen) in enumerate(zip(batch.req_pool_indices.tolist(), lens.tolist())):
            if not seen:
                continue
            latent = gather_latents(latents, req_to_token[row, :seen].long(), c.kv_lora_rank, c.kv_latent_dim)
            compressed, k_pe = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            k_nope, v = (compressed.to(gemm_dtype) @ w.T).view(seen, heads, -1).split(
                [c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            keys.append(torch.cat((k_nope, k_pe[:, None, :].expand(-1, heads, -1)), dim=-1).to(kv_dtype))
            values.append(v.to(kv_dtype))
            rows[b, :seen] = torch.arange(start, start + seen, dtype=torch.int32)
            start += seen
        out = gqa_extend(q_full, torch.cat(keys), torch.cat(values), rows, torch.arange(len(lens)), batch.prefix_lens,
                         batch.extend_lens, c.softmax_scale)
        return out.to(q.dtype)

    def compiled_decode_block(self, tokens: int) -> tuple | None:
        """mla_block's fixed arguments of this layer (block_weights) where every projection is stored quantized and
        runs `tokens` tokens on its row path (a CPU device's decode: cpu_dense.py), else None. Built once per token
        count and kept while the projection modules stay the same."""
        lora = self.cfg.q_lora_rank is not None
        parts = (self.q_kv_a_proj, self.q_b_proj if lora else self.q_kv_a_proj, self.uk_heads, self.uv_heads,
                 self.o_proj)
        kept = self._compiled_blocks.get(tokens)
        if kept is not None and all(a is b for a, b in zip(kept[0], parts)):
            return kept[1]
        if not (all(isinstance(p, QuantizedHeads) and p.on_rows(tokens) for p in parts) and self.o_proj.bias is None
                and self.o_proj.output_op is None):
            return None
        c = self.cfg
        q_a_norm = self.q_a_layernorm.weight if lora else self.kv_a_layernorm.weight[:0]
        q_kv_a, q_b, uk, uv, o = (p.row_weights for p in parts)
        block = mla_block.block_weights(
            q_kv_a, q_a_norm.detach().numpy(), q_b, uk, uv, o, self.kv_a_layernorm.weight.detach().numpy(),
            self.kv_a_layernorm.eps, self.rotary.cfg.interleave, self.num_heads, c.qk_nope_head_dim,
            c.qk_rope_head_dim, c.kv_lora_rank, c.softmax_scale)
        self._compiled_blocks[tokens] = (parts, block)
        return block

    def compiled_decode(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                        latents: torch.Tensor, req_to_token: torch.Tensor, block: tuple) -> torch.Tensor:
        """forward_batch of a decode batch as one compiled call (mla_block; block: compiled_decode_block): the same
        steps from the same stored weights."""
        return torch.from_numpy(mla_block.mla_decode_block(
            h.contiguous().numpy(), block, self.pool_rows(latents), cos.numpy(), sin.numpy(),
            batch.out_cache_loc.numpy(), req_to_token.numpy(), batch.req_pool_indices.numpy(),
            batch.prefix_lens.numpy()))

    def pool_rows(self, latents: torch.Tensor) -> np.ndarray | tuple:
        """This layer's latent pool as the compiled kernels read it in place (attention.pool_arrays)."""
        return pool_arrays(latents, self.cfg.kv_lora_rank, self.cfg.kv_latent_dim)

    def compiled_residual(self, norm: nn.Module, pool, layer_idx: int, tokens: int) -> Callable | None:
        """x + forward_batch(norm(x)) for `tokens` decode tokens as one compiled call on the residual stream x
        (mla_block.residual_block, a compiled_decode.Block) where forward_batch would take the compiled block over
        this layer's plain fp32 or bf16 latents and norm is a plain fp32 RMSNorm; else None."""
        latents = pool.buffer("latent", layer_idx)
        if latents.dtype not in (torch.float32, torch.bfloat16) or latents.device.type != "cpu" or not plain_norm(norm):
            return None
        block = self.compiled_decode_block(tokens)
        if block is None:
            return None
        return mla_block.residual_block(norm.weight.detach().numpy(), norm.eps, block, self.pool_rows(latents),
                                        self.rotary.inv_freq.numpy(), self.rotary.cfg.cos_sin_scale)

    def causal(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whole sequences x [B, T, hidden] at positions [B, T], causal, no cache: the plain decompressed form
        (differentiable; tests train an MTP layer through it)."""
        return self(x, positions, None, 0, absorbed=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: LatentCache | None,
        layer_idx: int,
        absorbed: bool,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] at positions [B, T] (the cache holds positions 0..cache.length-1); `keep` [B, T, S]: the
        keys each query may see beyond causality (sparse attention's selection), None: all of them."""
        c = self.cfg
        cos, sin = self.rotary.cos_sin(positions)  # [B, T, rope/2]
        q_in, kv_in = self.input_projections(x)
        q = self.query(q_in)  # [B, T, heads, qk_head_dim]
        new_latent = self.latent(kv_in, cos, sin)  # [B, T, D]
        past = cache.length if cache is not None else 0
        latents = cache.write(layer_idx, new_latent) if cache is not None else new_latent  # [B, S, D]
        t, s = x.shape[1], latents.shape[1]
        # query i sits at position past + i and may see keys 0..past + i
        causal = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=past)
        if keep is not None:
            causal = (causal & keep).unsqueeze(1)  # [B, 1 (heads), T, S]

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


def _layer(cfg: DeepseekConfig, i: int, rotary: RotaryEmbedding, routed_experts: bool, attention: type) -> DecoderLayer:
    if cfg.is_moe_layer(i):
        mlp = MoE(cfg.router, cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size, routed_experts)
    else:
        mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
    return DecoderLayer(i, cfg.hidden_size, cfg.rms_norm_eps, attention(cfg, rotary), mlp)


class DeepseekForCausalLM(CausalLM):
    """`model(input_ids [B, T]) -> logits [B, T, vocab]` (float32); pass a LatentCache to decode, and
    `absorbed=False` for the naive form."""

    attention_class: type = MLAttention  # DeepSeek-V3.2 swaps in sparse MLA

    def __init__(self, cfg: DeepseekConfig, routed_experts: bool = True):
        rotary = RotaryEmbedding(cfg.rope)
        layers = [_layer(cfg, i, rotary, routed_experts, self.attention_class) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, Backbone(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, rotary, layers))
        if cfg.mtp_layer:  # its routed experts, as every MoE layer's, are the runtime's (CPU store, GPU experts)
            self.mtp = MTPLayer.around(_layer(cfg, cfg.num_hidden_layers, rotary, routed_experts, self.attention_class))

    checkpoint_name = CausalLM.mtp_as_last_layer

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, cache: LatentCache | None = None, absorbed: bool = True
    ) -> torch.Tensor:
        b, t = input_ids.shape
        past = cache.length if cache is not None else 0
        positions = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), positions, cache, layer.layer_idx, absorbed)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if cache is not None:
            cache.length += t
        return self.lm_head(self.model.norm(x)).float()

    def new_cache(self, batch: int, max_len: int) -> LatentCache:
        return LatentCache.allocate(self.config, batch, max_len, self.dtype, self.device)


Model = DeepseekForCausalLM
__all__ = ["ARCHITECTURES", "MODEL_TYPES", "TINY_CONFIGS", "DeepseekConfig", "DeepseekForCausalLM", "LatentCache", "Model", "parse_config"]
