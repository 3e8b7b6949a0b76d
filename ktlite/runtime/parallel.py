"""Tensor parallelism: the GPU side split over `--tensor-parallel-size` ranks, one process per rank.

`launch(config)` (what `Engine` calls when tensor_parallel_size > 1) spawns ranks 1..N-1 with
`torch.multiprocessing` (spawn); each worker selects its GPU and reports its free bytes, rank 0
fixes the flags every rank plans with (device size: the tightest GPU; KV pool: rank 0's token
count), so every rank's plan is the same per-rank plan and no process touches another's GPU.
Rank 0 then assembles its shard in this process while the workers assemble theirs, waits until
every rank has loaded, and joins them in a torch.distributed group (NCCL on CUDA, rank r on cuda:r; gloo on
CPU, each worker with one torch thread). The scheduler and the HTTP server stay on rank 0; the
returned runtime's runner is a `TPDriver` that, for each batch, sends a small header (command and
sizes) to every worker over its pipe and then broadcasts the ForwardBatch packed into one int64
tensor; each worker (`_worker_main`) loops receive -> forward. All ranks run the same
`ModelRunner.forward` on their shard; the logits are all-gathered (every rank gets them; only rank
0 samples).

Design decisions:
- Sharding (ktlite/runtime/models/tp_layers.py, the memory plan's split): MLA heads split
  (q_proj/q_b_proj/kv_b_proj column-parallel, o_proj row-parallel), dense MLP and shared experts
  split along the intermediate size, embeddings and lm_head vocab-parallel; norms, q_a_proj,
  kv_a_proj_with_mqa and routers replicated. Each rank reads only its slice of a split tensor.
  One all-reduce after o_proj and one after each MLP/MoE block.
- KV pool: each rank caches what its family declares per token per rank
  (`cfg.token_cache_specs(tp)`). MLA's latent (kv_lora_rank + rope dims per token) is shared by all
  heads and kv_a_proj_with_mqa is replicated, so every rank keeps a FULL copy (as SGLang does) and
  computes and writes the same latents; only the queries differ per rank. GQA's kv heads split
  across ranks (replicated when there are fewer kv heads than ranks); recurrent layers keep their
  per-request state whole on every rank. Rank 0's scheduler owns the free lists; a worker's
  `req_to_token` is brought up to date
  from each batch itself (request row, position and slot of every new token), so no table is sent.
  What a batch does not carry (a request row starting with prefix-cache slots, the host tier's
  copies) rank 0 records in its pool's journal and sends with the next batch's header; each
  worker replays it on its own pool and host tier before that forward, so every rank agrees on
  the slots.
- Routed experts: the router is replicated, so every rank computes the same top-k. GPU experts
  are expert-parallel: rank r holds placement[l][r::N] of each layer's GPU experts. The CPU
  experts exist once, on rank 0 (only rank 0 owns a CPUMoE, so CPU RAM holds one copy); rank 0
  submits them once per layer and adds their result (and, with
  --kt-max-deferred-experts-per-token, the deferred result of the previous layer) to its partial
  sum before the all-reduce, which adds every rank's GPU experts and shared-expert shard.
- Failure: the worker pipes carry the per-step header, so an idle worker waits without a
  collective timeout, and a worker whose rank 0 died sees EOF and exits. On rank 0 a watcher
  thread waits on the workers' process sentinels: when one exits unexpectedly it logs
  "tensor-parallel rank R (pid P) exited with code C", fails every request in flight and every
  later call with that message (`on_failure`), and, when the process has a SIGTERM handler (the
  `ktlite serve` loop installs one), sends itself SIGTERM so the server shuts down. A collective
  that fails (gloo raises when a peer's socket closes; both backends time out after
  KTLITE_TP_TIMEOUT seconds, default 300) is reported the same way. Startup failures of a worker
  (an exception while loading) are raised on rank 0 with the worker's traceback.
- Not supported with N > 1 (ConfigError): --kt-enable-dynamic-expert-update and
  --kt-gpu-prefill-token-threshold (layerwise prefill).
- One tensor-parallel Engine per process (it uses torch.distributed's default group).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import logging
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ktlite.config import EngineConfig
from ktlite.errors import ConfigError, EngineFailure
from ktlite.runtime.assembly import Runtime, assemble
from ktlite.runtime.host_cache import make_host_cache
from ktlite.runtime.memory import make_plan
from ktlite.runtime.model_runner import ForwardBatch, ModelRunner
from ktlite.runtime.models import serving_config
from ktlite.runtime.models.tp_layers import TPContext
from ktlite.runtime.plan_components import allocated_by_component
from ktlite.runtime.plan_inputs import plan_inputs
from ktlite.runtime.radix_cache import prefix_cache_enabled

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("KTLITE_TP_STARTUP_TIMEOUT", 1800))
_FORWARD, _STOP = "forward", "stop"


class RankFailure(EngineFailure):
    """A tensor-parallel rank died or a collective failed; the engine cannot continue."""


def timeout_s() -> float:
    return float(os.environ.get("KTLITE_TP_TIMEOUT", 300))


def validate(config: EngineConfig) -> None:
    tp = config.tensor_parallel_size
    if config.kt_enable_dynamic_expert_update:
        raise ConfigError(f"--kt-enable-dynamic-expert-update is not supported with --tensor-parallel-size {tp}; "
                          "use static GPU experts (--kt-num-gpu-experts / --init-expert-location)")
    if config.kt_gpu_prefill_token_threshold is not None:
        raise ConfigError(f"--kt-gpu-prefill-token-threshold (layerwise prefill) is not supported with "
                          f"--tensor-parallel-size {tp}")
    device = config.torch_device
    if device.type == "cuda" and torch.cuda.device_count() < tp:
        raise ConfigError(f"--tensor-parallel-size {tp}: only {torch.cuda.device_count()} CUDA GPUs are visible")


def rank_allocated(runtime: Runtime, rank: int) -> dict[str, int]:
    """Bytes per plan component this rank holds: model tensors plus what went through plan.alloc."""
    model = runtime.runner.model
    out = allocated_by_component(model)
    out.update(runtime.plan.allocated(rank))
    return out


# ---- the batch on the wire -------------------------------------------------------------------

def _pack(batch: ForwardBatch) -> tuple[tuple[int, int, int], torch.Tensor]:
    sizes = (batch.input_ids.numel(), batch.req_pool_indices.numel(), batch.logit_rows.numel())
    parts = (batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices, batch.prefix_lens,
             batch.extend_lens, batch.logit_rows)
    return sizes, torch.cat([p.reshape(-1).to(torch.int64) for p in parts])


def _unpack(sizes: tuple[int, int, int], payload: torch.Tensor) -> ForwardBatch:
    n, b, r = sizes
    parts = payload.split([n, n, n, b, b, b, r])
    return ForwardBatch(*parts)


def _update_table(runner: ModelRunner, batch: ForwardBatch) -> None:
    """A worker's req_to_token for this batch: token j of a request sits at (its row, its position)."""
    rows = batch.req_pool_indices.repeat_interleave(batch.extend_lens)
    table = runner.kv_pool.req_to_token
    table[rows, batch.positions] = batch.out_cache_loc.to(table.dtype)


