"""Grammar engines for structured output, side by side: xgrammar vs llguidance on a 150k vocabulary.

What the server pays per constrained request: one-time tokenizer set-up, a compile per schema, and
per decode step one token-mask fill (plus one token accept). The mask is what must stay small next
to a decode step (tens of ms on a big MoE), and it runs while the device runs the step.

The vocabulary: a byte-level BPE trained on this interpreter's standard-library sources up to
150,000 tokens (no download; real 150k vocabularies are multilingual, this one is code-heavy).
Both engines get the same tokenizer.json and EOS. Grammars are compact JSON (no free whitespace):
xgrammar `compile_json_schema(any_whitespace=False, separators=(",", ":"))`, llguidance
`grammar_from_json_schema` with `whitespace_flexible: false` and the same separators. Each step
replays the tokens of a valid instance, so masks are those a real decode sees.

    python bench/grammar_engines.py            # ~1-2 min the first time (tokenizer training)
    python bench/grammar_engines.py --write    # and replace its section of bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from _results_page import section, write_section

VOCAB = 150_000
CACHE = Path("/tmp/ktlite-bench-grammar")
EOS = "<|eos|>"

SCHEMAS = {
    "json_object": ({"type": "object"},
                    {"name": "ktlite", "ok": True, "n": [1, 2, 3], "nested": {"pi": 3.14, "s": "x y z"}}),
    "schema": ({"type": "object", "additionalProperties": False,
                "required": ["status", "done", "meta", "tags", "title"],
                "properties": {"status": {"enum": ["ok", "error", "retry"]}, "done": {"type": "boolean"},
                               "meta": {"type": "object", "additionalProperties": False,
                                        "required": ["level", "kind"],
                                        "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "kind": {"enum": ["a", "b"]}}},
                               "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
                               "title": {"type": "string", "maxLength": 40}}},
               {"status": "retry", "done": False, "meta": {"level": 3, "kind": "b"}, "tags": ["x", "z"],
                "title": "a title with some words in it"}),
    "tool_call": ({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                   "properties": {"name": {"const": "get_weather"},
                                  "arguments": {"type": "object", "additionalProperties": False,
                                                "required": ["city", "unit"],
                                                "properties": {"city": {"type": "string"},
                                                               "unit": {"enum": ["c", "f"]}}}}},
                  {"name": "get_weather", "arguments": {"city": "San Francisco, California", "unit": "f"}}),
}


def tokenizer_150k() -> Tokenizer:
    path = CACHE / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    files, budget = [], 60 * 2**20
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if budget <= 0:
            break
        try:
            f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # a few test files are latin-1 on purpose
            continue
        files.append(str(f))
        budget -= f.stat().st_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.perf_counter()
    tok.train(files, trainer)
    print(f"trained a {tok.get_vocab_size()}-token byte-level BPE on {len(files)} files in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


REPS = 8  # each instance replayed this many times, each with a fresh matcher


def measure(engine: str, name: str, ids: list[int], new_matcher, fill, accept, compile_ms: float) -> dict[str, float]:
    """Replay `ids` REPS times: mask fill and accept per step (the token must be allowed and accepted).
    Reports the median step, the mean, and the worst position (its median over replays): the cost
    that repeats for every token of e.g. a long string."""
    per_pos: list[list[float]] = [[] for _ in ids]
    accepts = []
    for _ in range(REPS):
        m = new_matcher()
        for pos, t in enumerate(ids):
            t0 = time.perf_counter()
            allowed = fill(m, t)
            t1 = time.perf_counter()
            assert allowed, f"{engine} masked a valid token {t}"
            assert accept(m, t), f"{engine} refused token {t}"
            accepts.append(time.perf_counter() - t1)
            per_pos[pos].append(t1 - t0)
    steps = sorted(x * 1e6 for xs in per_pos for x in xs)
    worst = max(statistics.median(xs) for xs in per_pos) * 1e6
    out = {"compile_ms": compile_ms, "mask_p50_us": steps[len(steps) // 2], "mask_mean_us": statistics.fmean(steps),
           "mask_worst_position_us": worst, "accept_mean_us": statistics.fmean(accepts) * 1e6}
    print(f"{engine:10s} {name:11s} compile {compile_ms:7.1f} ms  mask p50 {out['mask_p50_us']:7.1f} us  "
          f"mean {out['mask_mean_us']:7.1f}  worst position {worst:7.1f}  accept {out['accept_mean_us']:5.1f} us  "
          f"({len(ids)} tokens)", flush=True)
    return out


def _bit(bitmask, t: int) -> bool:
    return bool(bitmask[0, t // 32] >> (t % 32) & 1)


def bench_xgrammar(tok: Tokenizer, eos: int, cases: dict[str, tuple[dict, list[int]]]) -> dict[str, dict]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=len(vocab), stop_token_ids=[eos],
                             add_prefix_space=meta["add_prefix_space"])
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    out: dict[str, dict] = {"setup": {"ms": (time.perf_counter() - t0) * 1e3}}
    print(f"xgrammar   set-up {out['setup']['ms']:8.1f} ms", flush=True)
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))

    def fill(m, t):
        m.fill_next_token_bitmask(bitmask)
        return _bit(bitmask, t)

    for name, (schema, ids) in cases.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        out[name] = measure("xgrammar", name, ids, lambda: xgr.GrammarMatcher(compiled), fill,
                            lambda m, t: m.accept_token(t), (time.perf_counter() - t0) * 1e3)
    return out


def bench_llguidance(tok: Tokenizer, eos: int, cases: dict[str, tuple[dict, list[int]]]) -> dict[str, dict]:
    import llguidance
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=[eos])
    out: dict[str, dict] = {"setup": {"ms": (time.perf_counter() - t0) * 1e3}}
    print(f"llguidance set-up {out['setup']['ms']:8.1f} ms", flush=True)
    options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    bitmask = llt.allocate_token_bitmask(1, tok.get_vocab_size())

    def fill(m, t):
        llt.fill_next_token_bitmask(m, bitmask)
        return _bit(bitmask, t)

    for name, (schema, ids) in cases.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        first = llguidance.LLMatcher(lltok, grammar)  # the grammar is compiled here
        compile_ms = (time.perf_counter() - t0) * 1e3
        assert not first.is_error(), first.get_error()
        out[name] = measure("llguidance", name, ids, lambda: llguidance.LLMatcher(lltok, grammar), fill,
                            lambda m, t: m.consume_token(t), compile_ms)
    return out


def table(results: dict[str, dict]) -> str:
    """measure()'s figures as markdown, each engine's one-time set-up beside each of its grammars."""
    lines = ["| engine | grammar | set-up ms | compile ms | mask p50 us | mask mean us | worst position us | accept us |",
             "|---|---|---|---|---|---|---|---|"]
    for engine, cases in results.items():
        for name, m in cases.items():
            if name != "setup":
                lines.append(f"| {engine} | {name} | {cases['setup']['ms']:.1f} | {m['compile_ms']:.1f} "
                             f"| {m['mask_p50_us']:.1f} | {m['mask_mean_us']:.1f} | {m['mask_worst_position_us']:.1f} "
                             f"| {m['accept_mean_us']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_out", default=None, help="Also write the figures as JSON here.")
    ap.add_argument("--write", action="store_true", help="Replace this bench's section of bench/RESULTS.md.")
    args = ap.parse_args(argv)
    tok = tokenizer_150k()
    eos = tok.token_to_id(EOS)
    vocabulary = f"vocabulary {tok.get_vocab_size()} tokens; python {sys.version.split()[0]}"
    print(vocabulary, flush=True)
    cases = {name: (schema, tok.encode(json.dumps(instance, separators=(",", ":"))).ids + [eos])
             for name, (schema, instance) in SCHEMAS.items()}
    results = {"xgrammar": bench_xgrammar(tok, eos, cases), "llguidance": bench_llguidance(tok, eos, cases)}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    if args.write:
        write_section("grammar_engines", section("grammar_engines", "Grammar engines (bench/grammar_engines.py)",
                                                 f"{vocabulary}; times per constrained request.\n\n{table(results)}"))


if __name__ == "__main__":
    main()
