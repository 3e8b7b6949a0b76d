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
    inputs = PlanInputs(gpu_memory="24GiB", kt_num_gpu_experts=4, ...)    # plan_inputs.py; ConfigError
    plan = make_plan(cfg, inputs)            # raises PlanDoesNotFit (a PlanError) before allocating
    plan.kv_pool_tokens, plan.kv_bytes_per_token, plan.gpu_experts_per_layer[rank]
    kv = plan.alloc("kv_pool", shape, dtype, device, rank)       # KVPool(..., alloc=plan.alloc)
    planned = plan.bytes("attention", rank)
    allocated = allocated_by_component(model)        # plan_components.py: module tags -> components
    allocated.update(plan.allocated(rank))                         # what went through alloc()
    assert not plan.mismatches(allocated, rank)                    # {} when within 1 %
    print(plan.format_table())

This module is the arithmetic (`plan_on`: the plan for given device sizes, fitting or not) and
`make_plan`. Its neighbours: plan_inputs.py (PlanInputs, its checks, sizes, the flags resolved against
the config), plan_components.py (the components; `components_of`, `allocated_by_component` map a
model's tensors to them through the `plan_component` tags of its modules), plan_table.py (the table
and verdict as text) and plan_suggestions.py (what would fit, for PlanDoesNotFit).
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ktlite.errors import ConfigError, PlanError
from ktlite.kernels.cpu.mx import MX_GROUP
from ktlite.kernels.cpu.quant import RAWINT4_GROUP
from ktlite.runtime import plan_table
from ktlite.runtime.kv_cache import kv_bytes_per_token
from ktlite.runtime.models.config import ModelConfig
from ktlite.runtime.plan_components import (COMPONENTS, HEADROOM_COMPONENTS, STATIC_COMPONENTS, WEIGHT_COMPONENTS,
                                            allocated_by_component)
from ktlite.runtime.plan_inputs import PlanInputs, gib, resolve_inputs
from ktlite.runtime.plan_suggestions import Suggestion, suggestions
from ktlite.runtime.state_cache import state_bytes_per_request

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "bfloat16": 2, "float16": 2, "float32": 4}
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                 "fp8_e4m3": torch.float8_e4m3fn}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- what each rank holds --------------------------------------------------------------------


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
    from ktlite.runtime.cpu_dense import planned_weight_bytes  # numba kernels: imported on use only

    return {**dict.fromkeys(WEIGHT_COMPONENTS, 0), **planned_weight_bytes(model, dense_quantization)}


def _linear_bytes(cfg: ModelConfig, out_features: int, in_features: int, weight: str) -> int:
    numel = out_features * in_features
    if weight == "int4_g32":  # two codes per byte + one fp32 scale per group
        return numel // 2 + out_features * _ceil_div(in_features, RAWINT4_GROUP) * 4
    if weight in ("mxfp4", "mxfp8"):  # e2m1 codes two a byte or e4m3 one, + one e8m0 byte per 32: 4.25 / 8.25 bits
        return numel // (2 if weight == "mxfp4" else 1) + out_features * _ceil_div(in_features, MX_GROUP)
    if weight != "fp8":
        return numel * _DTYPE_BYTES[weight]
    bn, bk = cfg.fp8_block_size or (128, 128)
    return numel + _ceil_div(out_features, bn) * _ceil_div(in_features, bk) * 4  # + one fp32 scale per block


def expert_bytes(cfg: ModelConfig, weight_dtype: str) -> int:
    """Bytes of one routed expert (gate, up, down) in a GPU weight format (a dtype name, int4_g32, mxfp4, mxfp8)."""
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
            out.append(f"{label}: weights + GPU experts + KV pool need {gib(self.static_bytes)} but the static "
                       f"budget is {gib(self.static_budget)} ({gib(self.static_bytes - self.static_budget)} over)")
        if self.headroom_bytes > self.headroom_budget:
            out.append(f"{label}: prefill workspace + layerwise buffer need {gib(self.headroom_bytes)} but the "
                       f"headroom is {gib(self.headroom_budget)} ({gib(self.headroom_bytes - self.headroom_budget)} over)")
        return out


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

    # ---- text (plan_table.py) ----

    def table(self) -> str:
        return plan_table.table(self)

    def verdict(self) -> str:
        return plan_table.verdict(self)

    def format_table(self) -> str:
        return plan_table.format_table(self)


