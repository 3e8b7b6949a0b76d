"""What would fit: the changes a plan that does not fit is offered (PlanDoesNotFit's suggestions), each
found by re-planning: every memory flag that alone makes it fit at its best value, else a combination,
more GPUs, FP8 weights, a bigger GPU. `largest` is the search they (and ktlite.runtime.knobs) use.
"""

from __future__ import annotations

from ktlite.errors import ConfigError

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ktlite.runtime.models.config import ModelConfig
from ktlite.runtime.plan_components import WEIGHT_COMPONENTS
from ktlite.runtime.plan_inputs import PlanInputs, gib, splits

if TYPE_CHECKING:  # memory.py imports this module
    from ktlite.runtime.memory import MemoryPlan

TENSOR_PARALLEL_CHOICES = (2, 4, 8)  # what a "use more GPUs" suggestion may propose
_MIB = 2**20


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


def largest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
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


def suggestions(cfg: ModelConfig, inputs: PlanInputs, devices: tuple[int, ...], plan: MemoryPlan,
                machine_gpus: int, plan_on: Callable[[PlanInputs, tuple[int, ...]], MemoryPlan]) -> list[Suggestion]:
    """Every single-flag change that makes the plan fit, each at the largest (or smallest) value that
    does; else a combination. More GPUs are proposed as the GPUs the user has (plus one flag) first.
    `plan_on(inputs, device_bytes)` re-plans (memory.plan_on for this model)."""

    def replan(**changes: object) -> MemoryPlan:
        changed = dataclasses.replace(inputs, **changes)
        n = changed.tensor_parallel_size
        if "gpu_memory" in changes:
            sizes = (int(changed.gpu_memory),) * n
        else:  # other GPUs than planned: assume they are like the smallest one
            sizes = devices if n == len(devices) else (min(devices),) * n
        return plan_on(changed, sizes)

    def fits(**changes: object) -> bool:
        return _fits(replan, changes)

    out = _single_flag_fixes(cfg, plan, replan)
    if not out:
        out += _combined(cfg, inputs, replan)
    weights_alone = any(sum(rp.bytes(c) for c in WEIGHT_COMPONENTS) > rp.static_budget for rp in plan.ranks)
    if not out or weights_alone:
        out += _more_gpus(cfg, inputs, machine_gpus, replan)
        if cfg.fp8_block_size and plan.weight_dtype != "fp8" and fits(dtype="fp8"):
            out.append(Suggestion("--dtype auto (keep the checkpoint's FP8 weights)", "dtype", "auto"))
    need = largest(lambda mib: not fits(gpu_memory=mib * _MIB), 1, 2**26)  # largest size in MiB that fails
    if need is not None and need < 2**26:
        out.append(Suggestion(f"a GPU with at least {gib((need + 1) * _MIB)} free", "gpu_memory", (need + 1) * _MIB))
    return out


def _fits(replan: Callable[..., MemoryPlan], changes: dict[str, object]) -> bool:
    """Whether the plan with `changes` fits; a setting the model refuses (e.g. an FP8 KV pool on DeepSeek-V4 or
    GLM-5.3-Flash) is no fix."""
    try:
        return replan(**changes).fits
    except ConfigError:
        return False


def _single_flag_fixes(cfg: ModelConfig, plan: MemoryPlan, replan: Callable[..., MemoryPlan]) -> list[Suggestion]:
    """Each memory knob that alone makes `plan` fit (re-planned through `replan`), at its best value."""
    inputs = plan.inputs

    def fits(**changes: object) -> bool:
        return _fits(replan, changes)

    out: list[Suggestion] = []
    n = plan.gpu_experts_total
    best = largest(lambda v: fits(kt_num_gpu_experts=v, kt_gpu_experts_ratio=None), 0, n - 1)
    if best is not None:
        out.append(_experts_suggestion(cfg, inputs, best))
    if inputs.max_total_tokens is not None:
        best = largest(lambda v: fits(max_total_tokens=v), plan.chunk_tokens, inputs.max_total_tokens - 1)
        if best is not None:
            out.append(Suggestion(f"--max-total-tokens <= {best}", "max_total_tokens", best))
    best = largest(lambda v: fits(chunked_prefill_size=v), 1, plan.chunk_tokens - 1)
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
        if tp <= inputs.tensor_parallel_size or not splits(cfg, tp):
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
    experts = largest(lambda v: replan(**base, kt_num_gpu_experts=v).fits, 0, cfg.n_routed_experts)
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
