"""Tensor parallelism with gloo on CPU: 2 ranks (this process + one spawned worker).

TP=2 must give the logits (to float tolerance) and greedy tokens (exactly) of TP=1 on the tiny
checkpoints, with and without GPU experts; each rank must allocate what the plan says it holds;
a dead rank must end requests with a clear error instead of hanging.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from ktlite import Engine
from ktlite.errors import ConfigError
from ktlite.runtime.memory import make_plan
from ktlite.runtime.plan_components import COMPONENTS, allocated_by_component
from ktlite.runtime.plan_inputs import PlanInputs
from ktlite.runtime.model_runner import ForwardBatch
from ktlite.runtime.models import build, load_config
from ktlite.runtime.models.tp_layers import TPContext
from ktlite.runtime import parallel
from ktlite.runtime.parallel import RankFailure
from conftest import HANG_GUARD_S

GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
EXACT = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 256,
         "gpu_memory": "1GiB", "max_running_requests": 8}
DATA = Path(__file__).parent / "data"


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (7, 19, 1)]


def logits_of(engine: Engine, batch_ids: list[list[int]]) -> torch.Tensor:
    """One prefill forward of the prompts through the engine's runner (the scheduler is idle)."""
    runner = engine.runtime.runner
    pool = runner.kv_pool
    rows = [pool.alloc_request() for _ in batch_ids]
    try:
        slots = [pool.alloc_tokens(r, len(ids)) for r, ids in zip(rows, batch_ids)]
        batch = ForwardBatch.build(batch_ids, [0] * len(rows), rows, slots, [True] * len(rows), runner.device)
        return runner.forward(batch)
    finally:
        for r in rows:
            pool.free_request(r)


def run(path: Path, flags: dict) -> tuple[list[list[int]], torch.Tensor, dict]:
    with Engine(str(path), **flags) as eng:
        ids = prompts(eng.runtime.vocab_size)
        tokens = [r.token_ids for r in eng.generate(input_ids=ids, sampling_params=GREEDY)]
        logits = logits_of(eng, ids)
        per_rank = getattr(eng.runtime, "allocated_per_rank", {})
        assert all(len(v) == flags.get("kt_num_gpu_experts", 0) for v in eng.runtime.placement().values())
        plan = eng.runtime.plan
    return tokens, logits, {"plan": plan, "allocated": per_rank}