class PlanDoesNotFit(PlanError):
    """make_plan's error: `plan` is the failing plan, `suggestions` the changes that make it fit."""

    def __init__(self, plan: MemoryPlan, suggestions: list[Suggestion]):
        self.plan, self.suggestions = plan, suggestions
        fixes = "; ".join(s.text for s in suggestions) or "nothing a single flag can change (see the table)"
        tp = len(plan.ranks)
        gpus = f"{tp} GPUs of {gib(plan.ranks[0].device_bytes)}" if tp > 1 else f"one GPU of {gib(plan.ranks[0].device_bytes)}"
        super().__init__(
            f"The model does not fit on {gpus}. {'; '.join(plan.problems)}. "
            f"ktlite keeps {plan.inputs.mem_fraction_static:.2f} of each GPU's memory (--mem-fraction-static) for the "
            "weights, GPU experts and KV pool, and the rest for the prefill workspace and layerwise-prefill buffer. "
            f"To fit, change one of: {fixes}.\n\n{plan.table()}"
        )


def plan_on(cfg: ModelConfig, inputs: PlanInputs, device_bytes: tuple[int, ...]) -> MemoryPlan:
    """The plan for given device sizes, fitting or not (pure arithmetic, allocates nothing)."""
    res = resolve_inputs(cfg, inputs)
    tp, frac = inputs.tensor_parallel_size, inputs.mem_fraction_static
    weights = _weight_bytes(cfg, tp, res.weight_dtype, res.act_dtype, inputs.dense_quantization)
    # GPU experts are held dense in the activation dtype (FP8 checkpoints' experts too), or as INT4 codes
    gpu_format = res.act_dtype if inputs.gpu_expert_format == "dense" else inputs.gpu_expert_format
    per_expert = expert_bytes(cfg, gpu_format)
    dense_expert = expert_bytes(cfg, res.act_dtype)  # the layerwise buffer holds any expert, dequantized
    moe_layers = len(cfg.moe_layers)  # a served MTP layer's included: its routed experts are placed as the others'
    dense_layers = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    decoder_moe = cfg.num_hidden_layers - dense_layers
    experts_on = tuple(res.gpu_experts // tp + (r < res.gpu_experts % tp) for r in range(tp))
    kv_dtype = _TORCH_DTYPES[res.kv_dtype]
    cache_specs = cfg.token_cache_specs(tp, kv_dtype)
    kv_per_token = kv_bytes_per_token(cache_specs, kv_dtype)
    request_table = inputs.max_running_requests * res.context_length * 4  # int32 token slots per request
    state_per_request = state_bytes_per_request(cfg.request_state_specs(tp))
    static_budget = [int(frac * d) for d in device_bytes]
    state_pool = (inputs.max_running_requests + inputs.state_snapshots + inputs.state_verify_rows) * state_per_request
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
            "dense_mlp": f"{dense_layers} layers, intermediate {_ceil_div(cfg.intermediate_size, tp)}",
            "shared_experts": f"{decoder_moe} layers, intermediate {cfg.shared_intermediate_size}" if cfg.shared_intermediate_size else "none",
            "norms_router": "norms (replicated), fp32 routers, rope table",
            "mtp": (f"MTP layer for NEXTN drafts: attention, shared expert, eh_proj, {res.weight_dtype} (its routed "
                    "experts: a MoE layer of gpu_experts and the CPU store)" if cfg.mtp_layer
                    else "off (no --speculative-algorithm NEXTN)"),
            "gpu_experts": f"{experts_on[r]} per layer x {moe_layers} layers x {per_expert:,} B, {gpu_format}",
            "kv_pool": f"{kv_tokens:,} tokens x {kv_per_token:,} B ({plan_table.cache_note(cache_specs, res.kv_dtype)})",
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


def make_plan(cfg: ModelConfig, inputs: PlanInputs, machine_gpus: int | None = None) -> MemoryPlan:
    """The memory plan per GPU; raises PlanDoesNotFit (a PlanError) listing components and fixes.
    `machine_gpus`: GPUs the machine has, which a larger --tensor-parallel-size may use before more
    GPUs are proposed (None: the visible CUDA devices, or the planned ones under --gpu-memory)."""
    devices = _device_bytes(inputs)
    plan = plan_on(cfg, inputs, devices)
    if not plan.fits:
        if machine_gpus is None:
            visible = torch.cuda.device_count() if inputs.gpu_memory is None and torch.cuda.is_available() else 0
            machine_gpus = max(visible, len(devices))
        raise PlanDoesNotFit(plan, suggestions(cfg, inputs, devices, plan, machine_gpus, functools.partial(plan_on, cfg)))
    logger.info("memory plan: KV pool %d tokens, %d GPU experts per MoE layer, %s static on GPU 0",
                plan.kv_pool_tokens, plan.gpu_experts_total, gib(plan.ranks[0].static_bytes))
    return plan