def _init_group(rank: int, size: int, port: int, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_device_bytes(config: EngineConfig, rank: int) -> int | None:
    """Select this rank's GPU (cuda:rank); -> its free bytes (None on CPU). Each process touches only
    its own GPU, so no CUDA context lands on another rank's card."""
    if config.torch_device.type != "cuda":
        return None
    torch.cuda.set_device(rank)
    return torch.cuda.mem_get_info()[0]


def _agreed_config(config: EngineConfig, free: list[int | None]) -> EngineConfig:
    """The flags every rank plans with, so all ranks get the same plan: the device size (on CUDA
    without --gpu-memory, the tightest GPU's free bytes; on CPU, what rank 0 resolved from free RAM)
    and the KV pool size rank 0's plan chose. Raises the plan's error if it does not fit."""
    cfg = serving_config(config)
    gpu_memory = config.gpu_memory
    if gpu_memory is None:
        gpu_memory = min(free) if all(f is not None for f in free) else plan_inputs(config, cfg).gpu_memory
    fixed = dataclasses.replace(config, gpu_memory=gpu_memory)
    plan = make_plan(cfg, plan_inputs(fixed, cfg))
    return dataclasses.replace(fixed, max_total_tokens=plan.kv_pool_tokens)


# ---- worker ranks ----------------------------------------------------------------------------

def _worker_main(rank: int, size: int, config: EngineConfig, port: int, conn) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    joined = False
    try:
        conn.send(("hello", _free_device_bytes(config, rank)))
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] != "config":  # rank 0 gave up (e.g. the plan does not fit)
            return
        config = message[1]
        runtime = assemble(config, progress=False, tp=TPContext(rank, size))
        conn.send(("loaded", rank_allocated(runtime, rank)))
        _init_group(rank, size, port, config.torch_device)
        joined = True
        runner = runtime.runner
        device = runner.device
        host = make_host_cache(runner.kv_pool, config) if prefix_cache_enabled(config, runtime) else None
        while True:
            try:
                message = conn.recv()
            except EOFError:  # rank 0 went away
                logger.error("rank 0 closed the connection; exiting")
                return
            if message[0] == _STOP:
                return
            sizes, journal = message[1], message[2]
            payload = torch.empty(3 * sizes[0] + 3 * sizes[1] + sizes[2], dtype=torch.int64, device=device)
            dist.broadcast(payload, 0)
            batch = _unpack(sizes, payload)
            runner.kv_pool.replay(journal, host)
            _update_table(runner, batch)
            runner.forward(batch)
    except BaseException:  # noqa: BLE001 - reported to rank 0, then this process exits non-zero
        text = traceback.format_exc()
        try:
            conn.send(("error", text))
        except (OSError, EOFError):
            pass
        logger.error("rank %d failed:\n%s", rank, text)
        os._exit(1)  # do not wait in collectives' teardown
    finally:
        if joined:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


