"""DeepSeek-V4 (`DeepseekV4ForCausalLM`: DeepSeek-V4-Flash, -Pro).

Attention: shared-KV MQA: one `head_dim`-wide (512) head is both key and value (`wkv`, then a weighted RMSNorm); q
goes through a LoRA (`wq_a`, weighted `q_norm`, `wq_b`) and an unweighted RMSNorm per head. RoPE (interleaved pairs)
rotates the *trailing* `qk_rope_head_dim` values of each head; since V carries the keys' rotation, the output's rope
slice is rotated back at the query's position. A learned sink logit per head joins each softmax. The output
projection is grouped: block-diagonal over `o_groups` (`wo_a`), then `wo_b`.
Every layer sees the last `sliding_window` tokens (the query's own included) plus, on compressed layers, entries
that each pool a window of tokens (a softmax over the window's gate logits plus a learned position bias, per channel,
then a weighted RMSNorm and rope at the window's first position):
- HCA layers (`heavily_compressed_attention`, rate 128): one entry per 128 tokens; a query sees every closed window.
- CSA layers (`compressed_sparse_attention`, rate 4): each entry pools 8 tokens (window w's second half-channels and
  window w-1's first half-channels: overlapping windows); a Lightning Indexer (its own compressor at
  `index_head_dim`, scores sum_h w_h relu(q_h . k)) keeps the top `index_topk` closed entries per query.
Sliding-only layers rope with `rope_theta`; compressed layers (attention, compressors, indexer) with
`compress_rope_theta` and the file's YaRN (cos/sin not rescaled: transformers' attention_factor 1).

Residual: manifold-constrained hyper-connections: `hc_mult` residual streams; before each block a projection of the
streams gives `pre` (collapse the streams into the block's input), `post` (spread its output) and `comb` (mix the
streams: softmax, then Sinkhorn iterations towards a doubly-stochastic matrix); a HyperHead collapses them at the end.
MoE in every layer: sqrt(softplus) scores, top-k with a correction bias, normalised, x routed_scaling_factor; the
first `num_hash_layers` layers take their experts from the token id (`tid2eid`); SwiGLU clamped at `swiglu_limit`
in routed and shared experts.

Cache (what this file declares; the attention here is a model-level torch implementation, no kernel yet):
- per token per layer: the compressed entries striped over the slots of the tokens they pool: entry w of a layer
  with rate r is r stripes of ceil(dim / r) values, stripe k at the slot of position w * r + k (`csa_entry`
  ceil(head_dim / 4) and `csa_index` ceil(index_head_dim / 4) per CSA layer, `hca_entry` ceil(head_dim / 128) per HCA
  layer). So the pool holds exactly one entry per window.
- per request per layer: `window`, a ring of the last `sliding_window` key/value rows (head_dim each, fp32): a query
  reads the ring's rows of the positions before its chunk and the chunk's own rows, then the chunk's last rows
  replace the oldest. (Kept per token, these rows were 88 % of Flash's cache: 43 x 512 of its 50,912 B a token.)
- per request per compressed layer: the compressor's (and indexer's) kv and gate projections of the tokens not yet
  pooled, a ring over positions (HCA: `rate` rows; CSA: `2 * rate` rows, since an entry also reads the previous
  window).
The rings are only read at positions the request has written, so a request that starts again from position 0 (a new
one, or a preempted one recomputing its prompt) needs no reset. The state is not rewindable and the entries are not a
function of a token prefix alone (the window straddling a prefix's end pools tokens after it), so preemption
recomputes and there is no prefix cache (`snapshots_resume`): a cache that resumed only at positions that are
multiples of every rate (128), from a snapshot taken when a request passes one, would fit the striped layout; not
built. Speculative decoding is refused (drafts would advance the rings).

Names: the hub's (`layers.N.attn.wq_a`, `layers.N.attn.kv_norm`, `layers.N.ffn.experts.E.w1`, `embed`, `head`,
`hc_head_fn`, ...); a folder transformers re-saved keeps them under `model.` (`model.layers.N.attn.wq_a`,
`model.embed_tokens`, ...) but for the main kv norm (`attn.norm`), which `weight_renames` maps onto the same names.
The hub stores the attention projections (and the indexer's wq_b, the shared experts) in block FP8 with `.scale`
e8m0 tensors (`fp8_linears` says which: the compressors' and weights_proj stay bf16), the routed experts in FP4.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ktlite.errors import ConfigError
from ktlite.kernels.expert_activation import ExpertActivation
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.kv_cache import TokenCacheSpec
from ktlite.runtime.models.base import Backbone, CausalLM
from ktlite.runtime.models.config import Fields, ModelConfig, RopeConfig, RouterSpec, rope_config
from ktlite.runtime.models.fp8 import linear_weight
from ktlite.runtime.models.layers import MLP, MoE, RMSNorm, Router
from ktlite.runtime.models.rope import RotaryEmbedding, apply_rope
from ktlite.runtime.models.router import router_scores, weigh_experts
from ktlite.runtime.state_cache import RequestStateSpec

ARCHITECTURES = ("DeepseekV4ForCausalLM",)
MODEL_TYPES = ("deepseek_v4",)
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}  # the hub's `compress_ratios` values (transformers' reading)
HASH, ROUTED = "hash_moe", "moe"


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config(ModelConfig):
    # A request resuming from another's prefix would close the window that straddles the prefix's end and write that
    # entry's stripes into the prefix's shared slots (other requests read them): no prefix cache, a request recomputes
    # (see the module doc)
    snapshots_resume = False
    state_rewinds = False  # the compressors' rings: speculative decoding is refused
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int  # sliding_window: keys p - window + 1 .. p
    layer_kinds: tuple[str, ...]  # SLIDING, CSA or HCA per layer
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_iters: int
    hc_eps: float
    hash_layers: tuple[int, ...]
    router: RouterSpec
    shared_intermediate_size: int
    activation: ExpertActivation
    compress_rope: RopeConfig

    def is_moe_layer(self, layer_idx: int) -> bool:
        return True

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of the layer (0: sliding only)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_kinds[layer]]

    def layers_of(self, *kinds: str) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind in kinds)

    def token_cache_specs(self, tp_size: int = 1, kv_dtype: torch.dtype | None = None) -> list[TokenCacheSpec]:
        if kv_dtype is not None and kv_dtype.itemsize == 1:
            raise ConfigError("DeepSeek-V4: an FP8 KV cache is not supported yet")
        specs = []
        for name, kind, dim, rate in (("csa_entry", CSA, self.head_dim, self.csa_rate),
                                      ("csa_index", CSA, self.index_head_dim, self.csa_rate),
                                      ("hca_entry", HCA, self.head_dim, self.hca_rate)):
            if self.layers_of(kind):
                specs.append(TokenCacheSpec(name, self.layers_of(kind), (stripe(dim, rate),)))
        return specs

    def request_state_specs(self, tp_size: int = 1) -> list[RequestStateSpec]:
        specs = [RequestStateSpec("window", tuple(range(self.num_hidden_layers)), (self.window, self.head_dim))]
        for kind, prefix, rows, width in ((HCA, "hca", self.hca_rate, self.head_dim),
                                          (CSA, "csa", 2 * self.csa_rate, 2 * self.head_dim),
                                          (CSA, "idx", 2 * self.csa_rate, 2 * self.index_head_dim)):
            layers = self.layers_of(kind)
            if layers:
                specs += [RequestStateSpec(f"{prefix}_kv", layers, (rows, width)),
                          RequestStateSpec(f"{prefix}_gate", layers, (rows, width))]
        return specs

    def attention_workspace(self, tp_size: int) -> int:
        """q, the output before and after un-rotating, kv, the grouped projection, the indexer's q, per token."""
        return ((3 * self.num_attention_heads + 1) * self.head_dim + self.o_groups * self.o_lora_rank
                + self.index_heads * self.index_head_dim)

    def check_tensor_parallel(self, tp_size: int) -> None:
        for name, count in (("attention heads", self.num_attention_heads), ("o_groups", self.o_groups)):
            if count % tp_size:
                raise ConfigError(f"--tensor-parallel-size {tp_size}: the model's {count} {name} must split evenly")

    def expert_weight_name(self, layer: int, expert: int, proj: str) -> str:
        return f"layers.{layer}.ffn.experts.{expert}.{_EXPERT_PROJ[proj]}.weight"


