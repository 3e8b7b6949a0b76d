"""What every model family's config shares, and the parsing helpers families use.

Each family parses its own `config.json` (see the family modules and `registry.py`) into a frozen
dataclass deriving from `ModelConfig`: the facts the runtime needs without knowing the family
(layers, hidden size, vocabulary, which layers are MoE and their expert shapes, the router, what is
cached per token). The fields every family carries are declared there and read by `Fields.common`
(the family's defaults apply where the file says nothing); the family's dataclass adds its own. `load_config(path)` / `parse_config(raw)` pick the family from `architectures` /
`model_type`.

Two config dialects exist in the wild: hub folders (`rope_scaling` with `type`, top-level
`rope_theta` / `partial_rotary_factor`) and folders re-saved by recent transformers (`rope_parameters`
with `rope_type`, `rope_theta` and `partial_rotary_factor` inside). Both parse to the same
`RopeConfig` through one reader, `rope_config`: the value the file states wins wherever it is written,
and a family's default applies only where the file says nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ktlite.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ktlite.runtime.kv_cache import TokenCacheSpec

SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    head_dim: int  # the rotated slice of q/k (the rest of the head passes through unrotated)
    interleave: bool  # rotate adjacent pairs (x0, x1), ... (DeepSeek) rather than halves
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True  # YaRN: round the ramp's ends to whole dimensions

    @property
    def cos_sin_scale(self) -> float:
        """Factor applied to cos/sin (YaRN's `attention_factor`); 1 for plain RoPE."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """Multiplier on 1/sqrt(head_dim): DeepSeek squares mscale(factor, mscale_all_dim)."""
        if self.kind == "yarn" and self.mscale_all_dim:
            m = yarn_mscale(self.factor, self.mscale_all_dim)
            return m * m
        return 1.0


@dataclass(frozen=True)
class RouterSpec:
    """How a MoE layer picks experts and weighs them (router math in float32).

    scores = softmax, sigmoid or sqrt(softplus) (DeepSeek-V4) of the logits; the choice uses scores + e_score_correction_bias when
    `correction_bias` (the bias steers the choice only); `method` limits the choice to the best
    `topk_group` of `n_group` expert groups (noaux_tc scores a group by its top-2, group_limited_greedy
    by its best); the weights are the chosen unbiased scores, divided by their sum when `normalize`,
    times `scaling_factor`. `logit_bias`: the router is a linear layer with a bias (gpt-oss), added to the logits.
    gpt-oss's "top-k of the logits, softmax over the k" is softmax scoring with `normalize`: softmax keeps the
    logits' order, and the chosen probabilities over their sum are the softmax of the chosen logits."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = False
    scaling_factor: float = 1.0
    correction_bias: bool = False
    logit_bias: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCS:
            raise ConfigError(f"config.json: scoring_func={self.scoring!r} is not supported (one of {SCORING_FUNCS})")
        if self.method not in TOPK_METHODS:
            raise ConfigError(f"config.json: topk_method={self.method!r} is not supported (one of {TOPK_METHODS})")
        if not self.num_experts:
            return
        if self.num_experts % self.n_group:
            raise ConfigError(f"config.json: {self.num_experts} routed experts are not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"config.json: topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"config.json: num_experts_per_tok={self.top_k} must be in 1..{self.num_experts} routed experts")
        if self.method == "noaux_tc" and self.num_experts // self.n_group < 2:
            raise ConfigError("config.json: topk_method='noaux_tc' scores groups by their top-2, needs >= 2 experts per group")


@dataclass(frozen=True)
class StackedExpert:
    """Where a routed expert's matrix sits in a checkpoint that stacks a layer's experts in one tensor stored
    transposed, [E, in, out] (gpt-oss): expert e's matrix is columns start::step of `name`[e] (step 2: gate and up
    interleaved), read as ktlite's [out, in]."""

    name: str
    start: int = 0
    step: int = 1

    def take(self, stacked: np.ndarray | torch.Tensor, expert: int) -> np.ndarray | torch.Tensor:
        """[out, in] (a view) of expert `expert` in the stacked tensor [E, in, out * step] (numpy or torch)."""
        return stacked[expert][:, self.start::self.step].T


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What the runtime (plan, pool, loader, CPU experts, scheduler) reads of any family's config: the
    fields every family carries, declared and parsed (`Fields.common`) here once, and the methods each
    family implements. A family's config is a frozen dataclass deriving from this one that adds its own
    fields; it also gives `router` (RouterSpec) and `shared_intermediate_size` (intermediate size of a MoE
    layer's shared expert(s) together, 0: none), as fields or properties."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    num_hidden_layers: int
    num_attention_heads: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    fp8_block_size: tuple[int, int] | None  # block-FP8 checkpoints: (128, 128) as DeepSeek-V3's
    fp8_skip: tuple[str, ...]  # quantization_config.modules_to_not_convert: what an FP8 checkpoint keeps high precision
    stored_fp8_block: tuple[int, int] | None  # the scale block of float8 tensors as stored (stored_fp8_block())
    # (stored prefix, our prefix) pairs: where a wrapper checkpoint keeps the language model's tensors (see
    # wrapper.py); none: the checkpoint names them as the model does
    weight_renames: tuple[tuple[str, str], ...] = ()
    vision_skipped: bool = False  # a vision-language checkpoint of which ktlite loads and serves the text model only
    # serve the checkpoint's multi-token-prediction layer too (NEXTN drafts; `with_mtp`): its weights and its KV
    # (one more attention layer) are part of the model the plan counts
    mtp_layer: bool = False
    nextn_predict_layers: int = 0  # the multi-token-prediction layers the checkpoint carries after its last layer

    # whether the family builds its checkpoint's MTP layer (models/mtp.py) when `with_mtp` asks for it
    builds_mtp = False
    mtp_config_field = "num_nextn_predict_layers"  # where config.json counts them (read into nextn_predict_layers)

    # whether a copy of a request's per-request state where a prompt or reply ends (a prefix-cache snapshot,
    # runtime/state_cache.py) lets another request resume from there; False turns such a family's prefix cache off
    snapshots_resume = True
    # whether its per-request state layers `rewind` to the accepted tokens after a speculative verify
    # (gated_deltanet.py); False refuses speculative decoding on the family
    state_rewinds = True

    @property
    def moe_layers(self) -> list[int]:
        """MoE layers: the decoder's, and a served MTP layer (index num_hidden_layers), whose routed experts are placed
        and stored as every MoE layer's."""
        return [i for i in self.decoder_and_mtp_layers if self.is_moe_layer(i)]

    def is_moe_layer(self, layer_idx: int) -> bool:
        raise NotImplementedError

    @property
    def snapshot_state(self) -> bool:
        """Whether the prefix cache keeps snapshots of this family's per-request state (EngineConfig.state_snapshots)."""
        return bool(self.request_state_specs()) and self.snapshots_resume

    def with_mtp(self) -> "ModelConfig":
        """This config serving the checkpoint's multi-token-prediction layer (--speculative-algorithm NEXTN): one more
        decoder layer at index num_hidden_layers (chained drafts reuse the first MTP layer, as SGLang's); ConfigError
        for families that do not build one and checkpoints without one."""
        if not self.builds_mtp:
            ngram = ("; --speculative-algorithm NGRAM works with this model"
                     if self.state_rewinds or not self.request_state_specs() else "")
            raise ConfigError(f"--speculative-algorithm NEXTN/EAGLE: drafts from multi-token-prediction layers are not "
                              f"built for {self.architecture}{ngram}")
        if self.nextn_predict_layers < 1:
            raise ConfigError("--speculative-algorithm NEXTN/EAGLE drafts with the checkpoint's multi-token-prediction "
                              f"layer, and this one has none (config.json: {self.mtp_config_field} is 0 or absent); "
                              "--speculative-algorithm NGRAM needs no extra layer")
        return dataclasses.replace(self, mtp_layer=True)

    def mtp_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer_idx is a served MTP layer with a MoE: in every checkpoint with routed experts (GLM-4.5,
        Qwen3-Next, ...) it is one more MoE layer; DeepSeek's configs place it by index as their other layers."""
        return self.mtp_layer and layer_idx == self.num_hidden_layers and self.n_routed_experts > 0

    @property
    def decoder_and_mtp_layers(self) -> range:
        """The decoder's layer indices, and the served MTP layer's (num_hidden_layers)."""
        return range(self.num_hidden_layers + int(self.mtp_layer))

    def token_cache_specs(self, tp_size: int = 1, kv_dtype: torch.dtype | None = None) -> list[TokenCacheSpec]:
        """What one tensor-parallel rank caches per token (the KV pool's buffers) in a pool of kv_dtype
        (--kv-cache-dtype; None: a 16/32-bit pool). The layout may depend on it: an FP8 pool holds MLA
        latents, index keys and GQA K/V per kv head as packed rows with their scales (uint8 specs)."""
        raise NotImplementedError

    def request_state_specs(self, tp_size: int = 1) -> list:
        """What one running request keeps per layer beyond its tokens (recurrent layers' state)."""
        raise NotImplementedError

    def attention_workspace(self, tp_size: int) -> int:
        """Activation values per token one attention layer holds at once on a rank (the plan's estimate)."""
        raise NotImplementedError

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ConfigError when the model cannot split over `tp_size` ranks."""
        raise NotImplementedError

    def expert_weight_name(self, layer: int, expert: int, proj: str) -> str:
        """Checkpoint name of a routed expert's `proj` ("gate", "up" or "down") weight."""
        raise NotImplementedError

    def stacked_expert(self, layer: int, expert: int, proj: str) -> StackedExpert | None:
        """Where the expert's matrix sits when the checkpoint stacks a layer's experts; None: one tensor per expert
        (`expert_weight_name`), as most families."""
        return None


# ---- parsing helpers the families share ---------------------------------------------------------


def rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Every rope value the file states, from wherever it states it: inside `rope_scaling` (hub dialect,
    `type` or `rope_type`) or `rope_parameters` (transformers 5.x re-saves), else at top level
    (`rope_theta`, `partial_rotary_factor`). transformers' order: a value inside the rope dict beats the
    same value at top level, `rope_scaling` beats `rope_parameters` should a file carry both, and a
    top-level `original_max_position_embeddings` beats the dict's (transformers' Phi-3 exception).
    Unstated values are absent (None counts as unstated)."""
    stated: dict[str, Any] = {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if raw.get(key) is not None:
            stated[key] = raw[key]
    for name in ("rope_parameters", "rope_scaling"):
        params = raw.get(name)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ConfigError(f"config.json: {name} must be an object, got {params!r}")
        if "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
            raise ConfigError(f"config.json: {name} is nested per layer type ({', '.join(params)}); "
                              "ktlite reads one rope for every layer")
        stated.update({k: v for k, v in params.items() if v is not None and k != "type"})
        if "rope_type" not in params and params.get("type") is not None:
            stated["rope_type"] = params["type"]
    if raw.get("original_max_position_embeddings") is not None:
        stated["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    return stated


def rope_config(raw: dict[str, Any], head_dim: int, *, theta: float, interleave: bool, max_position_embeddings: int,
                partial_rotary_factor: float = 1.0, rotary_dim_field: bool = False) -> RopeConfig:
    """The RopeConfig of a config.json dict in either dialect: every value the file states wins wherever
    it is written (see `rope_fields`); the family's defaults (`theta`, `partial_rotary_factor`,
    `interleave`) apply only where the file says nothing. `head_dim` is the whole head; the rotated slice
    is `head_dim * partial_rotary_factor`. `rotary_dim_field`: the family's legacy `rotary_dim` (MiniMax-M2)
    states the rotated width where no `partial_rotary_factor` does, as transformers reads it."""
    stated = rope_fields(raw)
    if "partial_rotary_factor" not in stated and rotary_dim_field and raw.get("rotary_dim") is not None:
        stated["partial_rotary_factor"] = int(raw["rotary_dim"]) / head_dim
    partial = float(stated.get("partial_rotary_factor", partial_rotary_factor))
    if not 0 < partial <= 1:
        raise ConfigError(f"config.json: partial_rotary_factor={partial} must be in (0, 1]")
    rotated = int(head_dim * partial)
    if rotated % 2 or not rotated:
        raise ConfigError(f"config.json: the rotated width {head_dim} * partial_rotary_factor {partial} = {rotated} "
                          "must be a positive even number")
    common = dict(theta=float(stated.get("rope_theta", theta)), head_dim=rotated,
                  interleave=bool(raw.get("rope_interleave", interleave)))
    kind = stated.get("rope_type", "default")
    if kind == "default":
        return RopeConfig(**common)
    if kind != "yarn":
        raise ConfigError(f"config.json: rope type {kind!r} is not supported (supported: default, yarn)")
    original = int(stated.get("original_max_position_embeddings", max_position_embeddings))
    factor = stated.get("factor")
    return RopeConfig(
        **common,
        kind="yarn",
        factor=float(max_position_embeddings / original if factor is None else factor),
        original_max_position_embeddings=original,
        beta_fast=float(stated.get("beta_fast") or 32),
        beta_slow=float(stated.get("beta_slow") or 1),
        mscale=float(stated.get("mscale") or 0.0),
        mscale_all_dim=float(stated.get("mscale_all_dim") or 0.0),
        attention_factor=None if stated.get("attention_factor") is None else float(stated["attention_factor"]),
        truncate=bool(stated.get("truncate", True)),
    )


def fp8_block_size(raw: dict[str, Any]) -> tuple[int, int] | None:
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "compressed-tensors" and quant.get("format") == "pack-quantized":
        return None  # INT4 routed experts (Kimi-K2-Thinking; --kt-method RAWINT4 reads them), the rest bf16
    if method == "mxfp4":
        return None  # MXFP4 routed experts (gpt-oss; --kt-method MXFP4 reads them), the rest bf16
    if method == "mxfp8":
        return None  # MXFP8 linears (MiniMax-M3-MXFP8): experts kept by --kt-method MXFP8, the rest dequantized at load
    if method != "fp8":
        raise ConfigError(
            f"config.json: quantization_config.quant_method {method!r} is not supported "
            "(ktlite reads bf16/fp16/fp32 checkpoints, block-scaled fp8 and mxfp4 experts)"
        )
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def stored_fp8_block(raw: dict[str, Any]) -> tuple[int, int] | None:
    """The scale block of the checkpoint's float8 weights, which the reader dequantizes by: block FP8's, or
    MXFP8's [1, 32] with e8m0 scales. MXFP8 checkpoints store every linear but their `ignored_layers` (routers,
    embeddings, lm_head) in e4m3 (transformers reads quant_method 'mxfp8' as FineGrainedFP8 with [1, 32] blocks):
    ktlite keeps the routed experts as stored (--kt-method MXFP8) and dequantizes the other linears at load into
    the model's dtype, exactly in bf16 (an e4m3 code times a power of two has 4 significant bits), planned so."""
    quant = raw.get("quantization_config") or {}
    if quant.get("quant_method") == "mxfp8":
        block = quant.get("weight_block_size") or [1, 32]
        if list(block) != [1, 32]:
            raise ConfigError(f"config.json: mxfp8 weight_block_size {block} is not supported (MX blocks are [1, 32])")
        return 1, 32
    return fp8_block_size(raw)