# ---- rank 0 --------------------------------------------------------------------------------

def _exited(rank: int, proc: multiprocessing.process.BaseProcess) -> str:
    return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"


@dataclass
class _Workers:
    procs: list  # rank r at index r - 1
    conns: list
    failure: str | None = None
    closing: bool = False
    on_failure: list[Callable[[str], None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, message: str) -> None:
        with self.lock:
            if self.failure is not None or self.closing:
                return
            self.failure = message
        logger.error("%s; shutting the engine down", message)
        for callback in self.on_failure:
            try:
                callback(message)
            except Exception:  # noqa: BLE001
                logger.exception("rank-failure callback failed")
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            os.kill(os.getpid(), signal.SIGTERM)  # the server's shutdown path

    def watch(self) -> None:
        sentinels = {p.sentinel: (r + 1, p) for r, p in enumerate(self.procs)}
        while sentinels and not self.closing:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=1.0)
            for s in ready:
                rank, proc = sentinels.pop(s)
                if not self.closing:
                    self.fail(_exited(rank, proc))

    def exited_rank(self, wait_s: float) -> str | None:
        """The first rank whose process has exited, waiting up to wait_s for one (a failed collective usually means
        a rank died, and its exit can take a moment to show), as the watcher names it; None if all still run."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.exitcode is not None:
                    return _exited(rank, proc)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def stop(self) -> None:
        self.closing = True
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send((_STOP,))
                except (OSError, EOFError):
                    pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()


class TPDriver:
    """Rank 0's runner: sends each batch to the workers, then runs its own shard of the forward."""

    def __init__(self, runner: ModelRunner, workers: _Workers):
        self.runner, self.workers = runner, workers
        self.kv_pool, self.config, self.moe_layers = runner.kv_pool, runner.config, runner.moe_layers
        self.model, self.state_pool = runner.model, runner.state_pool
        self.kv_pool.journal = []  # what the prefix cache does to the pool beyond the batches
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        with self._lock:
            if self.workers.failure is not None:
                raise RankFailure(self.workers.failure)
            try:
                sizes, payload = _pack(batch)
                journal = self.kv_pool.take_journal()
                for conn in self.workers.conns:
                    conn.send((_FORWARD, sizes, journal))
                dist.broadcast(payload, 0)
                return self.runner.forward(batch)
            except Exception as exc:
                # name the dead rank when there is one (the watcher may not have seen it yet), else the error
                message = (self.workers.failure or self.workers.exited_rank(wait_s=2.0)
                           or f"tensor-parallel forward failed: {exc}")
                self.workers.fail(message)
                raise RankFailure(message) from exc


@dataclass
class ParallelRuntime(Runtime):
    workers: _Workers | None = None
    allocated_per_rank: dict[int, dict[str, int]] = field(default_factory=dict)

    def placement(self) -> dict[int, list[int]]:
        """GPU experts of each MoE layer over all ranks (rank 0 holds placement[l][0::N], ...)."""
        return {l: sorted(set(m.gpu_experts) | set(m.remote.nonzero().flatten().tolist()))
                for l, m in self.moe_layers.items()}

    def close(self) -> None:
        try:
            if self.workers is not None:
                self.workers.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            super().close()