_EXPERT_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


def _layer_kinds(f: Fields, layers: int) -> tuple[str, ...]:
    """transformers' reading: `layer_types`, else the hub's per-layer `compress_ratios` (0 / 4 / 128), else two HCA
    layers then CSA / HCA alternating."""
    kinds = f.get("layer_types")
    if kinds is None and f.get("compress_ratios") is not None:
        ratios = list(f.get("compress_ratios"))
        unknown = sorted({r for r in ratios if r not in RATIO_KINDS})
        if unknown:
            raise ConfigError(f"config.json: compress_ratios {unknown} are not supported (one of {sorted(RATIO_KINDS)})")
        kinds = [RATIO_KINDS[r] for r in ratios]
    if kinds is None:
        kinds = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    kinds = list(kinds)[:layers]
    if len(kinds) != layers or not set(kinds) <= {SLIDING, CSA, HCA}:
        raise ConfigError(f"config.json: layer_types must name {layers} layers, each one of {(SLIDING, CSA, HCA)}")
    return tuple(kinds)


def _compress_rates(f: Fields) -> tuple[int, int]:
    rates = {CSA: 4, HCA: 128, **(f.get("compress_rates") or {})}
    csa = f.get("compress_rate_csa", rates[CSA])
    hca = f.get("compress_rate_hca", rates[HCA])
    return int(csa), int(hca)


