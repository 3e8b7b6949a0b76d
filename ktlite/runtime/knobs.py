"""Automatic knobs: every memory and thread knob the user leaves out is chosen from the memory plan
and the hardware, and one table says, for each knob, its value and "set by you" or why it was chosen.

    config, rows = choose_knobs(config, cfg)            # hardware detected; or pass Hardware.describe(...)
    print(format_rows(rows))

The rules (each "chosen: ..." note in the table says which one applied):
- `--tensor-parallel-size`: 1 when one GPU holds the weights and the KV target below (with no GPU
  experts and the default chunk); otherwise every visible GPU the model splits over. No GPU: 1.
- KV target: `--max-running-requests` x min(context length, TARGET_CONTEXT) tokens, i.e. every
  running request can hold a typical chat turn (a few thousand prompt tokens plus the reply).
- `--chunked-prefill-size`: SGLang's 8192, capped by the context length and a `--max-total-tokens`
  you set, and lowered to the largest chunk whose prefill workspace and KV pool fit (rather than
  refused). Below MIN_AUTO_CHUNK the values you set are what does not fit, so the default stays
  and the plan's error names the knobs.
- `--kt-num-gpu-experts`: the most routed experts per MoE layer that fit beside the KV target (or
  beside the `--max-total-tokens` you set); 0 when the target needs all the room. No GPU: 0 (a
  "GPU" expert would be a second, unquantized copy in RAM).
- `--max-total-tokens`: what the static budget leaves after the weights and GPU experts (left unset
  in the config, so each rank applies the plan's rule to the free memory it measures at load). No
  GPU: the KV target (at least one chunk), not all of the RAM.
- `--kt-cpuinfer`: physical cores this process may use (hyperthreads share a core's bandwidth and
  vector units, which the expert kernels saturate); `--kt-threadpool-count`: NUMA nodes with such cores
  (pool p then runs on node p's cpus and keeps its experts' pages there: ktlite/numa.py).
The memory plan is ktlite.runtime.memory's: the chosen config is one `make_plan` accepts, and a
value you set that cannot fit fails there with the knob named and the value that fits. The routed
experts the CPU keeps must also fit in RAM in the `--kt-method` format (`cpu_expert_bytes`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ktlite.config import AUTO_KNOBS, EngineConfig
from ktlite.machine import available_ram, numa_nodes, physical_cores, usable_cpus
from ktlite.errors import ConfigError, PlanError
from ktlite.kernels.cpu.quant import QUANTIZED_METHODS, RAWINT4_GROUP, check_group_size, matrix_bytes, normalize_kt_method
from ktlite.runtime.expert_sources import stored_mx_method
from ktlite.runtime.memory import MemoryPlan, make_plan, plan_on
from ktlite.runtime.models.config import ModelConfig
from ktlite.runtime.plan_inputs import PlanInputs, gib, parse_size, plan_inputs, splits
from ktlite.runtime.plan_suggestions import largest

logger = logging.getLogger(__name__)

TARGET_CONTEXT = 4096  # tokens per running request the automatic KV pool aims to hold
DEFAULT_CHUNK = 8192  # SGLang's --chunked-prefill-size
MIN_AUTO_CHUNK = 256  # a chunk lowered below this would hide that the user's own values do not fit
CPU_DEVICE_SHARE = 0.5  # without a GPU, the share of available RAM planned for the device side
SET_BY_YOU = "set by you"


# ---- the machine ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """What the knobs are chosen for: this machine (`detect`) or one described (`describe`)."""

    gpus: int  # CUDA GPUs the engine may use; 0: the device side runs on the CPU
    gpu_memory: int | None  # bytes per GPU the plan may use (None without GPUs)
    ram: int  # bytes of RAM available for the CPU experts (and the device side without a GPU)
    physical_cores: int
    logical_cores: int
    numa_nodes: int
    described: bool = False

    @classmethod
    def detect(cls, device: torch.device | None = None) -> Hardware:
        """This machine. On CUDA the free memory of the current GPU is measured (no CUDA context is
        made on the other GPUs, whose ranks measure their own) and the other GPUs are taken as alike."""
        cpus = usable_cpus()
        gpus, gpu_memory = 0, None
        if device is not None and device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            gpus = torch.cuda.device_count() if device.index is None else 1
            gpu_memory = torch.cuda.mem_get_info(index)[0]
        return cls(gpus, gpu_memory, available_ram(), physical_cores(cpus), len(cpus), numa_nodes(cpus))

    @classmethod
    def describe(cls, gpus: int | None = None, gpu_memory: int | str | None = None, cpu_memory: int | str | None = None,
                 cpu_cores: int | None = None, numa: int | None = None, tensor_parallel_size: int | None = None) -> Hardware:
        """A machine given by sizes (what `ktlite plan` plans for); what is not given is this machine's,
        except the GPU count: `gpu_memory` alone means as many GPUs as --tensor-parallel-size (or one)."""
        here = cls.detect(torch.device("cuda") if gpu_memory is None and gpus != 0 and torch.cuda.is_available() else None)
        if gpus is None:
            gpus = (tensor_parallel_size or 1) if gpu_memory is not None else here.gpus
        if gpus < 0:
            raise ConfigError(f"--gpus {gpus}: must be >= 0")
        if gpus and gpu_memory is None and not here.gpu_memory:
            raise ConfigError(f"--gpus {gpus}: this machine has no CUDA GPU to measure; give --gpu-memory too "
                              "(e.g. --gpu-memory 24GiB)")
        per_gpu = (parse_size(gpu_memory) if gpu_memory is not None else here.gpu_memory) if gpus else None
        cores = cpu_cores or here.physical_cores
        return cls(gpus, per_gpu, parse_size(cpu_memory) if cpu_memory is not None else here.ram, cores,
                   cores if cpu_cores else here.logical_cores, numa or here.numa_nodes, described=True)

    def summary(self) -> str:
        gpus = f"{self.gpus} GPU{'s' if self.gpus > 1 else ''} x {gib(self.gpu_memory)}" if self.gpus else "no GPU"
        how = "described" if self.described else "detected"
        return (f"{gpus}, {gib(self.ram)} RAM available, {self.physical_cores} physical cores "
                f"({self.logical_cores} logical), {self.numa_nodes} NUMA node{'s' if self.numa_nodes > 1 else ''} ({how})")


# ---- CPU expert bytes ------------------------------------------------------------------------


def cpu_expert_bytes(cfg: ModelConfig, method: str, group_size: int | None) -> int | None:
    """Bytes of one routed expert (gate, up, down) in the CPU store for `--kt-method`; None for
    LLAMAFILE, whose size is the GGUF file's own (not in config.json)."""
    method = normalize_kt_method(method)
    if method == "LLAMAFILE":
        return None
    if method == "RAWINT4":  # the checkpoint's compressed-tensors INT4, kept as it is
        method, group_size = "INT4", RAWINT4_GROUP
    elif method == "FP8":  # the checkpoint's e4m3 bytes with one scale per block row (per channel: fewer)
        group_size = (cfg.fp8_block_size or (128, 128))[1]
    group_size = check_group_size(method, group_size)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return 2 * matrix_bytes(method, group_size, i, h) + matrix_bytes(method, group_size, h, i)


