"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration`, model_type `glm5_next`, text model `glm5_next_text`).

A hybrid of two mixers under DeepSeek-V4's residual:
- "linear_attention" layers (3 of every 4 by default): Kimi Delta Attention (gated_deltanet.KimiDeltaAttention: the
  delta rule with a per-channel decay `-5 sigmoid(exp(A_log) (f_b(f_a(x)) + dt_bias))`, a short conv on q, k, v, an
  output RMSNorm gated by sigmoid); per-request conv and recurrent state in the state pool.
- "indexed_attention" layers (transformers reads "full_attention" as this): MLA with no RoPE at all
  (`qk_rope_head_dim` 0: the latent is `kv_lora_rank` values, softmax scale qk_nope_head_dim^-0.5) over the tokens a
  DSA indexer selects. The indexer scores *pools* of `index_kpool` consecutive tokens (pool w: positions
  w k .. w k + k - 1 of the request): a pool's key is a softmax-weighted sum of its tokens' keys (`k_norm(wk(x))`), the
  weights per channel from `x @ index_kpool_compress_gate^T + index_kpool_compress_ape[slot]`; each query keeps the
  top `index_topk / index_kpool` complete pools that end at or before it (score sum_h w_h relu(q_h . key) / sqrt(d),
  no rope either) and, with `index_kpool_always_select_tail`, the tokens of its own incomplete pool. A layer whose
  `indexer_types` entry is "shared" reuses the selection of the layer before it (which must be an indexed layer).
  Cached per token on these layers (what transformers' indexer cache keeps): the latent ("latent") and the token's
  index key and pool-gate logits ("index_key", 2 x index_head_dim); pool keys are rebuilt from them per forward, so a
  pool is never stale and the cache is a function of the token prefix.
Residual: mHC over `hc_mult` streams (deepseek_v4.HyperConnection); the final collapse is their plain mean. MLP:
`mlp_layer_types` picks a dense MLP or a MoE (DeepSeek-V3's router: sigmoid, correction bias, groups, normalised, x
routed_scaling_factor, plus `n_shared_experts` shared experts); every SwiGLU (dense, shared, routed) clamps gate and
up at `swiglu_limit`.

The hub checkpoints are the vision-language model: `model.language_model.*` beside `lm_head.weight` and the vision
tower (`model.visual.*`, never read), the mHC weights as `layers.N.hc_attn_fn` / `hc_ffn_base` ..., the KDA conv as
`q_conv1d` / `k_conv1d` / `v_conv1d`, the forget gate's `f_a_proj`, `f_b_proj`, `dt_bias`, `A_log` on `self_attn`.
The multi-token-prediction layer (`layers.45.*` on the hub) is not read.

The published config.json (tests/data/glm-5.3-flash) carries the KDA shape in `linear_attn_config`, read into the
`linear_*` fields as transformers reads it; its restatements of the layer pattern (`linear_attn_config.kda_layers` /
`full_attn_layers`, `first_k_dense_replace`) must agree with `layer_types` / `mlp_layer_types`, and the switches
transformers does not read (`mla_use_nope`, `index_kpool_compress`, `mhc`, `topk_method`, `scoring_func`,
`moe_router_dtype`) must state the variant implemented; anything else is refused by name.

The per-channel decay goes through `attention.gated_delta_rule` like Gated DeltaNet's, in its recurrent form on both
devices (token by token, prompts too: no chunked kernel for a per-channel decay yet): Triton's recurrent kernel on a
GPU, numba's `kda_rows` on a CPU; the torch twin (chunked) is the spec. Not built: an FP8 KV pool (refused before
allocating); the NEXTN drafter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ktlite.errors import ConfigError
from ktlite.kernels.expert_activation import ExpertActivation
from ktlite.kernels.triton.reference import request_spans
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.kv_cache import TokenCacheSpec
from ktlite.runtime.models.base import Backbone, CausalLM
from ktlite.runtime.models.config import Fields, RopeConfig, refuse_other_values
from ktlite.runtime.models.deepseek_v32 import DeepseekV32Config, SparseMLAttention, index_scores
from ktlite.runtime.models.deepseek_v4 import HyperConnection
from ktlite.runtime.models.gated_deltanet import KimiDeltaAttention, LinearAttentionSpec
from ktlite.runtime.models.glm_moe_dsa import indexer_types
from ktlite.runtime.models.layers import MLP, MoE, RMSNorm
from ktlite.runtime.models.rope import RotaryEmbedding
from ktlite.runtime.models.wrapper import text_config
from ktlite.runtime.state_cache import RequestStateSpec

