"""Speculative decoding's cost side on a published model's shapes: what verifying k drafts costs, and what decode
gains at a given acceptance, against plain decode in the same run.

Drafts are *oracle* drafts: the greedy continuation of the prompt is computed first by a plain run; a request's
drafter proposes the next k tokens of it, each replaced by a wrong token with probability 1 - a (a per-token
acceptance; the engine's own accepted/drafted is reported beside it: a rejection ends a step's chain, so it is
lower). The continuation the drafts follow is the verify path's own (a k = 1 run first), since a plain step's kernels
may round a near-tie the other way (the compiled decode plan, int8 activations); a forward of 1 + k rows may take
other kernel paths again (token-count thresholds), so where a run's greedy output leaves that continuation is
printed: the drafts miss from there on, which the measured acceptance includes.

Rows, batch-1 decode on the checkpoint bench/e2e.py writes (random weights, --arch, --layers):
- plain decode: tok/s and ms per step;
- a = 1.0, k = 1..K: every draft accepted, so each step verifies k drafts and yields k + 1 tokens: the step's
  time over a plain step's is the verify cost c(k) (the union of the k + 1 tokens' experts grows with k);
- a in --acceptance, k = 1..K: tok/s and the speed-up over plain decode; the best k per a is marked, and the k that
  the start-up c(k) predicts ((1 - a^(k+1)) / (1 - a) tokens a step over c(k)) beside it;
- a in --acceptance, auto: what the engine does without --speculative-num-steps (speculative/auto_k.py: each step's
  k from the c(k) it measures before serving, runtime/verify.py, and the request's acceptance so far); the c(k) it
  measured is printed beside the bench's.

    python bench/speculative.py [--arch deepseek-v2-lite|qwen3-30b-a3b] [--layers 8] [--max-k 4]
                                [--acceptance 0.6,0.8,0.9] [--prompt-len 64] [--gen 48] [--tiny] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from _results_page import markdown_table, publish
from e2e import ARCHS, TINY_WIDTHS, write_checkpoint

from ktlite import Engine
from ktlite.runtime.speculative.auto_k import best_drafts
from ktlite.runtime.speculative.drafter import Speculation
from ktlite.runtime.verify import verify_cost_curve


class OracleDrafter:
    """Proposes the precomputed greedy continuation of `prompt_len` prompt tokens, each draft token wrong with
    probability 1 - acceptance (a fixed seed: every run of a configuration drafts the same)."""

    def __init__(self, continuation: list[int], prompt_len: int, acceptance: float, vocab: int, seed: int):
        self.continuation, self.prompt_len, self.acceptance, self.vocab = continuation, prompt_len, acceptance, vocab
        self.rng = random.Random(seed)
        self.length = 0

    @property
    def seen(self) -> int:
        return self.length

    def propose(self, new_tokens: Sequence[int], k: int) -> list[int]:
        self.length += len(new_tokens)
        start = self.length - self.prompt_len  # the output tokens already in the sequence
        drafts = []
        for token in self.continuation[start:start + k]:
            wrong = self.rng.random() >= self.acceptance
            drafts.append((token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab if wrong else token)
        return drafts


async def timed_decode(engine: Engine, prompt: list[int], gen: int) -> tuple[list[int], float, int]:
    """(output ids, seconds from the first token to the last, tokens produced in that time) of one request."""
    params = {"temperature": 0.0, "max_tokens": gen, "ignore_eos": True}
    ids, stamps = [], []
    async for event in engine.stream(input_ids=prompt, sampling_params=params):
        ids += event.token_ids
        stamps.append((time.perf_counter(), len(ids)))
    (first, after_first), (last, total) = stamps[0], stamps[-1]
    return ids, last - first, total - after_first


def run(engine: Engine, prompt: list[int], gen: int, speculation: Speculation | None) -> tuple[list[int], float, float]:
    """(output, decode tok/s, accepted / drafted) of one request, after one warm-up run of the same configuration
    (the prefix cache then serves the prompt: the timed part is decode only)."""
    engine.scheduler.speculation = speculation
    asyncio.run(timed_decode(engine, prompt, gen))
    drafted, accepted = engine.scheduler.drafted_tokens, engine.scheduler.accepted_tokens
    ids, seconds, tokens = asyncio.run(timed_decode(engine, prompt, gen))
    drafted = engine.scheduler.drafted_tokens - drafted
    rate = (engine.scheduler.accepted_tokens - accepted) / drafted if drafted else float("nan")
    return ids, tokens / seconds, rate



def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="deepseek-v2-lite")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--acceptance", default="0.6,0.8,0.9")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--kt-method", default="INT4")
    ap.add_argument("--dir", default="/tmp/ktlite-bench")
    ap.add_argument("--tiny", action="store_true", help="the same depth and experts at tiny widths (a smoke check)")
    ap.add_argument("--write", action="store_true", help="replace this bench's section of bench/RESULTS.md")
    args = ap.parse_args()
    path = write_checkpoint(Path(args.dir) / f"{args.arch}-{args.layers}layers{'-tiny' if args.tiny else ''}",
                            args.arch, args.layers, TINY_WIDTHS[args.arch] if args.tiny else None)
    flags = {"kt_method": args.kt_method, "dtype": "auto", "max_total_tokens": 8192, "chunked_prefill_size": 512,
             "context_length": 4096, "max_running_requests": 4}
    ks = list(range(1, args.max_k + 1))
    acceptances = [float(a) for a in args.acceptance.split(",")]
    g = torch.Generator().manual_seed(0)
    with Engine(str(path), **flags) as engine:
        vocab = engine.runtime.runner.config.vocab_size
        prompt = torch.randint(0, min(vocab, 1000), (args.prompt_len,), generator=g).tolist()
        plain, plain_rate, _ = run(engine, prompt, args.gen, None)
        step = 1 / plain_rate
        # every speculative step is one forward over 1 + k rows, whose kernels may round differently from a plain
        # step's (the compiled decode plan, int8 activations): the drafts follow the verify path's own greedy output
        reference = run(engine, prompt, args.gen, Speculation(1, lambda: OracleDrafter(plain, len(prompt), 1.0,
                                                                                        vocab, seed=0)))[0]
        differs = first_difference(plain, reference)
        diverged: dict[tuple, int | None] = {}
        startup_cost = verify_cost_curve(engine.runtime, args.max_k)  # the engine's own measure, before serving
        rows = [("plain decode", "-", "-", f"{plain_rate:.2f} tok/s", f"{step * 1e3:.1f} ms/step", "1.00x")]
        cost: dict[int, float] = {}
        for a in tqdm([1.0] + acceptances, desc="speculative runs", unit="acceptance"):
            rates = {}
            for k in ks:
                drafter = lambda: OracleDrafter(reference, len(prompt), a, vocab, seed=k)  # noqa: E731
                ids, rate, measured = run(engine, prompt, args.gen, Speculation(k, drafter))
                diverged[(a, k)] = first_difference(ids, reference)
                rates[k] = (rate, measured)
                if a == 1.0:
                    cost[k] = (k + 1) / rate / step  # a step's time over a plain step's
            best = max(ks, key=lambda k: rates[k][0])
            predicted = best_drafts(a, startup_cost)  # a=1.0 rows that left the drafts overstate c(k)
            for k in ks:
                rate, measured = rates[k]
                what = f"verify cost c({k}) = {cost[k]:.2f} plain steps" if a == 1.0 else \
                    (f"best k (the start-up c(k) predicts k={predicted})" if k == best else "")
                rows.append((f"oracle drafts a={a:.1f}", str(k), f"{measured:.2f}", f"{rate:.2f} tok/s",
                             what, f"{rate / plain_rate:.2f}x"))
            if a < 1.0:  # what the engine does without --speculative-num-steps: k per step from its own c(k)
                drafter = lambda: OracleDrafter(reference, len(prompt), a, vocab, seed=0)  # noqa: E731
                auto = Speculation(args.max_k, drafter, auto=True, cost=startup_cost)
                ids, rate, measured = run(engine, prompt, args.gen, auto)
                diverged[(a, "auto")] = first_difference(ids, reference)
                rows.append((f"oracle drafts a={a:.1f}", "auto", f"{measured:.2f}", f"{rate:.2f} tok/s",
                             "k per step from the start-up c(k) and the request's acceptance",
                             f"{rate / plain_rate:.2f}x"))
    threads = torch.get_num_threads()
    head = (f"{ARCHS[args.arch]} shapes cut to {args.layers} layers{' at tiny widths' if args.tiny else ''}, "
            f"random weights, CPU experts {args.kt_method}, batch 1, prompt {args.prompt_len}, {args.gen} new tokens, "
            f"torch threads {threads}. a: each oracle draft right with probability a; measured: the engine's "
            f"accepted / drafted. The engine's own start-up measure: "
            + ", ".join(f"c({k}) = {c:.2f}" for k, c in startup_cost.items())
            + ". The drafts follow the greedy output of a k = 1 run"
            + (", equal to plain decode's" if differs is None else
               f", which plain decode's leaves at token {differs} (a near-tie a plain step's kernels round the other "
               "way)")
            + ("; every run gave that output.\n" if not any(v is not None for v in diverged.values()) else
               "; runs whose output left it (a forward of 1 + k rows takes other kernel paths, which round near-ties "
               "differently: the drafts then miss, as the measured acceptance shows): "
               + ", ".join(f"a={a} k={k} from token {i}" for (a, k), i in diverged.items() if i is not None) + ".\n"))
    table = markdown_table(["drafts", "k", "measured acceptance", "decode", "note", "vs plain"], rows)
    publish("speculative", "Speculative decoding (bench/speculative.py)", head + "\n" + table, args.write)


if __name__ == "__main__":
    main()
