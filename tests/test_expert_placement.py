"""GPU expert placement: counts, strategies, recorded distributions and dynamic moves."""

from __future__ import annotations

import pytest
import torch

from ktlite.errors import ConfigError
from ktlite.runtime.experts import DynamicPlacement, ExpertStats, initial_placement


@pytest.mark.parametrize("strategy", ["uniform", "random", "front-loading", "frequency"])
def test_every_strategy_spends_the_same_budget(strategy):
    stats = ExpertStats(16, {l: torch.arange(16) for l in (1, 2, 3)})
    placement = initial_placement([1, 2, 3], 16, 5, strategy, stats=stats, seed=7)
    assert sum(len(v) for v in placement.values()) == 15
    assert all(len(set(v)) == len(v) and all(0 <= e < 16 for e in v) for v in placement.values())


def test_strategy_details():
    assert initial_placement([1, 2], 16, 4, "uniform") == {1: [0, 4, 8, 12], 2: [0, 4, 8, 12]}
    assert initial_placement([1, 2, 3], 16, 6, "front-loading") == {1: list(range(16)), 2: [0, 1], 3: []}
    stats = ExpertStats(16, {1: torch.tensor([5] * 8 + [9] * 8)})
    assert initial_placement([1], 16, 3, "frequency", stats=stats) == {1: [8, 9, 10]}
    with pytest.raises(ConfigError, match="init-expert-location"):
        initial_placement([1], 16, 3, "frequency")
    with pytest.raises(ConfigError, match="strategy"):
        initial_placement([1], 16, 3, "best")


def test_distribution_file_round_trip(tmp_path):
    stats = ExpertStats(8)
    stats.record(1, torch.tensor([[0, 1], [1, 7]]))
    stats.record(1, torch.tensor([[1, 2]]))
    path = tmp_path / "dist.json"
    stats.save(path)
    loaded = ExpertStats.load(path, 8)
    assert loaded.counts[1].tolist() == [1, 3, 1, 0, 0, 0, 0, 1]
    with pytest.raises(ConfigError, match="8 experts"):
        ExpertStats.load(path, 16)


def test_dynamic_placement_moves_hottest_in_and_coldest_out():
    dyn = DynamicPlacement(interval=2, num_experts=8)
    current = {1: [0, 1]}
    dyn.observe(1, torch.tensor([[5, 6], [5, 6], [5, 1]]))
    assert dyn.step(current) == {}  # not due yet
    dyn.observe(1, torch.tensor([[5, 6]]))
    moves = dyn.step(current)
    assert moves == {1: ([5, 6], [0, 1])}