def _ropes(f: Fields, head_dim: int, partial: float) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress): `rope_parameters` nested as transformers writes it ({"main": ..., "compress": ...}), or the
    hub's flat `rope_scaling` (the compressed branches' YaRN) with `rope_theta` / `compress_rope_theta`."""
    max_pos = int(f.need("max_position_embeddings"))
    params = f.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        flat = {k: v for k, v in {**params, **(f.get("rope_scaling") or {})}.items() if k not in ("main", "compress")}
        if "rope_type" not in flat and flat.get("type") is not None:
            flat["rope_type"] = flat["type"]
        main = {"rope_type": "default", "rope_theta": float(f.get("rope_theta", 10000.0))}
        compress = {**flat, "rope_theta": float(f.get("compress_rope_theta", 160000.0))}
    if compress.get("rope_type", "default") == "yarn":
        compress.setdefault("attention_factor", 1.0)  # V4 does not rescale cos/sin (transformers' default here)
    ropes = []
    for params in (main, compress):
        params = {k: v for k, v in params.items() if k != "type"}
        params.setdefault("partial_rotary_factor", partial)
        ropes.append(rope_config({"rope_parameters": params}, head_dim, theta=10000.0, interleave=True,
                                 max_position_embeddings=max_pos))
    return ropes[0], ropes[1]


def parse_config(raw: dict[str, Any]) -> DeepseekV4Config:
    f = Fields(raw, {"max_position_embeddings": 1048576, "head_dim": 512, "num_key_value_heads": 1,
                     "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
                     "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
                     "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
                     "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "q_lora_rank": 1024})
    # no dense layers; transformers reads `intermediate_size` as an alias of moe_intermediate_size (its attribute_map),
    # and a stated one wins
    common = f.common(ARCHITECTURES[0], intermediate_size=0,
                      moe_intermediate_size=int(f.get("intermediate_size") or f.need("moe_intermediate_size")))
    layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    head_dim = int(f.values["head_dim"])
    if int(f.values["num_key_value_heads"]) != 1:
        raise ConfigError("config.json: DeepSeek-V4 shares one key/value head (num_key_value_heads must be 1)")
    if f.get("qk_rope_head_dim") is not None and f.get("partial_rotary_factor") is None:
        partial = int(f.get("qk_rope_head_dim")) / head_dim
    else:
        partial = float(f.get("partial_rotary_factor", 64 / 512))
    kinds = _layer_kinds(f, layers)
    mlp_kinds = f.get("mlp_layer_types")
    if mlp_kinds is None:
        n_hash = int(f.get("num_hash_layers", 3))
        mlp_kinds = [HASH] * min(layers, n_hash) + [ROUTED] * max(0, layers - n_hash)
    mlp_kinds = list(mlp_kinds)[:layers]
    if len(mlp_kinds) != layers or not set(mlp_kinds) <= {HASH, ROUTED}:
        raise ConfigError(f"config.json: mlp_layer_types must name {layers} layers, each one of {(HASH, ROUTED)}")
    groups = int(f.values["o_groups"])
    if heads % groups:
        raise ConfigError(f"config.json: {heads} attention heads do not split into o_groups={groups}")
    csa_rate, hca_rate = _compress_rates(f)
    main, compress = _ropes(f, head_dim, partial)
    scoring = str(f.values["scoring_func"])
    experts = common["n_routed_experts"]
    limit = f.get("swiglu_limit")
    return DeepseekV4Config(
        **common,
        rope=main,
        compress_rope=compress,
        head_dim=head_dim,
        q_lora_rank=int(f.values["q_lora_rank"]),
        o_groups=groups,
        o_lora_rank=int(f.values["o_lora_rank"]),
        window=int(f.values["sliding_window"]),
        layer_kinds=kinds,
        csa_rate=csa_rate,
        hca_rate=hca_rate,
        index_heads=int(f.values["index_n_heads"]),
        index_head_dim=int(f.values["index_head_dim"]),
        index_topk=int(f.values["index_topk"]),
        hc_mult=int(f.values["hc_mult"]),
        hc_iters=int(f.values["hc_sinkhorn_iters"]),
        hc_eps=float(f.values["hc_eps"]),
        hash_layers=tuple(i for i, kind in enumerate(mlp_kinds) if kind == HASH),
        # transformers' V4 router always normalises (norm_topk_prob is not read)
        router=RouterSpec(experts, common["num_experts_per_tok"], scoring, normalize=True,
                          scaling_factor=float(f.values["routed_scaling_factor"]), correction_bias=True),
        shared_intermediate_size=int(f.values["n_shared_experts"]) * common["moe_intermediate_size"],
        activation=ExpertActivation("swiglu", limit=None if limit is None else float(limit)),
        # where transformers' save_pretrained puts the hub's names (see the module doc)
        weight_renames=(("model.layers.", "layers."), ("model.embed_tokens.", "embed."), ("model.norm.", "norm."),
                        ("model.hc_head.hc_", "hc_head_"))
        # the hub's `layers.N.attn.kv_norm` is `attn.norm` once transformers re-saves it (its conversion renames
        # every `.norm.` to `.kv_norm.` on load, so saving reverses it)
        + tuple((f"model.layers.{i}.attn.norm.", f"layers.{i}.attn.kv_norm.") for i in range(layers)),
    )


# ---- pieces --------------------------------------------------------------------------------------------------------


def stripe(dim: int, rate: int) -> int:
    """Values of a compressed entry each of the `rate` tokens it pools keeps in its slot."""
    return -(-dim // rate)


def write_entries(pool, name: str, layer_idx: int, row: int, first: int, entries: torch.Tensor, rate: int) -> None:
    """Entries [W, dim] of windows first .. first + W - 1 into the stripes of their tokens' slots."""
    width = stripe(entries.shape[-1], rate)
    stripes = F.pad(entries, (0, width * rate - entries.shape[-1])).reshape(-1, width)  # [W * rate, width]
    positions = torch.arange(first * rate, first * rate + stripes.shape[0], device=entries.device)
    pool.write(name, layer_idx, pool.req_to_token[row, positions].long(), stripes)