@dataclass(frozen=True)
class CPUExpertFit:
    """Whether the routed experts the CPU keeps fit in RAM, in the chosen --kt-method."""

    method: str
    expert_bytes: int | None  # the CPU experts of all MoE layers; None: set by a GGUF file, not known here
    device_bytes: int  # without a GPU, what the device side plans to hold in the same RAM
    ram: int
    smaller: tuple[tuple[str, int], ...]  # (method, bytes) of the formats ktlite makes that are smaller

    @property
    def fits(self) -> bool:
        return self.expert_bytes is None or self.expert_bytes + self.device_bytes <= self.ram

    def text(self) -> str:
        if self.expert_bytes is None:
            return f"routed experts on the CPU: {self.method}, as large as the GGUF file's expert tensors; {gib(self.ram)} RAM"
        beside = f" beside the device side's {gib(self.device_bytes)}" if self.device_bytes else ""
        verdict = "fit" if self.fits else "do NOT fit"
        return f"routed experts on the CPU: {gib(self.expert_bytes)} in {self.method}{beside}; {gib(self.ram)} RAM: {verdict}"

    def error(self) -> str:
        fixes = [f"--kt-method {m} ({gib(b)})" for m, b in self.smaller if b + self.device_bytes <= self.ram]
        fixes.append(f"a machine with at least {gib(self.expert_bytes + self.device_bytes)} of available RAM")
        return (f"The routed experts kept on the CPU need {gib(self.expert_bytes)} in --kt-method {self.method}"
                f"{' plus the device side ' + gib(self.device_bytes) if self.device_bytes else ''}, but only "
                f"{gib(self.ram)} of RAM is available. To fit, change one of: {'; '.join(fixes)}.")


