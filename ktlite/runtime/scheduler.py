"""Continuous batching on asyncio: waiting -> running -> finished, with chunked prefill.

Each step the scheduler builds one batch, runs the forward (and sampling) in a worker thread so the
event loop keeps serving clients, then streams each request's new text to its own queue.

Token accounting is uniform: a request's sequence is prompt + output; `computed` counts the tokens
whose KV entries are in the pool. A step processes `sequence[computed:computed + n]` and samples when
that reaches the end of the sequence. A decode is n = 1; a prefill chunk is larger; a preempted
request (KV freed, computed = 0) simply prefills prompt + output again later.

Policy:
- FCFS admission from the waiting queue while request rows (`--max-running-requests`) and free KV
  slots allow; a prefill step holds at most `--chunked-prefill-size` new tokens.
- Without `--enable-mixed-chunk`, prefill and decode steps alternate while both have work, so a
  long prompt does not stall the running streams; with it, decodes ride in the prefill batch.
- When decode needs more KV than is free, the newest running request is preempted (KV freed,
  requeued by arrival order) instead of failing.
- Abort frees a request's KV at once (or right after the step it is in).
- A request with a `json_schema` carries a grammar state (ktlite/runtime/grammar.py): its next-token
  mask is filled on a worker thread while the forward runs, applied at sampling, and the state
  advances with each token kept (preemption keeps the output, so the state stays valid).
- Logprobs (ktlite/runtime/logprobs.py): a request with `logprobs` gets each sampled token's logprob
  (and `top_logprobs` alternatives) on its event. One with `prompt_logprobs` also wants the logits of
  every prompt position, so it takes no cached prefix while they are missing, its prefill chunks ask
  for a logits row per prompt position (at most `prompt_logit_rows` such rows a step, counting every
  request's, but at least one per request), and its first event carries the prompt's values. With
  max_tokens 0 it only prefills: it finishes ("length") when the prompt is computed, sampling nothing.
- Speculative decoding (ktlite/runtime/speculative/, --speculative-algorithm): a decoding request's drafter proposes
  up to k tokens; they ride behind its last token in the same step (an extend of 1 + k tokens, so any batch carries
  them) while free KV slots and the tokens the memory plan sizes a forward for last. The kept tokens (accepted drafts
  plus the model's own) go through the same finish checks one by one as plain decoding's would; the rejected
  drafts' slots are freed and `computed` moves past the kept ones only. Drafting never preempts anyone. A draft model
  that reads the forward's hidden states (NEXTN: the checkpoint's MTP layer, speculative/mtp.py) runs right after the
  forward and sampling, in the forward's thread, over the rows each request keeps; its drafts wait in the request's
  drafter for the next step.

Prefix cache (ktlite/runtime/radix_cache.py, unless --disable-radix-cache): an admitted request starts
with `computed` = its longest cached prefix; each prefill chunk's tokens are indexed as soon as they are
computed, and a request that ends (finished, preempted or aborted) leaves all its computed tokens in the
cache. On a model with per-request recurrent state, the state is snapshotted where the prompt ends and
where the request ends, and a prefix is reused only up to a snapshot (copied into the request's row). Cached slots no request uses count
as free and are evicted before anyone is preempted. `--schedule-policy lpm` admits the waiting
request with the longest cached prefix first; one passed over LPM_MAX_SKIPS times goes first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ktlite.errors import RequestError
from ktlite.runtime.kv_cache import KVPool
from ktlite.runtime.logprobs import TokenLogprob, gather, prompt_logit_rows
from ktlite.runtime.model_runner import ForwardBatch, ModelRunner
from ktlite.runtime.radix_cache import Node, RadixCache
from ktlite.runtime.sampling import SamplerState, SamplingParams, sample
from ktlite.runtime.speculative import Drafter, Span, Speculation, accept_drafts, can_speculate, may_speculate
from ktlite.runtime.speculative.auto_k import Acceptance
from ktlite.runtime.stop import StopStringMatcher, finish_reason
from ktlite.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:  # imported on the first request with a json_schema (the grammar engine loads in ~2 s)
    from ktlite.runtime.grammar import GrammarBackend, GrammarState, TokenMasks

logger = logging.getLogger(__name__)

LPM_MAX_SKIPS = 8  # lpm: admissions of later requests a waiting one sits out before it goes first
LPM_MAX_QUEUE = 128  # lpm: longer queues are admitted fcfs (scoring every request each step costs too much)
PREFETCH_REQUESTS = 4  # waiting requests whose host-held prefixes are copied back during a step


@dataclass
class StreamEvent:
    """What a request's queue receives: new text/ids, and the finish reason on the last event."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids (params.logprobs)
    # params.prompt_logprobs, on a request's first event: of prompt tokens 1.. (the first has none)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class StepOutput:
    """What a step's forward and sampling produced."""

    ids: list[list[int]]  # the tokens each sampling request keeps: one, or its accepted drafts and one more
    sampled: list[TokenLogprob | None]  # their logprobs (requests with params.logprobs, which never draft)
    prompt: list[list[TokenLogprob]]  # per plan entry: the prompt logprobs its chunk gave


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    sampler: SamplerState
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    arrival: float = field(default_factory=time.monotonic)
    order: int = 0
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None
    computed: int = 0
    finish_reason: str | None = None
    aborted: bool = False
    first_token_time: float | None = None
    cached_tokens: int | None = None  # prompt tokens the prefix cache served at its first admission
    prefix: Node | None = None  # the prefix-cache node this request holds (its indexed tokens)
    skipped: int = 0  # lpm: scheduling passes that admitted a later request instead
    grammar: GrammarState | None = None  # params.json_schema: where the output is in its grammar
    prompt_lp: list[TokenLogprob] = field(default_factory=list)  # params.prompt_logprobs: of prompt tokens 1..
    prompt_lp_sent: bool = False
    drafter: Drafter | None = None  # speculative decoding: proposes its drafts
    drafts: list[int] = field(default_factory=list)  # this step's drafts, verified behind its last token
    acceptance: Acceptance = field(default_factory=Acceptance)  # its drafts' hits so far (how many it drafts next)

    @property
    def sequence_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """sequence[start:end] without concatenating prompt and output (decode asks every step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:end] + self.output_ids[: max(0, end - p)]

    @property
    def needs_prompt_rows(self) -> bool:
        """Whether prompt logprobs are still missing (so its prompt's logits must be computed)."""
        return self.params.prompt_logprobs and len(self.prompt_lp) < len(self.prompt_ids) - 1

    def prompt_rows(self, n: int) -> range:
        """Offsets into the chunk of its next n tokens whose logits give missing prompt logprobs:
        position q's logits are those of prompt token q + 1."""
        if not self.needs_prompt_rows:
            return range(0)
        start = max(self.computed, len(self.prompt_lp))
        end = max(start, min(self.computed + n, len(self.prompt_ids) - 1))
        return range(start - self.computed, end - self.computed)

    def wants_sample(self, n: int) -> bool:
        """Whether processing its next n tokens ends with a token to sample."""
        return self.computed + n == self.sequence_len and self.params.max_tokens > 0

    @property
    def remaining(self) -> int:
        """Tokens to process before the next token can be sampled."""
        return self.sequence_len - self.computed


@dataclass
class SchedulerConfig:
    chunked_prefill_size: int
    max_running_requests: int
    context_length: int
    enable_mixed_chunk: bool = False
    schedule_policy: str = "fcfs"  # or "lpm" (needs the prefix cache)


class Scheduler:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: SchedulerConfig,
                 after_step: Callable[[], None] | None = None, prefix_cache: RadixCache | None = None,
                 speculation: Speculation | None = None):
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.speculation = speculation
        # a draft model that reads the forward's hidden states (MTP drafts), run after every forward
        self.draft_model = (speculation.draft_model(runner, speculation.num_drafts)
                            if speculation is not None and speculation.draft_model is not None else None)
        self.pool: KVPool = runner.kv_pool
        self.cache = prefix_cache
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._after_step = after_step
        self._counter = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ktlite-forward")
        # grammar masks are computed on their own thread while the forward runs
        self._mask_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ktlite-grammar")
        self._grammars: GrammarBackend | None = None
        self._grammars_lock = threading.Lock()
        self._last_was_prefill = False
        self._closed = False
        self.steps = 0
        self.preemptions = 0
        self.drafted_tokens = 0  # speculative decoding: drafts verified, and those the model accepted
        self.accepted_tokens = 0

    # ---- submission -------------------------------------------------------------------------
    def check_prompt(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len == 0:
            raise RequestError("the prompt is empty", "prompt")
        if prompt_len >= self.config.context_length:
            raise RequestError(
                f"the prompt has {prompt_len} tokens; this model's context is {self.config.context_length} tokens",
                "messages",
            )
        if prompt_len + 1 > self.pool.num_slots:
            raise RequestError(
                f"the prompt has {prompt_len} tokens; the KV pool holds {self.pool.num_slots} tokens in all "
                "(raise --max-total-tokens or the GPU memory)",
                "messages",
            )

    @property
    def grammars(self) -> GrammarBackend:
        """The grammar engine (built on first use; thread-safe). Compile a new schema with
        `grammars.compile` off the event loop before `add`, which then finds it cached."""
        with self._grammars_lock:
            if self._grammars is None:
                from ktlite.runtime.grammar import GrammarBackend

                self._grammars = GrammarBackend(self.tokenizer, self.runner.config.vocab_size)
            return self._grammars

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request (call on the scheduler's loop). Returns the queue its events arrive on."""
        self.check_prompt(len(prompt_ids), params)
        queue: asyncio.Queue = asyncio.Queue()
        req = Request(
            rid=rid, prompt_ids=list(prompt_ids), params=params, queue=queue,
            sampler=SamplerState(prompt_ids, params.seed),
            detok=self.tokenizer.detokenizer(prompt_ids, params.skip_special_tokens),
            stops=StopStringMatcher(params.stop), order=next(self._counter),
            grammar=self.grammars.state(params.json_schema) if params.json_schema else None,
            drafter=self.speculation.new_drafter() if self.speculation is not None and may_speculate(params) else None,
        )
        self.waiting.append(req)
        self._wake()
        return queue

    def abort(self, rid: str) -> None:
        for req in itertools.chain(self.waiting, self.running):
            if req.rid == rid:
                req.aborted = True
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        self._wakeup = asyncio.Event()
        loop = asyncio.get_running_loop()
        empty = 0
        while not self._closed:
            self._reap_aborted()
            plan = self._schedule()
            if not plan:
                # Scheduling itself can free room (a request finished at the pool's limit, or one
                # preempted): look again before sleeping, or the waiting ones would never be woken.
                empty += 1
                if empty < 3 and (self.running or self._admissible()):
                    continue
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            empty = 0
            batch, sample_reqs = self._build_batch(plan)
            self._prefetch()
            out = await loop.run_in_executor(self._executor, self._forward_and_sample, batch, plan, sample_reqs)
            self._process(plan, sample_reqs, out)
            self.steps += 1
            if self._after_step is not None:
                self._after_step()

    def close(self) -> None:
        self._closed = True
        for req in self.waiting + self.running:
            self._finish(req, "abort")
        self._wake()
        self._executor.shutdown(wait=False)
        self._mask_executor.shutdown(wait=False)

    # ---- scheduling -------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Request, int]]:
        decoding = [r for r in self.running if r.remaining == 1]
        prefilling = [r for r in self.running if r.remaining > 1]
        want_prefill = bool(prefilling) or self._admissible()
        mixed = self.config.enable_mixed_chunk and self.pool.free_tokens > len(decoding)
        if want_prefill and (mixed or not decoding or not self._last_was_prefill):
            plan = self._schedule_prefill(prefilling, decoding if mixed else [])
            if plan:
                self._last_was_prefill = True
                return plan
        self._last_was_prefill = False
        return self._schedule_decode()

    def _admissible(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.config.max_running_requests and self.pool.free_tokens > 0

    def _schedule_decode(self) -> list[tuple[Request, int]]:
        decoding = sorted((r for r in self.running if r.remaining == 1), key=lambda r: r.order)
        while decoding and self.pool.free_tokens < len(decoding):
            victim = max(self.running, key=lambda r: r.order)
            if len(self.running) == 1:  # alone and still no room: the pool is its context limit
                self._finish(victim, "length")
            else:
                self._preempt(victim)
            decoding = [r for r in decoding if r is not victim]
        chunk = self.config.chunked_prefill_size if self.config.chunked_prefill_size > 0 else 1 << 62
        self._draft(decoding, chunk, len(decoding))
        return [(r, 1) for r in decoding]

    def _draft(self, decoding: list[Request], budget: int, reserved: int) -> None:
        """Give decoding requests drafts to verify behind their last token. The memory plan sizes a forward for a
        prefill chunk plus a token per running request: drafts take the prefill `budget` this step leaves and the
        rows the decodes leave, within the free KV slots beyond the `reserved` ones."""
        if self.speculation is None:
            return
        spare = min(budget + self.config.max_running_requests - len(decoding), self.pool.free_tokens - reserved)
        for req in decoding:
            limit = min(self.speculation.drafts_for(req.acceptance), spare,
                        req.params.max_tokens - len(req.output_ids) - 1,  # the model's own token follows the drafts
                        self.config.context_length - req.sequence_len - 1, self.pool.max_context - req.sequence_len)
            if limit > 0 and req.drafter is not None and can_speculate(req.params, req.sampler):
                req.drafts = req.drafter.propose(req.tokens(req.drafter.seen, req.sequence_len), limit)
                spare -= len(req.drafts)

    def _schedule_prefill(self, prefilling: list[Request], decoding: list[Request]) -> list[tuple[Request, int]]:
        budget = self.config.chunked_prefill_size if self.config.chunked_prefill_size > 0 else 1 << 62
        reserved = len(decoding)  # slots this step takes and has not allocated yet (a decode takes one)
        rows = prompt_logit_rows(self.runner.config.vocab_size)  # prompt-logprob logits rows left this step
        plan: list[tuple[Request, int]] = []
        for req in sorted(prefilling, key=lambda r: r.order):
            n = min(req.remaining, budget, self.pool.free_tokens - reserved)
            if n <= 0:
                break
            n, rows = self._cap_prompt_rows(req, n, rows)
            plan.append((req, n))
            budget, reserved = budget - n, reserved + n
        admitted = []
        for req in self._admission_order():
            if budget <= 0 or self.pool.free_tokens <= reserved or len(self.running) >= self.config.max_running_requests:
                break
            if req.sequence_len + 1 > self.pool.num_slots:  # a preempted request that outgrew the pool
                self._finish(req, "length")
                continue
            req.row = self.pool.alloc_request()
            self._take_cached_prefix(req, reserved)
            n = min(req.remaining, budget, self.pool.free_tokens - reserved)
            if n <= 0:  # its cached prefix held the last free slots: it waits for room
                self._release(req)
                req.computed = 0
                break
            n, rows = self._cap_prompt_rows(req, n, rows)
            if req.cached_tokens is None:
                req.cached_tokens = min(req.computed, len(req.prompt_ids))
            self.waiting.remove(req)
            self.running.append(req)
            admitted.append(req)
            plan.append((req, n))
            budget, reserved = budget - n, reserved + n
        self._count_skips(admitted)
        if not plan and prefilling and not decoding:
            # a chunked prefill is stuck on KV: make room from the newest other request
            others = [r for r in self.running if r is not prefilling[0]]
            if others:
                self._preempt(max(others, key=lambda r: r.order))
                return self._schedule_prefill([r for r in prefilling if r.row is not None], [])
            self._finish(prefilling[0], "length")  # cannot happen when the prompt fits the pool
        if not plan:
            return []
        self._draft(decoding, budget, reserved)
        return plan + [(r, 1) for r in decoding]

    @staticmethod
    def _cap_prompt_rows(req: Request, n: int, rows: int) -> tuple[int, int]:
        """A chunk with prompt logprobs to compute wants a logits row per token: bound the step's such
        rows by `rows` (but let every request run one token). -> (chunk length, rows left)."""
        if not req.needs_prompt_rows:
            return n, rows
        n = min(n, max(1, rows))
        return n, rows - n

    def _admission_order(self) -> list[Request]:
        """Waiting requests in the order to admit them: arrival (fcfs) or longest cached prefix first
        (lpm, arrival order among equals), a request passed over LPM_MAX_SKIPS times first of all."""
        if self.config.schedule_policy != "lpm" or self.cache is None or len(self.waiting) > LPM_MAX_QUEUE:
            return list(self.waiting)

        def key(req: Request) -> tuple[int, int]:  # sorted() is stable: arrival order among equal keys
            if req.skipped >= LPM_MAX_SKIPS:
                return (0, 0)
            return (1, -self.cache.match_len(req.tokens(0, req.sequence_len)))

        return sorted(self.waiting, key=key)

    def _count_skips(self, admitted: list[Request]) -> None:
        if admitted and self.config.schedule_policy == "lpm":
            newest = max(r.order for r in admitted)
            for req in self.waiting:
                if req.order < newest:
                    req.skipped += 1

    def _take_cached_prefix(self, req: Request, reserved: int) -> None:
        """Start req's row with its longest cached prefix (the prefix cache keeps one token for it to run)."""
        if self.cache is None:
            return
        # prompt logprobs need every prompt position's logits: such a request computes from position 0
        hit = self.cache.acquire(req.tokens(0, 1 if req.needs_prompt_rows else req.sequence_len), reserved + 1)
        req.prefix = hit.node
        self.pool.assign_prefix(req.row, hit.slots)
        req.computed = hit.length
        if hit.state is not None:  # a recurrent model: the state after the prefix, into the request's row
            self.cache.snapshots.load(hit.state, req.row)

    def _release(self, req: Request) -> None:
        """Give back req's row and slots; with the prefix cache its computed tokens stay indexed."""
        if self.cache is None:
            self.pool.free_request(req.row)
        else:
            slots = self.pool.release_request(req.row)
            done = min(req.computed, len(slots))  # slots past `computed` belong to a step that never finished
            # the row's recurrent state is that of its computed tokens (the model zeroes it for a new request)
            unused = self.cache.release(req.prefix, req.tokens(0, done), slots[:done],
                                        req.row if done == req.computed else None)
            self.pool.free_slots(unused + slots[done:])
            req.prefix = None
        req.row = None

    def _prefetch(self) -> None:
        """Copy the next waiting requests' host-held cached prefixes back while this step runs."""
        if self.cache is not None and self.cache.host is not None:
            for req in self.waiting[:PREFETCH_REQUESTS]:
                self.cache.prefetch(req.tokens(0, req.sequence_len))

    def _preempt(self, req: Request) -> None:
        logger.info("KV pool full: preempting request %s (%d tokens) to recompute later", req.rid, req.computed)
        self._release(req)
        req.computed = 0
        self.running.remove(req)
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: r.order)
        self.preemptions += 1

    def _build_batch(self, plan: list[tuple[Request, int]]) -> tuple[ForwardBatch, list[Request]]:
        chunks, prefix, rows, slots = [], [], [], []
        for req, n in plan:
            chunks.append(req.tokens(req.computed, req.computed + n) + req.drafts)
            prefix.append(req.computed)
            rows.append(req.row)
            slots.append(self.pool.alloc_tokens(req.row, n + len(req.drafts)))
        want = [req.wants_sample(n) for req, n in plan]
        # logits rows before the last token's: prompt logprobs, or (with drafts) the rows that verify them
        extra = [range(len(req.drafts)) if req.drafts else req.prompt_rows(n) for req, n in plan]
        capture = self.draft_model is not None and any(req.drafter is not None for req, _ in plan)
        batch = ForwardBatch.build(chunks, prefix, rows, slots, want, self.runner.device,
                                   extra if any(extra) else None, [len(req.drafts) for req, _ in plan],
                                   capture_hidden=capture)
        return batch, [req for (req, _), w in zip(plan, want) if w]

    def _forward_and_sample(self, batch: ForwardBatch, plan: list[tuple[Request, int]],
                            sample_reqs: list[Request]) -> StepOutput:
        plain = [r for r in sample_reqs if not r.drafts]  # sampled one token as usual (the drafting ones verify)
        rows = [i for i, r in enumerate(plain) if r.grammar is not None]
        masks: Future[TokenMasks] | None = None
        if rows:  # fill the grammar masks while the device runs the forward
            masks = self._mask_executor.submit(self.grammars.masks, [plain[i].grammar for i in rows], rows, len(plain))
        logits = self.runner.forward(batch)  # [R, vocab]: per plan entry its extra rows, then its sampling row
        prompt, sample_at, at = [], [], 0
        for req, n in plan:
            offsets = req.prompt_rows(n)  # contiguous rows: a view, no copy of the logits
            prompt.append(gather(logits[at:at + len(offsets)], [req.prompt_ids[req.computed + k + 1] for k in offsets],
                                 [req.params.top_logprobs] * len(offsets)))
            at += len(offsets)
            if req.wants_sample(n):
                sample_at.append(at)  # with drafts: the first of its 1 + k rows
                at += 1 + len(req.drafts)
        if not sample_reqs:
            self._run_draft_model(batch, plan, {})
            return StepOutput([], [], prompt)
        plain_at = [a for a, r in zip(sample_at, sample_reqs) if not r.drafts]
        plain_logits = logits[plain_at] if len(plain_at) < logits.shape[0] else logits
        ids = sample(plain_logits, [r.params for r in plain], [r.sampler for r in plain],
                     eos_token_ids=self.tokenizer.eos_token_ids, masks=masks.result() if masks else None).tolist()
        plain_out = iter(zip(ids, self._sampled_logprobs(plain_logits, plain, ids)))
        kept, logprobs = [], []
        for req, a in zip(sample_reqs, sample_at):
            if req.drafts:
                kept.append(accept_drafts(logits[a:a + 1 + len(req.drafts)], req.drafts, req.params, req.sampler))
                logprobs.append(None)
            else:
                token, lp = next(plain_out)
                kept.append([token])
                logprobs.append(lp)
        self._run_draft_model(batch, plan, {id(r): k for r, k in zip(sample_reqs, kept)})
        return StepOutput(kept, logprobs, prompt)

    def _run_draft_model(self, batch: ForwardBatch, plan: list[tuple[Request, int]],
                         kept: dict[int, list[int]]) -> None:
        """The draft model (MTP) over the rows each drafting request keeps: a chunk's tokens, or a verify's last token
        and accepted drafts (kept: id(request) -> the tokens it keeps after its chunk, for those that sampled)."""
        if self.draft_model is None or not batch.capture_hidden:
            return
        spans, offset = [], 0
        for req, n in plan:
            if req.drafter is not None:
                end = req.computed + n  # the token after each row: the sequence's next ones, then what it sampled
                new = kept.get(id(req), [])
                after = req.tokens(req.computed + 1, min(end + 1, req.sequence_len)) + new
                # drafts only for a request that sampled and may draft next step (its min_tokens out)
                drafts = id(req) in kept and len(req.output_ids) + len(new) >= req.params.min_tokens
                spans.append(Span(req.drafter, req.row, req.computed, offset, after, drafts))
            offset += n + len(req.drafts)
        self.draft_model.step(batch, spans)

    @staticmethod
    def _sampled_logprobs(logits: torch.Tensor, reqs: list[Request], ids: list[int]) -> list[TokenLogprob | None]:
        """The sampled tokens' logprobs under the raw logits, for the requests that want them."""
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs]
        out: list[TokenLogprob | None] = [None] * len(reqs)
        if rows:
            for i, lp in zip(rows, gather(logits[rows], [ids[i] for i in rows],
                                          [reqs[i].params.top_logprobs for i in rows])):
                out[i] = lp
        return out

    # ---- results ----------------------------------------------------------------------------
    def _process(self, plan: list[tuple[Request, int]], sample_reqs: list[Request], out: StepOutput) -> None:
        for (req, n), prompt_lp in zip(plan, out.prompt):
            req.computed += n
            req.prompt_lp += prompt_lp
            if self.cache is not None and n > 1 and req.row is not None:  # a prefill chunk: index it now
                req.prefix = self.cache.extend(req.prefix, req.tokens(0, req.computed),
                                               self.pool.row_slots(req.row)[: req.computed])
                if req.computed == len(req.prompt_ids):  # the next turn of a conversation starts here
                    self.cache.save_state(req.prefix, req.row)
            if req.params.max_tokens == 0 and req.computed >= len(req.prompt_ids) and req.finish_reason is None:
                self._finish(req, "length")  # prefill only: the prompt's logprobs are the reply
        for req, tokens, lp in zip(sample_reqs, out.ids, out.sampled):
            drafts, req.drafts = req.drafts, []
            if req.finish_reason is not None:
                continue
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            kept, emit, reason, hit = [], "", None, False
            for token in tokens:  # one by one, as plain decoding would have taken them
                kept.append(token)
                reason, text, hit = self._append(req, token)
                emit += text
                if reason is not None or hit:
                    break
            if drafts:
                self._settle_drafts(req, len(drafts), len(tokens) - 1)
            if hit:
                reason = "stop"
            elif reason is not None:
                emit += self._drain(req)
            self._emit(req, emit, kept, reason, [lp] if lp is not None else [])
            if reason is not None:
                self._finish(req, reason, notify=False)

    def _append(self, req: Request, token: int) -> tuple[str | None, str, bool]:
        """Add a token to req's output -> (finish reason, text to emit, whether a stop string was hit)."""
        req.output_ids.append(token)
        req.sampler.append(token)
        reason = finish_reason(req.params, token, len(req.output_ids), self.tokenizer.eos_token_ids)
        if req.grammar is not None and reason is None:
            reason = self._advance_grammar(req, token)
        if reason is None and req.sequence_len >= self.config.context_length:
            reason = "length"
        # EOS/stop ids end the text without adding to it (OpenAI's finish_reason "stop"), special tokens kept or not
        text = "" if reason == "stop" else req.detok.push(token)
        emit, hit = req.stops.feed(text)
        return reason, emit, hit

    def _settle_drafts(self, req: Request, drafted: int, accepted: int) -> None:
        """After a verify: the last token and the accepted drafts are computed (up to where the output ended), the
        rejected drafts' slots go back to the pool."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        req.acceptance.record(drafted, accepted)
        verified_from = req.computed - 1  # where the verify's last token sat
        req.computed = min(req.computed + accepted, req.sequence_len)
        if req.computed - verified_from < 1 + drafted and self.runner.state_pool.verify_rows:
            self.runner.rewind_states(req.row, req.computed - verified_from)  # recurrent layers keep only those
        self.pool.truncate(req.row, req.computed)

    @staticmethod
    def _advance_grammar(req: Request, token: int) -> str | None:
        """Move req's grammar past its new token; -> "stop" once the grammar is complete."""
        if not req.grammar.advance(token):  # the mask allowed only grammar tokens: an engine fault
            logger.warning("request %s: token %d is outside its grammar; ending the output here", req.rid, token)
            return "stop"
        return "stop" if req.grammar.terminated else None

    def _emit(self, req: Request, text: str, ids: list[int], reason: str | None,
              logprobs: list[TokenLogprob] | None = None) -> None:
        prompt = None
        if req.params.prompt_logprobs and not req.prompt_lp_sent:
            prompt, req.prompt_lp_sent = req.prompt_lp, True
        req.queue.put_nowait(StreamEvent(text, ids, reason, len(req.prompt_ids), len(req.output_ids),
                                         req.cached_tokens or 0, logprobs or [], prompt))

    def _finish(self, req: Request, reason: str, notify: bool = True) -> None:
        if req.row is not None:
            self._release(req)
        req.finish_reason = reason
        req.grammar = None  # finished or aborted: its grammar state goes with it
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if notify:
            self._emit(req, self._drain(req), [], reason)

    @staticmethod
    def _drain(req: Request) -> str:
        """Text held back by the detokenizer or the stop matcher, at the end of a stream."""
        held, hit = req.stops.feed(req.detok.flush())
        return held if hit else held + req.stops.flush()

    def _reap_aborted(self) -> None:
        for req in [r for r in self.waiting + self.running if r.aborted]:
            self._finish(req, "abort")
