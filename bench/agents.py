"""Agent-session benchmark: a coding agent's multi-turn session against `ktlite serve`, turn by turn.

A coding agent resends its whole prompt every turn: system instructions, tool definitions, the history.
This bench replays such a session (bench/_agent_session.py: a coding agent's instructions, twelve JSON-schema
tools and project documentation sized to --prefix-tokens, then turns that each append the assistant's reply
with a tool call, the tool's result and a user message) through the Anthropic Messages API and the OpenAI
chat API, streamed, and reports per turn: prompt tokens, cached tokens (what the prefix cache served:
`cache_read_input_tokens` / `prompt_tokens_details.cached_tokens`), time to first token and decode tok/s.

Targets (issue: agent sessions), checked and printed per API: from turn 2 on, cached >= 95 % of the prompt
and TTFT <= 10 % of turn 1's. The exit status is 1 when a target is missed.

With --claude-code / --codex it also drives the real CLIs (`claude -p`, then `claude -p --continue`;
`codex exec`, then `codex exec resume --last`) through a recording proxy that reads the same figures from
the streams they receive. A CLI that is not installed is reported as such (never skipped silently):
    npm install -g @anthropic-ai/claude-code @openai/codex

    python bench/agents.py --tiny                          # in-process tiny random model (qwen3_moe)
    python bench/agents.py --tiny --tiny-arch qwen3_next   # recurrent layers: turns resume from state snapshots
    python bench/agents.py --tiny --claude-code --codex --write
    python bench/agents.py --url http://127.0.0.1:30000 --served-model NAME --prefix-tokens 18000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _agent_session import STEPS, Session  # noqa: E402

CACHED_TARGET = 0.95  # from turn 2 on: cached share of the prompt at least this
TTFT_TARGET = 0.10  # from turn 2 on: TTFT at most this share of turn 1's


# ---- reading a streamed reply ----------------------------------------------------------------------------------
@dataclass
class StreamStats:
    """Usage and timings of one generation request, read from the SSE events (or JSON body) the client receives.

    Understands Anthropic messages (message_start / content_block_delta / message_delta), OpenAI chat chunks and
    OpenAI Responses events (response.*.delta, response.completed)."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None  # first generated text/arguments
    last: float | None = None  # the last event after that
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""

    def feed(self, event: dict[str, Any]) -> None:
        now = time.perf_counter()
        piece = _generated_piece(event)
        if piece is not None:
            self.first = self.first or now
            self.text += piece
        if self.first is not None:
            self.last = now  # the stream's end, not its last text: detokenized text can arrive in bursts
        self._usage(event)

    def _usage(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start":  # Anthropic: input_tokens is the part that was prefilled
            u = event["message"].get("usage") or {}
            self.cached_tokens = u.get("cache_read_input_tokens") or 0
            self.prompt_tokens = (u.get("input_tokens") or 0) + self.cached_tokens + (
                u.get("cache_creation_input_tokens") or 0)
        elif kind == "message_delta":
            self.output_tokens = (event.get("usage") or {}).get("output_tokens", self.output_tokens)
        elif kind == "response.completed":  # Responses: input_tokens is the whole prompt
            u = event["response"].get("usage") or {}
            self.prompt_tokens = u.get("input_tokens", 0)
            self.cached_tokens = (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
            self.output_tokens = u.get("output_tokens", 0)
        elif isinstance(event.get("usage"), dict) and "prompt_tokens" in event["usage"]:  # OpenAI chat/completions
            u = event["usage"]
            self.prompt_tokens = u["prompt_tokens"]
            self.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.output_tokens = u.get("completion_tokens", 0)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def decode_tok_s(self) -> float | None:
        if self.first is None or self.last is None or self.last <= self.first or self.output_tokens < 2:
            return None
        return (self.output_tokens - 1) / (self.last - self.first)


def _generated_piece(event: dict[str, Any]) -> str | None:
    """The generated text (or tool-call arguments) an event carries, or None."""
    kind = event.get("type", "")
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        return delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
    if kind.startswith("response.") and kind.endswith(".delta"):
        return event.get("delta") or ""
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return delta.get("content") or ""
        if choice.get("text"):
            return choice["text"]
    return None


class SSEParser:
    """Feeds the JSON of each `data:` line of a byte stream to a StreamStats."""

    def __init__(self, stats: StreamStats):
        self.stats, self.buffer = stats, b""

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                try:
                    self.stats.feed(json.loads(line[5:]))
                except ValueError:
                    pass


# ---- the scripted session --------------------------------------------------------------------------------------
@dataclass
class TurnRow:
    client: str
    turn: int
    stats: StreamStats
    status: int = 200
    label: str = ""


ROUTES = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}


async def send(session: aiohttp.ClientSession, url: str, api: str, body: dict[str, Any],
               api_key: str | None) -> tuple[int, StreamStats]:
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization" if api == "openai" else "x-api-key"] = (
            f"Bearer {api_key}" if api == "openai" else api_key)
    stats = StreamStats()
    parser = SSEParser(stats)
    async with session.post(url + ROUTES[api], json=body, headers=headers) as resp:
        async for chunk in resp.content.iter_any():
            parser.feed(chunk)
        parser.feed(b"\n")
        return resp.status, stats


