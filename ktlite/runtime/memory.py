"""The GPU memory plan: bytes per component per device, computed before anything is allocated.

Inputs are the model's config (any family, `ktlite.runtime.models.ModelConfig`) and the serving flags (`PlanInputs`, SGLang/KTransformers
names). The plan has one table per tensor-parallel rank (`RankPlan`), because under TP each GPU holds
its own shard:

- weights: exactly the shapes of the rank's shard of the model, built on the meta device
  (`models.build(..., device="meta", tp=...)`, see `tp_layers.py` for the split), so planned and
  allocated bytes agree by construction; the modules' `plan_component` tags name the components;
- routers (fp32) are replicated; the GPU routed experts are expert-parallel (each rank holds 1/tp of
  each layer's GPU experts, the first `count % tp` ranks one more);
- the KV pool holds what the family declares per token per rank (`cfg.token_cache_specs(tp, kv_dtype)`:
  e.g. a full MLA latent on every rank, or this rank's GQA kv heads; with --kv-cache-dtype fp8_e4m3
  the MLA latent, index keys and GQA K/V per kv head are packed rows with their scales).

The budget rule (stated again in every verdict):
    static budget   = mem_fraction_static x device memory  >= weights + GPU experts + KV pool
                                                              + request table
    headroom budget = (1 - mem_fraction_static) x device   >= prefill workspace + layerwise buffer
What the headroom does not use is slack for the CUDA context, cuBLAS/Triton scratch and allocator
fragmentation. Without `max_total_tokens` the KV pool takes every whole token the static budget
leaves (the same count on all ranks); with it, the pool has exactly that size. Either way the pool
must hold at least one prefill chunk.

Weight bytes follow the GPU weight format (`dtype`): "fp8" (the default "auto" for
block-FP8 checkpoints) stores each linear projection as 1 byte per value plus one float32 scale per
128x128 block (ceil(N/128) * ceil(K/128) * 4 bytes); embeddings, lm_head and norms stay in the
activation dtype (bf16) and routers in float32, exactly as the checkpoints store them. "bfloat16",
"float16", "float32" store everything but the routers in that dtype.

API for the runtime:
    inputs = PlanInputs(gpu_memory="24GiB", kt_num_gpu_experts=4, ...)    # validates; ConfigError
    plan = make_plan(cfg, inputs)            # raises PlanDoesNotFit (a PlanError) before allocating
    plan.kv_pool_tokens, plan.kv_bytes_per_token, plan.gpu_experts_per_layer[rank]
    kv = plan.alloc("kv_pool", shape, dtype, device, rank)       # KVPool(..., alloc=plan.alloc)
    planned = plan.bytes("attention", rank)
    allocated = allocated_by_component(model)                      # module tags -> components
    allocated.update(plan.allocated(rank))                         # what went through alloc()
    assert not plan.mismatches(allocated, rank)                    # {} when within 1 %
    print(plan.format_table())
`components_of(model)` maps every parameter/buffer of a model to its component through the
`plan_component` tags of its modules; routed experts map to "gpu_experts" because a routed expert
tensor that lives on the GPU is a GPU expert.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import chain

import torch
from torch import nn

from ktlite.errors import ConfigError, PlanError
from ktlite.kernels.cpu.quant import RAWINT4_GROUP
from ktlite.runtime.kv_cache import kv_bytes_per_token
from ktlite.runtime.state_cache import state_bytes_per_request
from ktlite.runtime.models.config import ModelConfig

logger = logging.getLogger(__name__)

WEIGHT_COMPONENTS = ("embeddings", "lm_head", "attention", "dense_mlp", "shared_experts", "norms_router")
STATIC_COMPONENTS = WEIGHT_COMPONENTS + ("gpu_experts", "kv_pool", "state_pool", "request_table")
HEADROOM_COMPONENTS = ("prefill_workspace", "layerwise_buffer")
COMPONENTS = STATIC_COMPONENTS + HEADROOM_COMPONENTS

WEIGHT_DTYPES = ("auto", "fp8", "bfloat16", "float16", "float32")
# how the GPU experts are held: "dense" in the activation dtype (the fused MoE's dense path), or
# "int4_g32", a checkpoint's INT4 codes with fp32 scales per group of 32 (RAWINT4, never re-quantized)
GPU_EXPERT_FORMATS = ("dense", "int4_g32")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "bfloat16", "float16", "float32")
_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "bfloat16": 2, "float16": 2, "float32": 4}
TENSOR_PARALLEL_CHOICES = (2, 4, 8)  # what a "use more GPUs" suggestion may propose

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_GIB, _MIB = 2**30, 2**20


def parse_size(value: int | str) -> int:
    """Bytes from 17179869184, "16GiB", "24GB" (10^9), "800MiB", "1.5G" (bare K/M/G/T are binary)."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"--gpu-memory {value!r}: expected a size like 16GiB, 24GB, 800MiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _gib(n: float) -> str:
    return f"{n / _GIB:.2f} GiB"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PlanInputs:
    """Serving flags that decide GPU memory (field = flag name without dashes).

    gpu_memory: bytes per GPU (or a size string); None = the free memory of each visible CUDA device.
    chunked_prefill_size: prompt tokens per prefill forward (SGLang's default 8192); -1 = no chunking,
      a whole prompt (up to context_length) in one forward.
    max_running_requests: requests batched together; their decode tokens can ride along with a
      prefill chunk, so one forward has up to chunked_prefill_size + max_running_requests tokens.
    context_length: longest request (default: the config's max_position_embeddings).
    kt_num_gpu_experts: routed experts per MoE layer on the GPU(s), over all ranks;
      kt_gpu_experts_ratio (fraction of n_routed_experts, rounded) wins when both are given.
    kt_gpu_prefill_token_threshold: prompts this long run layerwise prefill on the GPU, which needs a
      buffer for one MoE layer's routed experts; None = no layerwise prefill.
    dtype: GPU weight format, see WEIGHT_DTYPES; kv_cache_dtype: see KV_CACHE_DTYPES ("auto" = the
      activation dtype: bf16, or fp16/fp32 when the weights run in that).
    gpu_expert_format: see GPU_EXPERT_FORMATS (set by --kt-method, not a flag of its own).
    dense_quantization: INT8 / INT4 when a CPU device quantizes its linear layers (--cpu-dense-method,
      runtime/cpu_dense.py), None when they keep the weight dtype.
    """

    gpu_memory: int | str | None = None
    mem_fraction_static: float = 0.80
    max_total_tokens: int | None = None
    chunked_prefill_size: int = 8192
    max_running_requests: int = 64
    context_length: int | None = None
    kt_num_gpu_experts: int = 0
    kt_gpu_experts_ratio: float | None = None
    kt_gpu_prefill_token_threshold: int | None = None
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_expert_format: str = "dense"
    dense_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.gpu_memory is not None:
            object.__setattr__(self, "gpu_memory", parse_size(self.gpu_memory))
            _require(self.gpu_memory > 0, "--gpu-memory", self.gpu_memory, "must be positive")
        _require(0 < self.mem_fraction_static <= 1, "--mem-fraction-static", self.mem_fraction_static, "must be in (0, 1]")
        _require(self.max_total_tokens is None or self.max_total_tokens >= 1, "--max-total-tokens", self.max_total_tokens, "must be >= 1")
        _require(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1, "--chunked-prefill-size",
                 self.chunked_prefill_size, "must be >= 1, or -1 to disable chunking")
        _require(self.max_running_requests >= 1, "--max-running-requests", self.max_running_requests, "must be >= 1")
        _require(self.context_length is None or self.context_length >= 1, "--context-length", self.context_length, "must be >= 1")
        _require(self.kt_num_gpu_experts >= 0, "--kt-num-gpu-experts", self.kt_num_gpu_experts, "must be >= 0")
        _require(self.kt_gpu_experts_ratio is None or 0 <= self.kt_gpu_experts_ratio <= 1, "--kt-gpu-experts-ratio",
                 self.kt_gpu_experts_ratio, "must be in [0, 1]")
        _require(self.kt_gpu_prefill_token_threshold is None or self.kt_gpu_prefill_token_threshold >= 1,
                 "--kt-gpu-prefill-token-threshold", self.kt_gpu_prefill_token_threshold, "must be >= 1")
        _require(self.tensor_parallel_size >= 1, "--tensor-parallel-size", self.tensor_parallel_size, "must be >= 1")
        _require(self.dtype in WEIGHT_DTYPES, "--dtype", self.dtype, f"must be one of {', '.join(WEIGHT_DTYPES)}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "--kv-cache-dtype", self.kv_cache_dtype,
                 f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.gpu_expert_format not in GPU_EXPERT_FORMATS:  # set by the runtime, not typed by a user
            raise ValueError(f"gpu_expert_format {self.gpu_expert_format!r} not in {GPU_EXPERT_FORMATS}")
        if self.dense_quantization not in (None, "INT8", "INT4"):
            raise ValueError(f"dense_quantization {self.dense_quantization!r}: INT8, INT4 or None")


def _require(ok: bool, flag: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{flag} {value}: {rule}")


@dataclass(frozen=True)
class _Resolved:
    """PlanInputs with the model-dependent defaults filled in and checked against the config."""

    weight_dtype: str  # "fp8" | "bfloat16" | "float16" | "float32"
    act_dtype: str  # embeddings, norms, activations
    kv_dtype: str
    gpu_experts: int  # per MoE layer, all ranks together
    context_length: int
    chunk_tokens: int  # prompt tokens in one prefill forward


def _resolve(cfg: ModelConfig, inputs: PlanInputs) -> _Resolved:
    tp = inputs.tensor_parallel_size
    cfg.check_tensor_parallel(tp)
    if inputs.dtype == "fp8" and cfg.fp8_block_size is None:
        raise ConfigError("--dtype fp8: this checkpoint is not block-FP8; use auto/bfloat16/float16/float32")
    weight = ("fp8" if cfg.fp8_block_size else "bfloat16") if inputs.dtype == "auto" else inputs.dtype
    act = "bfloat16" if weight == "fp8" else weight
    kv = act if inputs.kv_cache_dtype == "auto" else inputs.kv_cache_dtype
    experts = cfg.n_routed_experts
    if inputs.kt_gpu_experts_ratio is not None:
        count = round(inputs.kt_gpu_experts_ratio * experts)
    else:
        count = inputs.kt_num_gpu_experts
        _require(count <= experts, "--kt-num-gpu-experts", count, f"must be in 0..{experts} (n_routed_experts)")
    context = inputs.context_length or cfg.max_position_embeddings
    _require(context <= cfg.max_position_embeddings, "--context-length", context,
             f"exceeds the model's max_position_embeddings {cfg.max_position_embeddings}")
    chunk = context if inputs.chunked_prefill_size == -1 else inputs.chunked_prefill_size
    return _Resolved(weight, act, kv, count, context, chunk)


# ---- what each rank holds --------------------------------------------------------------------

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                 "fp8_e4m3": torch.float8_e4m3fn}


# a tag in here names a kind of tensor that counts as such wherever its module sits (a norm inside
# attention is a norm); every other tag names a role, which the outermost tagged module decides (an
# MLP, tagged dense_mlp, inside a shared expert belongs to the shared expert)
KIND_COMPONENTS = ("norms_router",)


def components_of(model: nn.Module) -> dict[str, str]:
    """{parameter or buffer name: plan component} from the modules' `plan_component` tags: a tensor
    counts against its outermost tagged module, unless a module on the way names a kind
    (KIND_COMPONENTS)."""
    out: dict[str, str] = {}

    def visit(module: nn.Module, prefix: str, component: str | None) -> None:
        tag = getattr(module, "plan_component", None)
        if tag is not None and (component is None or tag in KIND_COMPONENTS):
            component = tag
        for name, _ in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            if component is None:
                raise ValueError(f"{prefix}{name} has no memory-plan component: tag its module with plan_component")
            out.setdefault(prefix + name, component)
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.", component)

    visit(model, "", None)
    return out


def allocated_by_component(model: nn.Module) -> dict[str, int]:
    """Bytes per component of a model's parameters and buffers (a tied or shared tensor once)."""
    owner = components_of(model)
    out: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out[owner[name]] += tensor.numel() * tensor.element_size()
    return dict(out)


@functools.lru_cache(maxsize=64)
def _weight_bytes(cfg: ModelConfig, tp: int, weight: str, act: str, dense_quantization: str | None = None) -> dict[str, int]:
    """Bytes per component of one rank's non-expert weights: the rank's shard built on the meta
    device (cached: knob searches re-plan often), its linear layers counted quantized when a CPU
    device quantizes them."""
    from ktlite.runtime.models import build
    from ktlite.runtime.models.tp_layers import TPContext

    model = build(cfg, "meta", _TORCH_DTYPES[act], routed_experts=False, fp8_weights=weight == "fp8",
                  tp=TPContext(0, tp) if tp > 1 else None)
    if weight != "fp8" and weight != act:
        raise ValueError(f"weights {weight} with activations {act}")
    if dense_quantization is None:
        return {**dict.fromkeys(WEIGHT_COMPONENTS, 0), **allocated_by_component(model)}
    from ktlite.runtime.cpu_dense import planned_weight_bytes  # it builds on this module

    return {**dict.fromkeys(WEIGHT_COMPONENTS, 0), **planned_weight_bytes(model, dense_quantization)}


def _linear_bytes(cfg: ModelConfig, out_features: int, in_features: int, weight: str) -> int:
    numel = out_features * in_features
    if weight == "int4_g32":  # two codes per byte + one fp32 scale per group
        return numel // 2 + out_features * _ceil_div(in_features, RAWINT4_GROUP) * 4
    if weight != "fp8":
        return numel * _DTYPE_BYTES[weight]
    bn, bk = cfg.fp8_block_size or (128, 128)
    return numel + _ceil_div(out_features, bn) * _ceil_div(in_features, bk) * 4  # + one fp32 scale per block


def expert_bytes(cfg: ModelConfig, weight_dtype: str) -> int:
    """Bytes of one routed expert (gate, up, down) in a GPU weight format (a dtype name or int4_g32)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return 2 * _linear_bytes(cfg, i, h, weight_dtype) + _linear_bytes(cfg, h, i, weight_dtype)


def workspace_bytes(cfg: ModelConfig, tokens: int, logits_rows: int, tp: int, act: str, gpu_moe: bool) -> int:
    """Estimated activation bytes of one forward of `tokens` tokens on one rank (an upper bound:
    tensors of a phase are summed as if none were freed early).

    With a = activation bytes, H = hidden:
      per token:
        stream    4 H a                     residual, normed input, layer output, CPU-expert result
        + max(attention, mlp), where
        attention cfg.attention_workspace(tp) a   what the family's attention holds at once
                                            (MLA: q_a, q, latent, absorbed q, latent output, W_UV output;
                                             GQA: q, k, v, output)
        mlp       max(dense: 3 I/tp a,
                      moe: router 2 E 4 + k 12  (fp32 logits + scores, top-k ids + weights)
                           + shared 3 I_shared/tp a
                           + GPU experts k (I_moe + H) a + 4 H  (fused-MoE act + per-pair output +
                             fp32 sum; only when GPU experts or layerwise prefill run)
      plus logits_rows x vocab x 4 (fp32 logits of the last token of each request, vocab gathered).
    """
    a = _DTYPE_BYTES[act]
    h = cfg.hidden_size
    attention = cfg.attention_workspace(tp) * a
    has_dense = any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    dense = 3 * _ceil_div(cfg.intermediate_size, tp) * a if has_dense else 0
    moe = 0
    if cfg.moe_layers:
        k = cfg.num_experts_per_tok
        moe = 2 * cfg.n_routed_experts * 4 + k * 12
        moe += 3 * _ceil_div(cfg.shared_intermediate_size, tp) * a
        if gpu_moe:
            moe += k * (cfg.moe_intermediate_size + h) * a + 4 * h
    per_token = 4 * h * a + max(attention, dense, moe)
    return tokens * per_token + logits_rows * cfg.vocab_size * 4


# ---- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    component: str
    bytes: int
    note: str


@dataclass(frozen=True)
class RankPlan:
    rank: int
    device_bytes: int
    static_budget: int
    headroom_budget: int
    rows: tuple[Row, ...]

    def bytes(self, component: str) -> int:
        return next(r.bytes for r in self.rows if r.component == component)

    @property
    def static_bytes(self) -> int:
        return sum(r.bytes for r in self.rows if r.component in STATIC_COMPONENTS)

    @property
    def headroom_bytes(self) -> int:
        return sum(r.bytes for r in self.rows if r.component in HEADROOM_COMPONENTS)

    def problems(self, label: str) -> list[str]:
        out = []
        if self.static_bytes > self.static_budget:
            out.append(f"{label}: weights + GPU experts + KV pool need {_gib(self.static_bytes)} but the static "
                       f"budget is {_gib(self.static_budget)} ({_gib(self.static_bytes - self.static_budget)} over)")
        if self.headroom_bytes > self.headroom_budget:
            out.append(f"{label}: prefill workspace + layerwise buffer need {_gib(self.headroom_bytes)} but the "
                       f"headroom is {_gib(self.headroom_budget)} ({_gib(self.headroom_bytes - self.headroom_budget)} over)")
        return out


@dataclass(frozen=True)
class Suggestion:
    """One change that makes the plan fit; `field`/`value` re-plan it (None: not a flag), together
    with the further flag changes in `with_` when one flag alone is not enough."""

    text: str
    field: str | None = None
    value: object = None
    with_: tuple[tuple[str, object], ...] = ()

    @property
    def changes(self) -> dict[str, object]:
        """Every PlanInputs field this suggestion changes, to re-plan with."""
        return {self.field: self.value, **dict(self.with_)} if self.field else {}


@dataclass
class MemoryPlan:
    cfg: ModelConfig
    inputs: PlanInputs
    weight_dtype: str
    kv_dtype: str
    context_length: int
    chunk_tokens: int
    kv_pool_tokens: int
    kv_bytes_per_token: int
    gpu_experts_total: int  # per MoE layer, all ranks
    gpu_experts_per_layer: tuple[int, ...]  # per rank: how many of each MoE layer's experts it holds
    ranks: tuple[RankPlan, ...]
    problems: tuple[str, ...]  # empty when the plan fits
    ledger: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    @property
    def fits(self) -> bool:
        return not self.problems

    def rows(self, rank: int = 0) -> tuple[Row, ...]:
        return self.ranks[rank].rows

    def bytes(self, component: str, rank: int = 0) -> int:
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}; one of {', '.join(COMPONENTS)}")
        return self.ranks[rank].bytes(component)

    def alloc(self, component: str, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device,
              rank: int = 0) -> torch.Tensor:
        """torch.empty(shape) whose bytes are recorded against `component` on `rank`."""
        planned = self.bytes(component, rank)
        tensor = torch.empty(shape, dtype=dtype, device=device)
        used = self.ledger[rank][component] = self.ledger[rank][component] + tensor.numel() * tensor.element_size()
        if used > planned * 1.01:
            logger.warning("%s on GPU %d: allocated %d bytes, planned %d", component, rank, used, planned)
        return tensor

    def allocated(self, rank: int = 0) -> dict[str, int]:
        """Bytes that went through alloc() on `rank`, per component."""
        return dict(self.ledger[rank])

    def mismatches(self, allocated: Mapping[str, int], rank: int = 0, rel_tol: float = 0.01) -> dict[str, tuple[int, int]]:
        """{component: (planned, allocated)} for the given components that differ by more than rel_tol."""
        out = {}
        for component, used in allocated.items():
            planned = self.bytes(component, rank)
            if abs(used - planned) > rel_tol * planned:
                out[component] = (planned, used)
        return out

    # ---- text ----

    def _header(self) -> list[str]:
        c, i = self.cfg, self.inputs
        fmt = f"fp8 with fp32 scales per {c.fp8_block_size or (128, 128)} block" if self.weight_dtype == "fp8" else self.weight_dtype
        if self.weight_dtype == "fp8" and c.fp8_skip:  # the linear layers the checkpoint keeps in bf16
            fmt += f" but {len(c.fp8_skip)} modules_to_not_convert patterns in bf16"
        if i.dense_quantization:  # a CPU device: its linear layers quantized at load
            fmt += f", linear layers {i.dense_quantization} (--cpu-dense-method)"
        experts = f"{len(c.moe_layers)} MoE layers x {c.n_routed_experts} routed experts" if c.moe_layers else "no MoE layers"
        return [
            f"{c.architecture}: {c.num_hidden_layers} layers ({experts}), GPU weights {fmt}, KV cache {self.kv_dtype}",
            f"flags: --mem-fraction-static {i.mem_fraction_static:.2f} --chunked-prefill-size {i.chunked_prefill_size} "
            f"--max-running-requests {i.max_running_requests} --context-length {self.context_length} "
            f"--kt-num-gpu-experts {self.gpu_experts_total} --tensor-parallel-size {i.tensor_parallel_size}"
            + (f" --max-total-tokens {i.max_total_tokens}" if i.max_total_tokens else "")
            + (f" --kt-gpu-prefill-token-threshold {i.kt_gpu_prefill_token_threshold}"
               if i.kt_gpu_prefill_token_threshold else ""),
        ]

    def _rank_lines(self, rp: RankPlan) -> list[str]:
        tp, frac = len(self.ranks), self.inputs.mem_fraction_static
        width = max(len(c) for c in COMPONENTS + ("headroom total",))
        line = f"  {{:<{width}}} {{:>10}} {{:>18}}  {{}}".format
        out = [f"GPU {rp.rank} of {tp}: {_gib(rp.device_bytes)}", line("component", "GiB", "bytes", "note")]

        def section(components: tuple[str, ...], total_name: str, total: int, budget: int, rule: str) -> None:
            for r in rp.rows:
                if r.component in components:
                    out.append(line(r.component, f"{r.bytes / _GIB:.2f}", f"{r.bytes:,}", r.note))
            verdict = "ok" if total <= budget else f"OVER by {_gib(total - budget)}"
            out.append(line(total_name, f"{total / _GIB:.2f}", f"{total:,}", f"budget {_gib(budget)} = {rule}: {verdict}"))

        section(STATIC_COMPONENTS, "static total", rp.static_bytes, rp.static_budget, f"{frac:.2f} x device")
        section(HEADROOM_COMPONENTS, "headroom total", rp.headroom_bytes, rp.headroom_budget, f"{1 - frac:.2f} x device")
        return out

    def table(self) -> str:
        lines = self._header()
        for rp in self.ranks:
            lines += [""] + self._rank_lines(rp)
        return "\n".join(lines)

    def verdict(self) -> str:
        rule = (f"Rule: {self.inputs.mem_fraction_static:.2f} x GPU memory (--mem-fraction-static) holds the weights, "
                "GPU experts and KV pool; the rest holds the prefill workspace and layerwise-prefill buffer.")
        if not self.fits:
            return f"verdict: does NOT fit. {'; '.join(self.problems)}. {rule}"
        per_rank = "/".join(map(str, self.gpu_experts_per_layer))
        copies = " (a full copy on each GPU)" if len(self.ranks) > 1 else ""
        text = (f"verdict: fits. KV pool {self.kv_pool_tokens:,} tokens x {self.kv_bytes_per_token:,} bytes{copies}; "
                f"{self.gpu_experts_total} GPU experts per MoE layer ({per_rank} per GPU). ")
        if self.kv_pool_tokens < self.context_length:
            text += (f"A single request can use at most {self.kv_pool_tokens:,} tokens, less than context length "
                     f"{self.context_length:,}. ")
        return text + rule

    def format_table(self) -> str:
        return f"{self.table()}\n{self.verdict()}"


class PlanDoesNotFit(PlanError):
    """make_plan's error: `plan` is the failing plan, `suggestions` the changes that make it fit."""

    def __init__(self, plan: MemoryPlan, suggestions: list[Suggestion]):
        self.plan, self.suggestions = plan, suggestions
        fixes = "; ".join(s.text for s in suggestions) or "nothing a single flag can change (see the table)"
        tp = len(plan.ranks)
        gpus = f"{tp} GPUs of {_gib(plan.ranks[0].device_bytes)}" if tp > 1 else f"one GPU of {_gib(plan.ranks[0].device_bytes)}"
        super().__init__(
            f"The model does not fit on {gpus}. {'; '.join(plan.problems)}. "
            f"ktlite keeps {plan.inputs.mem_fraction_static:.2f} of each GPU's memory (--mem-fraction-static) for the "
            "weights, GPU experts and KV pool, and the rest for the prefill workspace and layerwise-prefill buffer. "
            f"To fit, change one of: {fixes}.\n\n{plan.table()}"
        )


def _plan(cfg: ModelConfig, inputs: PlanInputs, device_bytes: tuple[int, ...]) -> MemoryPlan:
    """The plan for given device sizes, fitting or not (pure arithmetic, allocates nothing)."""
    res = _resolve(cfg, inputs)
    tp, frac = inputs.tensor_parallel_size, inputs.mem_fraction_static
    weights = _weight_bytes(cfg, tp, res.weight_dtype, res.act_dtype, inputs.dense_quantization)
    # GPU experts are held dense in the activation dtype (FP8 checkpoints' experts too), or as INT4 codes
    gpu_format = res.act_dtype if inputs.gpu_expert_format == "dense" else inputs.gpu_expert_format
    per_expert = expert_bytes(cfg, gpu_format)
    dense_expert = expert_bytes(cfg, res.act_dtype)  # the layerwise buffer holds any expert, dequantized
    moe_layers = len(cfg.moe_layers)
    experts_on = tuple(res.gpu_experts // tp + (r < res.gpu_experts % tp) for r in range(tp))
    kv_dtype = _TORCH_DTYPES[res.kv_dtype]
    cache_specs = cfg.token_cache_specs(tp, kv_dtype)
    kv_per_token = kv_bytes_per_token(cache_specs, kv_dtype)
    request_table = inputs.max_running_requests * res.context_length * 4  # int32 token slots per request
    state_per_request = state_bytes_per_request(cfg.request_state_specs(tp))
    static_budget = [int(frac * d) for d in device_bytes]
    state_pool = inputs.max_running_requests * state_per_request
    fixed = [sum(weights.values()) + experts_on[r] * moe_layers * per_expert + request_table + state_pool
             for r in range(tp)]

    problems: list[str] = []
    if inputs.max_total_tokens is not None:
        kv_tokens = inputs.max_total_tokens
    else:  # whole tokens the tightest rank leaves; at least one chunk (else the static check fails)
        kv_tokens = max(min((b - f) // kv_per_token for b, f in zip(static_budget, fixed)), res.chunk_tokens)
    if kv_tokens < res.chunk_tokens:
        problems.append(f"The KV pool ({kv_tokens:,} tokens) must hold at least one prefill chunk "
                        f"({res.chunk_tokens:,} tokens)")

    layerwise = inputs.kt_gpu_prefill_token_threshold is not None
    lw_experts = _ceil_div(cfg.n_routed_experts, tp) if layerwise and moe_layers else 0
    forward_tokens = res.chunk_tokens + inputs.max_running_requests
    shard = _ceil_div(cfg.vocab_size, tp)
    heads = cfg.num_attention_heads // tp
    ranks = []
    for r, dev in enumerate(device_bytes):
        gpu_moe = layerwise or experts_on[r] > 0
        notes = {
            "embeddings": f"{shard:,} of {cfg.vocab_size:,} rows x {cfg.hidden_size}, {res.act_dtype}",
            "lm_head": "tied to the embeddings" if cfg.tie_word_embeddings else f"{shard:,} vocab rows x {cfg.hidden_size}, {res.act_dtype}",
            "attention": f"{cfg.num_hidden_layers} layers, {heads} of {cfg.num_attention_heads} heads, {res.weight_dtype}",
            "dense_mlp": f"{cfg.num_hidden_layers - moe_layers} layers, intermediate {_ceil_div(cfg.intermediate_size, tp)}",
            "shared_experts": f"{moe_layers} layers, intermediate {cfg.shared_intermediate_size}" if cfg.shared_intermediate_size else "none",
            "norms_router": "norms (replicated), fp32 routers, rope table",
            "gpu_experts": f"{experts_on[r]} per layer x {moe_layers} layers x {per_expert:,} B, {gpu_format}",
            "kv_pool": f"{kv_tokens:,} tokens x {kv_per_token:,} B ({_cache_note(cache_specs, res.kv_dtype)})",
            "request_table": f"{inputs.max_running_requests} requests x {res.context_length:,} token slots, int32",
            "state_pool": (f"{inputs.max_running_requests} requests x {state_per_request:,} B (recurrent layers' state)"
                           if state_per_request else "none (no recurrent layers)"),
            "prefill_workspace": f"estimate for {forward_tokens:,} tokens per forward",
            "layerwise_buffer": f"one MoE layer's {lw_experts} experts" if layerwise else "off (no --kt-gpu-prefill-token-threshold)",
        }
        sizes = {
            **weights,
            "gpu_experts": experts_on[r] * moe_layers * per_expert,
            "kv_pool": kv_tokens * kv_per_token,
            "request_table": request_table,
            "state_pool": state_pool,
            "prefill_workspace": workspace_bytes(cfg, forward_tokens, inputs.max_running_requests, tp, res.act_dtype, gpu_moe),
            "layerwise_buffer": lw_experts * dense_expert,
        }
        rows = tuple(Row(c, sizes[c], notes[c]) for c in COMPONENTS)
        ranks.append(RankPlan(r, dev, static_budget[r], dev - static_budget[r], rows))
    alike = all((rp.device_bytes, rp.rows) == (ranks[0].device_bytes, ranks[0].rows) for rp in ranks)
    if alike:  # one line for all GPUs rather than the same line per GPU
        problems += ranks[0].problems("Each GPU" if tp > 1 else "GPU 0")
    else:
        for rp in ranks:
            problems += rp.problems(f"GPU {rp.rank}")
    return MemoryPlan(
        cfg=cfg, inputs=inputs, weight_dtype=res.weight_dtype, kv_dtype=res.kv_dtype,
        context_length=res.context_length, chunk_tokens=res.chunk_tokens, kv_pool_tokens=kv_tokens,
        kv_bytes_per_token=kv_per_token, gpu_experts_total=res.gpu_experts, gpu_experts_per_layer=experts_on,
        ranks=tuple(ranks), problems=tuple(problems),
    )


def _cache_note(specs, kv_dtype: str) -> str:
    """'61 layers x 576 x bfloat16' (MLA latent), '48 layers x (k 4x128 + v 4x128) x bfloat16' (GQA), or
    with packed FP8 rows (uint8 specs) '61 layers x (latent 656 B + index_key 132 B), fp8_e4m3 rows
    with fp32 scales'."""
    packed = any(spec.dtype == torch.uint8 for spec in specs)
    groups: dict[int, list[str]] = defaultdict(list)
    for spec in specs:
        unit = " B" if spec.dtype == torch.uint8 else ""
        groups[len(spec.layers)].append(f"{spec.name} {'x'.join(map(str, spec.shape))}{unit}")
    parts = [f"{n} layers x " + (items[0].split(" ", 1)[1] if len(items) == 1 else f"({' + '.join(items)})")
             for n, items in groups.items()]
    return " + ".join(parts) + (f", {kv_dtype} rows with fp32 scales" if packed else f" x {kv_dtype}")


def _device_bytes(inputs: PlanInputs) -> tuple[int, ...]:
    tp = inputs.tensor_parallel_size
    if inputs.gpu_memory is not None:
        return (int(inputs.gpu_memory),) * tp
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA GPU is visible, so its memory is unknown: pass --gpu-memory (e.g. --gpu-memory 24GiB) "
                          "to plan for a GPU this machine does not have")
    if torch.cuda.device_count() < tp:
        raise ConfigError(f"--tensor-parallel-size {tp}: only {torch.cuda.device_count()} CUDA GPUs are visible")
    return tuple(torch.cuda.mem_get_info(r)[0] for r in range(tp))  # free bytes: what we can still allocate


def _splits(cfg: ModelConfig, tp: int) -> bool:
    try:
        cfg.check_tensor_parallel(tp)
    except ConfigError:
        return False
    return True


def _largest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """Largest v in [lo, hi] with ok(v), for ok true up to some point and false after; None if ok(lo) fails."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _experts_suggestion(cfg: ModelConfig, inputs: PlanInputs, count: int) -> Suggestion:
    """At most `count` GPU experts per layer, phrased in the flag the user set (the ratio wins)."""
    if inputs.kt_gpu_experts_ratio is None:
        return Suggestion(f"--kt-num-gpu-experts <= {count}", "kt_num_gpu_experts", count)
    ratio = float(f"{count / cfg.n_routed_experts:.6g}")  # round(ratio * n_routed_experts) == count
    return Suggestion(f"--kt-gpu-experts-ratio <= {ratio:g} ({count} experts per layer)", "kt_gpu_experts_ratio", ratio)


def _suggestions(cfg: ModelConfig, inputs: PlanInputs, devices: tuple[int, ...], plan: MemoryPlan,
                 machine_gpus: int) -> list[Suggestion]:
    """Every single-flag change that makes the plan fit, each at the largest (or smallest) value that
    does; else a combination. More GPUs are proposed as the GPUs the user has (plus one flag) first."""

    def replan(**changes: object) -> MemoryPlan:
        changed = dataclasses.replace(inputs, **changes)
        n = changed.tensor_parallel_size
        if "gpu_memory" in changes:
            sizes = (int(changed.gpu_memory),) * n
        else:  # other GPUs than planned: assume they are like the smallest one
            sizes = devices if n == len(devices) else (min(devices),) * n
        return _plan(cfg, changed, sizes)

    def fits(**changes: object) -> bool:
        return replan(**changes).fits

    out = _single_flag_fixes(cfg, plan, replan)
    if not out:
        out += _combined(cfg, inputs, replan)
    weights_alone = any(sum(rp.bytes(c) for c in WEIGHT_COMPONENTS) > rp.static_budget for rp in plan.ranks)
    if not out or weights_alone:
        out += _more_gpus(cfg, inputs, machine_gpus, replan)
        if cfg.fp8_block_size and plan.weight_dtype != "fp8" and fits(dtype="fp8"):
            out.append(Suggestion("--dtype auto (keep the checkpoint's FP8 weights)", "dtype", "auto"))
    need = _largest(lambda mib: not fits(gpu_memory=mib * _MIB), 1, 2**26)  # largest size in MiB that fails
    if need is not None and need < 2**26:
        out.append(Suggestion(f"a GPU with at least {_gib((need + 1) * _MIB)} free", "gpu_memory", (need + 1) * _MIB))
    return out


def _single_flag_fixes(cfg: ModelConfig, plan: MemoryPlan, replan: Callable[..., MemoryPlan]) -> list[Suggestion]:
    """Each memory knob that alone makes `plan` fit (re-planned through `replan`), at its best value."""
    inputs = plan.inputs

    def fits(**changes: object) -> bool:
        return replan(**changes).fits

    out: list[Suggestion] = []
    n = plan.gpu_experts_total
    best = _largest(lambda v: fits(kt_num_gpu_experts=v, kt_gpu_experts_ratio=None), 0, n - 1)
    if best is not None:
        out.append(_experts_suggestion(cfg, inputs, best))
    if inputs.max_total_tokens is not None:
        best = _largest(lambda v: fits(max_total_tokens=v), plan.chunk_tokens, inputs.max_total_tokens - 1)
        if best is not None:
            out.append(Suggestion(f"--max-total-tokens <= {best}", "max_total_tokens", best))
    best = _largest(lambda v: fits(chunked_prefill_size=v), 1, plan.chunk_tokens - 1)
    if best is not None:
        out.append(Suggestion(f"--chunked-prefill-size <= {best}", "chunked_prefill_size", best))
    if plan.kv_dtype != "fp8_e4m3" and fits(kv_cache_dtype="fp8_e4m3"):  # the KV pool is what does not fit
        packed = replan(kv_cache_dtype="fp8_e4m3").kv_bytes_per_token
        out.append(Suggestion(f"--kv-cache-dtype fp8_e4m3 ({packed:,} instead of {plan.kv_bytes_per_token:,} KV bytes "
                              "per token)", "kv_cache_dtype", "fp8_e4m3"))
    if inputs.kt_gpu_prefill_token_threshold is not None and fits(kt_gpu_prefill_token_threshold=None):
        out.append(Suggestion("drop --kt-gpu-prefill-token-threshold (no layerwise-prefill buffer)",
                              "kt_gpu_prefill_token_threshold", None))
    fractions = [k / 100 for k in range(1, 101) if fits(mem_fraction_static=k / 100)]
    if fractions and fractions[0] > inputs.mem_fraction_static:
        out.append(Suggestion(f"--mem-fraction-static >= {fractions[0]:.2f}", "mem_fraction_static", fractions[0]))
    elif fractions and fractions[-1] < inputs.mem_fraction_static:
        out.append(Suggestion(f"--mem-fraction-static <= {fractions[-1]:.2f}", "mem_fraction_static", fractions[-1]))
    return out


def _more_gpus(cfg: ModelConfig, inputs: PlanInputs, gpus_seen: int,
               replan: Callable[..., MemoryPlan]) -> list[Suggestion]:
    """A larger --tensor-parallel-size: the GPUs the machine has, with one more flag where the split
    alone is not enough, before the smallest count of "GPUs like this one" that fits alone."""
    for tp in TENSOR_PARALLEL_CHOICES:
        if tp <= inputs.tensor_parallel_size or not _splits(cfg, tp):
            continue
        split = replan(tensor_parallel_size=tp)
        if split.fits:
            where = "the GPUs this machine has" if tp <= gpus_seen else f"{tp} GPUs like this one"
            return [Suggestion(f"--tensor-parallel-size {tp} ({where})", "tensor_parallel_size", tp)]
        if tp <= gpus_seen:
            fixes = _single_flag_fixes(cfg, split, lambda **c: replan(tensor_parallel_size=tp, **c))
            combos = [Suggestion(f"--tensor-parallel-size {tp} with {f.text}", "tensor_parallel_size", tp,
                                 ((f.field, f.value),)) for f in fixes if f.field]
            if combos:
                return combos
    return []


def _combined(cfg: ModelConfig, inputs: PlanInputs, replan: Callable[..., MemoryPlan]) -> list[Suggestion]:
    """When no single flag is enough: the most GPU experts that fit with the KV pool sized by what
    is left and no layerwise buffer, and that pool's size."""
    base = {"kt_gpu_experts_ratio": None, "max_total_tokens": None, "kt_gpu_prefill_token_threshold": None}
    experts = _largest(lambda v: replan(**base, kt_num_gpu_experts=v).fits, 0, cfg.n_routed_experts)
    if experts is None:
        return []
    settled = {**base, "kt_num_gpu_experts": experts}
    current = replan().gpu_experts_total
    parts = [_experts_suggestion(cfg, inputs, experts).text] if experts < current else []
    if inputs.max_total_tokens is not None:
        tokens = replan(**settled).kv_pool_tokens
        parts.append(f"--max-total-tokens <= {tokens}")
    if inputs.kt_gpu_prefill_token_threshold is not None:
        parts.append("no --kt-gpu-prefill-token-threshold")
    return [Suggestion(" with ".join(parts))]


def make_plan(cfg: ModelConfig, inputs: PlanInputs, machine_gpus: int | None = None) -> MemoryPlan:
    """The memory plan per GPU; raises PlanDoesNotFit (a PlanError) listing components and fixes.
    `machine_gpus`: GPUs the machine has, which a larger --tensor-parallel-size may use before more
    GPUs are proposed (None: the visible CUDA devices, or the planned ones under --gpu-memory)."""
    devices = _device_bytes(inputs)
    plan = _plan(cfg, inputs, devices)
    if not plan.fits:
        if machine_gpus is None:
            visible = torch.cuda.device_count() if inputs.gpu_memory is None and torch.cuda.is_available() else 0
            machine_gpus = max(visible, len(devices))
        raise PlanDoesNotFit(plan, _suggestions(cfg, inputs, devices, plan, machine_gpus))
    logger.info("memory plan: KV pool %d tokens, %d GPU experts per MoE layer, %s static on GPU 0",
                plan.kv_pool_tokens, plan.gpu_experts_total, _gib(plan.ranks[0].static_bytes))
    return plan