def _wait_all(workers: _Workers, expect: str) -> dict[int, object]:
    """Each worker's `expect` report ('hello': free bytes, 'loaded': allocated bytes); a worker error
    or death raises."""
    out: dict[int, dict[str, int]] = {}
    pending = {conn: r + 1 for r, conn in enumerate(workers.conns)}
    sentinels = {p.sentinel: r + 1 for r, p in enumerate(workers.procs)}
    while pending:
        ready = multiprocessing.connection.wait(list(pending) + list(sentinels), timeout=STARTUP_TIMEOUT_S)
        if not ready:
            raise RankFailure(f"tensor-parallel ranks {sorted(pending.values())} did not load within "
                              f"{STARTUP_TIMEOUT_S:.0f} s")
        for item in ready:
            if item in pending:
                rank = pending.pop(item)
                try:
                    kind, value = item.recv()
                except EOFError:
                    kind, value = "error", "(no report)"
                if kind != expect:
                    raise RankFailure(f"tensor-parallel rank {rank} failed while loading:\n{value}")
                out[rank] = value
            elif item in sentinels:
                rank = sentinels.pop(item)
                if rank in pending.values():
                    conn = next(c for c, r in pending.items() if r == rank)
                    if conn.poll():
                        continue  # its report (an error) is read from the pipe
                    proc = workers.procs[rank - 1]
                    raise RankFailure(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                      f"{proc.exitcode} while loading")
    return out


def _is_main_test(node: ast.expr) -> bool:
    """`__name__ == "__main__"` (either way round)."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(node.left), ast.dump(node.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def require_main_guard(size: int) -> None:
    """Spawned ranks import the main script again: an Engine created by its top-level code (not under
    `if __name__ == "__main__":`) would start again in every rank, which dies before it can report
    anything. Raise ConfigError with the fix before any rank starts."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return  # python -c, a REPL, a notebook: spawn does not re-run anything
    script = os.path.realpath(path)
    frame = next((f for f, _ in traceback.walk_stack(None)
                  if f.f_code.co_name == "<module>" and os.path.realpath(f.f_code.co_filename) == script), None)
    if frame is None:
        return  # the script's top level has finished (e.g. an engine started from a thread or callback)
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), path)
    except (OSError, SyntaxError, ValueError):
        return
    guards = [(n.lineno, n.end_lineno) for n in ast.walk(tree) if isinstance(n, ast.If) and _is_main_test(n.test)]
    if any(lo <= frame.f_lineno <= hi for lo, hi in guards):
        return
    raise ConfigError(
        f"tensor_parallel_size={size} starts one process per rank with the 'spawn' method, which runs "
        f"{path} again in each of them; line {frame.f_lineno} starts the engine outside "
        "`if __name__ == \"__main__\":`, so every rank would start another engine instead of joining this one. "
        "Put the code that creates the Engine under the guard:\n\n"
        "    if __name__ == \"__main__\":\n        engine = Engine(...)\n")


def launch(config: EngineConfig, on_failure: Callable[[str], None] | None = None) -> ParallelRuntime:
    """Start ranks 1..N-1, build rank 0 here, join the group; -> rank 0's runtime (runner = TPDriver)."""
    validate(config)
    require_main_guard(config.tensor_parallel_size)
    size = config.tensor_parallel_size
    if dist.is_initialized():
        raise ConfigError("torch.distributed is already initialised in this process: one tensor-parallel "
                          "Engine per process")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs, conns = [], []
    workers = _Workers(procs, conns)
    try:
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, size, config, port, child),
                               name=f"ktlite-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        free = [_free_device_bytes(config, 0), *_wait_all(workers, "hello").values()]
        config = _agreed_config(config, free)
        for conn in conns:
            conn.send(("config", config))
        runtime = assemble(config, tp=TPContext(0, size))  # loads while the workers load
        try:
            allocated = {0: rank_allocated(runtime, 0), **_wait_all(workers, "loaded")}
            _init_group(0, size, port, config.torch_device)
        except BaseException:
            runtime.close()
            raise
    except BaseException:
        workers.stop()
        raise
    if on_failure is not None:
        workers.on_failure.append(on_failure)
    threading.Thread(target=workers.watch, name="ktlite-tp-watch", daemon=True).start()
    logger.info("tensor parallel: %d ranks joined (%s)", size, dist.get_backend())
    fields_ = {f: getattr(runtime, f) for f in Runtime.__dataclass_fields__}
    fields_["runner"] = TPDriver(runtime.runner, workers)
    return ParallelRuntime(**fields_, workers=workers, allocated_per_rank=allocated)
