"""Which routed experts of each MoE layer live on the GPU, and how that changes with traffic.

How many experts per layer (`--kt-num-gpu-experts`, or `--kt-gpu-experts-ratio`, which wins) is
resolved by the memory plan; this module decides which ones.

- `initial_placement`: the strategies of `--kt-expert-placement-strategy`:
  uniform (the same count in every layer, ids spread over the id range), frequency (the hottest
  experts of an activation-count file from `--init-expert-location`), front-loading (the same total
  budget, spent on the first layers first) and random (seeded).
- `ExpertStats` counts routed tokens per (layer, expert); `--record-expert-distribution PATH` saves
  it, and `DynamicPlacement` uses it to move the hottest experts onto the GPU every M steps within
  the same per-layer budget.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ktlite.errors import ConfigError

logger = logging.getLogger(__name__)

STRATEGIES = ("uniform", "frequency", "front-loading", "random")


@dataclass
class ExpertStats:
    """Routed-token counts per MoE layer and expert."""

    num_experts: int
    counts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E] int64

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        hist = torch.bincount(topk_ids.reshape(-1).cpu(), minlength=self.num_experts)
        self.counts[layer] = self.counts.get(layer, torch.zeros(self.num_experts, dtype=torch.int64)) + hist

    def save(self, path: str | Path) -> None:
        data = {"num_experts": self.num_experts, "layers": {str(l): c.tolist() for l, c in sorted(self.counts.items())}}
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path, num_experts: int) -> "ExpertStats":
        try:
            data = json.loads(Path(path).read_text())
            counts = {int(l): torch.tensor(c, dtype=torch.int64) for l, c in data["layers"].items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--init-expert-location {path}: not an expert distribution file ({exc})") from exc
        if data.get("num_experts") != num_experts or any(c.numel() != num_experts for c in counts.values()):
            raise ConfigError(f"--init-expert-location {path}: recorded for {data.get('num_experts')} experts, model has {num_experts}")
        return cls(num_experts, counts)


def _hottest(counts: torch.Tensor, n: int) -> list[int]:
    # stable: ties go to the lower id, so placements are reproducible
    order = sorted(range(counts.numel()), key=lambda e: (-int(counts[e]), e))
    return sorted(order[:n])


def initial_placement(
    moe_layers: list[int],
    num_experts: int,
    per_layer: int,
    strategy: str = "uniform",
    stats: ExpertStats | None = None,
    seed: int = 0,
) -> dict[int, list[int]]:
    """layer -> sorted GPU expert ids. The total is per_layer x len(moe_layers) for every strategy."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"--kt-expert-placement-strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "uniform":
        ids = sorted({(i * num_experts) // per_layer for i in range(per_layer)}) if per_layer else []
        return {l: list(ids) for l in moe_layers}
    if strategy == "random":
        rng = random.Random(seed)
        return {l: sorted(rng.sample(range(num_experts), per_layer)) for l in moe_layers}
    if strategy == "frequency":
        if stats is None:
            raise ConfigError("--kt-expert-placement-strategy frequency needs --init-expert-location FILE")
        zeros = torch.zeros(num_experts, dtype=torch.int64)
        return {l: _hottest(stats.counts.get(l, zeros), per_layer) for l in moe_layers}
    budget = per_layer * len(moe_layers)  # front-loading: whole layers first
    placement = {}
    for l in moe_layers:
        take = min(budget, num_experts)
        placement[l] = list(range(take))
        budget -= take
    return placement


@dataclass
class DynamicPlacement:
    """Every `interval` steps, move each layer's hottest experts (since the last move) onto the GPU.

    The per-layer GPU count never changes, so the planned GPU expert memory still holds.
    """

    interval: int
    num_experts: int
    _steps: int = 0
    _window: ExpertStats | None = None

    def __post_init__(self):
        self._window = ExpertStats(self.num_experts)

    def observe(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._window.record(layer, topk_ids)

    def step(self, current: dict[int, list[int]]) -> dict[int, tuple[list[int], list[int]]]:
        """Call once per forward step; returns {layer: (experts to bring in, experts to evict)} when due."""
        self._steps += 1
        if self._steps % self.interval:
            return {}
        moves = {}
        for layer, on_gpu in current.items():
            counts = self._window.counts.get(layer)
            if counts is None or not on_gpu:
                continue
            wanted = set(_hottest(counts, len(on_gpu)))
            bring, evict = sorted(wanted - set(on_gpu)), sorted(set(on_gpu) - wanted)
            if bring:
                moves[layer] = (bring, evict)
        self._window = ExpertStats(self.num_experts)
        if moves:
            logger.info("dynamic expert update: moving %d experts in %d layers", sum(len(b) for b, _ in moves.values()), len(moves))
        return moves
