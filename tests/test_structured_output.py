"""Grammar-constrained output: response_format json_schema / json_object through the official
openai client, checked with `jsonschema`; batching with unconstrained neighbours, preemption, abort,
and the sampler's masks."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

from ktlite import Engine
from ktlite.runtime.sampling import SamplerState, SamplingParams, sample
from ktlite.server import ServerOptions, ServerThread

ENGINE_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 400, "chunked_prefill_size": 256,
                "max_running_requests": 8, "gpu_memory": "1GiB", "served_model_name": "tiny"}
MSG = [{"role": "user", "content": "Report the status as JSON."}]
# enums, booleans, a nested object, a bounded array and a bounded integer: every value is bounded,
# so even a random model finishes the object well inside max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "status": {"enum": ["ok", "error", "retry"]},
        "done": {"type": "boolean"},
        "meta": {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "kind": {"enum": ["a", "b"]}},
                 "required": ["level", "kind"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
    },
    "required": ["status", "done", "meta", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "status", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def engine(tiny_v3):
    with Engine(str(tiny_v3), **ENGINE_FLAGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with ServerThread(engine, ServerOptions(port=0)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    assert text == json.dumps(obj, separators=(",", ":"), ensure_ascii=False)  # compact: no whitespace at all
    return obj


def test_json_schema_always_validates_over_30_seeds(client):
    def one(seed: int) -> tuple[str, str]:
        r = client.chat.completions.create(model="tiny", messages=MSG, response_format=RESPONSE_FORMAT, seed=seed,
                                           temperature=1.0, max_tokens=MAX_TOKENS)
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(30)))
    objects = [_check(text) for text, reason in results if reason == "stop"]
    assert len(objects) == 30, results
    assert len({json.dumps(o) for o in objects}) > 5  # sampled, not one forced answer


def test_json_schema_streaming(client):
    for seed in range(3):
        chunks = list(client.chat.completions.create(model="tiny", messages=MSG, response_format=RESPONSE_FORMAT,
                                                     seed=seed, max_tokens=MAX_TOKENS, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop"
        _check(text)


def test_json_object(client):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=MSG, response_format={"type": "json_object"},
                                           seed=seed, max_tokens=MAX_TOKENS)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        if reason == "stop":  # a random model may also wander inside a string until max_tokens
            assert isinstance(json.loads(text), dict)
        assert text.startswith("{") and not any(c.isspace() for c in text.split('"')[0])


def test_unenforceable_schema_is_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "x"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MSG, response_format=bad, max_tokens=8)
    assert err.value.body["param"] == "response_format" and err.value.body["code"] == "invalid_schema"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_batched_with_plain_neighbours_and_preemption(engine):
    """Constrained and plain requests share batches and get preempted (400-token pool); the plain
    ones decode exactly as alone and every constrained one still follows its grammar."""
    prompts = [f"{'long prompt words ' * 4} {i}" for i in range(8)]
    # the plain ones run for as long as a constrained one may (MAX_TOKENS), so the pool overflows whenever the
    # constrained ones join (each after its grammar compiles in a worker thread: when is timing)
    plain = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    alone = [engine.generate(p, plain).text for p in prompts[:2]]
    before = engine.scheduler.preemptions

    async def mixed():
        plain_runs = [engine.async_generate(p, plain) for p in prompts[:2]]
        constrained = [engine.async_generate(p, {"temperature": 1.0, "seed": i, "max_tokens": MAX_TOKENS,
                                                 "json_schema": SCHEMA}) for i, p in enumerate(prompts[2:])]
        return await asyncio.gather(*plain_runs, *constrained)

    results = asyncio.run(mixed())
    assert [r.text for r in results[:2]] == alone
    for r in results[2:]:
        assert r.finish_reason == "stop"
        _check(r.text)
    assert engine.scheduler.preemptions > before


def test_abort_mid_grammar(client, engine):
    stream = client.chat.completions.create(model="tiny", messages=MSG, response_format=RESPONSE_FORMAT, seed=1,
                                            max_tokens=MAX_TOKENS, stream=True)
    next(iter(stream))
    stream.close()
    for _ in range(200):
        if engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0:
            break
        time.sleep(0.02)
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    r = client.chat.completions.create(model="tiny", messages=MSG, response_format=RESPONSE_FORMAT, seed=1,
                                       max_tokens=MAX_TOKENS)
    _check(r.choices[0].message.content)


def test_masks_touch_only_their_rows(engine):
    """sample(): a masked row draws an allowed token; an unmasked row draws what it draws without masks."""
    grammars = engine.scheduler.grammars
    state = grammars.state(SamplingParams(json_schema=SCHEMA).json_schema)
    vocab = grammars.vocab_size
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0, seed=4)]
    masks = grammars.masks([state], [1], 2)
    allowed = [t for t in range(vocab) if masks.bits[1, t // 32] >> (t % 32) & 1]
    assert 0 < len(allowed) < vocab
    got = sample(logits, params, [SamplerState([1], 3), SamplerState([1], 4)], masks=masks)
    free = sample(logits, params, [SamplerState([1], 3), SamplerState([1], 4)])
    assert got[0] == free[0] and int(got[1]) in allowed
    assert state.advance(int(got[1])) and not state.terminated


def test_vocabulary_metadata_matches_xgrammars_detection():
    """How token strings encode bytes, read from tokenizer.json, agrees with xgrammar's own detector
    (private API: used only here, as the reference) for byte-level, sentencepiece-style and raw vocabularies."""
    import xgrammar as xgr
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    from ktlite.runtime.grammar import _vocab_type

    def spec(byte_fallback=False, pre=None, norm=None, dec=None) -> str:
        tok = HFTokenizer(models.BPE(vocab={"<unk>": 0, "▁a": 1, "a": 2, "<0x20>": 3}, merges=[], unk_token="<unk>",
                                     byte_fallback=byte_fallback))
        for attr, value in (("pre_tokenizer", pre), ("normalizer", norm), ("decoder", dec)):
            if value is not None:
                setattr(tok, attr, value)
        return tok.to_str()

    cases = [spec(pre=pre_tokenizers.ByteLevel(add_prefix_space=False), dec=decoders.ByteLevel()),
             spec(True, norm=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                  dec=decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])),
             spec(True, pre=pre_tokenizers.Metaspace(prepend_scheme="first"),
                  dec=decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])),
             spec(pre=pre_tokenizers.Metaspace(prepend_scheme="never"), dec=decoders.Metaspace(prepend_scheme="never"))]
    for text in cases:
        ref = xgr.TokenizerInfo._detect_metadata_from_hf(text)
        assert _vocab_type(json.loads(text)) == (ref["vocab_type"], ref["add_prefix_space"])