ARCHITECTURES = ("Glm5NextForConditionalGeneration",)
MODEL_TYPES = ("glm5_next", "glm5_next_text")
LINEAR, INDEXED = "linear_attention", "indexed_attention"
# transformers reads "full_attention" as an indexed layer; "deepseek_sparse_attention" is other runtimes' spelling
_INDEXED_ALIASES = ("full_attention", "deepseek_sparse_attention")
DENSE, SPARSE = "dense", "sparse"
# (stored prefix, our prefix): the hub's (and save_pretrained's) names of the language model
WEIGHT_RENAMES = (("model.language_model.", "model."),)
# transformers' Glm5NextTextConfig defaults (the published GLM-5.3-Flash shape but index_kpool: the file states 4)
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "n_shared_experts": 1, "n_routed_experts": 288,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0, "v_head_dim": 256,
    "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "attention_bias": False, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 32, "swiglu_limit": 10.0, "linear_head_dim": 128, "linear_num_heads": 64,
    "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
    "index_kpool": 16, "index_kpool_always_select_tail": True, "tie_word_embeddings": False,
}


@dataclass(frozen=True, kw_only=True)
class Glm5NextConfig(DeepseekV32Config):
    builds_mtp = False  # its MTP layer (with the mHC streams) is not built: NEXTN is refused, NGRAM drafts
    layer_kinds: tuple[str, ...]  # LINEAR or INDEXED per layer
    moe_layer_ids: tuple[int, ...]
    linear: LinearAttentionSpec
    index_kpool: int
    index_tail: bool  # index_kpool_always_select_tail
    hc_mult: int
    hc_iters: int
    hc_eps: float
    activation: ExpertActivation  # every SwiGLU's (dense, shared, routed)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.moe_layer_ids

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The MLA (indexed) layers: the latent's."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == INDEXED)

    @property
    def indexed_layers(self) -> tuple[int, ...]:
        """MLA layers that run their own indexer (and cache index keys)."""
        return tuple(i for i in self.attention_layers if i not in self.shared_index_layers)

    @property
    def index_width(self) -> int:
        """Token slots a query's selection holds: the pools' tokens and the tail's."""
        return self.index_topk + (self.index_kpool - 1 if self.index_tail else 0)

    def token_cache_specs(self, tp_size: int = 1, kv_dtype: torch.dtype | None = None) -> list[TokenCacheSpec]:
        """Per token on the MLA layers (replicated over tensor-parallel ranks, as every MLA latent): the latent, and on
        the layers with an indexer its key and pool-gate logits."""
        if kv_dtype is not None and kv_dtype.itemsize == 1:
            raise ConfigError("GLM-5.3-Flash (glm5_next): an FP8 KV cache is not supported yet (--kv-cache-dtype auto)")
        return [TokenCacheSpec("latent", self.attention_layers, (self.kv_lora_rank,)),
                TokenCacheSpec("index_key", self.indexed_layers, (2 * self.index_head_dim,))]

    def request_state_specs(self, tp_size: int = 1) -> list[RequestStateSpec]:
        return self.linear.state_specs(self.linear_layers)  # replicated on every rank

    def attention_workspace(self, tp_size: int) -> int:
        """The sparse MLA layer's (its indexer's key now twice as wide) or the KDA layer's (its decay per channel)."""
        mla = super().attention_workspace(tp_size) + self.index_head_dim
        s = self.linear
        return max(mla, s.workspace() + s.value_heads * s.key_dim)


