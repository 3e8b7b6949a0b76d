"""Logprobs, prompt logprobs with echo, n > 1 and best_of on the OpenAI routes, and lm-eval's recorded requests.

Reference values come from transformers' forward of the same tiny checkpoint (log-softmax of its logits), never
from the server's own code path; replies are parsed through the `openai` SDK types where it has them.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import aiohttp
import openai
import pytest
import torch
import transformers
from openai.types import Completion
from openai.types.completion_choice import Logprobs
from openai.types.chat import ChatCompletion

from conftest import HANG_GUARD_S
from ktlite import Engine
from ktlite.runtime import logprobs as logprobs_module
from ktlite.server import ServerOptions, ServerThread

ENGINE_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 1024, "chunked_prefill_size": 64,
                "max_running_requests": 8, "gpu_memory": "1GiB", "served_model_name": "tiny"}
LM_EVAL = Path(__file__).parent / "data" / "agents" / "lm_eval"
TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_v3):
    with Engine(str(tiny_v3), **ENGINE_FLAGS) as eng:
        yield eng


@pytest.fixture(scope="module")
def url(engine):
    with ServerThread(engine, ServerOptions(port=0)) as s:
        yield s.url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_v3):
    """ids -> log-softmax [len(ids), vocab] of transformers' logits: row q is the distribution of token q + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_v3, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)

    return run


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL


def check_completion_logprobs(lp, ids: list[int], ref: torch.Tensor, top: int) -> None:
    """A completions logprobs object over echoed prompt + output `ids` against the reference."""
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for q in range(len(ids) - 1):
        want = ref[q]
        assert close(lp.token_logprobs[q + 1], want[ids[q + 1]].item()), q
        allowed = want.topk(top).values.tolist() + [want[ids[q + 1]].item()]  # the top ones and the chosen one
        values = lp.top_logprobs[q + 1].values()
        assert all(any(close(v, w) for w in allowed) for v in values), q
        assert close(max(values), allowed[0]) and len(values) <= top + 1, q  # lm-eval's is_greedy reads the max
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_prompt_logprobs_match_reference(client, engine, reference, monkeypatch):
    """max_tokens 0 (prefill only) and 1 (lm-eval's shape); several prompts at once; the per-step cap on
    prompt-logprob rows (shrunk here to 5 rows) chunks the prefills without changing a value."""
    monkeypatch.setattr(logprobs_module, "PROMPT_LOGIT_BYTES", 4 * engine.runtime.vocab_size * 5)
    prompts = [prompt(23, 1), prompt(9, 2)]
    reply = client.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=2, max_tokens=0)
    assert [c.index for c in reply.choices] == [0, 1]
    for ids, choice in zip(prompts, reply.choices):
        assert choice.finish_reason == "length"
        check_completion_logprobs(choice.logprobs, ids, reference(ids), 2)
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == 32
    # the prompts are cached now; prompt logprobs still compute every position
    again = client.completions.create(model="tiny", prompt=prompts[0], echo=True, logprobs=2, max_tokens=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(reply.choices[0].logprobs.token_logprobs[1:],
                                                                         abs=TOL)
    pair = client.completions.create(model="tiny", prompt=prompts[1], echo=True, logprobs=2, max_tokens=0, n=2)
    first, second = (c.logprobs.token_logprobs for c in pair.choices)  # one prefill answers both choices
    assert first == second and first[1:] == pytest.approx(reply.choices[1].logprobs.token_logprobs[1:], abs=TOL)
    single = client.completions.create(model="tiny", prompt=[7], echo=True, logprobs=1, max_tokens=0)
    assert single.choices[0].logprobs.token_logprobs == [None] and single.choices[0].finish_reason == "length"

    ids = prompts[0]
    one = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = one.choices[0].logprobs
    out = one.choices[0].text[len(one.choices[0].text) - len(lp.tokens[-1]):]
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[-1] == out
    ref = reference(ids)
    greedy = int(ref[-1].argmax())
    check_completion_logprobs(lp, ids + [greedy], reference(ids + [greedy]), 1)
    # the sampled token's logprob is the raw distribution's, whatever the temperature
    hot = client.completions.create(model="tiny", prompt=ids, logprobs=0, max_tokens=1, temperature=1.5, seed=3)
    [token] = hot.choices[0].logprobs.tokens
    [value] = hot.choices[0].logprobs.token_logprobs
    candidates = [t for t, v in enumerate(ref[-1].tolist()) if close(v, value)]
    assert token in [engine.tokenizer.decode([t], skip_special_tokens=False) for t in candidates]


def test_chat_logprobs_streamed_and_not(client, engine, reference):
    messages = [{"role": "user", "content": "Tell me about logprobs"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    whole = client.chat.completions.create(**body)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    ids = engine.tokenizer.encode_chat(messages)
    out = [int(reference(ids)[-1].argmax())]
    for _ in range(5):
        out.append(int(reference(ids + out)[-1].argmax()))
    ref = reference(ids + out)
    for i, entry in enumerate(content):
        row = ref[len(ids) - 1 + i]
        assert close(entry.logprob, row[out[i]].item())
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=TOL)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=TOL)  # greedy: the top token
        assert entry.bytes == list(entry.token.encode())
    streamed = [e for chunk in client.chat.completions.create(**body, stream=True) if chunk.choices
                for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_streamed_echo_completion(client, reference):
    ids = prompt(12, 4)
    chunks = list(client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True))
    values = [v for c in chunks for v in (c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [])]
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert len(values) == len(ids) + 3 and values[0] is None
    whole = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=3, temperature=0)
    assert whole.choices[0].logprobs.tokens == tokens
    assert whole.choices[0].logprobs.token_logprobs[1:] == pytest.approx(values[1:], abs=TOL)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text

    scored = list(client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=0, n=2,
                                            stream=True))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in scored if c.choices[0].finish_reason}
    echoed = [c.choices[0].index for c in scored if c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert finished == {0: "length", 1: "length"} and sorted(echoed) == [0, 1]


def test_n_samples_share_the_prompt_kv(client, engine):
    """n = 3 choices: sample 0 prefills, samples 1 and 2 take the prompt from the prefix cache (the engine's
    hit count); seeded samples are reproducible and differ from each other."""
    ids = prompt(40, 5)
    stats = engine.scheduler.cache.stats
    hits = stats.hit_tokens
    body = dict(model="tiny", prompt=ids, n=3, max_tokens=8, temperature=1.0, seed=11, logprobs=0)
    reply = client.completions.create(**body)
    assert stats.hit_tokens - hits >= 2 * (len(ids) - 1)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.text for c in reply.choices]
    assert len(set(texts)) > 1
    assert [c.text for c in client.completions.create(**body).choices] == texts
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 24

    # several prompts: index = prompt_i * n + j
    two = client.completions.create(model="tiny", prompt=[ids, ids[:20]], n=2, max_tokens=2, temperature=0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text  # greedy: the samples agree

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]

    # best_of: the n samples with the highest cumulative logprob of best_of (the same seeds as n=3 above)
    best = client.completions.create(**{**body, "n": 1, "best_of": 3})
    sums = sorted((sum(c.logprobs.token_logprobs), c.text) for c in reply.choices)
    assert best.choices[0].text == sums[-1][1]