def fp8_skip(raw: dict[str, Any]) -> tuple[str, ...]:
    """The module name patterns a block-FP8 checkpoint keeps in high precision: its quantization_config's
    `modules_to_not_convert`, as transformers' FineGrainedFP8 quantizer writes it (names or regexes, matched
    by `fp8.skipped`); none without it."""
    if fp8_block_size(raw) is None:
        return ()
    return tuple(str(p) for p in raw["quantization_config"].get("modules_to_not_convert") or ())


def refuse_other_values(stated: dict[str, Any], implemented: dict[str, Any], family: str, where: str = "") -> None:
    """Switches a published config states that transformers' model does not read (it builds one variant whatever
    the file says) and ktlite implements that same variant of: a file stating another value is refused, naming
    the field, rather than served with numerics that differ from the checkpoint's. Unstated or null: accepted."""
    for name, value in implemented.items():
        if stated.get(name) is not None and stated[name] != value:
            raise ConfigError(f"config.json: {where}{name}={stated[name]!r} is not supported: {family} is "
                              f"implemented (as in transformers) with {name}={value!r} only")


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


class Fields:
    """config.json values with family defaults; `need` names a missing required field."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any], keep_none: tuple[str, ...] = ()):
        self.raw = raw
        self.values = {**defaults, **{k: v for k, v in raw.items() if v is not None or k in keep_none}}

    def need(self, name: str) -> Any:
        if name not in self.values:
            raise ConfigError(f"config.json: required field {name!r} is missing")
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        value = self.values.get(name)
        return default if value is None else value

    def common(self, architecture: str, **given: Any) -> dict[str, Any]:
        """`ModelConfig`'s fields but `rope` (see `rope`), each read under its usual name (required unless the
        family's defaults hold it); `given` holds the ones the family reads its own way (another name, a
        value of its own)."""
        self.check_silu()
        common = dict(
            architecture=architecture,
            vocab_size=int(self.need("vocab_size")),
            hidden_size=int(self.need("hidden_size")),
            num_hidden_layers=int(self.need("num_hidden_layers")),
            num_attention_heads=int(self.need("num_attention_heads")),
            tie_word_embeddings=bool(self.get("tie_word_embeddings", False)),
            rms_norm_eps=float(self.get("rms_norm_eps", 1e-6)),
            bos_token_id=self.values.get("bos_token_id"),
            eos_token_ids=eos_ids(self.values.get("eos_token_id")),
            torch_dtype=str(self.get("dtype") or self.get("torch_dtype", "bfloat16")),
            fp8_block_size=fp8_block_size(self.values),
            fp8_skip=fp8_skip(self.values),
            stored_fp8_block=stored_fp8_block(self.values),
        )
        for name in ("max_position_embeddings", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                     "num_experts_per_tok"):
            if name not in given:
                common[name] = int(self.need(name))
        return {**common, **given}

    def rope(self, head_dim: int, **family: Any) -> RopeConfig:
        """`rope_config` of the raw file over `head_dim`, with the family's defaults (`theta`, `interleave`, ...)."""
        return rope_config(self.raw, head_dim, max_position_embeddings=int(self.need("max_position_embeddings")),
                           **family)

    def check_silu(self) -> None:
        act = self.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: --model must be a folder with config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """The family's config for a config.json dict; an unknown architecture lists the supported ones."""
    from ktlite.runtime.models.registry import parse

    return parse(raw)


def load_config(model_dir: str | Path) -> ModelConfig:
    return parse_config(read_config_json(model_dir))