def _cpu_fit(config: EngineConfig, cfg: ModelConfig, plan: MemoryPlan, hardware: Hardware) -> CPUExpertFit:
    cpu_experts = len(cfg.moe_layers) * (cfg.n_routed_experts - plan.gpu_experts_total)
    method = normalize_kt_method(config.kt_method)
    device = 0 if hardware.gpus else sum(rp.static_bytes + rp.headroom_bytes for rp in plan.ranks)
    per_expert = cpu_expert_bytes(cfg, method, config.kt_group_size)
    needed = None if per_expert is None else cpu_experts * per_expert
    others = {m: cpu_experts * cpu_expert_bytes(cfg, m, config.kt_group_size) for m in QUANTIZED_METHODS}
    smaller = tuple((m, b) for m, b in others.items() if needed is not None and b < needed)
    return CPUExpertFit(method, needed, device, hardware.ram, smaller)


# ---- choosing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KnobRow:
    flag: str
    value: str
    how: str  # "set by you", "chosen: why" or "default"


@dataclass
class KnobChoice:
    config: EngineConfig  # every knob final (user_set None)
    rows: list[KnobRow]
    plan: MemoryPlan  # the plan of `config` on the hardware (fits)
    cpu: CPUExpertFit
    hardware: Hardware


def format_rows(rows: list[KnobRow]) -> str:
    width = max(len(r.flag) for r in rows)
    vwidth = max(len(r.value) for r in rows)
    return "\n".join(f"  {r.flag:<{width}}  {r.value:>{vwidth}}  {r.how}" for r in rows)


def _device_budget(config: EngineConfig, hardware: Hardware) -> tuple[int, str]:
    if config.gpu_memory is not None:
        return parse_size(config.gpu_memory), SET_BY_YOU
    if hardware.gpus:
        return hardware.gpu_memory, ("as described" if hardware.described else "detected: free memory of the GPU")
    return int(CPU_DEVICE_SHARE * hardware.ram), f"chosen: no GPU, {CPU_DEVICE_SHARE:.0%} of the available RAM holds the device side"


@dataclass(frozen=True)
class _Search:
    """Plans of candidate knob values: the flags as the plan sees them, varied one knob at a time."""

    cfg: ModelConfig
    base: PlanInputs
    budget: int  # bytes per device
    user_total: int | None  # --max-total-tokens as set, None: what is left
    target: int  # KV tokens for every running request's typical context
    target_text: str

    def plan(self, tp: int, experts: int | None, chunk: int) -> MemoryPlan:
        """experts None: the user's --kt-num-gpu-experts / --kt-gpu-experts-ratio."""
        count = {} if experts is None else {"kt_num_gpu_experts": experts, "kt_gpu_experts_ratio": None}
        inputs = dataclasses.replace(self.base, tensor_parallel_size=tp, chunked_prefill_size=chunk,
                                     max_total_tokens=self.user_total, **count)
        return plan_on(self.cfg, inputs, (self.budget,) * tp)

    def holds_target(self, plan: MemoryPlan) -> bool:
        return plan.fits and (self.user_total is not None or plan.kv_pool_tokens >= self.target)


