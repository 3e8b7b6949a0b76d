"""The OpenAI-compatible HTTP server: routes, auth, admission, streaming, shutdown.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, GET /openapi.json (the OpenAPI description, `ktlite/server/openapi.py`), OpenAI's
Responses API POST /v1/responses (`ktlite/server/responses.py`, with its bounded in-memory store for
`previous_response_id`), and Anthropic's POST /v1/messages and /v1/messages/count_tokens
(`ktlite/server/anthropic.py`). Every error is OpenAI's JSON shape `{"error": {message, type, param,
code}}`, on /v1/messages* Anthropic's `{"type": "error", "error": {type, message}}`. With --api-key,
/v1/* takes the key as `Authorization: Bearer KEY` or `x-api-key: KEY` (what each API's clients send).

A request with a JSON schema to enforce (response_format, or a forced tool call) has its grammar
compiled in a worker thread before it is queued, so a schema the engine cannot enforce is a 400
and a slow first compile never stalls the event loop.

A request that is admitted gets its own rid (the response id) and runs through
`Engine.stream_ids`, one engine request per sample (`n`, or `best_of` to choose from): the first
prefills the prompt, which the prefix cache indexes, and the others start once its first event is
out, so they take the prompt's KV from the cache instead of computing it again. If the client goes
away (a failed write, or aiohttp cancelling the handler when the connection drops) the stream
iterators are closed, which aborts the requests and frees their KV at once.

Admission (`--max-queued-requests Q`): the server holds at most `--max-running-requests` + Q
requests at once; the next one gets 503 with `Retry-After`, so a flood never piles up unbounded.
Bodies must be UTF-8 JSON of at most `--max-request-bytes` (413 beyond it).

Shutdown (SIGINT/SIGTERM): stop listening, abort what is in flight so every open stream ends with an
error event (code "aborted") and `data: [DONE]` (non-streaming requests get a 503), wait a bounded
time for those responses to go out, then close the connections and shut the engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import random
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from ktlite.errors import RequestError
from ktlite.runtime.sampling import SamplingParams
from ktlite.runtime.scheduler import StreamEvent
from ktlite.server import anthropic, responses
from ktlite.server.chat_output import parse_output
from ktlite.server.metrics import Metrics
from ktlite.server.openapi import openapi
from ktlite.server.protocol import (APIError, Collected, OpenAIStream, ParsedRequest, bad_request, chat_response,
                                    completion_response, models_response, parse_chat, parse_completion, pick_choices)
from ktlite.server.reasoning import think_format
from ktlite.server.sse import ClientGone, SSEWriter
from ktlite.server.tool_parsers.stream import tool_format

logger = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("ktlite_server", object)
MODEL_ALIASES = ("default",)  # SGLang's examples send model="default"


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the engine's, else the model folder's name
    max_queued_requests: int | None = None  # default: the engine config's (None: unbounded)
    max_request_bytes: int = 8 * 2**20  # --max-request-bytes
    retry_after_s: int = 1
    tool_call_parser: str | None = None  # --tool-call-parser: take tool calls out of chat replies
    reasoning_parser: str | None = None  # --reasoning-parser: split thinking into reasoning_content


def served_name(engine, options: ServerOptions | None = None) -> str:
    if options is not None and options.served_model_name:
        return options.served_model_name
    if engine.config.served_model_name:
        return engine.config.served_model_name
    return Path(engine.config.model_path).resolve().name


class OpenAIServer:
    def __init__(self, engine, options: ServerOptions | None = None):
        self.engine = engine
        self.options = options or ServerOptions()
        if self.options.tool_call_parser:
            tool_format(self.options.tool_call_parser)  # ConfigError naming the supported ones
        if self.options.reasoning_parser:
            think_format(self.options.reasoning_parser)
        self.model_name = served_name(engine, self.options)
        self.metrics = Metrics(self.model_name)
        queued = self.options.max_queued_requests
        if queued is None:
            queued = engine.config.max_queued_requests
        self.capacity = None if queued is None else engine.config.max_running_requests + queued
        self.created = int(time.time())
        self.shutting_down = False
        self._active: set[str] = set()  # rids of the requests in the engine, aborted on shutdown
        self.responses = responses.ResponseStore()  # Responses API: stored responses (store: true)

    # ---- app ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.options.max_request_bytes)
        app[ENGINE_KEY] = self
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.create_response)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/openapi.json", self.openapi_page)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "other"
        status = 500
        try:
            if request.path.startswith("/v1/"):
                self._check_auth(request)
            response = await handler(request)
            status = response.status
            return response
        except APIError as exc:
            status = exc.status
            return _error_response(request, exc)
        except web.HTTPException as exc:  # aiohttp's own 404/405/413...
            status = exc.status
            if exc.status < 400:
                raise
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
            return _error_response(request, APIError(exc.status, exc.reason if exc.status != 413 else exc.text, kind,
                                                     None, code))
        except asyncio.CancelledError:
            status = 499  # client closed the connection (nginx's convention)
            raise
        except Exception as exc:  # never a hang, never an HTML page
            logger.exception("internal error on %s %s", request.method, request.path)
            return _error_response(request, APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                                     "server_error", None, "internal_error"))
        finally:
            self.metrics.count_request(endpoint, status)

    def _check_auth(self, request: web.Request) -> None:
        key = self.options.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")  # Anthropic's clients send the key here
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' "
                           "(the server's --api-key)", "invalid_request_error", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})

    # ---- simple routes ------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_response([self.model_name], self.created))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self._resolve_model(name)
        return web.json_response(models_response([self.model_name], self.created)["data"][0])

    async def health(self, request: web.Request) -> web.Response:
        if self.shutting_down or getattr(self.engine, "_closed", False):
            raise APIError(503, "the engine is shut down", "server_error", None, "unavailable")
        return web.json_response({"status": "ok", "model": self.model_name})

    async def openapi_page(self, request: web.Request) -> web.Response:
        return web.json_response(openapi(api_key_required=bool(self.options.api_key)))

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(self.engine), content_type="text/plain",
                            headers={"X-Content-Type": "text/plain; version=0.0.4"})

    # ---- generation routes ---------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._json(request)
        model = self._resolve_model(body.get("model") if isinstance(body, dict) else None)
        parsed = parse_chat(body, self.engine.tokenizer, self.engine.runtime.context_length, model,
                            self.options.tool_call_parser, self.options.reasoning_parser)
        return await self._run(request, parsed, arrival)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._json(request)
        model = self._resolve_model(body.get("model"))
        parsed = anthropic.parse_request(body, self.engine.tokenizer, self.engine.runtime.context_length, model,
                                         self.options.tool_call_parser, self.options.reasoning_parser)
        return await self._run(request, parsed, arrival)

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._json(request)
        model = self._resolve_model(body.get("model"))
        parsed = responses.parse_request(body, self.engine.tokenizer, self.engine.runtime.context_length, model,
                                         self.options.tool_call_parser, self.options.reasoning_parser, self.responses)
        return await self._run(request, parsed, arrival)

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        self._resolve_model(body.get("model"))
        return web.json_response(anthropic.count_tokens(body, self.engine.tokenizer))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        body = await self._json(request)
        model = self._resolve_model(body.get("model") if isinstance(body, dict) else None)
        parsed = parse_completion(body, self.engine.tokenizer, self.engine.runtime.vocab_size,
                                  self.engine.runtime.context_length, model)
        return await self._run(request, parsed, arrival)

    async def _json(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise APIError(413, f"request body too large (limit {self.options.max_request_bytes} bytes)",
                           "invalid_request_error", None, "request_too_large") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad_request(f"the request body is not UTF-8: {exc}"[:300], None, "invalid_encoding") from exc
        try:
            body = json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise bad_request(f"the request body is not valid JSON: {exc}"[:300], None, "invalid_json") from exc
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object", None, "invalid_json")
        return body

    def _resolve_model(self, name: Any) -> str:
        if name is None:
            return self.model_name
        if not isinstance(name, str):
            raise bad_request(f"model must be a string, got {name!r}", "model")
        if name in (self.model_name, *MODEL_ALIASES) or name == self.engine.config.model_path:
            return self.model_name
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                       "invalid_request_error", "model", "model_not_found")

    async def _run(self, request: web.Request, parsed: ParsedRequest, arrival: float) -> web.StreamResponse:
        for ids in parsed.prompts:
            try:
                self.engine.scheduler.check_prompt(len(ids), parsed.params)
            except RequestError as exc:
                param = {"completion": "prompt", "responses": "input"}.get(parsed.kind, exc.param or "messages")
                code = "context_length_exceeded" if "context" in str(exc) or "KV pool" in str(exc) else None
                raise bad_request(str(exc), param, code) from exc
        if parsed.params.json_schema is not None:
            await self._compile_grammar(parsed)
        requests = len(parsed.prompts) * parsed.best_of
        self._admit(requests)
        self.metrics.in_flight += requests
        try:
            if parsed.stream:
                return await self._stream(request, parsed, arrival)
            return await self._complete(request, parsed, arrival)
        finally:
            self.metrics.in_flight -= requests

    async def _compile_grammar(self, parsed: ParsedRequest) -> None:
        """Compile (or find cached) the request's grammar off the event loop; 400 if it cannot be enforced."""
        try:
            await asyncio.to_thread(self.engine.scheduler.grammars.compile, parsed.params.json_schema)
        except RequestError as exc:
            param = "tools" if parsed.output.forced_call else \
                "text.format" if parsed.kind == "responses" else "response_format"
            raise bad_request(str(exc), param, "invalid_schema") from exc

    def _admit(self, n: int) -> None:
        if self.shutting_down or getattr(self.engine, "_closed", False):
            raise APIError(503, "the server is shutting down", "server_error", None, "unavailable",
                           {"Retry-After": str(self.options.retry_after_s)})
        if self.capacity is not None and self.metrics.in_flight + n > self.capacity:
            raise APIError(
                503, f"the server is at capacity ({self.capacity} requests: --max-running-requests "
                f"{self.engine.config.max_running_requests} + --max-queued-requests "
                f"{self.capacity - self.engine.config.max_running_requests}); retry later",
                "server_error", None, "server_overloaded", {"Retry-After": str(self.options.retry_after_s)})

    async def _events(self, ids: list[int], params: SamplingParams, rid: str, arrival: float):
        """Engine events for one sample, with metrics; closing this generator aborts the request."""
        agen = self.engine.stream_ids(ids, params, rid=rid)
        last = None
        finished = False
        self._active.add(rid)
        try:
            async for event in agen:
                now = time.monotonic()
                if event.token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - arrival)
                    else:
                        self.metrics.itl.observe((now - last) / len(event.token_ids))
                    last = now
                    self.metrics.generation_tokens += len(event.token_ids)
                if event.finish_reason is not None:
                    finished = True
                    self.metrics.prompt_tokens += event.prompt_tokens
                    self.metrics.e2e.observe(now - arrival)
                yield event
        finally:
            self._active.discard(rid)
            if not finished:
                self.metrics.aborted += 1
            await agen.aclose()

    def _samples(self, ids: list[int], parsed: ParsedRequest, rid: str,
                 arrival: float) -> list[AsyncIterator[StreamEvent]]:
        """The event streams of one prompt's samples (best_of of them; one with max_tokens 0, which
        samples nothing). Sample 0 prefills the prompt; the others start once its first event is out,
        when the prompt is in the prefix cache, so they take its KV from there."""
        prefilled = asyncio.Event()

        async def first():
            try:
                async with contextlib.aclosing(self._events(ids, parsed.params, rid, arrival)) as events:
                    async for event in events:
                        prefilled.set()
                        yield event
            finally:
                prefilled.set()

        async def later(j: int):
            await prefilled.wait()
            async with contextlib.aclosing(self._events(ids, _sample_params(parsed.params, j), f"{rid}-{j}",
                                                        arrival)) as events:
                async for event in events:
                    yield event

        count = 1 if parsed.params.max_tokens == 0 else parsed.best_of
        return [first()] + [later(j) for j in range(1, count)]

    async def _complete(self, request: web.Request, parsed: ParsedRequest, arrival: float) -> web.Response:
        async def collect(ids: list[int], events) -> Collected:
            r = Collected("", [], "abort", 0, 0, 0, prompt_ids=ids)
            texts = []
            async with contextlib.aclosing(events):
                async for event in events:
                    texts.append(event.text)
                    r.token_ids += event.token_ids
                    r.logprobs += event.logprobs
                    if event.prompt_logprobs is not None:
                        r.prompt_logprobs = event.prompt_logprobs
                    r.finish_reason, r.prompt_tokens = event.finish_reason, event.prompt_tokens
                    r.completion_tokens, r.cached_tokens = event.completion_tokens, event.cached_tokens
                    transport = request.transport
                    if transport is None or transport.is_closing():
                        raise ClientGone()
            r.text = "".join(texts)
            return r

        samples = []
        for i, ids in enumerate(parsed.prompts):
            rid = parsed.request_id if len(parsed.prompts) == 1 else f"{parsed.request_id}-{i}"
            samples.append([asyncio.ensure_future(collect(ids, s)) for s in self._samples(ids, parsed, rid, arrival)])
        tasks = [t for ts in samples for t in ts]
        try:
            await asyncio.gather(*tasks)
        except ClientGone:
            logger.info("client went away: request %s aborted", parsed.request_id)
            await _cancel_all(tasks)
            return web.Response(status=499)
        except BaseException:  # cancelled (client gone) or failed: abort the other prompts too
            await _cancel_all(tasks)
            raise
        if any(t.result().finish_reason == "abort" for t in tasks):
            raise APIError(503, "the request was aborted (the server is shutting down)", "server_error", None, "aborted")
        results = [c for ts in samples for c in pick_choices(parsed, [t.result() for t in ts])]
        r = results[0]
        if parsed.kind == "responses":
            final = StreamEvent("", [], r.finish_reason, r.prompt_tokens, r.completion_tokens, r.cached_tokens)
            return web.json_response(responses.response_object(parsed, r.text, final, self._count_tokens))
        if parsed.kind == "chat":
            return web.json_response(chat_response(parsed, results))
        if parsed.kind == "messages":
            return web.json_response(anthropic.message_response(
                parsed, parse_output(parsed.output, r.text), r.finish_reason,
                self._stop_sequence(parsed, r.token_ids, r.finish_reason), r.prompt_tokens, r.completion_tokens,
                r.cached_tokens))
        return web.json_response(completion_response(parsed, results))

    def _stop_sequence(self, parsed: ParsedRequest, token_ids: list[int], reason: str) -> str | None:
        """The stop string that ended a reply (Anthropic reports it), from its untruncated text."""
        if reason != "stop" or not parsed.params.stop:
            return None
        full = self.engine.tokenizer.decode(token_ids, skip_special_tokens=parsed.params.skip_special_tokens)
        return anthropic.matched_stop(parsed.params.stop, full)

    def _count_tokens(self, text: str) -> int:
        return len(self.engine.tokenizer.encode(text, add_bos=False))

    async def _stream(self, request: web.Request, parsed: ParsedRequest, arrival: float) -> web.StreamResponse:
        frames: OpenAIStream | anthropic.MessageStream | responses.ResponseStream
        if parsed.kind == "messages":
            frames = anthropic.MessageStream(parsed, lambda ids, reason: self._stop_sequence(parsed, ids, reason))
        elif parsed.kind == "responses":
            frames = responses.ResponseStream(parsed, self._count_tokens)
        else:
            frames = OpenAIStream(parsed)
        writer = SSEWriter(request)
        await writer.start()
        samples = self._samples(parsed.prompts[0], parsed, parsed.request_id, arrival)
        fanout = parsed.n // len(samples)  # max_tokens 0: the one prefill answers every choice
        gen = _merged(samples)

        async def send(batch: list[tuple[str | None, dict[str, Any]]]) -> None:
            for name, data in batch:
                await writer.send(data, name)

        async def close() -> None:
            await (writer.done() if frames.done else writer.end())

        try:
            await send(frames.start())
            finals: list[StreamEvent | None] = [None] * parsed.n
            async for j, event in gen:
                for k in range(j, j + fanout):
                    await send(frames.event(event, k))
                    if event.finish_reason is not None:
                        finals[k] = event
            if any(f is None or f.finish_reason == "abort" for f in finals):
                await send(frames.error("the request was aborted (the server is shutting down)", 503))
            else:
                await send(frames.end(*finals))
            await close()
        except ClientGone:
            logger.info("client went away mid-stream: request %s aborted", parsed.request_id)
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, then end the stream
            logger.exception("request %s failed mid-stream", parsed.request_id)
            try:
                await send(frames.error(str(exc), 500))
                await close()
            except ClientGone:
                pass
        finally:
            await gen.aclose()
        return writer.response

    # ---- shutdown -----------------------------------------------------------------------------
    async def drain(self, timeout: float = 10.0) -> int:
        """Refuse new requests, abort the ones in flight and wait (at most `timeout` s) until their
        responses are written (streams: an error event and [DONE]). -> requests still in flight."""
        self.shutting_down = True
        for rid in list(self._active):
            self.engine.abort(rid)
        deadline = time.monotonic() + timeout
        while self.metrics.in_flight > 0 and time.monotonic() < deadline:
            for rid in list(self._active):  # a request admitted after the first sweep
                self.engine.abort(rid)
            await asyncio.sleep(0.02)
        return self.metrics.in_flight