CASES = {
    "v3-cpu-experts-only": ("tiny_v3", {}),
    "v3-gpu-experts-deferred": ("tiny_v3", {"kt_num_gpu_experts": 5, "kt_max_deferred_experts_per_token": 1}),
    "v2-gpu-experts": ("tiny_v2", {"kt_num_gpu_experts": 3}),
    "v3-fp8-checkpoint": ("tiny_v3_fp8", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1_and_each_rank_allocates_its_plan(case, request):
    fixture, extra = CASES[case]
    path = request.getfixturevalue(fixture)
    flags = {**EXACT, **extra}
    tokens1, logits1, _ = run(path, flags)
    tokens2, logits2, info = run(path, {**flags, "tensor_parallel_size": 2})
    assert tokens2 == tokens1
    assert logits2.shape == logits1.shape
    torch.testing.assert_close(logits2, logits1, atol=1e-4, rtol=1e-4)

    plan, allocated = info["plan"], info["allocated"]
    assert sorted(allocated) == [0, 1]
    n_gpu = extra.get("kt_num_gpu_experts", 0)
    assert sum(plan.gpu_experts_per_layer) == n_gpu
    for rank, got in allocated.items():
        assert plan.mismatches(got, rank) == {}, rank
        for component in ("embeddings", "lm_head", "attention", "dense_mlp", "shared_experts", "kv_pool"):
            assert got[component] == plan.bytes(component, rank) > 0, (rank, component)
        assert got.get("gpu_experts", 0) == plan.bytes("gpu_experts", rank)
    if n_gpu:  # uneven split: the first count % tp ranks hold one more
        assert plan.gpu_experts_per_layer == (n_gpu - n_gpu // 2, n_gpu // 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_deepseek_v3_fp8_shards_match_the_plan_on_2x16gib(rank):
    """The shipped DeepSeek-V3 config, FP8 weights, 2 x 16 GiB, 0 GPU experts: the plan fits and the
    weights one rank builds (on the meta device, nothing allocated) are the bytes its table lists."""
    cfg = load_config(DATA / "deepseek-v3")
    plan = make_plan(cfg, PlanInputs(gpu_memory="16GiB", tensor_parallel_size=2, dtype="fp8"))
    assert plan.fits
    model = build(cfg, "meta", torch.bfloat16, routed_experts=False, fp8_weights=True, tp=TPContext(rank, 2))
    built = allocated_by_component(model)
    assert plan.mismatches(built, rank) == {}
    assert set(built) <= set(COMPONENTS)


def test_unsupported_features_are_rejected_before_spawning(tiny_v3):
    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        Engine(str(tiny_v3), **EXACT, tensor_parallel_size=2, kt_enable_dynamic_expert_update=True,
               kt_num_gpu_experts=2)
    with pytest.raises(ConfigError, match="layerwise"):
        Engine(str(tiny_v3), **EXACT, tensor_parallel_size=2, kt_gpu_prefill_token_threshold=8)


@pytest.mark.parametrize("watcher", ["watching", "watcher-late"])
def test_a_dead_rank_fails_requests_with_a_clear_message_and_no_hang(tiny_v3, watcher, monkeypatch):
    """Whichever sees the dead rank first, the watcher or rank 0's failed collective (the race the second case
    forces by silencing the watcher), the requests end naming the rank."""
    if watcher == "watcher-late":
        monkeypatch.setattr(parallel._Workers, "watch", lambda self: None)
    eng = Engine(str(tiny_v3), **EXACT, tensor_parallel_size=2)
    try:
        worker = eng.runtime.workers.procs[0]
        outcome: dict = {}

        def long_request():
            try:
                outcome["result"] = eng.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_tokens": 400})
            except Exception as exc:  # noqa: BLE001
                outcome["error"] = exc

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while eng.scheduler.steps < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(worker.pid, signal.SIGKILL)
        t.join(HANG_GUARD_S)
        assert not t.is_alive(), "the request hung after a rank died"
        assert isinstance(outcome.get("error"), RankFailure), outcome
        assert "rank 1" in str(outcome["error"])
        with pytest.raises(RankFailure, match="rank 1"):
            eng.generate(input_ids=[1, 2], sampling_params=GREEDY)
    finally:
        start = time.monotonic()
        eng.shutdown()
        assert time.monotonic() - start < HANG_GUARD_S


def test_loader_reads_fp8_shards_raw_or_dequantized(tmp_path):
    """A rank's slice of a block-FP8 tensor: kept FP8 (weight rows/cols + the covering scale blocks)
    when the shard is block-aligned, dequantized from just the covering blocks otherwise."""
    from safetensors.torch import save_file
    from torch import nn

    from ktlite.runtime.loader import CheckpointReader, load_weights
    from ktlite.runtime.models.fp8 import FP8Linear

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 384, generator=g) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=g) + 0.5
    save_file({"m.w.weight": w, "m.w.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    full = reader.get("m.w.weight")

    class Holder(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.m = nn.Module()
            self.m.w = layer

    rows = Holder(FP8Linear(384, 128))  # column-parallel rank 1 of 2: rows 128..256
    load_weights(rows, reader, progress=False, shards={"m.w.weight": (0, 128, 256)})
    torch.testing.assert_close(rows.m.w.dequantized(torch.float32), full[128:256])
    cols = Holder(FP8Linear(128, 256))  # row-parallel: input columns 256..384
    load_weights(cols, reader, progress=False, shards={"m.w.weight": (1, 256, 384)})
    torch.testing.assert_close(cols.m.w.dequantized(torch.float32), full[:, 256:384])
    for shard in [(0, 64, 192), (1, 100, 300)]:
        dim, start, stop = shard
        shape = (stop - start, 384) if dim == 0 else (256, stop - start)
        dense = Holder(nn.Linear(shape[1], shape[0], bias=False))
        load_weights(dense, reader, progress=False, shards={"m.w.weight": shard})
        torch.testing.assert_close(dense.m.w.weight.detach(), full.narrow(dim, start, stop - start))
    with pytest.raises(Exception, match="block boundary"):
        load_weights(Holder(FP8Linear(384, 64)), reader, progress=False, shards={"m.w.weight": (0, 64, 128)})


def test_a_plan_that_does_not_fit_raises_and_leaves_no_worker(tiny_v3):
    import multiprocessing

    from ktlite.errors import PlanError

    with pytest.raises(PlanError):
        Engine(str(tiny_v3), **{**EXACT, "gpu_memory": "64KiB"}, tensor_parallel_size=2)
    deadline = time.monotonic() + HANG_GUARD_S
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