# Switches of the published config.json that transformers' model does not read: it builds MLA without rope, pooled
# (compressed) index keys, mHC streams and DeepSeek-V3's noaux_tc sigmoid router in float32, and so does ktlite;
# another stated value is refused (config.refuse_other_values). `indexer_rope_interleave` is moot without rope, and
# `index_share_for_mtp_iteration` / `num_nextn_predict_layers` concern the MTP layer, which is not built.
_IMPLEMENTED = {"mla_use_nope": True, "index_kpool_compress": True, "mhc": True, "topk_method": "noaux_tc",
                "scoring_func": "sigmoid", "moe_router_dtype": "float32"}


def _check_restated_layers(text: dict[str, Any], kinds: list[str], mlp_kinds: list[str]) -> None:
    """The published file restates its layer pattern in fields transformers does not read
    (`linear_attn_config.kda_layers` / `full_attn_layers`, `first_k_dense_replace`); transformers follows
    `layer_types` / `mlp_layer_types` (or its defaults), and so does ktlite. A restatement that disagrees with them
    is refused: the checkpoint's weights would follow one and transformers the other."""
    lac = text.get("linear_attn_config") or {}
    for name, kind in (("kda_layers", LINEAR), ("full_attn_layers", INDEXED)):
        want = [i for i, k in enumerate(kinds) if k == kind]
        if lac.get(name) is not None and sorted(lac[name]) != want:
            raise ConfigError(f"config.json: linear_attn_config.{name} {lac[name]} disagrees with layer_types "
                              f"({kind} layers {want}, what transformers reads)")
    first = text.get("first_k_dense_replace")
    if first is not None and mlp_kinds != [DENSE] * int(first) + [SPARSE] * (len(mlp_kinds) - int(first)):
        raise ConfigError(f"config.json: first_k_dense_replace={first} disagrees with mlp_layer_types (what "
                          "transformers reads)")


def _per_layer(values: list | None, name: str, kinds: tuple[str, ...], layers: int) -> list[str]:
    if values is None or len(values) != layers or not set(values) <= set(kinds):
        raise ConfigError(f"config.json: {name} must name {layers} layers, each one of {kinds}")
    return list(values)


def _linear_fields(text: dict[str, Any]) -> dict[str, Any]:
    """The linear attention's fields, with transformers' reading of the nested `linear_attn_config`."""
    lac = text.get("linear_attn_config") or {}
    fields = {k: text[k] for k in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound")
              if k in text}
    for flat, nested in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                         ("linear_conv_kernel_dim", "short_conv_kernel_size"), ("linear_lower_bound", "gate_lower_bound")):
        if nested in lac:
            fields[flat] = lac[nested]
    if lac and lac.get("safe_gate", True) and fields.get("linear_lower_bound", -5.0) is None:
        fields["linear_lower_bound"] = -5.0
    return fields