async def count_prompt_tokens(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int | None:
    """The prompt's tokens by /v1/messages/count_tokens (leaves the cache alone), or None where there is none."""
    body = {k: v for k, v in body.items() if k in ("model", "system", "tools", "messages")}
    try:
        async with session.post(url + "/v1/messages/count_tokens", json=body) as resp:
            return (await resp.json())["input_tokens"] if resp.status == 200 else None
    except (aiohttp.ClientError, ValueError, KeyError):
        return None


async def size_context(session: aiohttp.ClientSession, url: str, model: str | None, prefix_tokens: int) -> int:
    """Characters of project documentation that bring the first prompt to about `prefix_tokens` tokens."""
    probe = 40_000
    bare = await count_prompt_tokens(session, url, Session("anthropic", "probe", 0, 1).body(model))
    full = await count_prompt_tokens(session, url, Session("anthropic", "probe", probe, 1).body(model))
    if bare is None or full is None:
        print("  note: the server has no /v1/messages/count_tokens; sizing by 4 characters per token", flush=True)
        return max(0, prefix_tokens * 4 - 12_000)
    per_char = (full - bare) / probe
    return max(0, int((prefix_tokens - bare) / per_char))


async def run_session(url: str, api: str, model: str | None, context_chars: int, turns: int, max_tokens: int,
                      api_key: str | None) -> list[TurnRow]:
    session = Session(api, uuid.uuid4().hex[:12], context_chars, max_tokens)
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        for turn in range(1, turns + 1):
            status, stats = await send(http, url, api, session.body(model), api_key)
            rows.append(TurnRow(api, turn, stats, status))
            print(f"  {api} turn {turn}: {_row_line(rows[-1])}", flush=True)
            if status != 200 or turn == turns:
                break
            session.advance(stats.text, turn, STEPS[(turn - 1) % len(STEPS)])
    return rows


def _row_line(row: TurnRow) -> str:
    s = row.stats
    if row.status != 200:
        return f"HTTP {row.status}"
    ttft = f"{s.ttft * 1e3:.0f} ms" if s.ttft is not None else "n/a"
    return f"prompt {s.prompt_tokens}, cached {s.cached_tokens}, TTFT {ttft}, {s.output_tokens} tokens out"


# ---- the real CLIs, through a recording proxy --------------------------------------------------------------------
class RecordingProxy:
    """Forwards every request to the server unchanged and records each generation request's StreamStats."""

    def __init__(self, upstream: str):
        self.upstream, self.records = upstream.rstrip("/"), []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        return self.url

    async def stop(self) -> None:
        await self._http.close()
        await self._runner.cleanup()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        stats = StreamStats()
        async with self._http.request(request.method, self.upstream + request.path_qs, data=body,
                                      headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in ("content-length", "transfer-encoding")})
            await resp.prepare(request)
            parser, raw = SSEParser(stats), b""
            try:
                async for chunk in up.content.iter_any():
                    parser.feed(chunk)
                    if not up.headers.get("content-type", "").startswith("text/event-stream"):
                        raw += chunk
                    await resp.write(chunk)
                await resp.write_eof()
            except ConnectionError:  # the CLI went away (e.g. killed at --cli-timeout): keep what was measured
                pass
            parser.feed(b"\n")
            if raw:
                try:
                    stats.feed(json.loads(raw))
                except ValueError:
                    pass
        if request.method == "POST" and request.path in ("/v1/messages", "/v1/responses", "/v1/chat/completions"):
            self.records.append((request.path, up.status, stats))
        return resp


