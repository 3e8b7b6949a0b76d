"""`Engine`: the one object scripts, the CLI and the server drive.

The scheduler runs on an event loop in a background thread that the engine owns, so the same
engine works from a plain script (`generate`), from inside any running event loop
(`async_generate`, `stream`), and from several threads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ktlite.config import EngineConfig
from ktlite.errors import EngineFailure, RequestError
from ktlite.runtime.assembly import Runtime, assemble
from ktlite.runtime.host_cache import make_host_cache
from ktlite.runtime.knobs import choose_knobs
from ktlite.runtime.models import serving_config
from ktlite.runtime.radix_cache import RadixCache, prefix_cache_enabled
from ktlite.runtime.sampling import SamplingParams
from ktlite.runtime.state_cache import StateSnapshots
from ktlite.runtime.scheduler import Scheduler, SchedulerConfig, StreamEvent
from ktlite.runtime.speculative import speculation_for
from ktlite.runtime.tokenizer import Tokenizer
from ktlite.runtime.verify import verify_cost_curve, verify_plan, warm_paths

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not prefilled again)

    @property
    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def _params(sampling_params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    if sampling_params is None:
        return SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params.validate()
        return sampling_params
    return SamplingParams.from_dict(sampling_params)


class Engine:
    """`Engine(model_path, **flags)`; flags are the CLI's names in snake_case (see EngineConfig)."""

    def __init__(self, model_path: str, **flags: Any):
        self.config = EngineConfig.from_kwargs(model_path, **flags)
        # every knob the caller left out, chosen from the plan and the hardware (logged as one table);
        # before the tensor-parallel branch, since the rank count is one of them
        model_config = serving_config(self.config)  # ConfigError: NEXTN without an MTP layer
        self.config, self.knobs = choose_knobs(self.config, model_config)
        speculation = speculation_for(self.config, model_config)  # before allocating
        self.tokenizer = Tokenizer(self.config.model_path)
        self._failure: EngineFailure | None = None  # set when the scheduler stops on an error or a TP rank dies
        if self.config.tensor_parallel_size > 1:  # ranks 1..N-1 in their own processes
            from ktlite.runtime.parallel import launch

            self.runtime: Runtime = launch(self.config, on_failure=self._on_rank_failure)
        else:
            self.runtime = assemble(self.config)
        verify_plan(self.runtime)  # one full chunk and the largest decode batch, before serving anything
        warm_paths(self.runtime)  # and every smaller forward size: nothing compiles in a request
        if speculation is not None and speculation.auto:  # each step's draft count from the measured cost curve
            speculation = replace(speculation, cost=verify_cost_curve(self.runtime, speculation.num_drafts))
        self.scheduler = Scheduler(
            self.runtime.runner,
            self.tokenizer,
            SchedulerConfig(
                chunked_prefill_size=self.config.chunked_prefill_size,
                max_running_requests=self.config.max_running_requests,
                context_length=self.runtime.context_length,
                enable_mixed_chunk=self.config.enable_mixed_chunk,
                schedule_policy=self.config.schedule_policy,
            ),
            after_step=self.runtime.after_step,
            prefix_cache=self._prefix_cache(),
            speculation=speculation,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ktlite-engine", daemon=True)
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self.scheduler.run(), self._loop)
        self._task.add_done_callback(self._on_scheduler_stop)
        self._closed = False

    def _prefix_cache(self) -> RadixCache | None:
        if not prefix_cache_enabled(self.config, self.runtime):
            if not self.config.disable_radix_cache:
                logger.info("prefix cache off: this model keeps per-request recurrent state and no snapshot of it "
                            "can be kept (--max-mamba-cache-size 0, or tensor parallelism)")
            return None
        pool, states = self.runtime.runner.kv_pool, self.runtime.snapshot_pool
        return RadixCache(pool, make_host_cache(pool, self.config), StateSnapshots(states) if states else None)

    # ---- prompts ------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | None, input_ids: Sequence[int] | None) -> list[int]:
        if (prompt is None) == (input_ids is None):
            raise RequestError("give exactly one of prompt or input_ids", "prompt")
        if input_ids is not None:
            ids = [int(t) for t in input_ids]
            bad = [t for t in ids if not 0 <= t < self.runtime.vocab_size]
            if bad:
                raise RequestError(f"token ids out of range [0, {self.runtime.vocab_size}): {bad[:5]}", "input_ids")
            return ids
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string", "prompt")
        return self.tokenizer.encode(prompt)

    # ---- async API (any event loop) -----------------------------------------------------------
    async def _on_engine_loop(self, coro):
        """Run a coroutine on the engine's loop and await it from whatever loop we are on."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def stream_ids(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None) -> AsyncIterator[StreamEvent]:
        """Events for one request; the last one carries finish_reason. Closing the iterator early aborts it."""
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError("the engine is shut down")
        rid = rid or uuid.uuid4().hex

        async def add():
            return self.scheduler.add(rid, prompt_ids, params)

        queue = await self._on_engine_loop(add())
        finished = False
        try:
            while not finished:
                event: StreamEvent = await self._on_engine_loop(queue.get())
                finished = event.finish_reason is not None
                if finished and event.finish_reason == "abort":
                    self._raise_if_failed()
                yield event
        finally:
            if not finished:
                self.abort(rid)

    async def stream(self, prompt: str | None = None, sampling_params=None, input_ids=None) -> AsyncIterator[StreamEvent]:
        async for event in self.stream_ids(self._prompt_ids(prompt, input_ids), _params(sampling_params)):
            yield event

    async def _collect(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        text, ids, event = [], [], None
        async for event in self.stream_ids(prompt_ids, params):
            text.append(event.text)
            ids.extend(event.token_ids)
        return GenerationResult("".join(text), ids, event.finish_reason, event.prompt_tokens, event.completion_tokens,
                                event.cached_tokens)

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None):
        """Like `generate`, awaitable from any event loop."""
        params = _params(sampling_params)
        batch = self._batch(prompt, input_ids)
        results = await asyncio.gather(*(self._collect(ids, params) for ids in batch[0]))
        return results if batch[1] else results[0]

    def _batch(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        """-> (token lists, whether the caller passed a list)."""
        if isinstance(prompt, (list, tuple)):
            return [self._prompt_ids(p, None) for p in prompt], True
        if input_ids is not None and len(input_ids) and isinstance(input_ids[0], (list, tuple)):
            return [self._prompt_ids(None, ids) for ids in input_ids], True
        return [self._prompt_ids(prompt, input_ids)], False

    # ---- sync API -----------------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None):
        """Prompt (str or list of str) or input_ids (list or list of lists) -> GenerationResult(s).

        Blocks until done; the requests of a list run concurrently (continuous batching)."""
        params = _params(sampling_params)
        batch, is_list = self._batch(prompt, input_ids)

        async def run_all():
            return await asyncio.gather(*(self._collect(ids, params) for ids in batch))

        results = asyncio.run_coroutine_threadsafe(run_all(), self._loop).result()
        return results if is_list else results[0]

    def chat(self, messages: list[dict[str, Any]], sampling_params=None) -> GenerationResult:
        return self.generate(input_ids=self.tokenizer.encode_chat(messages), sampling_params=sampling_params)

    def abort(self, rid: str) -> None:
        self._loop.call_soon_threadsafe(self.scheduler.abort, rid)

    # ---- lifecycle ----------------------------------------------------------------------------
    def _on_rank_failure(self, message: str) -> None:
        """A tensor-parallel rank died (called from the watcher thread): end every request."""
        from ktlite.runtime.parallel import RankFailure

        self._failure = RankFailure(f"{message}; the engine has shut down")
        self._loop.call_soon_threadsafe(self.scheduler.close)

    def _on_scheduler_stop(self, task: concurrent.futures.Future) -> None:
        """The scheduler's loop ended (on the engine's loop thread). If by an error (a forward step raised), end
        every request with it: their callers would otherwise wait for events from a loop that no longer runs."""
        error = None if task.cancelled() else task.exception()
        if error is None or self._failure is not None:
            return
        logger.error("the scheduler stopped: %r", error, exc_info=error)
        self._failure = EngineFailure(f"the engine stopped on an error in its forward step ({error!r}); "
                                      "it has shut down: restart it")
        self.scheduler.close()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self.scheduler.close)
        try:
            try:
                self._task.result(timeout=30)
            except Exception:
                if self._failure is None:  # after a rank failure the scheduler's error is expected
                    raise
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self.runtime.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