def parse_config(raw: dict[str, Any]) -> Glm5NextConfig:
    """The VL checkpoint's config.json (the text model in `text_config`), or a flat text model's."""
    text = {**text_config(raw), **_linear_fields(text_config(raw))}
    refuse_other_values(text, _IMPLEMENTED, "GLM-5.3-Flash")
    f = Fields(text, _DEFAULTS, keep_none=("linear_lower_bound",))
    tied = raw.get("tie_word_embeddings", f.values["tie_word_embeddings"])
    common = f.common(ARCHITECTURES[0], tie_word_embeddings=bool(tied))
    layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    if int(f.values["qk_rope_head_dim"]) != 0:
        raise ConfigError("config.json: GLM-5.3-Flash's MLA has no rope (qk_rope_head_dim must be 0)")
    if int(f.get("num_key_value_heads", heads)) != heads:
        raise ConfigError("config.json: num_key_value_heads must equal num_attention_heads (MLA)")
    if f.values["attention_bias"]:
        raise ConfigError("config.json: attention_bias=true is not supported")
    kinds = f.get("layer_types") or [LINEAR if i % 4 != 3 else INDEXED for i in range(layers)]
    kinds = _per_layer([INDEXED if k in _INDEXED_ALIASES else k for k in kinds], "layer_types", (LINEAR, INDEXED), layers)
    mlp_kinds = _per_layer(f.get("mlp_layer_types") or [DENSE] * min(3, layers) + [SPARSE] * max(layers - 3, 0),
                           "mlp_layer_types", (DENSE, SPARSE), layers)
    _check_restated_layers(text, kinds, mlp_kinds)
    index_kinds = indexer_types(text, layers)
    shared = tuple(i for i, kind in enumerate(index_kinds) if kind == "shared" and kinds[i] == INDEXED)
    for i in shared:  # transformers hands a shared layer the selection of the layer right before it
        if i == 0 or kinds[i - 1] != INDEXED or i - 1 in shared:
            raise ConfigError(f"config.json: indexer_types[{i}] is 'shared', but layer {i - 1} is not an indexed "
                              "layer with its own indexer")
    kpool, topk = int(f.values["index_kpool"]), int(f.values["index_topk"])
    if kpool < 1 or topk % kpool:
        raise ConfigError(f"config.json: index_topk ({topk}) must be a multiple of index_kpool ({kpool})")
    lower = f.values["linear_lower_bound"]
    lin_heads, lin_dim = int(f.values["linear_num_heads"]), int(f.values["linear_head_dim"])
    limit = f.get("swiglu_limit")
    cfg = Glm5NextConfig(
        **common,
        # no rope anywhere: a zero-width table keeps MLA's rope slices empty
        rope=RopeConfig(theta=10000.0, head_dim=0, interleave=True),
        q_lora_rank=int(f.values["q_lora_rank"]),
        kv_lora_rank=int(f.values["kv_lora_rank"]),
        qk_nope_head_dim=int(f.values["qk_nope_head_dim"]),
        qk_rope_head_dim=0,
        v_head_dim=int(f.values["v_head_dim"]),
        n_shared_experts=int(f.values["n_shared_experts"]),
        first_k_dense_replace=next((i for i, k in enumerate(mlp_kinds) if k == SPARSE), layers),
        moe_layer_freq=1,
        routed_scaling_factor=float(f.values["routed_scaling_factor"]),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=int(f.values["n_group"]),
        topk_group=int(f.values["topk_group"]),
        norm_topk_prob=bool(f.values["norm_topk_prob"]),
        index_n_heads=int(f.values["index_n_heads"]),
        index_head_dim=int(f.values["index_head_dim"]),
        index_topk=topk,
        shared_index_layers=shared,
        weight_renames=WEIGHT_RENAMES,
        vision_skipped="vision_config" in raw,
        layer_kinds=tuple(kinds),
        moe_layer_ids=tuple(i for i, k in enumerate(mlp_kinds) if k == SPARSE and common["n_routed_experts"]),
        linear=LinearAttentionSpec(common["hidden_size"], lin_heads, lin_heads, lin_dim, lin_dim,
                                   int(f.values["linear_conv_kernel_dim"]), common["rms_norm_eps"],
                                   decay_lower_bound=None if lower is None else float(lower)),
        index_kpool=kpool,
        index_tail=bool(f.values["index_kpool_always_select_tail"]),
        hc_mult=int(f.values["hc_mult"]),
        hc_iters=int(f.values["hc_sinkhorn_iters"]),
        hc_eps=float(f.values["hc_eps"]),
        activation=ExpertActivation("swiglu", limit=None if limit is None else float(limit)),
    )
    cfg.router  # validates the routing fields
    return cfg