async def drive_cli(cli: str, binary: str, proxy: RecordingProxy, model: str, workdir: Path, timeout: float,
                    max_output: int | None) -> tuple[list[TurnRow], list[str]]:
    """Two turns of a real CLI in `workdir`; -> (one row per generation request, the CLI's exit lines)."""
    env = {**os.environ}
    if cli == "claude-code":
        env.update(ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY="ktlite", DISABLE_TELEMETRY="1",
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
        if max_output:  # a reply that reaches this cap makes Claude Code exit 1 ("exceeded the ... maximum")
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output)
        commands = [[binary, "-p", "What is in a.txt?", "--model", model],
                    [binary, "-p", "--continue", "And in b.txt?", "--model", model]]
    else:
        home = workdir / ".codex-home"
        home.mkdir(exist_ok=True)
        (home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "ktlite"\n\n[model_providers.ktlite]\nname = "ktlite"\n'
            f'base_url = "{proxy.url}/v1"\nwire_api = "responses"\nenv_key = "KTLITE_API_KEY"\n')
        env.update(CODEX_HOME=str(home), KTLITE_API_KEY="ktlite")
        exec_ = [binary, "exec", "--skip-git-repo-check", "-s", "danger-full-access"]  # its sandbox needs namespaces
        commands = [[*exec_, "What is in a.txt?"], [*exec_, "resume", "--last", "And in b.txt?"]]
    rows, outcomes = [], []
    for turn, command in enumerate(commands, 1):
        before = len(proxy.records)
        proc = await asyncio.create_subprocess_exec(*command, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
            code: int | str = proc.returncode
        except asyncio.TimeoutError:
            proc.kill()
            out, code = b"", f"killed after {timeout:.0f} s"
        outcomes.append(f"{' '.join(command[1:])}: exit {code}; {out.decode(errors='replace').strip()[-200:]!r}")
        print(f"  {cli} turn {turn}: {outcomes[-1]}", flush=True)
        for i, (path, status, stats) in enumerate(proxy.records[before:], 1):
            rows.append(TurnRow(cli, turn, stats, status, label=f"{path} #{i}"))
    return rows, outcomes


# ---- report ----------------------------------------------------------------------------------------------------
def table(rows: list[TurnRow]) -> str:
    head = ("| client | turn | request | prompt tok | cached tok | cached % | TTFT ms | TTFT / turn 1 | decode tok/s "
            "| out tok |\n|---|---|---|---|---|---|---|---|---|---|\n")
    first: dict[str, float] = {}
    lines = []
    for r in rows:
        s = r.stats
        if r.status != 200:
            lines.append(f"| {r.client} | {r.turn} | {r.label or '-'} | HTTP {r.status} | | | | | | |")
            continue
        if r.turn == 1 and r.client not in first and s.ttft is not None:
            first[r.client] = s.ttft
        ratio = f"{s.ttft / first[r.client]:.3f}" if s.ttft is not None and r.client in first else "-"
        pct = f"{100 * s.cached_tokens / s.prompt_tokens:.1f}" if s.prompt_tokens else "-"
        ttft = f"{s.ttft * 1e3:.0f}" if s.ttft is not None else "-"
        rate = f"{s.decode_tok_s:.1f}" if s.decode_tok_s is not None else "-"
        lines.append(f"| {r.client} | {r.turn} | {r.label or '-'} | {s.prompt_tokens} | {s.cached_tokens} | {pct} | "
                     f"{ttft} | {ratio} | {rate} | {s.output_tokens} |")
    return head + "\n".join(lines)


def check_targets(rows: list[TurnRow]) -> tuple[list[str], bool]:
    """Per scripted API: whether turns 2+ met the cache and TTFT targets. -> (lines, all met)."""
    lines, ok = [], True
    for api in ROUTES:
        mine = [r for r in rows if r.client == api]
        if not mine:
            continue
        if any(r.status != 200 for r in mine) or len(mine) < 2 or mine[0].stats.ttft is None:
            lines.append(f"- {api}: incomplete session (an error or no text in turn 1): targets not measured")
            ok = False
            continue
        later = mine[1:]
        cached = min(r.stats.cached_tokens / r.stats.prompt_tokens for r in later)
        ttft = max((r.stats.ttft or float("inf")) / mine[0].stats.ttft for r in later)
        met = cached >= CACHED_TARGET and ttft <= TTFT_TARGET
        ok &= met
        lines.append(f"- {api}: turns 2-{len(mine)}: cached >= {CACHED_TARGET:.0%} of the prompt: "
                     f"{'met' if cached >= CACHED_TARGET else 'MISSED'} (lowest {cached:.1%}); TTFT <= "
                     f"{TTFT_TARGET:.0%} of turn 1's: {'met' if ttft <= TTFT_TARGET else 'MISSED'} "
                     f"(highest {ttft:.1%})")
    return lines, ok


# ---- in-process tiny server ----------------------------------------------------------------------------------------
TINY_FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 98304, "chunked_prefill_size": 4096,
              "max_running_requests": 4, "gpu_memory": "2GiB", "served_model_name": "tiny"}
