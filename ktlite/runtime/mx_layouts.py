"""Where MX checkpoints keep a routed expert's codes and e8m0 scales: one small table, tried in order.

- per-expert: codes at `<expert weight>`, [out, in/2] I8 / U8 / F4 (FP4) or [out, in] F8_E4M3 (MXFP8); scales
  at `<base>.scale`, `<base>.weight_scale_inv` or `<base>.weight_scale`, [out, in/32] F8_E8M0 / U8. DeepSeek-V4's
  FP4 experts; MXFP8 checkpoints (transformers' `mxfp8` quantizer writes `weight_scale_inv`).
- blocks: codes at `<experts>.{gate_up,down}_proj_blocks` [E, out, in/32, 16] U8, scales at
  `<experts>.{gate_up,down}_proj_scales` [E, out, in/32] U8. gpt-oss (MXFP4).

`<expert weight>` is the family's `expert_weight_name(layer, expert, proj)`, `<base>` that name without
`.weight`, `<experts>` the prefix of the layer's experts (up to `.experts`). gpt-oss's fused gate_up rows
alternate gate, up (transformers' GptOssExperts reads `gate_up[..., ::2]` and `[..., 1::2]`): its gate rows are
the even rows. A family with another dialect adds a function to LAYOUTS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ktlite.runtime.models.config import ModelConfig


@dataclass(frozen=True)
class MXTensors:
    """One expert matrix in a checkpoint: its codes and scales tensors, and which part of them it is."""

    codes: str
    scales: tuple[str, ...]  # candidates, the first one present is used
    expert: int | None = None  # index into a stack of every expert ([E, ...]); None: a per-expert tensor
    rows: slice = field(default_factory=lambda: slice(None))  # its rows of a fused gate_up tensor


def per_expert(cfg: ModelConfig, layer: int, expert: int, proj: str) -> MXTensors:
    weight = cfg.expert_weight_name(layer, expert, proj)
    base = weight.removesuffix(".weight")
    return MXTensors(weight, (f"{base}.scale", f"{base}.weight_scale_inv", f"{base}.weight_scale"))


def blocks(cfg: ModelConfig, layer: int, expert: int, proj: str) -> MXTensors:
    name = cfg.expert_weight_name(layer, expert, proj)
    experts = name[:name.index(".experts") + len(".experts")] if ".experts" in name else name
    fused = "down" if proj == "down" else "gate_up"
    rows = {"gate": slice(0, None, 2), "up": slice(1, None, 2)}.get(proj, slice(None))
    return MXTensors(f"{experts}.{fused}_proj_blocks", (f"{experts}.{fused}_proj_scales",), expert, rows)


LAYOUTS: dict[str, Callable[[ModelConfig, int, int, str], MXTensors]] = {"per-expert": per_expert, "blocks": blocks}
