"""The memory plan's inputs: the serving flags as the plan sees them (`PlanInputs`, checked as they are
made), sizes parsed and printed, and those flags resolved against a model's config (`resolve_inputs`).

    inputs = PlanInputs(gpu_memory="24GiB", kt_num_gpu_experts=4, ...)    # validates; ConfigError
    inputs = plan_inputs(engine_config, cfg)    # the same from an EngineConfig (a CPU device: RAM)
    res = resolve_inputs(cfg, inputs)           # dtypes, GPU experts, context and chunk for this model

The arithmetic that turns them into bytes is ktlite/runtime/memory.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ktlite.config import EngineConfig
from ktlite.errors import ConfigError
from ktlite.machine import meminfo
from ktlite.runtime.expert_sources import gpu_expert_format
from ktlite.runtime.models.config import ModelConfig

WEIGHT_DTYPES = ("auto", "fp8", "bfloat16", "float16", "float32")
# how the GPU experts are held: "dense" in the activation dtype (the fused MoE's dense path), or
# "int4_g32", a checkpoint's INT4 codes with fp32 scales per group of 32 (RAWINT4, never re-quantized), or
# "mxfp4" / "mxfp8", a checkpoint's e2m1 / e4m3 codes with e8m0 scales per 32 (MXFP4 / FP4, MXFP8)
GPU_EXPERT_FORMATS = ("dense", "int4_g32", "mxfp4", "mxfp8")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "bfloat16", "float16", "float32")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_GIB = 2**30


def parse_size(value: int | str) -> int:
    """Bytes from 17179869184, "16GiB", "24GB" (10^9), "800MiB", "1.5G" (bare K/M/G/T are binary)."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"--gpu-memory {value!r}: expected a size like 16GiB, 24GB, 800MiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def gib(n: float) -> str:
    """'1.50 GiB'."""
    return f"{n / _GIB:.2f} GiB"


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
    state_snapshots: recurrent-state snapshots the prefix cache keeps beyond the running requests' states
      (--max-mamba-cache-size, EngineConfig.state_snapshots).
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
    state_snapshots: int = 0
    state_verify_rows: int = 0  # recurrent states from before a speculative verify (EngineConfig.state_verify_rows)

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
        _require(self.state_snapshots >= 0, "--max-mamba-cache-size", self.state_snapshots, "must be >= 0")
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
class Resolved:
    """PlanInputs with the model-dependent defaults filled in and checked against the config."""

    weight_dtype: str  # "fp8" | "bfloat16" | "float16" | "float32"
    act_dtype: str  # embeddings, norms, activations
    kv_dtype: str
    gpu_experts: int  # per MoE layer, all ranks together
    context_length: int
    chunk_tokens: int  # prompt tokens in one prefill forward


def resolve_inputs(cfg: ModelConfig, inputs: PlanInputs) -> Resolved:
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
    return Resolved(weight, act, kv, count, context, chunk)


def splits(cfg: ModelConfig, tp: int) -> bool:
    """Whether the model splits over `tp` tensor-parallel ranks."""
    try:
        cfg.check_tensor_parallel(tp)
    except ConfigError:
        return False
    return True


# ---- from the engine's flags -----------------------------------------------------------------

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float8_e4m3fn: "fp8_e4m3"}
CPU_DEVICE_CONTEXTS = 4  # KV pool of a CPU-only run without --max-total-tokens: this many full contexts


def _free_ram() -> int:
    return meminfo().get("MemAvailable", 8 * 2**30)


def plan_inputs(config: EngineConfig, cfg: ModelConfig) -> PlanInputs:
    """The plan's view of the flags. On a CPU-only run the "GPU" is the CPU: without --gpu-memory it
    plans against half the free RAM, and the KV pool defaults to a few full contexts rather than
    all of that."""
    context = config.context_length or cfg.max_position_embeddings
    gpu_memory, max_total = config.gpu_memory, config.max_total_tokens
    if config.torch_device.type == "cpu":
        gpu_memory = gpu_memory or _free_ram() // 2
        max_total = max_total or CPU_DEVICE_CONTEXTS * context
    return PlanInputs(
        gpu_memory=gpu_memory,
        mem_fraction_static=config.mem_fraction_static,
        max_total_tokens=max_total,
        # a chunk longer than the context is never formed, so it need not be planned for
        chunked_prefill_size=min(config.chunked_prefill_size, context) if config.chunked_prefill_size > 0 else -1,
        max_running_requests=config.max_running_requests,
        context_length=context,
        kt_num_gpu_experts=config.kt_num_gpu_experts,
        kt_gpu_experts_ratio=config.kt_gpu_experts_ratio,
        kt_gpu_prefill_token_threshold=config.kt_gpu_prefill_token_threshold,
        tensor_parallel_size=config.tensor_parallel_size,
        dtype="fp8" if config.keeps_fp8(cfg.fp8_block_size is not None) else _DTYPE_NAMES[config.torch_dtype],
        kv_cache_dtype=_DTYPE_NAMES[config.torch_kv_dtype],
        gpu_expert_format=gpu_expert_format(config),
        dense_quantization=config.cpu_dense_quantization,
        state_snapshots=config.state_snapshots(cfg.snapshot_state),
        state_verify_rows=config.state_verify_rows(bool(cfg.request_state_specs())),
    )
