"""A verified plan: before serving, run the two forwards that need the most activation memory and,
on CUDA, compare their peak with what the plan left for activations.

KTransformers' guide asks users to send, by hand, a prompt as long as `--chunked-prefill-size` to
find out whether the prefill fits; `verify_plan(runtime)` does it at startup for every model
family, through only the runner's `forward(ForwardBatch)` and the KV pool's request/slot API:

1. prefill: one request with a full chunk plus one decode token for each other running request
   (the plan budgets chunk + --max-running-requests tokens per forward: decodes ride in prefill
   batches with --enable-mixed-chunk);
2. decode: --max-running-requests requests of one new token each, their prefixes spread over the
   whole KV pool (the prefix slots are allocated, not computed: their contents do not change the
   memory a forward needs).

On CUDA, peak allocated bytes above what was allocated before are the activations; more than the
headroom the plan leaves for them ((1 - --mem-fraction-static) x GPU memory, minus the layerwise
buffer) stops startup with PlanError naming the knob, instead of an OOM in the first long request.
More than the plan's own workspace estimate but within the headroom is logged as a warning (the
estimate is an upper bound by design, so that is a plan bug to report, not a reason to refuse).
Everything allocated is freed; expert statistics observers are paused so the dummy tokens do not
count as traffic.

Call it on the finished runtime, before the scheduler starts: under tensor parallelism that is rank
0's runtime after `parallel.launch` (its runner sends each forward to the other ranks; inside
`assemble` a rank's forward would wait for ranks that are not running it). Only rank 0's peak is
measured; the other ranks run the same shapes, and their tables point the allocated-but-uncomputed
prefix positions at whatever slots they held, which changes values, not memory.

`warm_paths(runtime)` then runs the smaller forwards a request can reach, so that nothing a request runs compiles
or loads on first use after the server says ready: numba kernels (compiled for, or loaded from numba's cache into,
this process: numba specialises on argument types, and a path first taken by a request compiles then), a CPU
device's compiled decode plans, torch's first calls. The modules choose their kernels by the forward's token count
(a dense layer's row dots below its threshold and a GEMM above, a MoE layer's one fused call where no expert can
reach the matmul path, tile kernels from 2 or 3 tokens, ...) and by its kind (prefill or decode), so it runs a
prefill of one request and a decode step of that many requests at every size of `reach_sizes` below the two passes
above: 1, 2, 3, then powers of two, and one extend of two tokens after a computed one (a prefill's later chunk, a
speculative verify: attention over a prefix and the new tokens). Any threshold on the forward's token count has a forward on each side of it,
without a list of kernels or thresholds here. Thresholds on one expert's tokens are crossed where the dummy prompts'
routing crosses them (CPUMoE.warmup also runs both expert paths on synthetic inputs). It costs about one more
chunk of prefill and a decode step per size (a tiny model: well under a second).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ktlite.errors import PlanError
from ktlite.runtime.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

_GIB = 2**30


@dataclass(frozen=True)
class PassResult:
    name: str  # "prefill" | "decode"
    tokens: int  # new tokens in the forward
    requests: int
    seconds: float
    peak_bytes: int | None  # activation peak on CUDA (None elsewhere: nothing to measure against)


@dataclass(frozen=True)
class VerifyReport:
    passes: tuple[PassResult, ...]
    planned_workspace: int  # the plan's estimate
    allowed: int  # the headroom left for activations

    def summary(self) -> str:
        parts = []
        for p in self.passes:
            peak = f", peak {p.peak_bytes / _GIB:.2f} GiB" if p.peak_bytes is not None else ""
            parts.append(f"{p.name} {p.tokens:,} tokens / {p.requests} requests in {p.seconds:.2f} s{peak}")
        return (f"plan verified: {'; '.join(parts)} (workspace planned {self.planned_workspace / _GIB:.2f} GiB, "
                f"headroom {self.allowed / _GIB:.2f} GiB)")


@contextlib.contextmanager
def _observers_paused(runtime) -> Iterator[None]:
    saved = {layer: moe.observers for layer, moe in runtime.moe_layers.items()}
    for moe in runtime.moe_layers.values():
        moe.observers = []
    try:
        yield
    finally:
        for layer, moe in runtime.moe_layers.items():
            moe.observers = saved[layer]


def _dummy_ids(n: int, vocab: int, offset: int = 0) -> list[int]:
    return [1 + (offset + 7919 * i) % (vocab - 1) for i in range(n)]


class _Pass:
    """Rows and slots of one dummy forward; everything goes back to the pool on exit."""

    def __init__(self, pool):
        self.pool, self.rows = pool, []

    def __enter__(self) -> _Pass:
        return self

    def __exit__(self, *exc) -> None:
        for row in self.rows:
            self.pool.free_request(row)

    def request(self, tokens: int) -> tuple[int, torch.Tensor]:
        row = self.pool.alloc_request()
        self.rows.append(row)
        return row, self.pool.alloc_tokens(row, tokens)


def _measure(runner, batch: ForwardBatch) -> tuple[float, int | None]:
    device = runner.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    runner.forward(batch)
    if cuda:
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated(device) - before
    return time.perf_counter() - t0, None


def _prefill(runtime, requests: int) -> PassResult:
    runner, pool, plan = runtime.runner, runtime.runner.kv_pool, runtime.plan
    chunk = max(1, min(plan.chunk_tokens, runtime.context_length, pool.free_tokens - (requests - 1)))
    # one full chunk, then a decode token for each other running request riding in the same batch
    lengths = [chunk] + [1] * (requests - 1)
    with _Pass(pool) as p:
        rows, slots = zip(*(p.request(n) for n in lengths))
        chunks = [_dummy_ids(n, runtime.vocab_size, r) for r, n in enumerate(lengths)]
        batch = ForwardBatch.build(chunks, [0] * requests, list(rows), list(slots), [True] * requests, runner.device)
        seconds, peak = _measure(runner, batch)
    return PassResult("prefill", chunk + requests - 1, requests, seconds, peak)


def _decode(runtime, requests: int) -> PassResult:
    runner, pool = runtime.runner, runtime.runner.kv_pool
    prefix = max(0, min(pool.free_tokens // requests - 1, runtime.context_length - 1))
    with _Pass(pool) as p:
        rows, slots = zip(*(p.request(prefix + 1) for _ in range(requests)))  # the prefix's slots + the new token's
        slots = [s[-1:] for s in slots]
        chunks = [_dummy_ids(1, runtime.vocab_size, r) for r in range(requests)]
        batch = ForwardBatch.build(chunks, [prefix] * requests, list(rows), slots, [True] * requests, runner.device)
        seconds, peak = _measure(runner, batch)
    return PassResult("decode", requests, requests, seconds, peak)


def _overrun(result: PassResult, allowed: int, runtime) -> str:
    plan = runtime.plan
    frac = plan.inputs.mem_fraction_static
    device = plan.ranks[0].device_bytes
    lower_frac = int(100 * (1 - (result.peak_bytes + plan.bytes("layerwise_buffer")) / device)) / 100
    if result.name == "prefill":
        knob = f"--chunked-prefill-size <= about {max(1, plan.chunk_tokens * allowed // result.peak_bytes):,}"
    else:
        knob = f"--max-running-requests <= about {max(1, result.requests * allowed // result.peak_bytes)}"
    fixes = [knob] + ([f"--mem-fraction-static <= {lower_frac:.2f} (a smaller KV pool)"] if 0 < lower_frac < frac else [])
    return (f"The {result.name} check ({result.tokens:,} tokens, {result.requests} requests) peaked at "
            f"{result.peak_bytes / _GIB:.2f} GiB of activations on GPU 0, more than the {allowed / _GIB:.2f} GiB the "
            f"plan leaves for them ({1 - frac:.2f} x GPU memory, --mem-fraction-static {frac:.2f}, minus the "
            f"layerwise buffer). The first request this large would run out of memory. To fit, change one of: "
            f"{'; '.join(fixes)}.")


def verify_plan(runtime) -> VerifyReport:
    """Run the largest prefill and decode forwards the plan allows; raises PlanError on a CUDA overrun."""
    pool, plan = runtime.runner.kv_pool, runtime.plan
    requests = max(1, min(plan.inputs.max_running_requests, pool.free_rows, pool.free_tokens))
    rank = plan.ranks[0]
    allowed = rank.headroom_budget - plan.bytes("layerwise_buffer")
    planned = plan.bytes("prefill_workspace")
    results = []
    with _observers_paused(runtime):
        for run in (_prefill, _decode):
            result = run(runtime, requests)
            results.append(result)
            if result.peak_bytes is None:
                continue
            if result.peak_bytes > allowed:
                raise PlanError(_overrun(result, allowed, runtime))
            if result.peak_bytes > planned:
                logger.warning("%s check: activations peaked at %d bytes, above the plan's estimate of %d "
                               "(still within the %d-byte headroom); please report this", result.name,
                               result.peak_bytes, planned, allowed)
    report = VerifyReport(tuple(results), planned, allowed)
    logger.info("%s", report.summary())
    return report


def reach_sizes(limit: int) -> list[int]:
    """1, 2, 3, then powers of two, below `limit`: a forward size on each side of every token-count threshold up to
    it (3 separates the thresholds at 2, 3 and 4 tokens the CPU kernels have)."""
    sizes, n = [1, 2, 3], 4
    while n < limit:
        sizes.append(n)
        n *= 2
    return [n for n in sizes if n < limit]


def _warm_forward(runner, batch: ForwardBatch) -> None:
    """runner.forward(batch), then the MTP layer over the same rows where the model serves one: the paths NEXTN
    drafts take (an extend after a forward, one-token chain steps) compile here too."""
    mtp = getattr(getattr(runner, "model", None), "mtp", None)
    batch.capture_hidden = mtp is not None
    runner.forward(batch)
    if mtp is not None:
        with torch.inference_mode():
            runner.model.draft_forward(batch, runner.model.model.norm(batch.hidden_states), runner)


def warm_paths(runtime) -> float:
    """Run a prefill of one request and a decode step of that many requests at each reach_sizes size below the
    verified passes', and an extend after a prefix (see the module docstring); returns the seconds spent."""
    runner, pool, plan = runtime.runner, runtime.runner.kv_pool, runtime.plan
    requests = max(1, min(plan.inputs.max_running_requests, pool.free_rows, pool.free_tokens // 2))
    chunk = max(1, min(plan.chunk_tokens, runtime.context_length, pool.free_tokens))
    t0 = time.perf_counter()
    with _observers_paused(runtime):
        for n in reach_sizes(chunk):
            with _Pass(pool) as p:
                row, slots = p.request(n)
                _warm_forward(runner, ForwardBatch.build([_dummy_ids(n, runtime.vocab_size)], [0], [row], [slots],
                                                         [True], runner.device))
        if pool.free_tokens >= 3:
            with _Pass(pool) as p:  # new tokens after computed ones: a prefill's later chunks, a verify of drafts
                row, slots = p.request(3)
                _warm_forward(runner, ForwardBatch.build([_dummy_ids(2, runtime.vocab_size)], [1], [row], [slots[1:]],
                                                         [True], runner.device, [range(1)]))
        for n in reach_sizes(requests):
            with _Pass(pool) as p:  # each request with one prefix position and its new token
                rows, slots = zip(*(p.request(2) for _ in range(n)))
                chunks = [_dummy_ids(1, runtime.vocab_size, r) for r in range(n)]
                _warm_forward(runner, ForwardBatch.build(chunks, [1] * n, list(rows), [s[-1:] for s in slots],
                                                         [True] * n, runner.device))
    seconds = time.perf_counter() - t0
    logger.info("warmed the forwards a request can reach (prefills and decode steps of 1, 2, 3, 4, 8, ... tokens) "
                "in %.2f s", seconds)
    return seconds


COST_PREFIX = 256  # prefix tokens behind the timed steps: attention over a short context, as an agent's turn starts
COST_REPEATS = 3


def verify_cost_curve(runtime, max_drafts: int) -> dict[int, float]:
    """c(k) for k = 1..max_drafts: the time of one request's forward over its last token and k drafts (an extend
    behind COST_PREFIX positions, logits of every row, as a verify) over a plain decode step's at the same position;
    the median of COST_REPEATS, on the warm model (speculative/auto_k.py chooses each step's k from it). On a pool
    too small for the prefix, a shorter one."""
    runner, pool = runtime.runner, runtime.runner.kv_pool
    prefix = max(1, min(COST_PREFIX, pool.free_tokens - max_drafts - 1, runtime.context_length - max_drafts - 1))

    def seconds(drafts: int) -> float:
        times = []
        with _observers_paused(runtime):
            for _ in range(COST_REPEATS):
                with _Pass(pool) as p:
                    row, slots = p.request(prefix + 1 + drafts)
                    batch = ForwardBatch.build([_dummy_ids(1 + drafts, runtime.vocab_size)], [prefix], [row],
                                               [slots[prefix:]], [True], runner.device,
                                               [range(drafts)] if drafts else None)
                    times.append(_measure(runner, batch)[0])
        return sorted(times)[len(times) // 2]

    plain = seconds(0)
    curve = {k: seconds(k) / plain for k in range(1, max_drafts + 1)}
    logger.info("speculative verify cost, in plain decode steps: %s",
                ", ".join(f"c({k}) = {c:.2f}" for k, c in curve.items()))
    return curve