async def test_streamed_n_choices(url):
    body = {"model": "tiny", "prompt": prompt(10, 6), "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 5,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        lines = [line.decode().strip()[len("data: "):] async for line in r.content if line.strip()]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    texts, finishes, counts = {0: "", 1: ""}, {}, {0: 0, 1: 0}
    for c in chunks[:-1]:
        for choice in c["choices"]:  # streamed chunks: the SDK does not validate them, its Logprobs type applies
            texts[choice["index"]] += choice["text"]
            counts[choice["index"]] += len(Logprobs.model_validate(choice["logprobs"]).tokens)
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"} and counts == {0: 5, 1: 5}
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    whole = openai.OpenAI(base_url=url + "/v1", api_key="x").completions.create(
        **{k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert [c.text for c in whole.choices] == [texts[0], texts[1]]


def _recorded(name: str) -> list[dict]:
    return [json.loads(line)["body"] for line in (LM_EVAL / name).read_text().splitlines()]


async def test_lm_eval_requests_answered(url, reference):
    """lm-eval 0.4.13's recorded bodies (local-completions loglikelihood and generate_until,
    local-chat-completions generate_until), replayed concurrently: every one answered; loglikelihood replies
    carry the prompt tokens' logprobs, equal to the reference log-softmax."""
    completions, chats = _recorded("completions_requests.jsonl"), _recorded("chat_requests.jsonl")
    async with aiohttp.ClientSession() as s:
        async def post(path: str, body: dict) -> dict:
            async with s.post(url + path, json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        replies = await asyncio.gather(*(post("/v1/completions", b) for b in completions),
                                       *(post("/v1/chat/completions", b) for b in chats))
    scored = 0
    for body, reply in zip(completions, replies):
        # construct (as the SDK's client does): its types have no null for the echoed first token
        choice = Completion.construct(**reply).choices[0]
        if not body.get("echo"):
            assert choice.logprobs is None and choice.finish_reason in ("stop", "length")
            continue
        [ids] = body["prompt"]
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + body["max_tokens"]
        ref = reference(ids)
        got = torch.tensor(lp.token_logprobs[1:len(ids)])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (got - want).abs().max().item() <= TOL
        assert all(not math.isnan(v) for v in lp.token_logprobs[1:])
        scored += 1
    assert scored == sum(1 for b in completions if b.get("echo")) > 0
    for reply in replies[len(completions):]:
        assert ChatCompletion.model_validate(reply).choices[0].message.content is not None


async def test_client_gone_aborts_every_sample(url, engine):
    body = {"model": "tiny", "prompt": prompt(10, 7), "n": 3, "max_tokens": 300, "ignore_eos": True,
            "temperature": 1.0, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        seen = set()
        async for line in r.content:
            if line.startswith(b"data: {"):
                seen.update(c["index"] for c in json.loads(line[len(b"data: "):])["choices"])
            if len(seen) == 3:
                break
    for _ in range(int(HANG_GUARD_S / 0.05)):
        if engine.scheduler.num_running == engine.scheduler.num_waiting == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
