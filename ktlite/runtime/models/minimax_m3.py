"""MiniMax-M3 (`MiniMaxM3SparseForConditionalGeneration`, model_type `minimax_m3_vl`, text model `minimax_m3_vl_text`).

Attention: GQA with a (1 + w) RMSNorm per head on q and k, then rope over the first `head_dim * partial_rotary_factor`
values (transformers reads the rotated width from `partial_rotary_factor` only, never `rotary_dim`). Layers
whose `layer_types` entry is `minimax_m3_sparse` add a lightning indexer (`index_q_proj`, `index_k_proj` and their
(1 + w) norms, the same rope): each query keeps the key blocks `block_sparse.select_blocks` picks, one selection per kv
head (`index_n_heads` must equal `num_key_value_heads`). Its one index key per token (`index_head_dim` values) is
cached in the token pool beside K and V on those layers ("index_key"), so it is planned and freed with them. The
sparse layers' attention runs in torch at model level (`kernels/triton/reference.attend_heads` under the block mask:
no compiled block-sparse kernel yet); the full layers use the GQA kernels.

MLP: `mlp_layer_types` picks a dense MLP (`dense_intermediate_size`) or a MoE: a sigmoid router whose
`e_score_correction_bias` steers the choice, weights normalised then times `routed_scaling_factor` (2.0), routed experts
of `intermediate_size` and one shared expert of `shared_intermediate_size`. Every MLP (dense, shared, routed) uses the
clamped SwiGLU "swiglu_oai" (`swiglu_limit` 7, `swiglu_alpha` 1.702, up + 1), gate and up not interleaved. Every
RMSNorm stores w of its (1 + w) scale.

Config: the published config.json (MiniMaxAI/MiniMax-M3, tests/data/minimax-m3) is the older layout: no
`layer_types` / `mlp_layer_types` / `index_*` / `rope_parameters`, but `sparse_attention_config` (its
`sparse_attention_freq` places the 57 sparse layers), `moe_layer_freq` (3 dense layers, then 57 MoE), top-level
`rope_theta` / `partial_rotary_factor` 0.5 / `rotary_dim` 64, hidden_act "swigluoai". Both layouts are read as
transformers' MiniMaxM3VLTextConfig reads them; the switches it does not read (`use_gemma_norm`, `qk_norm_type`,
`sparse_score_type`, `sparse_init_block`, `sparse_disable_index_value`, ...) are checked against what is implemented
and another value is refused, naming the field.

Weights: the hub checkpoints are the vision-language model; ktlite reads the language model only (the vision tower,
projector and `mtp.*` are never read). Stored as `language_model.model.*` / `language_model.lm_head.weight` (what
transformers' save_pretrained writes too; in memory transformers names them `model.language_model.*`), the MoE block
`block_sparse_moe` with per-expert `w1` / `w3` / `w2`, the indexer `self_attn.index_{q,k}_{proj,norm}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ktlite.errors import ConfigError
from ktlite.kernels.expert_activation import ExpertActivation
from ktlite.kernels.triton.kv_fp8 import head_rows, packs_fp8
from ktlite.kernels.triton.reference import attend_heads, gather_heads, request_spans
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.kv_cache import TokenCacheSpec
from ktlite.runtime.models.base import Backbone, CausalLM, DecoderLayer
from ktlite.runtime.models.block_sparse import block_mask, select_blocks
from ktlite.runtime.models.config import Fields, RouterSpec, refuse_other_values, rope_fields
from ktlite.runtime.models.gqa import GQASpec, GQAttention
from ktlite.runtime.models.gqa_moe import GQAMoEConfig, GQAMoEForCausalLM, moe_layer_ids
from ktlite.runtime.models.layers import MLP, MoE, RMSNorm
from ktlite.runtime.models.rope import RotaryEmbedding
from ktlite.runtime.models.wrapper import text_config

ARCHITECTURES = ("MiniMaxM3SparseForConditionalGeneration",)
MODEL_TYPES = ("minimax_m3_vl", "minimax_m3_vl_text")
LAYER_TYPES = ("full_attention", "minimax_m3_sparse")
MLP_LAYER_TYPES = ("dense", "sparse")
# (stored prefix, our prefix): the hub's (and save_pretrained's) names first, then transformers' in-memory ones
WEIGHT_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
# the torch path's score values held at once per sparse layer (fp32: 256 MiB); a long prefill runs in query steps
SCORES_PER_STEP = 1 << 26
# the checkpoints' older field names (transformers' MiniMaxM3VLTextConfig reads them the same way)
_LEGACY_INDEX_FIELDS = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                        "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                        "index_local_blocks": "sparse_local_block"}


@dataclass(frozen=True)
class IndexSpec:
    """The lightning indexer of a sparse layer: `heads` selections (one per kv head) of `topk` blocks of `block` keys,
    the query's own block and the `local - 1` before it always among them."""

    heads: int
    head_dim: int
    block: int
    topk: int
    local: int