def read_entries(pool, name: str, layer_idx: int, row: int, windows: int, rate: int, dim: int) -> torch.Tensor:
    """The first `windows` entries of request `row` -> [windows, dim] float32."""
    slots = pool.req_to_token[row, : windows * rate].long()
    buf = pool.buffer(name, layer_idx)
    return buf[slots].float().reshape(windows, rate * buf.shape[-1])[:, :dim]


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope on the trailing 2 * cos.shape[-1] values of x's last dim (cos/sin broadcast against them)."""
    rot = 2 * cos.shape[-1]
    return torch.cat((x[..., :-rot], apply_rope(x[..., -rot:], cos, sin, interleave=True)), dim=-1)


class HyperConnection(nn.Module):
    """mHC weights of one block from the `hc` streams [N, hc, hidden]: (post [N, hc], comb [N, hc, hc], the
    collapsed block input [N, hidden])."""

    plan_component = "norms_router"
    fp32_params = ("fn", "base", "scale")  # fp32 on the hub and in transformers (models.build)

    def __init__(self, hc: int, hidden: int, iters: int, hc_eps: float, eps: float):
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.eps = hc, iters, hc_eps, eps
        self.fn = nn.Parameter(torch.empty((2 + hc) * hc, hc * hidden))
        self.base = nn.Parameter(torch.empty((2 + hc) * hc))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc = self.hc
        mixes = F.linear(unweighted_rms(streams.flatten(1).float(), self.eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns, then (rows, columns) iters - 1 times
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The streams after a block: its output spread by `post` plus the streams mixed by comb^T."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden vector per token."""

    plan_component = "norms_router"
    fp32_params = ("fn", "base", "scale")

    def __init__(self, hc: int, hidden: int, hc_eps: float, eps: float):
        super().__init__()
        self.hc_eps, self.eps = hc_eps, eps
        self.fn = nn.Parameter(torch.empty(hc, hc * hidden))
        self.base = nn.Parameter(torch.empty(hc))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms(streams.flatten(1).float(), self.eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def grouped_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Block-diagonal projection (V4's `wo_a`): x [N, groups, in] -> [N, groups * out], group g through rows
    g * out .. of the layer's [groups * out, in] weight (an nn.Linear, or an FP8Linear dequantized)."""
    w = linear_weight(layer, x.dtype).view(x.shape[1], -1, x.shape[-1])  # [groups, out, in]
    return torch.einsum("ngi,goi->ngo", x, w).flatten(1)


class Compressor(nn.Module):
    """Pools windows of `rate` tokens into entries of `dim` values (hub names: wkv, wgate, ape, norm). `overlap`
    (CSA): the projections are 2 * dim wide and entry w pools window w's second half with window w-1's first half."""

    fp8_linears = ()  # bf16 on the hub, beside FP8 attention projections
    fp32_params = ("ape",)

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, rotary: RotaryEmbedding):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap, self.rotary = dim, rate, overlap, rotary
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))
        self.norm = RMSNorm(dim, eps)

    @property
    def ring(self) -> int:
        """Positions the request state keeps: the current window, and the previous one with overlap."""
        return 2 * self.rate if self.overlap else self.rate

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first: int) -> torch.Tensor:
        """The projections kv, gate [T, width] of whole windows (windows first, first + 1, ...; with overlap and
        first > 0, window first - 1 in front as well) -> entries [windows, dim] of windows first, first + 1, ...:
        the gate's softmax over each window's slots (plus the position bias), per channel, weighs the kv; then the
        norm and rope at the window's first position (compress rope)."""
        r, d = self.rate, self.dim
        kv, gate = kv.view(-1, r, kv.shape[-1]), gate.view(-1, r, gate.shape[-1]) + self.ape.float()
        if self.overlap:
            if first == 0:  # window 0 has no previous one: its slots weigh nothing
                kv = torch.cat((kv.new_zeros(1, r, 2 * d), kv))
                gate = torch.cat((gate.new_full((1, r, 2 * d), float("-inf")), gate))
            kv = torch.cat((kv[:-1, :, :d], kv[1:, :, d:]), dim=1)  # [windows, 2r, d]
            gate = torch.cat((gate[:-1, :, :d], gate[1:, :, d:]), dim=1)
        entries = self.norm((kv * gate.softmax(dim=1)).sum(dim=1))
        positions = (torch.arange(entries.shape[0], device=kv.device) + first) * r
        cos, sin = self.rotary.cos_sin(positions)
        return rotate_tail(entries, cos, sin)

    def update(self, h: torch.Tensor, batch: ForwardBatch, ctx, layer_idx: int, state: str, cache: str) -> None:
        """Pool every window the batch's tokens close; the entries go to the `cache` stripes of the slots of the
        tokens they pool (write_entries), the tokens' projections to the request's ring (`state`_kv / _gate)."""
        pool, states = ctx.kv_pool, ctx.state_pool
        ring_kv, ring_gate = states.state(f"{state}_kv", layer_idx), states.state(f"{state}_gate", layer_idx)
        kv, gate = self.wkv(h).float(), self.wgate(h).float()  # [N, width]
        r, start = self.rate, 0
        for row, p, m in zip(batch.req_pool_indices.tolist(), batch.prefix_lens.tolist(), batch.extend_lens.tolist()):
            first, end = p // r, (p + m) // r  # windows closing in this chunk: first .. end - 1
            if end > first:
                lo = max(first - 1, 0) * r if self.overlap else first * r  # the earliest position they read
                old = torch.arange(lo, p, device=h.device) % self.ring
                src_kv = torch.cat((ring_kv[row, old], kv[start : start + end * r - p]))
                src_gate = torch.cat((ring_gate[row, old], gate[start : start + end * r - p]))
                write_entries(pool, cache, layer_idx, row, first, self.pool(src_kv, src_gate, first), r)
            keep = min(m, self.ring)
            at = torch.arange(p + m - keep, p + m, device=h.device) % self.ring
            ring_kv[row, at] = kv[start + m - keep : start + m]
            ring_gate[row, at] = gate[start + m - keep : start + m]
            start += m