# ---- the indexed attention --------------------------------------------------------------------------------------


class PooledIndexer(nn.Module):
    """The DSA indexer over pools of `index_kpool` tokens (see the module doc). Same interface as deepseek_v32's
    Indexer (`key`, `top_slots`), so SparseMLAttention runs it."""

    plan_component = "attention"
    fp8_linears = ("wq_b", "wk")

    def __init__(self, cfg: Glm5NextConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * d, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(cfg.index_kpool, d))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(d, cfg.hidden_size))

    def key(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] -> the cached [N, 2 d]: the token's key and its pool-gate logits (no rope)."""
        return torch.cat((self.k_norm(self.wk(h)), F.linear(h, self.index_kpool_compress_gate)), dim=-1)

    def pool_keys(self, cached: torch.Tensor) -> torch.Tensor:
        """The cached rows of P whole pools [P * kpool, 2 d] -> their keys [P, d] (fp32): per channel, the softmax over
        the pool's tokens of gate logit + position bias weighs the tokens' keys."""
        c = self.cfg
        keys, gates = cached.float().view(-1, c.index_kpool, 2 * c.index_head_dim).chunk(2, dim=-1)
        weights = (gates + self.index_kpool_compress_ape.float()).softmax(dim=1)
        return (weights * keys).sum(dim=1)

    def top_slots(self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  batch: ForwardBatch, keys: torch.Tensor, req_to_token: torch.Tensor) -> torch.Tensor:
        """[N, index_width] pool slots each new token attends to: the tokens of its top pools, then its incomplete
        pool's (the tail), -1 padded."""
        c, k = self.cfg, self.cfg.index_kpool
        q = self.wq_b(q_resid).view(-1, c.index_n_heads, c.index_head_dim).float()
        w = self.weights_proj(h).float() * c.index_n_heads**-0.5  # [N, H]
        out = torch.full((h.shape[0], c.index_width), -1, dtype=torch.int64, device=h.device)
        for row, prefix, n, start in request_spans(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens):
            seen = prefix + n
            slots = req_to_token[row, :seen].long()
            positions = torch.arange(prefix, seen, device=h.device)  # [n]
            pools = seen // k  # the pools whole by the end of this forward
            if pools:
                scores = index_scores(q[start : start + n], w[start : start + n],
                                      self.pool_keys(keys[slots[: pools * k]]), c.index_head_dim**-0.5)
                ends = torch.arange(pools, device=h.device) * k + k - 1
                scores.masked_fill_(ends > positions[:, None], float("-inf"))  # pools not yet whole at the query
                best = scores.topk(min(c.index_topk // k, pools), dim=-1)
                tokens = (best.indices[..., None] * k + torch.arange(k, device=h.device)).flatten(1)  # [n, picks k]
                chosen = slots[tokens].masked_fill((best.values == float("-inf")).repeat_interleave(k, dim=1), -1)
                out[start : start + n, : chosen.shape[1]] = chosen
            if c.index_tail and k > 1:
                tail = (positions + 1) % k  # the query's own pool's tokens so far, itself included
                at = (positions + 1 - tail)[:, None] + torch.arange(k - 1, device=h.device)
                keep = torch.arange(k - 1, device=h.device) < tail[:, None]
                out[start : start + n, c.index_topk :] = torch.where(keep, slots[at.clamp(max=seen - 1)], -1)
        return out


class PooledSparseMLA(SparseMLAttention):
    """MLA (no rope) over the tokens its pooled indexer selects; the forward is deepseek_v32's."""

    def __init__(self, cfg: Glm5NextConfig, rotary: RotaryEmbedding):
        super().__init__(cfg, rotary)
        self.indexer = PooledIndexer(cfg)


# ---- the model --------------------------------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, layer_idx: int, rotary: RotaryEmbedding, routed_experts: bool):
        super().__init__()
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.layer_idx = layer_idx
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: nn.Module = (KimiDeltaAttention(cfg.linear) if cfg.layer_kinds[layer_idx] == LINEAR
                                     else PooledSparseMLA(cfg, rotary))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoE(cfg.router, cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.shared_intermediate_size, routed_experts, cfg.activation)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation)


class Glm5NextForCausalLM(CausalLM):
    supports_prefix_cache = False  # per-request recurrent state: resumed only from the state pool's snapshots

    def __init__(self, cfg: Glm5NextConfig, routed_experts: bool = True):
        rotary = RotaryEmbedding(cfg.rope)  # zero-width: no rope
        layers = [DecoderLayer(cfg, i, rotary, routed_experts) for i in range(cfg.num_hidden_layers)]
        for i in cfg.shared_index_layers:  # the selection of the layer before (checked by parse_config)
            attn = layers[i].self_attn
            attn.indexer, attn.reuses = None, (layers[i - 1].self_attn,)
        super().__init__(cfg, Backbone(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, rotary, layers))

    def forward_batch(self, batch: ForwardBatch, ctx) -> torch.Tensor:
        """-> float32 logits [R, vocab] for the tokens in batch.logit_rows."""
        backbone, hc = self.model, self.config.hc_mult
        x = backbone.embed_tokens(batch.input_ids)  # [N, hidden]
        cos, sin = backbone.rotary.cos_sin(batch.positions)  # [N, 0]
        streams = x.unsqueeze(1).expand(-1, hc, -1).contiguous()  # [N, hc, hidden]
        for layer in backbone.layers:
            post, comb, collapsed = layer.attn_hc(streams)
            out = layer.self_attn.forward_batch(layer.input_layernorm(collapsed), cos, sin, batch, ctx, layer.layer_idx)
            streams = HyperConnection.merge(post, comb, streams, ctx.reduce(out))
            post, comb, collapsed = layer.ffn_hc(streams)
            out = ctx.feed_forward(layer.layer_idx, layer.mlp, layer.post_attention_layernorm(collapsed))
            streams = HyperConnection.merge(post, comb, streams, out)
        if batch.capture_hidden:
            batch.hidden_states = streams.mean(dim=1)
        return self.lm_head(backbone.norm(streams[batch.logit_rows].mean(dim=1))).float()

    def checkpoint_name(self, name: str) -> str:
        """ours -> the checkpoint's (after WEIGHT_RENAMES): the mHC weights as `hc_attn_fn`, ..."""
        return re.sub(r"\.(attn|ffn)_hc\.", r".hc_\1_", name)


Model = Glm5NextForCausalLM

# `ktlite tiny-model --arch glm5_next` (and tests/hf_checkpoints.py's transformers-written twin): every layer kind
# (KDA, indexed MLA with its own indexer, indexed MLA reusing the one before), a dense then MoE layers, pools of 4 tokens
# with 2 kept (so ~30-token prompts drop pools), 16 index heads (fewer tie at relu zeros), a clamp limit of 1
TINY_TEXT = {
    "model_type": "glm5_next_text",
    "num_hidden_layers": 4,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 0,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "layer_types": [LINEAR, INDEXED, INDEXED, LINEAR],
    "indexer_types": ["full", "full", "shared", "full"],
    "mlp_layer_types": [DENSE, SPARSE, SPARSE, SPARSE],
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "index_kpool": 4,
    "linear_num_heads": 2,
    "linear_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "swiglu_limit": 1.0,
    "pad_token_id": None,
}
# the smallest vision tower transformers' class builds (written by transformers in the tests, never read by ktlite)
TINY_VISION = {"model_type": "glm5_next_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
               "patch_size": 4, "out_hidden_size": 64, "projection_intermediate_size": 32}
TINY_CONFIGS = {"glm5_next": {
    "architectures": list(ARCHITECTURES),
    "model_type": "glm5_next",
    "tie_word_embeddings": False,
    "text_config": TINY_TEXT,
    "vision_config": TINY_VISION,
}}
