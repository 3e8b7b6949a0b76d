"""Per-request sampling parameters and the batched sampler the scheduler calls once per step.

Order of logits processing, per row: penalties -> grammar mask (rows with a `json_schema`) ->
min_tokens suppression of ending ids (not on grammar rows: the grammar decides where output may end)
-> greedy argmax, or temperature -> top_k -> top_p -> min_p -> one draw with the request's own
generator. A thinking budget then overrides the draw: once `thinking_budget` output tokens are out
and the think block is still open, the next tokens are `think_end_ids`, one per step (SGLang's
thinking budget), after which sampling goes on as before.

Batch invariance: every sampled row goes through the same sorted pipeline and draws exactly one
uniform number per step from its own CPU generator, so a request's tokens depend only on its
seed, its logits and its params, never on which other requests share the batch or on the device.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from ktlite.errors import RequestError
from ktlite.runtime.logprobs import MAX_TOP_LOGPROBS

if TYPE_CHECKING:  # the grammar engine is imported on the first constrained request only (~2 s)
    from ktlite.runtime.grammar import TokenMasks

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
GREEDY_TEMPERATURE = 1e-5


def is_int(value: Any) -> bool:
    """A JSON-style integer: True/False are not numbers here."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (NaN and inf are rejected)."""
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def canonical_schema(schema: Any) -> str:
    """A JSON schema (dict or JSON text) -> canonical JSON text (the grammar cache's key)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise RequestError(f"json_schema is not valid JSON: {exc}", "json_schema") from exc
    if not isinstance(schema, dict):
        raise RequestError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}", "json_schema")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)  # key order kept: it is the output order


@dataclass
class SamplingParams:
    max_tokens: int = 128
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the request before this many tokens
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt + output
    frequency_penalty: float = 0.0  # OpenAI-style, over output
    presence_penalty: float = 0.0  # OpenAI-style, over output
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # a single str is accepted and wrapped
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Constrain the output to compact JSON matching this schema (a dict or JSON text; {"type":
    # "object"} for any object); kept as canonical JSON text. See ktlite/runtime/grammar.py.
    json_schema: str | dict[str, Any] | None = None
    # At most this many output tokens of reasoning: after them, unless `think_end_ids` (the think
    # block's close tag, tokenized) already occurred, those ids are forced and the answer follows.
    thinking_budget: int | None = None
    think_end_ids: list[int] = field(default_factory=list)
    # Log-probabilities (ktlite/runtime/logprobs.py): of each output token, of each prompt token
    # after the first (computed from position 0: such a request takes no cached prefix), with
    # `top_logprobs` alternatives per token. max_tokens may be 0 with prompt_logprobs (prefill only).
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.json_schema is not None:
            self.json_schema = canonical_schema(self.json_schema)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise RequestError(param=<field>) for the first wrong-typed or out-of-range field."""

        def check(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise RequestError(f"{name} must be {expected}, got {getattr(self, name)!r}", param=name)

        least = 0 if self.prompt_logprobs is True else 1  # nothing to compute otherwise
        check(is_int(self.max_tokens) and self.max_tokens >= least, "max_tokens",
              "an integer >= 1 (0 only with prompt_logprobs)")
        check(is_int(self.min_tokens) and 0 <= self.min_tokens, "min_tokens", "an integer >= 0")
        check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})")
        check(is_number(self.temperature) and 0 <= self.temperature <= 2, "temperature", "a number in [0, 2]")
        check(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        check(is_int(self.top_k), "top_k", "an integer (<= 0 disables it)")
        check(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        check(is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "a number > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            check(is_number(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name, "a number in [-2, 2]")
        check(self.seed is None or is_int(self.seed), "seed", "an integer or null")
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a non-empty string or a list of non-empty strings",
        )
        check(
            isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of non-negative integers",
        )
        check(self.thinking_budget is None or (is_int(self.thinking_budget) and self.thinking_budget >= 0),
              "thinking_budget", "an integer >= 0 or null")
        check(isinstance(self.think_end_ids, list) and all(is_int(t) and t >= 0 for t in self.think_end_ids)
              and (self.thinking_budget is None or bool(self.think_end_ids)),
              "think_end_ids", "a non-empty list of non-negative integers with a thinking_budget")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "a boolean")
        for name in ("logprobs", "prompt_logprobs"):
            check(isinstance(getattr(self, name), bool), name, "a boolean")
        check(is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
              f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "a boolean")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a plain dict; None values mean "not given" (JSON null); unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise RequestError(f"sampling parameters must be a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise RequestError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}",
                param=unknown[0],
            )
        return cls(**{k: v for k, v in d.items() if v is not None})

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def ending_token_ids(self, eos_token_ids: Iterable[int]) -> set[int]:
        """Token ids that finish the request with "stop": stop_token_ids, plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return ids


class SamplerState:
    """What the sampler remembers about one request; keep it for the request's whole life
    (including preemption and recompute) and `append` every token the request keeps."""

    def __init__(self, prompt_ids: Sequence[int], seed: int | None = None):
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        # A CPU generator, one uniform per sampled step: the same seed gives the same draws on any
        # device and in any batch.
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed % 2**64)  # torch takes [0, 2**64); OpenAI seeds may be negative
        # Penalty bookkeeping, built on first use on the logits' device and then updated
        # incrementally, so a step costs O(new tokens), not O(prompt + output).
        self._seen: torch.Tensor | None = None  # [V] bool: token occurs in prompt + output
        self._counts: torch.Tensor | None = None  # [V] float32: occurrences in output
        self._counted = 0  # output_ids[:_counted] are already in _seen/_counts
        # thinking budget: the output index where the close tag began to be forced, -1 when the think
        # block closed within the budget, None before the budget is reached
        self._forced_from: int | None = None

    def forced_token(self, params: SamplingParams) -> int | None:
        """The token the thinking budget forces next, or None (sample as usual)."""
        budget, end, out = params.thinking_budget, params.think_end_ids, self.output_ids
        if budget is None or len(out) < budget:
            return None
        if self._forced_from is None:  # the budget is spent now: is the think block still open?
            closed = any(out[i : i + len(end)] == end for i in range(len(out) - len(end) + 1))
            self._forced_from = -1 if closed else len(out)
        k = len(out) - self._forced_from
        return end[k] if self._forced_from >= 0 and k < len(end) else None

    def append(self, token_id: int) -> None:
        self.output_ids.append(int(token_id))

    def _penalty_tensors(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._seen is None or self._counts is None:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._seen[torch.tensor(self.prompt_ids, dtype=torch.long, device=device)] = True
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        new = self.output_ids[self._counted :]
        if new:
            idx = torch.tensor(new, dtype=torch.long, device=device)
            self._seen[idx] = True
            self._counts.index_add_(0, idx, torch.ones(len(new), dtype=torch.float32, device=device))
            self._counted = len(self.output_ids)
        return self._seen, self._counts


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], states: Sequence[SamplerState]
) -> torch.Tensor:
    """Return a penalised float32 copy of logits [B, V].

    repetition (tokens in prompt + output): positive logits / penalty, negative logits * penalty;
    then over output tokens: logit -= frequency_penalty * count + presence_penalty * (count > 0).
    """
    out = logits.to(torch.float32, copy=True)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return out
    vocab, device = out.shape[1], out.device
    seen, counts = (torch.stack(t) for t in zip(*(states[i]._penalty_tensors(vocab, device) for i in rows)))
    x = out[rows]  # [P, V]
    rep = _column([params[i].repetition_penalty for i in rows], device)
    x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
    x -= _column([params[i].frequency_penalty for i in rows], device) * counts
    x -= _column([params[i].presence_penalty for i in rows], device) * (counts > 0)
    out[rows] = x
    return out


def _filtered(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits [N, V] -> (probabilities after temperature, top_k, top_p and min_p, in descending order with
    the dropped ones 0 and the rest not renormalised; the token ids of that order), both [N, V]."""
    vocab, device = logits.shape[1], logits.device
    x = logits / _column([p.temperature for p in params], device)
    # Filters work on the descending order; stable so ties break by token id on every device.
    x, order = x.sort(dim=-1, descending=True, stable=True)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)[:, None]
    x.masked_fill_(torch.arange(vocab, device=device) >= top_k, -math.inf)
    probs = x.softmax(dim=-1)
    # top_p: drop a token once the mass before it already reaches top_p (the top token always stays).
    # top_p == 1 is skipped outright, since float cumsums can reach 1.0 before the tail.
    top_p = _column([p.top_p if p.top_p < 1 else math.inf for p in params], device)
    drop = probs.cumsum(dim=-1) - probs >= top_p
    # min_p: relative to the top probability (a ratio, so unaffected by top_k/top_p renormalising).
    drop |= probs < _column([p.min_p for p in params], device) * probs[:, :1]
    return probs.masked_fill_(drop, 0.0), order


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a non-greedy row of logits [N, V] is sampled from (no penalties or masks): [N, V] float32,
    in token order, each row summing to 1 (speculative decoding's rejection sampling needs it whole)."""
    probs, order = _filtered(logits.to(torch.float32), params)
    out = torch.zeros_like(probs).scatter_(1, order, probs)
    return out / out.sum(dim=-1, keepdim=True)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplerState]) -> torch.Tensor:
    """Draw one token per row of logits [N, V] with temperature, top_k, top_p and min_p."""
    probs, order = _filtered(logits, params)
    device = logits.device
    cdf = probs.cumsum(dim=-1)
    # Inverse CDF with target in (0, total]: the first cdf >= target has a nonzero probability.
    u = torch.cat([torch.rand(1, generator=s.generator) for s in states]).to(device)
    target = (1.0 - u[:, None]) * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target)  # [N, 1]
    return order.gather(1, pick).squeeze(1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    states: Sequence[SamplerState],
    eos_token_ids: Iterable[int] = (),
    masks: TokenMasks | None = None,
) -> torch.Tensor:
    """One token per row of logits [B, V] -> int64 [B] on the logits' device.

    Does not modify `logits` and does not append to `states`: the scheduler appends the tokens
    it keeps. `eos_token_ids` (the tokenizer's) are suppressed, with stop_token_ids, while a
    request has fewer than min_tokens output tokens. `masks`: the allowed tokens of the rows that
    follow a grammar (masks.rows); every other token of those rows gets -inf.
    """
    batch, vocab = logits.shape
    if len(params) != batch or len(states) != batch:
        raise ValueError(f"sample: {batch} logits rows but {len(params)} params and {len(states)} states")
    forced = [(i, s.forced_token(p)) for i, (p, s) in enumerate(zip(params, states)) if p.thinking_budget is not None]
    forced = [(i, t) for i, t in forced if t is not None]
    tokens = _sample(logits, params, states, eos_token_ids, masks)
    for i, t in forced:
        tokens[i] = t
    return tokens


def _sample(logits: torch.Tensor, params: Sequence[SamplingParams], states: Sequence[SamplerState],
            eos_token_ids: Iterable[int], masks: TokenMasks | None) -> torch.Tensor:
    batch, vocab = logits.shape
    if masks is None and all(p.is_greedy and not p.has_penalties and len(s.output_ids) >= p.min_tokens
                             for p, s in zip(params, states)):
        return logits.argmax(dim=-1)  # nothing to change first: no copy of the logits (~0.3 ms of a CPU decode step)
    x = apply_penalties(logits, params, states)  # a float32 copy: masking it leaves `logits` alone
    constrained = set()
    if masks is not None:
        masks.apply(x)
        constrained = set(masks.rows)
    eos_token_ids = tuple(eos_token_ids)
    for i, (p, s) in enumerate(zip(params, states)):
        if len(s.output_ids) < p.min_tokens and i not in constrained:
            ids = [t for t in p.ending_token_ids(eos_token_ids) if t < vocab]
            x[i, ids] = -math.inf
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if greedy:
        tokens[greedy] = x[greedy].argmax(dim=-1)
    if sampled:
        tokens[sampled] = _sample_rows(x[sampled], [params[i] for i in sampled], [states[i] for i in sampled])
    return tokens