def _choose_tp(s: _Search, config: EngineConfig, hardware: Hardware, experts: int | None, chunk: int) -> tuple[int, str]:
    if not hardware.gpus:
        return 1, "chosen: no GPU"
    if hardware.gpus == 1:
        return 1, "chosen: one GPU"
    if s.holds_target(s.plan(1, experts, chunk)):
        return 1, f"chosen: one GPU holds the weights and {s.target_text}"
    for flag, on in (("--kt-enable-dynamic-expert-update", config.kt_enable_dynamic_expert_update),
                     ("--kt-gpu-prefill-token-threshold", config.kt_gpu_prefill_token_threshold is not None)):
        if on:
            return 1, f"chosen: {flag} does not run with tensor parallelism"
    tp = next((t for t in range(hardware.gpus, 1, -1) if splits(s.cfg, t)), None)
    if tp is None:
        return 1, f"chosen: the model does not split over 2..{hardware.gpus} GPUs"
    share = "all" if tp == hardware.gpus else f"{tp} of the"
    return tp, f"chosen: one GPU cannot hold the weights and {s.target_text}; {share} {hardware.gpus} GPUs share them"


def _choose_chunk(s: _Search, tp: int, experts: int | None, default: int, context: int) -> tuple[int, str]:
    best = largest(lambda c: s.plan(tp, experts, c).fits, 1, default)
    if best is not None and best < default and best >= min(MIN_AUTO_CHUNK, default):
        return best, "chosen: the largest chunk whose prefill workspace and KV pool fit"
    caps = [name for name, v in (("the context length", context), ("--max-total-tokens", s.user_total)) if v == default]
    if caps and default < DEFAULT_CHUNK:
        return default, f"chosen: {DEFAULT_CHUNK} capped by {caps[0]}"
    return default, "chosen: the default; its prefill workspace fits"


def _choose_experts(s: _Search, tp: int, chunk: int, gpu: bool) -> tuple[int, str]:
    if not gpu:
        return 0, "chosen: no GPU; the routed experts stay in the CPU store"
    beside = s.target_text if s.user_total is None else f"the {s.user_total:,}-token KV pool you set"
    experts = largest(lambda e: s.holds_target(s.plan(tp, e, chunk)), 0, s.cfg.n_routed_experts) or 0
    if experts == s.cfg.n_routed_experts:
        return experts, f"chosen: every routed expert fits beside {beside}"
    return experts, f"chosen: the most that fit beside {beside}" if experts else f"chosen: {beside} needs the room"


def _choose_total(s: _Search, plan: MemoryPlan, gpu: bool) -> tuple[int | None, str]:
    """-> (the value for the config, why). On a GPU that is None: the plan's own rule, the whole tokens
    the static budget leaves, applied again at load time to the free memory each rank measures then
    (a count fixed now could miss by a few tokens, and fail, if that moved)."""
    if gpu:
        return None, "chosen: what the static budget leaves after the weights and GPU experts"
    # without a GPU "what is left" is half the RAM: hold the target, leave the rest to the system
    total = min(plan.kv_pool_tokens, max(s.target, plan.chunk_tokens))
    return total, f"chosen: no GPU; {s.target_text}" if total == s.target else "chosen: no GPU; what the device budget leaves"


def _clamp_to_machine(config: EngineConfig, cfg: ModelConfig, hardware: Hardware) -> EngineConfig:
    """A launch line written for a bigger machine or model runs here: --kt-cpuinfer above the logical
    cores and --kt-num-gpu-experts above the model's routed experts are lowered, one warning each."""
    changes: dict[str, int] = {}
    if config.kt_cpuinfer is not None and config.kt_cpuinfer > hardware.logical_cores:
        logger.warning("--kt-cpuinfer %d: this machine has %d logical cores; using %d", config.kt_cpuinfer,
                       hardware.logical_cores, hardware.logical_cores)
        changes["kt_cpuinfer"] = max(hardware.logical_cores, config.kt_threadpool_count)
    if config.kt_num_gpu_experts > cfg.n_routed_experts:
        logger.warning("--kt-num-gpu-experts %d: the model has %d routed experts per layer; using %d",
                       config.kt_num_gpu_experts, cfg.n_routed_experts, cfg.n_routed_experts)
        changes["kt_num_gpu_experts"] = cfg.n_routed_experts
    return dataclasses.replace(config, **changes) if changes else config