def _sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sample j > 0 of a prompt: seed + j (distinct, reproducible draws); the prompt's logprobs come from sample 0."""
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed + j, prompt_logprobs=False)


async def _merged(streams: list[AsyncIterator[StreamEvent]]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """(index, event) from several event streams as they arrive; closing it closes them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(j: int, stream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((j, event, None))
            queue.put_nowait((j, None, None))
        except Exception as exc:  # noqa: BLE001 - raised by the consumer
            queue.put_nowait((j, None, exc))

    tasks = [asyncio.ensure_future(pump(j, s)) for j, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            j, event, exc = await queue.get()
            if exc is not None:
                raise exc
            if event is None:
                left -= 1
            else:
                yield j, event
    finally:
        await _cancel_all(tasks)
        for s in streams:
            await s.aclose()


async def _cancel_all(tasks: list[asyncio.Future]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _error_response(request: web.Request, exc: APIError) -> web.Response:
    body = anthropic.error_body(exc) if request.path.startswith("/v1/messages") else exc.body()
    return web.json_response(body, status=exc.status, headers=exc.headers)


def create_app(engine, options: ServerOptions | None = None) -> web.Application:
    return OpenAIServer(engine, options).app()


# ---- start-up, running, shutdown -----------------------------------------------------------------
def warmup(engine, tokens: int = 8) -> tuple[int, float]:
    """One short greedy request through the whole engine: a prefill of `tokens` prompt tokens and one decode step, so
    the request path's own first-call costs (scheduler, sampler, detokenizer, streaming) are paid before the server
    says ready. The forwards themselves, of every size a request can reach, and the memory check of the largest ones
    already ran when the engine started (runtime/verify.py). Returns (tokens, seconds)."""
    tokens = max(1, min(tokens, engine.runtime.context_length - 2, engine.runtime.runner.kv_pool.num_slots - 2))
    rng = random.Random(0)
    ids = [rng.randrange(min(engine.runtime.vocab_size, 1000) - 1) + 1 for _ in range(tokens)]
    t0 = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params={"max_tokens": 2, "temperature": 0.0, "ignore_eos": True})
    return tokens, time.perf_counter() - t0


async def start_site(server: OpenAIServer, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Start listening; -> (runner, base url). Port 0 picks a free port."""
    runner = web.AppRunner(server.app(), handler_cancellation=True, shutdown_timeout=2.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    bound_host, bound_port = bound[0], bound[1]
    shown = host if host not in ("0.0.0.0", "::", "") else bound_host
    if ":" in shown:
        shown = f"[{shown}]"
    return runner, f"http://{shown}:{bound_port}"


def run_server(engine, options: ServerOptions, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then stop listening, abort what is in flight and shut the engine down."""
    server = OpenAIServer(engine, options)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread / not POSIX
                pass
        runner, url = await start_site(server, options.host, options.port)
        try:
            if on_ready is not None:
                on_ready(url)
            await stop.wait()
            logger.info("shutting down: %d requests in flight", server.metrics.in_flight)
            for site in list(runner.sites):
                await site.stop()  # stop listening; open connections stay to get their last events
            left = await server.drain()
            if left:
                logger.warning("%d requests still in flight at shutdown; their connections are closed", left)
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


class ServerThread:
    """The server on a background thread with its own loop (tests, `chat` helpers): `.url`, `.stop()`."""

    def __init__(self, engine, options: ServerOptions | None = None):
        self.options = options or ServerOptions(port=0)
        self.server = OpenAIServer(engine, self.options)
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="ktlite-http", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner, self.url = self._loop.run_until_complete(
                start_site(self.server, self.options.host, self.options.port))
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def start(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