TINY_CONTEXT = 131072  # as the trial: a tiny Qwen3-MoE with max_position_embeddings raised
TINY_PARSERS = {"tool_call_parser": "qwen3_coder", "reasoning_parser": "qwen3"}


def tiny_model(arch: str) -> str:
    """A tiny random model of `arch` with a chat template that renders tools (tests/chat_templates.py's MAPPING)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from chat_templates import MAPPING, with_template

    from ktlite.runtime.tiny_model import write_tiny_model

    root = Path("/tmp/ktlite-tiny-agents")
    base = root / arch
    if not (base / "config.json").is_file():
        write_tiny_model(base, arch, seed=1)
    return str(with_template(base, root / f"{arch}-with-tools", MAPPING, context=TINY_CONTEXT))


# ---- main ------------------------------------------------------------------------------------------------------------
async def bench(url: str, args: argparse.Namespace) -> tuple[list[TurnRow], list[str]]:
    async with aiohttp.ClientSession() as http:
        chars = await size_context(http, url, args.served_model, args.prefix_tokens)
    print(f"project context: {chars} characters for a ~{args.prefix_tokens}-token first prompt", flush=True)
    rows: list[TurnRow] = []
    for api in args.apis.split(","):
        rows += await run_session(url, api, args.served_model, chars, args.turns, args.max_tokens, args.api_key)
    notes = []
    for cli, flag, binary_name, explicit in (("claude-code", args.claude_code, "claude", args.claude_bin),
                                             ("codex", args.codex, "codex", args.codex_bin)):
        if not flag:
            continue
        binary = explicit or shutil.which(binary_name)
        if binary is None:
            notes.append(f"- {cli}: not installed (`{binary_name}` is not on PATH; npm install -g "
                         f"{'@anthropic-ai/claude-code' if cli == 'claude-code' else '@openai/codex'}): not run")
            print(notes[-1], flush=True)
            continue
        version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
        proxy = RecordingProxy(url)
        await proxy.start()
        try:
            with tempfile.TemporaryDirectory(prefix=f"agents-{cli}-") as tmp:
                work = Path(tmp)
                (work / "a.txt").write_text("alpha\n")
                (work / "b.txt").write_text("beta\n")
                cli_rows, outcomes = await drive_cli(cli, binary, proxy, args.served_model or "default", work,
                                                     args.cli_timeout, args.cli_max_tokens)
        finally:
            await proxy.stop()
        rows += cli_rows
        notes.append(f"- {cli} {version}: " + "; ".join(outcomes))
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="A running server (http://127.0.0.1:PORT).")
    ap.add_argument("--tiny", action="store_true", help="In-process engine + server on a tiny random model.")
    ap.add_argument("--tiny-arch", default="qwen3_moe",
                    help="--tiny's family: qwen3_moe (attention only), qwen3_next (recurrent layers: the prefix cache "
                         "restores state snapshots), or another of ktlite tiny-model's --arch values.")
    ap.add_argument("--served-model", default=None, help="The 'model' field to send (--tiny: tiny).")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--apis", default="anthropic,openai", help="Scripted sessions: anthropic, openai or both.")
    ap.add_argument("--prefix-tokens", type=int, default=18000, help="Tokens of the first prompt (system + tools).")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32, help="Reply tokens per scripted turn.")
    ap.add_argument("--claude-code", action="store_true", help="Also drive the real Claude Code CLI (two turns).")
    ap.add_argument("--codex", action="store_true", help="Also drive the real Codex CLI (two turns).")
    ap.add_argument("--claude-bin", default=None, help="The claude executable (default: from PATH).")
    ap.add_argument("--codex-bin", default=None, help="The codex executable (default: from PATH).")
    ap.add_argument("--cli-timeout", type=float, default=900.0, help="Seconds a CLI turn may take.")
    ap.add_argument("--cli-max-tokens", type=int, default=None,
                    help="Claude Code's reply cap (CLAUDE_CODE_MAX_OUTPUT_TOKENS; default: its own, 32000). A reply "
                         "that reaches it is an error to Claude Code. Codex has none.")
    ap.add_argument("--write", action="store_true", help="Replace this bench's section of bench/RESULTS.md.")
    args = ap.parse_args(argv)
    if bool(args.url) == bool(args.tiny):
        ap.error("give exactly one of --url, --tiny")

    if args.url:
        rows, notes = asyncio.run(bench(args.url, args))
        setup = f"Server: {args.url}"
    else:
        from ktlite import Engine
        from ktlite.server import ServerOptions, ServerThread

        args.served_model = args.served_model or "tiny"
        t0 = time.perf_counter()
        with Engine(tiny_model(args.tiny_arch), **TINY_FLAGS) as engine:
            print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
            with ServerThread(engine, ServerOptions(port=0, **TINY_PARSERS)) as srv:
                rows, notes = asyncio.run(bench(srv.url, args))
        setup = (f"In-process tiny random {args.tiny_arch} (context {TINY_CONTEXT}), engine flags {json.dumps(TINY_FLAGS)}, "
                 f"--tool-call-parser {TINY_PARSERS['tool_call_parser']} --reasoning-parser "
                 f"{TINY_PARSERS['reasoning_parser']}")
    target_lines, ok = check_targets(rows)
    # here, not at the top: tests import this module from its file, without bench/ on sys.path
    from _results_page import section, write_section

    body = (f"{setup}. Scripted sessions: {args.turns} turns, first prompt ~{args.prefix_tokens} tokens, "
            f"{args.max_tokens}-token greedy replies. TTFT is the client's (first streamed text); decode tok/s over "
            f"the rest of the stream.\n\n{table(rows)}\n\nTargets (turn 2 on):\n" + "\n".join(target_lines)
            + ("\n\nReal CLIs:\n" + "\n".join(notes) if notes else ""))
    text = section("agents", "Agent sessions (bench/agents.py)", body)
    print()
    print(text)
    if args.write:
        write_section("agents", text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