def resolve(config: EngineConfig, cfg: ModelConfig, hardware: Hardware) -> KnobChoice:
    """Choose every knob of AUTO_KNOBS the caller did not set; raises PlanDoesNotFit when even the
    chosen values cannot fit (the error names the knobs and the values that fit)."""
    config = _clamp_to_machine(config, cfg, hardware)
    given = config.user_set if config.user_set is not None else frozenset(AUTO_KNOBS)
    why: dict[str, str] = {}
    if config.user_set is not None and "kt_method" not in given and config.kt_weight_path is None:
        stored = stored_mx_method(Path(config.model_path), cfg)
        if stored is not None:  # MX codes are served as stored or not at all: the default INT4 would be refused
            config = dataclasses.replace(config, kt_method=stored)
            why["kt_method"] = f"chosen: the checkpoint's routed experts are {stored} codes, kept as stored"
    ratio_set = config.kt_gpu_experts_ratio is not None  # the ratio wins over the count
    chosen = {k for k in AUTO_KNOBS if k not in given} - ({"kt_num_gpu_experts"} if ratio_set else set())
    gpu = hardware.gpus > 0
    budget, budget_how = _device_budget(config, hardware)
    if gpu and config.tensor_parallel_size > hardware.gpus and "tensor_parallel_size" in given:
        raise ConfigError(f"--tensor-parallel-size {config.tensor_parallel_size}: only {hardware.gpus} GPUs")
    # the flags as the plan sees them on this hardware (dtype follows the device: bf16 / FP8 kept on CUDA)
    device = "cuda" if gpu else "cpu"
    base = plan_inputs(dataclasses.replace(config, device=device, gpu_memory=budget, user_set=None), cfg)
    context, requests = base.context_length, config.max_running_requests
    user_total = None if "max_total_tokens" in chosen else config.max_total_tokens
    target = requests * min(context, TARGET_CONTEXT)
    s = _Search(cfg, base, budget, user_total, target,
                f"a KV pool for {requests} requests x {min(context, TARGET_CONTEXT):,} tokens ({target:,})")

    tp, chunk, experts = config.tensor_parallel_size, base.chunked_prefill_size, None  # None: the user's count/ratio
    default_chunk = min(DEFAULT_CHUNK, context, user_total or context)
    if "chunked_prefill_size" in chosen:
        chunk = default_chunk
    if "kt_num_gpu_experts" in chosen:
        experts = 0
    if "tensor_parallel_size" in chosen:
        tp, why["tensor_parallel_size"] = _choose_tp(s, config, hardware, experts, chunk)
    if "chunked_prefill_size" in chosen:
        chunk, why["chunked_prefill_size"] = _choose_chunk(s, tp, experts, default_chunk, context)
    if "kt_num_gpu_experts" in chosen:
        experts, why["kt_num_gpu_experts"] = _choose_experts(s, tp, chunk, gpu)
    total = config.max_total_tokens
    if "max_total_tokens" in chosen:
        total, why["max_total_tokens"] = _choose_total(s, s.plan(tp, experts, chunk), gpu)
    cpuinfer, pools = config.kt_cpuinfer, config.kt_threadpool_count
    if "kt_cpuinfer" in chosen:
        cpuinfer, why["kt_cpuinfer"] = hardware.physical_cores, f"chosen: physical cores ({hardware.logical_cores} logical)"
    if "kt_threadpool_count" in chosen:
        pools = max(1, min(hardware.numa_nodes, cpuinfer or hardware.physical_cores))
        why["kt_threadpool_count"] = f"chosen: one per NUMA node ({hardware.numa_nodes}), each on its node's cpus and memory"

    final = dataclasses.replace(
        config, tensor_parallel_size=tp, chunked_prefill_size=chunk, max_total_tokens=total, kt_cpuinfer=cpuinfer,
        kt_threadpool_count=pools, user_set=None,
        # on CUDA each rank measures its own free memory later; on the CPU the budget is fixed here, so
        # the plan made at load time is the one chosen now (free RAM moves)
        gpu_memory=config.gpu_memory if gpu or config.gpu_memory is not None else budget,
        **({} if experts is None else {"kt_num_gpu_experts": experts}),
    )
    final.validate()
    # the plan the runtime will make (a chosen KV pool on a GPU is "what is left", so an error names the user's knobs)
    checked = plan_inputs(dataclasses.replace(final, device=device, gpu_memory=budget), cfg)
    plan = make_plan(cfg, checked, hardware.gpus or None)  # raises PlanDoesNotFit
    cpu = _cpu_fit(final, cfg, plan, hardware)
    return KnobChoice(final, _rows(final, given, why, plan, cpu, budget, budget_how, gpu), plan, cpu, hardware)


