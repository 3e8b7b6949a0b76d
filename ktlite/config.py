"""Engine flags: one dataclass whose field names are the SGLang/KTransformers flag names.

`Engine(model_path, **flags)` and `ktlite serve --flag` both end here, so a launch script's flags
and a script's keyword arguments mean the same thing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ktlite.errors import ConfigError
from ktlite.kernels.cpu.quant import int8_activations, normalize_activations
from ktlite.kernels.cpu.target import bf16_attention_cpu

# Knobs ktlite chooses from the memory plan and the hardware when the caller leaves them out
# (ktlite/runtime/knobs.py); the defaults below are only what a config built directly keeps.
AUTO_KNOBS = frozenset({"tensor_parallel_size", "kt_num_gpu_experts", "max_total_tokens", "chunked_prefill_size",
                        "kt_cpuinfer", "kt_threadpool_count"})
CPU_DENSE_METHODS = ("auto", "INT8", "INT4", "none")  # --cpu-dense-method values (any case)
SPECULATIVE_ALGORITHMS = ("NGRAM", "NEXTN", "EAGLE")  # --speculative-algorithm values (any case)
MTP_ALGORITHMS = ("NEXTN", "EAGLE")  # drafts from the checkpoint's MTP layer (EAGLE: SGLang's alias of NEXTN)
# the most drafts a request verifies per step when the caller sets neither --speculative-num-steps nor
# --speculative-num-draft-tokens: each step takes 1..this many, chosen from the measured cost curve
# (runtime/speculative/auto_k.py)
MAX_AUTO_SPECULATIVE_DRAFTS = 4
# an agent session needs one or two (its prompt's end, its last reply's end); more serve sessions side by side
DEFAULT_STATE_SNAPSHOTS = 8


@dataclass
class EngineConfig:
    model_path: str
    served_model_name: str | None = None
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str = "auto"  # weights/activations on the device side; "auto": bfloat16 on cuda, float32 on cpu
    # "auto": the activation dtype; on a CPU device with AMX-BF16 or AVX512-BF16 and --dtype auto, bfloat16 (prefill
    # attention in bf16 products; an explicit --dtype float32 keeps fp32, the exact reference setting)
    kv_cache_dtype: str = "auto"
    # projections of a block-FP8 checkpoint: "auto" keeps them FP8 on CUDA and dequantizes them on a
    # CPU device (where every matmul would dequantize again); "fp8" keeps them FP8 anywhere
    weight_dtype: str = "auto"
    # the device-side linear layers on a CPU device (ktlite/runtime/cpu_dense.py): INT8 or INT4 quantize them
    # at load for the CPU kernels; none keeps the torch layers (in --dtype); auto is INT8 unless --dtype
    # float32 asks for exact fp32 math. No effect on CUDA (see cpu_dense_quantization)
    cpu_dense_method: str = "auto"
    # what INT4/INT8 CPU rows (experts, --cpu-dense-method layers) are dotted with: int8 activations (per 32
    # values, integer dot products), fp32, or auto: int8 where the CPU has AVX2, unless --dtype float32 asks
    # for exact fp32 math (cpu_int8_activations)
    cpu_activations: str = "auto"
    seed: int = 0
    # memory plan
    gpu_memory: str | int | None = None  # bytes or "16GiB"; default: what the device reports
    mem_fraction_static: float = 0.80
    max_total_tokens: int | None = None
    chunked_prefill_size: int = 8192
    max_running_requests: int = 64
    max_queued_requests: int | None = None
    context_length: int | None = None
    enable_mixed_chunk: bool = False
    # prefix cache (SGLang names)
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"  # "lpm": the waiting request with the longest cached prefix first
    hicache_size: float = 0.0  # GiB of CPU RAM holding KV evicted from the device pool (0: no host tier)
    max_mamba_cache_size: int | None = None  # recurrent-state snapshots of the prefix cache (state_snapshots)
    # hybrid experts (KTransformers names)
    kt_method: str = "INT4"
    kt_group_size: int | None = None  # None: the method's default (quant.DEFAULT_GROUP_SIZES)
    kt_weight_path: str | None = None
    kt_cpuinfer: int | None = None
    kt_threadpool_count: int = 1
    kt_num_gpu_experts: int = 0
    kt_gpu_experts_ratio: float | None = None
    kt_gpu_prefill_token_threshold: int | None = None
    kt_enable_dynamic_expert_update: bool = False
    kt_expert_update_interval: int = 32
    kt_expert_placement_strategy: str = "uniform"
    init_expert_location: str | None = None
    record_expert_distribution: str | None = None
    kt_max_deferred_experts_per_token: int = 0
    tensor_parallel_size: int = 1
    # speculative decoding (SGLang names): drafts proposed per request, verified in one forward of the target model
    speculative_algorithm: str | None = None  # NGRAM (prompt lookup); NEXTN/EAGLE (the checkpoint's MTP layer)
    speculative_num_steps: int | None = None  # drafts per step (an MTP chain's length)
    speculative_num_draft_tokens: int | None = None  # tokens a verify holds per request: the last one + drafts
    speculative_eagle_topk: int | None = None  # draft branches per step: only 1 (a chain)
    # the flags the caller gave (from_kwargs); None: every value is final (a config built directly, or
    # one returned by knobs.choose_knobs, which fills in the AUTO_KNOBS the caller left out)
    user_set: frozenset[str] | None = field(default=None, repr=False)

    @classmethod
    def from_kwargs(cls, model_path: str, **flags: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"user_set"}
        unknown = sorted(set(flags) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        given = frozenset(name for name, value in flags.items() if value is not None)
        config = cls(model_path=str(model_path), **flags, user_set=given)
        config.validate()
        return config

    def validate(self) -> None:
        if not os.path.isdir(self.model_path):
            raise ConfigError(f"--model-path {self.model_path}: not a folder")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ConfigError(f"--chunked-prefill-size must be positive (or -1 for no chunking), got {self.chunked_prefill_size}")
        if self.max_running_requests < 1:
            raise ConfigError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ConfigError(f"--max-total-tokens must be >= 1, got {self.max_total_tokens}")
        if self.kt_threadpool_count < 1:
            raise ConfigError(f"--kt-threadpool-count must be >= 1, got {self.kt_threadpool_count}")
        if self.kt_cpuinfer is not None and self.kt_cpuinfer < self.kt_threadpool_count:
            raise ConfigError(f"--kt-cpuinfer ({self.kt_cpuinfer}) must be >= --kt-threadpool-count ({self.kt_threadpool_count})")
        if self.kt_max_deferred_experts_per_token < 0:
            raise ConfigError("--kt-max-deferred-experts-per-token must be >= 0")
        if self.kt_expert_update_interval < 1:
            raise ConfigError("--kt-expert-update-interval must be >= 1")
        if self.weight_dtype not in ("auto", "fp8"):
            raise ConfigError(f"--weight-dtype must be auto or fp8, got {self.weight_dtype!r}")
        if str(self.cpu_dense_method).upper() not in {m.upper() for m in CPU_DENSE_METHODS}:
            raise ConfigError(f"--cpu-dense-method must be one of {', '.join(CPU_DENSE_METHODS)} (any case), "
                              f"got {self.cpu_dense_method!r}")
        normalize_activations(self.cpu_activations)
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ConfigError(f"--schedule-policy must be fcfs or lpm, got {self.schedule_policy!r}")
        if self.hicache_size < 0:
            raise ConfigError(f"--hicache-size must be >= 0 (GiB), got {self.hicache_size}")
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < 0:
            raise ConfigError(f"--max-mamba-cache-size must be >= 0, got {self.max_mamba_cache_size}")
        if self.disable_radix_cache and (self.hicache_size or self.schedule_policy == "lpm"):
            raise ConfigError("--hicache-size and --schedule-policy lpm work on the prefix cache: "
                              "drop --disable-radix-cache or them")
        self._validate_speculative()

    def _validate_speculative(self) -> None:
        tuning = {"--speculative-num-steps": self.speculative_num_steps,
                  "--speculative-num-draft-tokens": self.speculative_num_draft_tokens,
                  "--speculative-eagle-topk": self.speculative_eagle_topk}
        if self.speculative_algorithm is None:
            given = [flag for flag, value in tuning.items() if value is not None]
            if given:
                raise ConfigError(f"{', '.join(given)} tune speculative decoding: give --speculative-algorithm NGRAM too")
            return
        algorithm = str(self.speculative_algorithm).upper()
        if algorithm not in SPECULATIVE_ALGORITHMS:
            raise ConfigError(f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, "
                              f"got {self.speculative_algorithm!r}")
        self.speculative_algorithm = algorithm
        if self.speculative_eagle_topk not in (None, 1):
            raise ConfigError(f"--speculative-eagle-topk: only 1 (one chain of drafts) is supported, "
                              f"got {self.speculative_eagle_topk}")
        if self.speculative_num_steps is not None and self.speculative_num_steps < 1:
            raise ConfigError(f"--speculative-num-steps must be >= 1, got {self.speculative_num_steps}")
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 2:
            raise ConfigError("--speculative-num-draft-tokens counts the last token and its drafts: it must be >= 2, "
                              f"got {self.speculative_num_draft_tokens}")
        if (self.speculative_num_steps is not None and self.speculative_num_draft_tokens is not None
                and self.speculative_num_draft_tokens != self.speculative_num_steps + 1):
            raise ConfigError(f"with --speculative-eagle-topk 1, --speculative-num-draft-tokens must be "
                              f"--speculative-num-steps + 1 ({self.speculative_num_steps + 1}), "
                              f"got {self.speculative_num_draft_tokens}")

    @property
    def drafts_from_mtp(self) -> bool:
        """Whether drafts come from the checkpoint's multi-token-prediction layer (NEXTN / EAGLE)."""
        return self.speculative_algorithm in MTP_ALGORITHMS

    @property
    def speculative_drafts(self) -> int:
        """The most drafts proposed and verified per request per decode step (0: no speculative decoding)."""
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens - 1
        return MAX_AUTO_SPECULATIVE_DRAFTS

    @property
    def speculative_drafts_auto(self) -> bool:
        """Speculation on with no draft count given: each step's count is chosen (speculative/auto_k.py)."""
        return (self.speculative_algorithm is not None and self.speculative_num_steps is None
                and self.speculative_num_draft_tokens is None)

    def state_snapshots(self, recurrent: bool) -> int:
        """Recurrent-state snapshots the prefix cache keeps for a model with per-request recurrent state:
        --max-mamba-cache-size, default min(DEFAULT_STATE_SNAPSHOTS, --max-running-requests); 0 (which turns
        such a model's prefix cache off) without recurrent layers, with --disable-radix-cache, and under
        tensor parallelism (the other ranks do not replay the snapshot copies)."""
        if not recurrent or self.disable_radix_cache or self.tensor_parallel_size > 1:
            return 0
        if self.max_mamba_cache_size is not None:
            return self.max_mamba_cache_size
        return min(DEFAULT_STATE_SNAPSHOTS, self.max_running_requests)

    def state_verify_rows(self, recurrent: bool) -> int:
        """State rows kept for speculative verifies on a model with recurrent layers: one per running request,
        each holding its state from before the verify, which the accepted tokens replay from (the layers'
        `rewind`); 0 without speculation or recurrent layers."""
        return self.max_running_requests if recurrent and self.speculative_algorithm is not None else 0

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _dtype(self.dtype, "--dtype")

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            if self.dtype == "auto" and self.torch_device.type == "cpu" and bf16_attention_cpu():
                # 1.2-2.1x the fp32 pool's prefill at 512-16k tokens on AMX, 1.2-1.6x at 512-4k on a Zen 5
                return torch.bfloat16  # (bench/RESULTS.md)
            return self.torch_dtype
        # fp8_e4m3: 1 byte per value; MLA latents and index keys are packed with scales (kernels/triton/kv_fp8.py)
        return _dtype(self.kv_cache_dtype, "--kv-cache-dtype", {"fp8_e4m3": torch.float8_e4m3fn})

    @property
    def cpu_dense_quantization(self) -> str | None:
        """INT8 / INT4 the device-side linear layers are quantized to on a CPU device, or None (kept)."""
        method = str(self.cpu_dense_method).upper()
        if self.torch_device.type != "cpu" or method == "NONE":
            return None
        if method == "AUTO":  # an explicit --dtype float32 is the exact reference setting: kept
            return None if self.dtype == "float32" else "INT8"
        return method

    @property
    def cpu_int8_activations(self) -> bool:
        """Whether INT4/INT8 CPU rows dot int8-quantized activations (activations.quantize_activations)."""
        if normalize_activations(self.cpu_activations) == "auto" and self.dtype == "float32":
            return False  # the exact reference setting, as for --cpu-dense-method auto
        return int8_activations(self.cpu_activations)

    def keeps_fp8(self, checkpoint_is_fp8: bool) -> bool:
        """Whether FP8 projections stay FP8 on the device (see weight_dtype)."""
        if not checkpoint_is_fp8:
            if self.weight_dtype == "fp8":
                raise ConfigError("--weight-dtype fp8: this checkpoint has no block-FP8 weights")
            return False
        return self.weight_dtype == "fp8" or self.torch_device.type == "cuda"

    @property
    def cpu_threads(self) -> int:
        return self.kt_cpuinfer or os.cpu_count() or 1


def _dtype(name: str, flag: str, extra: dict[str, torch.dtype] | None = None) -> torch.dtype:
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             **(extra or {})}
    if name not in table:
        choices = ", ".join(["auto", "bfloat16", "float16", "float32", *(extra or {})])
        raise ConfigError(f"{flag} must be one of {choices}; got {name!r}")
    return table[name]