@dataclass(frozen=True, kw_only=True)
class MiniMaxM3Config(GQAMoEConfig):
    sparse_layer_ids: tuple[int, ...]  # layers with the indexer (block-sparse attention)
    index: IndexSpec
    activation: ExpertActivation  # every MLP's: dense, shared and routed

    def token_cache_specs(self, tp_size: int = 1, kv_dtype: torch.dtype | None = None) -> list[TokenCacheSpec]:
        """K and V per kv head on every layer, and the sparse layers' index key (replicated over tensor-parallel
        ranks: one small key per token), held as one more kv-like head (packed FP8 rows in an FP8 pool)."""
        d = self.index.head_dim
        index = (TokenCacheSpec("index_key", self.sparse_layer_ids, (1, head_rows(d).row_bytes), torch.uint8)
                 if packs_fp8(kv_dtype) else TokenCacheSpec("index_key", self.sparse_layer_ids, (1, d)))
        return super().token_cache_specs(tp_size, kv_dtype) + ([index] if self.sparse_layer_ids else [])

    def attention_workspace(self, tp_size: int) -> int:
        """GQA's, plus the indexer's queries and key (its block scores per key are not counted: the torch path
        scores one request at a time)."""
        return super().attention_workspace(tp_size) + (self.index.heads + 1) * self.index.head_dim


# Switches of the published config.json that transformers' model does not read: it builds this variant (Gemma
# (1 + w) norms, per-head q/k norm, no output gate, a sigmoid router with its correction bias, one shared expert) and
# so does ktlite; another stated value is refused (config.refuse_other_values).
_IMPLEMENTED = {"use_gemma_norm": True, "use_qk_norm": True, "qk_norm_type": "per_head",
                "attention_output_gate": False, "scoring_func": "sigmoid", "use_routing_bias": True,
                "n_shared_experts": 1}
# sparse_attention_config's: max-pooled block scores, no always-kept initial blocks (transformers has none; the local
# blocks are `sparse_local_block`)
_IMPLEMENTED_SPARSE = {"sparse_score_type": "max", "sparse_init_block": 0}


