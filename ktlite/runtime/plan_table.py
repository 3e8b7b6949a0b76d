"""The memory plan as text: the table `ktlite plan` prints and errors quote, one section per GPU, and
its verdict. `MemoryPlan.table()`, `.verdict()` and `.format_table()` (ktlite/runtime/memory.py) call
these; the plan's arithmetic is there.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from ktlite.runtime.plan_components import COMPONENTS, HEADROOM_COMPONENTS, STATIC_COMPONENTS
from ktlite.runtime.plan_inputs import gib

if TYPE_CHECKING:  # memory.py imports this module
    from ktlite.runtime.memory import MemoryPlan, RankPlan

_GIB = 2**30


def header_lines(plan: MemoryPlan) -> list[str]:
    """The model, its formats and the flags the plan was made with."""
    c, i = plan.cfg, plan.inputs
    fmt = f"fp8 with fp32 scales per {c.fp8_block_size or (128, 128)} block" if plan.weight_dtype == "fp8" else plan.weight_dtype
    if plan.weight_dtype == "fp8" and c.fp8_skip:  # the linear layers the checkpoint keeps in bf16
        fmt += f" but {len(c.fp8_skip)} modules_to_not_convert patterns in bf16"
    if i.dense_quantization:  # a CPU device: its linear layers quantized at load
        fmt += f", linear layers {i.dense_quantization} (--cpu-dense-method)"
    experts = f"{len(c.moe_layers)} MoE layers x {c.n_routed_experts} routed experts" if c.moe_layers else "no MoE layers"
    return [
        f"{c.architecture}: {c.num_hidden_layers} layers ({experts}), GPU weights {fmt}, KV cache {plan.kv_dtype}",
        f"flags: --mem-fraction-static {i.mem_fraction_static:.2f} --chunked-prefill-size {i.chunked_prefill_size} "
        f"--max-running-requests {i.max_running_requests} --context-length {plan.context_length} "
        f"--kt-num-gpu-experts {plan.gpu_experts_total} --tensor-parallel-size {i.tensor_parallel_size}"
        + (f" --max-total-tokens {i.max_total_tokens}" if i.max_total_tokens else "")
        + (f" --kt-gpu-prefill-token-threshold {i.kt_gpu_prefill_token_threshold}"
           if i.kt_gpu_prefill_token_threshold else ""),
    ]


def rank_lines(plan: MemoryPlan, rp: RankPlan) -> list[str]:
    """One GPU's table: its components, their totals against the two budgets."""
    tp, frac = len(plan.ranks), plan.inputs.mem_fraction_static
    width = max(len(c) for c in COMPONENTS + ("headroom total",))
    line = f"  {{:<{width}}} {{:>10}} {{:>18}}  {{}}".format
    out = [f"GPU {rp.rank} of {tp}: {gib(rp.device_bytes)}", line("component", "GiB", "bytes", "note")]

    def section(components: tuple[str, ...], total_name: str, total: int, budget: int, rule: str) -> None:
        for r in rp.rows:
            if r.component in components:
                out.append(line(r.component, f"{r.bytes / _GIB:.2f}", f"{r.bytes:,}", r.note))
        verdict = "ok" if total <= budget else f"OVER by {gib(total - budget)}"
        out.append(line(total_name, f"{total / _GIB:.2f}", f"{total:,}", f"budget {gib(budget)} = {rule}: {verdict}"))

    section(STATIC_COMPONENTS, "static total", rp.static_bytes, rp.static_budget, f"{frac:.2f} x device")
    section(HEADROOM_COMPONENTS, "headroom total", rp.headroom_bytes, rp.headroom_budget, f"{1 - frac:.2f} x device")
    return out


def table(plan: MemoryPlan) -> str:
    lines = header_lines(plan)
    for rp in plan.ranks:
        lines += [""] + rank_lines(plan, rp)
    return "\n".join(lines)


def verdict(plan: MemoryPlan) -> str:
    rule = (f"Rule: {plan.inputs.mem_fraction_static:.2f} x GPU memory (--mem-fraction-static) holds the weights, "
            "GPU experts and KV pool; the rest holds the prefill workspace and layerwise-prefill buffer.")
    if not plan.fits:
        return f"verdict: does NOT fit. {'; '.join(plan.problems)}. {rule}"
    per_rank = "/".join(map(str, plan.gpu_experts_per_layer))
    copies = " (a full copy on each GPU)" if len(plan.ranks) > 1 else ""
    text = (f"verdict: fits. KV pool {plan.kv_pool_tokens:,} tokens x {plan.kv_bytes_per_token:,} bytes{copies}; "
            f"{plan.gpu_experts_total} GPU experts per MoE layer ({per_rank} per GPU). ")
    if plan.kv_pool_tokens < plan.context_length:
        text += (f"A single request can use at most {plan.kv_pool_tokens:,} tokens, less than context length "
                 f"{plan.context_length:,}. ")
    return text + rule


def format_table(plan: MemoryPlan) -> str:
    return f"{table(plan)}\n{verdict(plan)}"


def cache_note(specs, kv_dtype: str) -> str:
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