def _rows(config: EngineConfig, given: frozenset[str], why: dict[str, str], plan: MemoryPlan, cpu: CPUExpertFit,
          budget: int, budget_how: str, gpu: bool) -> list[KnobRow]:
    """The table: `config` is the final one, `why` says how each chosen knob was chosen."""
    def row(flag: str, field: str, value: object, note: str = "") -> KnobRow:
        how = why.get(field) or (SET_BY_YOU if field in given else "default")
        return KnobRow(flag, f"{value:,}" if isinstance(value, int) else str(value), how + note)

    experts = (row("--kt-gpu-experts-ratio", "kt_gpu_experts_ratio", f"{config.kt_gpu_experts_ratio:g} "
                   f"({plan.gpu_experts_total})") if config.kt_gpu_experts_ratio is not None else
               row("--kt-num-gpu-experts", "kt_num_gpu_experts", plan.gpu_experts_total))
    return [
        row("--tensor-parallel-size", "tensor_parallel_size", config.tensor_parallel_size),
        experts,
        row("--max-total-tokens", "max_total_tokens", plan.kv_pool_tokens),
        row("--chunked-prefill-size", "chunked_prefill_size", config.chunked_prefill_size),
        row("--kt-cpuinfer", "kt_cpuinfer", config.kt_cpuinfer),
        row("--kt-threadpool-count", "kt_threadpool_count", config.kt_threadpool_count),
        row("--max-running-requests", "max_running_requests", config.max_running_requests),
        KnobRow("--gpu-memory" if gpu else "device budget (RAM)", gib(budget), budget_how),
        row("--kt-method", "kt_method", cpu.method, f"; {cpu.text()}"),
    ]


def choose_knobs(config: EngineConfig, cfg: ModelConfig, hardware: Hardware | None = None
                 ) -> tuple[EngineConfig, list[KnobRow]]:
    """The config with every knob the caller left out chosen, and the table rows (also logged).

    A config whose values are final (`user_set` None: built directly, or returned here) comes back
    unchanged with no rows, so calling this again (e.g. in assemble() after Engine) changes nothing.
    Raises PlanDoesNotFit when the plan cannot fit and PlanError when the CPU experts do not fit in RAM."""
    if config.user_set is None:
        return config, []
    choice = resolve(config, cfg, hardware or Hardware.detect(config.torch_device))
    if not choice.cpu.fits:
        raise PlanError(choice.cpu.error())
    logger.info("knobs (%s):\n%s", choice.hardware.summary(), format_rows(choice.rows))
    return choice.config, choice.rows


__all__ = ["CPUExpertFit", "Hardware", "KnobChoice", "KnobRow", "choose_knobs", "cpu_expert_bytes", "format_rows",
           "resolve"]