def _text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config with transformers' reading of the older fields (sparse_attention_config,
    moe_layer_freq) and the activation read from swiglu_* alone (the hub states hidden_act "swigluoai"). What the
    published file states beyond transformers' fields is checked against what ktlite implements (see
    `_IMPLEMENTED`, `_IMPLEMENTED_SPARSE`, `_check_index_value`)."""
    text = dict(raw)
    refuse_other_values(text, _IMPLEMENTED, "MiniMax-M3")
    sparse = text.pop("sparse_attention_config", None) or {}
    refuse_other_values(sparse, _IMPLEMENTED_SPARSE, "MiniMax-M3", "sparse_attention_config.")
    if sparse.get("use_sparse_attention") is False and any(sparse.get("sparse_attention_freq") or ()):
        raise ConfigError("config.json: sparse_attention_config.use_sparse_attention is false but "
                          "sparse_attention_freq marks sparse layers (transformers builds them; which is meant?)")
    for flat, legacy in _LEGACY_INDEX_FIELDS.items():
        if legacy in sparse:
            text[flat] = sparse[legacy]
    if text.get("layer_types") is None and "sparse_attention_freq" in sparse:
        text["layer_types"] = [LAYER_TYPES[1] if f else LAYER_TYPES[0] for f in sparse["sparse_attention_freq"]]
    freq = text.pop("moe_layer_freq", None)
    if text.get("mlp_layer_types") is None and freq is not None:
        text["mlp_layer_types"] = [MLP_LAYER_TYPES[1] if f else MLP_LAYER_TYPES[0] for f in freq]
    text["hidden_act"] = "silu"
    return text


def _check_index_value(disabled: list | None, sparse_layers: tuple[int, ...]) -> None:
    """`sparse_attention_config.sparse_disable_index_value`: MiniMax's index-value branch (the indexer adding an
    output of its own) is off on every sparse layer of the published checkpoint; transformers' indexer and ktlite's
    only select blocks, so a sparse layer with the branch on is refused."""
    on = [i for i in sparse_layers if disabled is not None and i < len(disabled) and not disabled[i]]
    if on:
        raise ConfigError(f"config.json: sparse_attention_config.sparse_disable_index_value is 0 on sparse layer(s) "
                          f"{on}: the indexer's value branch is not implemented (nor is it in transformers)")


def _check_rotary_dim(f: Fields, head_dim: int, rotated: int) -> None:
    """transformers rotates `head_dim * partial_rotary_factor` values and never reads `rotary_dim` (a file it saved
    carries its inert default 64 whatever the head). A file that states no `partial_rotary_factor` (top level or in
    its rope dict) but a `rotary_dim` narrower than the head means partial rotary that transformers would not honour
    (it rotates the whole head; MiniMax-M2's config, which transformers reads, rotates `rotary_dim`): refused. The
    published file states both, and they agree (64 = 128 x 0.5)."""
    stated = f.raw.get("rotary_dim")
    if stated is None or "partial_rotary_factor" in rope_fields(f.raw) or not 0 < int(stated) < head_dim:
        return
    raise ConfigError(f"config.json: rotary_dim={stated} but no partial_rotary_factor: transformers rotates "
                      f"{rotated} of the {head_dim} head values and never reads rotary_dim; state "
                      f"partial_rotary_factor {int(stated) / head_dim}")


def _per_layer(f: Fields, name: str, kinds: tuple[str, ...], default: str, layers: int) -> list[str]:
    values = f.get(name) or [default] * layers
    if len(values) != layers or not set(values) <= set(kinds):
        raise ConfigError(f"config.json: {name} must name {layers} layers, each one of {kinds}")
    return list(values)


def parse_config(raw: dict[str, Any]) -> MiniMaxM3Config:
    """The VL model's file (the text model in `text_config`) or the text model's own."""
    text = text_config(raw)
    f = Fields(_text_fields(text), {
        "max_position_embeddings": 524288, "rms_norm_eps": 1e-6, "head_dim": 128, "num_key_value_heads": 4,
        "dense_intermediate_size": 12288, "shared_intermediate_size": 3072, "routed_scaling_factor": 2.0,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "index_n_heads": 4, "index_head_dim": 128,
        "index_block_size": 128, "index_topk_blocks": 16, "index_local_blocks": 1,
        "bos_token_id": 200034, "eos_token_id": 200020})  # transformers' defaults (the hub's text_config has neither)
    common = f.common(ARCHITECTURES[0], intermediate_size=int(f.values["dense_intermediate_size"]),
                      moe_intermediate_size=int(f.need("intermediate_size")),  # MiniMax names the expert width so
                      n_routed_experts=int(f.need("num_local_experts")))
    layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    head_dim, kv_heads = int(f.values["head_dim"]), int(f.values["num_key_value_heads"])
    attention = _per_layer(f, "layer_types", LAYER_TYPES, LAYER_TYPES[0], layers)
    mlp = _per_layer(f, "mlp_layer_types", MLP_LAYER_TYPES, MLP_LAYER_TYPES[1], layers)
    index = IndexSpec(*(int(f.values[k]) for k in _LEGACY_INDEX_FIELDS))
    rope = f.rope(head_dim, theta=5000000.0, interleave=False)
    _check_rotary_dim(f, head_dim, rope.head_dim)
    sparse_layers = tuple(i for i in range(layers) if attention[i] == LAYER_TYPES[1])
    _check_index_value((text.get("sparse_attention_config") or {}).get("sparse_disable_index_value"), sparse_layers)
    if LAYER_TYPES[1] in attention:
        if index.heads != kv_heads:  # transformers gives query head h the selection of index head h // group
            raise ConfigError(f"config.json: index_n_heads={index.heads} must equal num_key_value_heads={kv_heads} "
                              "(one block selection per kv head)")
        if index.head_dim < rope.head_dim:
            raise ConfigError(f"config.json: index_head_dim={index.head_dim} is narrower than the rotated width "
                              f"{rope.head_dim}")
    return MiniMaxM3Config(
        **common,
        attention=GQASpec(common["hidden_size"], heads, kv_heads, head_dim, common["rms_norm_eps"],
                          qk_norm="per_head", unit_offset_norms=True),
        shared_intermediate_size=int(f.values["shared_intermediate_size"]),
        moe_layer_ids=moe_layer_ids(layers, lambda i: mlp[i] == MLP_LAYER_TYPES[1]),
        router=RouterSpec(common["n_routed_experts"], common["num_experts_per_tok"], "sigmoid", normalize=True,
                          scaling_factor=float(f.values["routed_scaling_factor"]), correction_bias=True),
        rope=rope,
        expert_names=("w1", "w3", "w2"),
        moe_prefix="block_sparse_moe",
        weight_renames=WEIGHT_RENAMES,
        vision_skipped="vision_config" in raw,
        sparse_layer_ids=sparse_layers,
        index=index,
        activation=ExpertActivation("swiglu_oai", limit=float(f.values["swiglu_limit"]),
                                    alpha=float(f.values["swiglu_alpha"])),
    )


class BlockSparseAttention(GQAttention):
    """GQA whose queries see only the key blocks the lightning indexer selects (one selection per kv head). Tensor
    parallelism replicates the indexer: every rank selects for all kv heads and keeps those it reads."""

    def __init__(self, spec: GQASpec, rotary: RotaryEmbedding, index: IndexSpec):
        super().__init__(spec, rotary)
        self.index = index
        self.index_q_proj = nn.Linear(spec.hidden, index.heads * index.head_dim, bias=False)
        self.index_k_proj = nn.Linear(spec.hidden, index.head_dim, bias=False)
        self.index_q_norm = RMSNorm(index.head_dim, spec.eps, unit_offset=True)
        self.index_k_norm = RMSNorm(index.head_dim, spec.eps, unit_offset=True)
        self.kv_held = (0, spec.kv_heads)  # the kv heads (= index heads) this rank attends with
        self.last_selection: list[torch.Tensor] = []  # per request of the last forward: [n, heads held, k] block ids

    def shard(self, prefix: str, tp, shards: dict) -> None:
        super().shard(prefix, tp, shards)
        lo = tp.rank * self.num_kv_heads
        self.kv_held = self.kv_keep or (lo, lo + self.num_kv_heads)

    def forward_batch(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, ctx,
                      layer_idx: int) -> torch.Tensor:
        pool, ix, n = ctx.kv_pool, self.index, h.shape[0]
        q, _, k, v = self.qkv(h, cos, sin)
        rows = self.spec.fp8_rows
        pool.write("k", layer_idx, batch.out_cache_loc, k, rows)
        pool.write("v", layer_idx, batch.out_cache_loc, v, rows)
        idx_k = self.rotary(self.index_k_norm(self.index_k_proj(h).view(n, 1, ix.head_dim)), cos, sin)
        pool.write("index_key", layer_idx, batch.out_cache_loc, idx_k, head_rows(ix.head_dim))
        idx_q = self.rotary(self.index_q_norm(self.index_q_proj(h).view(n, ix.heads, ix.head_dim)), cos, sin)
        idx_q = idx_q[:, self.kv_held[0] : self.kv_held[1]]
        k_buf, v_buf, keys = (pool.buffer(name, layer_idx) for name in ("k", "v", "index_key"))
        out = torch.empty_like(q)
        self.last_selection = []
        for row, prefix, m, start in request_spans(batch.req_pool_indices, batch.prefix_lens, batch.extend_lens):
            slots = pool.req_to_token[row, : prefix + m].long()
            k_all, v_all = gather_heads(k_buf, slots), gather_heads(v_buf, slots)
            i_all = gather_heads(keys, slots)[:, 0]
            chosen = []
            # queries a few at a time: the scores are [queries, heads, prefix + m] fp32 (bounded to ~SCORES_PER_STEP)
            step = max(1, SCORES_PER_STEP // (q.shape[1] * (prefix + m)))
            for lo in range(start, start + m, step):
                hi = min(lo + step, start + m)
                positions = batch.positions[lo:hi].long()
                sel = select_blocks(idx_q[lo:hi], i_all, positions, ix.block, ix.topk, ix.local)
                seen = block_mask(sel, positions, prefix + m, ix.block)
                out[lo:hi] = attend_heads(q[lo:hi], k_all, v_all, seen, self.spec.scale).to(q.dtype)
                chosen.append(sel)
            self.last_selection.append(torch.cat(chosen))
        return self.o_proj(out.flatten(-2))


class MiniMaxM3ForCausalLM(CausalLM):
    def __init__(self, cfg: MiniMaxM3Config, routed_experts: bool = True):
        rotary = RotaryEmbedding(cfg.rope)
        layers = []
        for i in range(cfg.num_hidden_layers):
            attention = (BlockSparseAttention(cfg.attention, rotary, cfg.index) if i in cfg.sparse_layer_ids
                         else GQAttention(cfg.attention, rotary))
            if cfg.is_moe_layer(i):
                mlp = MoE(cfg.router, cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size,
                          routed_experts, cfg.activation)
            else:
                mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation)
            layers.append(DecoderLayer(i, cfg.hidden_size, cfg.rms_norm_eps, attention, mlp, unit_offset_norms=True))
        super().__init__(cfg, Backbone(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, rotary, layers,
                                       unit_offset_norms=True))

    # the MoE block's names: `block_sparse_moe`, experts w1/w3/w2 (MiniMax-M2's)
    checkpoint_name = GQAMoEForCausalLM.checkpoint_name


Model = MiniMaxM3ForCausalLM

# `ktlite tiny-model --arch minimax_m3` (and tests/hf_checkpoints.py's transformers-written twin): the text model's
# fields beyond the shared tiny ones. Every layer kind: sparse + dense MLP, full + MoE, sparse + MoE; blocks of 4 keys
# and 2 kept (the query's own among them) drop key blocks from prompts past 8 tokens; a clamp limit of 1 clamps
# many gate/up values.
TINY_TEXT = {
    "model_type": "minimax_m3_vl_text",
    "intermediate_size": 32,
    "dense_intermediate_size": 96,
    "shared_intermediate_size": 32,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.0,
    "swiglu_limit": 1.0,
    "swiglu_alpha": 1.702,
    "layer_types": ["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
    "mlp_layer_types": ["dense", "sparse", "sparse"],
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_block_size": 4,
    "index_topk_blocks": 2,
    "index_local_blocks": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}
# the smallest vision tower transformers' class builds (written by transformers in the tests, never read by ktlite)
TINY_VISION = {"model_type": "minimax_m3_vl_vision", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
               "num_attention_heads": 2, "patch_size": 4, "image_size": 16}
TINY_CONFIGS = {"minimax_m3": {
    "architectures": list(ARCHITECTURES),
    "model_type": "minimax_m3_vl",
    "tie_word_embeddings": False,
    "projector_hidden_size": 32,
    "text_config": TINY_TEXT,
    "vision_config": TINY_VISION,
}}