class Indexer(nn.Module):
    """Lightning Indexer of a CSA layer: its compressor's entries (index keys) and, per query, the top `topk` closed
    entries by sum_h w_h relu(q_h . k) (hub names: wq_b, weights_proj, compressor)."""

    fp8_linears = ("wq_b",)  # weights_proj is bf16 on the hub

    def __init__(self, cfg: DeepseekV4Config, rotary: RotaryEmbedding):
        super().__init__()
        self.heads, self.dim, self.topk, self.rate = cfg.index_heads, cfg.index_head_dim, cfg.index_topk, cfg.csa_rate
        self.rotary = rotary
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.dim, cfg.csa_rate, True, cfg.rms_norm_eps, rotary)

    def select(self, q_residual: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor) -> torch.Tensor:
        """Bool [T, E]: which of the E entries (index keys [E, dim]) each of T queries keeps."""
        cos, sin = self.rotary.cos_sin(positions)
        q = rotate_tail(self.wq_b(q_residual).view(-1, self.heads, self.dim), cos.unsqueeze(-2), sin.unsqueeze(-2))
        scores = F.relu(torch.einsum("thd,ed->the", q.float(), keys.float())) * self.dim**-0.5
        weights = self.weights_proj(h).float() * self.heads**-0.5  # [T, heads]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [T, E]
        closed = torch.arange(keys.shape[0], device=h.device) < ((positions + 1) // self.rate).unsqueeze(-1)
        scores = scores.masked_fill(~closed, float("-inf"))
        chosen = scores.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        keep = torch.zeros_like(closed).scatter_(1, chosen, True)
        return keep & closed  # fewer closed entries than topk: the picks past them are dropped


class Attention(nn.Module):
    """Shared-KV MQA with sinks, a sliding window and, on compressed layers, pooled entries (see the module doc)."""

    plan_component = "attention"
    fp8_linears = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")  # what the hub stores in block FP8 (models/fp8.py)
    fp32_params = ("attn_sink",)  # fp32 on the hub and in transformers, whatever the weights' dtype (models.build)
    keep_linears = ("wo_a",)  # applied per group, not called: a CPU device stores its groups (head_matrices)

    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, rotary: RotaryEmbedding, compress_rotary: RotaryEmbedding):
        super().__init__()
        self.kind, self.rate = cfg.layer_kinds[layer_idx], cfg.rate(layer_idx)
        self.heads, self.head_dim, self.window, self.eps = (cfg.num_attention_heads, cfg.head_dim, cfg.window,
                                                            cfg.rms_norm_eps)
        self.rotary = rotary if self.kind == SLIDING else compress_rotary
        hidden, heads, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.wq_a = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, heads * d, bias=False)
        self.wkv = nn.Linear(hidden, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(heads * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)  # per group
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(heads))
        self.compressor = None if self.kind == SLIDING else Compressor(
            hidden, d, self.rate, self.kind == CSA, cfg.rms_norm_eps, compress_rotary)
        self.indexer = Indexer(cfg, compress_rotary) if self.kind == CSA else None
        self.o_groups = cfg.o_groups
        self.wo_a_groups: nn.Module | None = None  # wo_a per group once a CPU device stored it quantized

    def head_matrices(self) -> dict[str, torch.Tensor]:
        """The CPU dense path's protocol (cpu_dense.py): wo_a's groups [groups, out, in] to store quantized as
        `wo_a_groups`; {} where wo_a is not a plain Linear (FP8 weights stay FP8)."""
        if not isinstance(self.wo_a, nn.Linear):
            return {}
        return {"wo_a_groups": self.wo_a.weight.view(self.o_groups, -1, self.wo_a.in_features)}

    def shard(self, prefix: str, tp, shards: dict) -> None:
        """Tensor parallel: query heads (wq_b rows, their sinks) and whole output groups (wo_a rows) split, wo_b
        row-parallel (partial sums); the one shared KV head, the compressors and the indexer (its top-k needs every
        indexer head) are computed whole on every rank, so the caches are replicated."""
        from ktlite.runtime.models.tp_layers import column, row, split

        column(self, "wq_b", prefix, self.heads * self.head_dim, tp, shards)
        column(self, "wo_a", prefix, self.wo_a.out_features, tp, shards)
        row(self, "wo_b", prefix, self.wo_b.in_features, tp, shards)
        _, lo, hi = split(self.heads, tp)
        self.attn_sink = nn.Parameter(torch.empty(hi - lo, dtype=self.attn_sink.dtype))
        shards[prefix + "attn_sink"] = (0, lo, hi)
        self.heads, self.o_groups = self.heads // tp.size, self.o_groups // tp.size

    def forward_batch(self, h: torch.Tensor, batch: ForwardBatch, ctx, layer_idx: int) -> torch.Tensor:
        """h [N, hidden] (the normed block input) -> this rank's partial output [N, hidden]."""
        pool, n = ctx.kv_pool, h.shape[0]
        cos, sin = self.rotary.cos_sin(batch.positions)  # [N, rope / 2]
        q_residual = self.q_norm(self.wq_a(h))
        q = unweighted_rms(self.wq_b(q_residual).view(n, self.heads, self.head_dim), self.eps)
        q = rotate_tail(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        kv = rotate_tail(self.kv_norm(self.wkv(h)), cos, sin)  # [N, d]: key and value
        ring = ctx.state_pool.state("window", layer_idx)  # [requests, window, d]
        if self.compressor is not None:
            state = "hca" if self.kind == HCA else "csa"
            self.compressor.update(h, batch, ctx, layer_idx, state, f"{state}_entry")
        if self.indexer is not None:
            self.indexer.compressor.update(h, batch, ctx, layer_idx, "idx", "csa_index")
        out, start = [], 0
        for row, p, m in zip(batch.req_pool_indices.tolist(), batch.prefix_lens.tolist(), batch.extend_lens.tolist()):
            rows = slice(start, start + m)
            out.append(self._attend(q[rows], q_residual[rows], h[rows], kv[rows], batch.positions[rows], pool, ring,
                                    row, p, m, layer_idx))
            keep = min(m, self.window)  # after attending: the chunk's last rows replace the oldest
            ring[row, torch.arange(p + m - keep, p + m, device=h.device) % self.window] = kv[rows][m - keep:].float()
            start += m
        o = rotate_tail(torch.cat(out), cos.unsqueeze(-2), -sin.unsqueeze(-2))  # V's rotation undone
        grouped = o.view(n, self.o_groups, -1)
        if self.wo_a_groups is not None:
            return self.wo_b(self.wo_a_groups(grouped).flatten(1))
        return self.wo_b(grouped_linear(self.wo_a, grouped))

    def _attend(self, q: torch.Tensor, q_residual: torch.Tensor, h: torch.Tensor, kv: torch.Tensor,
                positions: torch.Tensor, pool, ring: torch.Tensor, row: int, p: int, m: int,
                layer_idx: int) -> torch.Tensor:
        """One request's m queries (positions p .. p + m - 1, their rows kv [m, d]) -> [m, heads, d]; the window's
        earlier rows come from the request's ring."""
        lo = max(p - self.window + 1, 0)
        key_pos = torch.arange(lo, p + m, device=q.device)
        keys = torch.cat((ring[row, torch.arange(lo, p, device=q.device) % self.window], kv.float()))  # [K, d]
        scale = self.head_dim**-0.5
        logits = torch.einsum("thd,kd->thk", q.float(), keys) * scale
        dist = positions.unsqueeze(-1) - key_pos  # [m, K]
        logits = logits.masked_fill(((dist < 0) | (dist >= self.window)).unsqueeze(1), float("-inf"))
        values = [keys]
        if self.rate:
            closed = (p + m) // self.rate
            state = "hca" if self.kind == HCA else "csa"
            entries = read_entries(pool, f"{state}_entry", layer_idx, row, closed, self.rate, self.head_dim)
            if self.indexer is not None:
                index_keys = read_entries(pool, "csa_index", layer_idx, row, closed, self.rate, self.indexer.dim)
                visible = self.indexer.select(q_residual, h, positions, index_keys)
            else:
                visible = torch.arange(closed, device=q.device) < ((positions + 1) // self.rate).unsqueeze(-1)
            comp = torch.einsum("thd,ed->the", q.float(), entries) * scale
            logits = torch.cat((logits, comp.masked_fill(~visible.unsqueeze(1), float("-inf"))), dim=-1)
            values.append(entries)
        sinks = self.attn_sink.float().view(1, -1, 1).expand(m, -1, 1)
        probs = torch.cat((logits, sinks), dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("thk,kd->thd", probs, torch.cat(values)).to(q.dtype)


class ClampedMLP(MLP):
    """SwiGLU with the experts' activation (DeepSeek-V4's clamp at swiglu_limit): routed and shared experts."""

    def __init__(self, hidden: int, intermediate: int, activation: ExpertActivation):
        super().__init__(hidden, intermediate)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate, up))


class HashRouter(Router):
    """A hash-MoE layer's router: the experts come from the token id (`tid2eid` [vocab, k]), the weights from the
    scores as a learned router's. The model sets `token_ids` (the batch's ids [N]) before the block runs."""

    def __init__(self, spec: RouterSpec, hidden: int, vocab: int):
        super().__init__(dataclasses.replace(spec, correction_bias=False), hidden)
        self.register_buffer("tid2eid", torch.zeros(vocab, spec.top_k, dtype=torch.long))
        self.token_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.token_ids is not None and self.token_ids.shape[0] == x.shape[0], "hash-MoE needs the token ids"
        scores = router_scores(F.linear(x.float(), self.weight.float()), self.spec)
        topk_ids = self.tid2eid[self.token_ids].long()
        return topk_ids, weigh_experts(scores, topk_ids, self.spec)


class DeepseekV4MoE(MoE):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, routed_experts: bool):
        super().__init__(cfg.router, cfg.hidden_size, cfg.moe_intermediate_size, 0, routed_experts=False)
        self.activation = cfg.activation
        if layer_idx in cfg.hash_layers:
            self.gate = HashRouter(cfg.router, cfg.hidden_size, cfg.vocab_size)
        count = cfg.n_routed_experts if routed_experts else 0
        self.experts = nn.ModuleList(ClampedMLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.activation)
                                     for _ in range(count))
        for expert in self.experts:
            expert.plan_component = "gpu_experts"
        if cfg.shared_intermediate_size:
            self.shared_experts = ClampedMLP(cfg.hidden_size, cfg.shared_intermediate_size, cfg.activation)
            self.shared_experts.plan_component = "shared_experts"


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, rotary: RotaryEmbedding,
                 compress_rotary: RotaryEmbedding, routed_experts: bool):
        super().__init__()
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.layer_idx = layer_idx
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, rotary, compress_rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekV4MoE(cfg, layer_idx, routed_experts)


class DeepseekV4ForCausalLM(CausalLM):
    supports_prefix_cache = False  # the compressors' per-request state cannot be restored from a token prefix

    def __init__(self, cfg: DeepseekV4Config, routed_experts: bool = True):
        rotary, compress_rotary = RotaryEmbedding(cfg.rope), RotaryEmbedding(cfg.compress_rope)
        layers = [DecoderLayer(cfg, i, rotary, compress_rotary, routed_experts) for i in range(cfg.num_hidden_layers)]
        backbone = Backbone(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, rotary, layers)
        backbone.compress_rotary = compress_rotary
        compress_rotary.plan_component = "norms_router"
        backbone.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        super().__init__(cfg, backbone)

    def forward_batch(self, batch: ForwardBatch, ctx) -> torch.Tensor:
        """-> float32 logits [R, vocab] for the tokens in batch.logit_rows."""
        backbone, hc = self.model, self.config.hc_mult
        x = backbone.embed_tokens(batch.input_ids)  # [N, hidden]
        streams = x.unsqueeze(1).expand(-1, hc, -1).contiguous()  # [N, hc, hidden]
        for layer in backbone.layers:
            post, comb, collapsed = layer.attn_hc(streams)
            out = layer.self_attn.forward_batch(layer.input_layernorm(collapsed), batch, ctx, layer.layer_idx)
            streams = HyperConnection.merge(post, comb, streams, ctx.reduce(out))
            post, comb, collapsed = layer.ffn_hc(streams)
            if isinstance(layer.mlp.gate, HashRouter):
                layer.mlp.gate.token_ids = batch.input_ids
            out = ctx.feed_forward(layer.layer_idx, layer.mlp, layer.post_attention_layernorm(collapsed))
            streams = HyperConnection.merge(post, comb, streams, out)
        rows = streams[batch.logit_rows]
        return self.lm_head(backbone.norm(backbone.hc_head(rows))).float()

    def checkpoint_name(self, name: str) -> str:
        """ours -> the hub's name (transformers' conversion mapping, read backwards)."""
        fixed = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                 "model.norm.weight": "norm.weight"}
        if name in fixed:
            return fixed[name]
        if name.startswith("model.hc_head."):
            return "hc_head_" + name.removeprefix("model.hc_head.")
        name = name.removeprefix("model.").replace(".weight_scale_inv", ".scale")  # the hub's FP8 block scales
        name = re.sub(r"\.(attn|ffn)_hc\.", r".hc_\1_", name)
        for ours, hub in ((".self_attn.", ".attn."), (".mlp.", ".ffn."), (".input_layernorm.", ".attn_norm."),
                          (".post_attention_layernorm.", ".ffn_norm."), (".gate.e_score_correction_bias", ".gate.bias"),
                          (".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")):
            name = name.replace(ours, hub)
        return name


Model = DeepseekV4ForCausalLM

# `ktlite tiny-model --arch deepseek_v4`: config.json fields beyond the shared tiny ones (ktlite/runtime/tiny_model.py),
# as transformers writes them (layer_types, compress_rates): every layer kind, hash-MoE then routed MoE, a window of
# 8, rates 4 and 8 and an indexer top-3, so ~30-token prompts drop keys and entries; a clamp limit of 1
TINY_CONFIGS = {"deepseek_v4": {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "num_hidden_layers": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "intermediate_size": 32,  # transformers' alias of moe_intermediate_size: the shared tiny fields' 128 would win
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "layer_types": [HCA, CSA, SLIDING, CSA],
    "mlp_layer_types": [HASH, HASH, ROUTED, ROUTED],
    "compress_rates": {CSA: 4, HCA: 8},
    "sliding_window": 8,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 3,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 1.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                        "beta_fast": 32, "beta_slow": 1},
}}
