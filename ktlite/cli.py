"""`ktlite` command line: serve, chat, generate, plan, convert, tiny-model, bench, version.

`serve`, `chat` and `generate` share one set of engine flags, spelled as SGLang/KTransformers spell
them, so a launch script moves over with only the command name changed. Flags that make no
difference to ktlite are accepted with one info line each.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from ktlite import __version__

logger = logging.getLogger("ktlite.cli")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


# `ktlite tiny-model --arch` names (each family's TINY_CONFIGS)
_TINY_ARCHS = ["deepseek_v3", "deepseek_v2", "deepseek_v32", "glm_moe_dsa", "qwen3_moe", "minimax_m2", "glm4_moe"]


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """ktlite: MoE inference (DeepSeek-V2/V3, Kimi-K2, Qwen3-MoE, MiniMax-M2, GLM-4.5) with CPU experts and GPU attention."""
    _setup_logging(verbose)


@main.command("tiny-model")
@click.argument("path", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(_TINY_ARCHS), default="deepseek_v3", show_default=True,
              help="Model family of the checkpoint.")
@click.option("--fp8", is_flag=True, help="Store linear weights as block-scaled float8_e4m3fn (as DeepSeek-V3, MiniMax-M2 and Qwen3 FP8 checkpoints do).")
@click.option("--seed", type=int, default=0, show_default=True)
def tiny_model(path: Path, arch: str, fp8: bool, seed: int) -> None:
    """Write a small random HF-format checkpoint (with tokenizer and chat template) to PATH."""
    from ktlite.runtime.tiny_model import write_tiny_model

    write_tiny_model(path, arch, fp8=fp8, seed=seed)
    click.echo(f"wrote {arch} tiny checkpoint to {path}")


# ---- engine flags shared by serve / generate / chat ---------------------------------------------
# (decls, EngineConfig field, click kwargs). Defaults are None: a flag not given keeps EngineConfig's.
_ENGINE_FLAGS: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
    (("--served-model-name",), "served_model_name", dict(type=str, help="Name in /v1/models and responses (default: the folder name).")),
    (("--device",), "device", dict(type=str, help="Device for attention/dense: auto, cuda, cuda:N or cpu.")),
    (("--dtype",), "dtype", dict(type=click.Choice(["auto", "bfloat16", "float16", "float32"]), help="Activation/weight dtype on the device side.")),
    (("--kv-cache-dtype",), "kv_cache_dtype", dict(type=str, help="KV cache dtype (auto: the activation dtype).")),
    (("--weight-dtype",), "weight_dtype", dict(type=click.Choice(["auto", "fp8"]), help="Block-FP8 checkpoints: auto keeps FP8 on CUDA and dequantizes on CPU; fp8 keeps FP8 anywhere.")),
    (("--random-seed", "--seed"), "seed", dict(type=int, help="Engine seed (expert placement; requests bring their own).")),
    (("--gpu-memory",), "gpu_memory", dict(type=str, help="Plan against this much device memory (e.g. 24GiB) instead of what the device reports.")),
    (("--mem-fraction-static",), "mem_fraction_static", dict(type=float, help="Fraction of device memory for weights, GPU experts and KV pool [0.80].")),
    (("--max-total-tokens",), "max_total_tokens", dict(type=int, help="KV pool size in tokens (default: what the memory plan allows).")),
    (("--chunked-prefill-size",), "chunked_prefill_size", dict(type=int, help="Most new prompt tokens per prefill step; -1: no chunking [8192].")),
    (("--max-running-requests",), "max_running_requests", dict(type=int, help="Most requests decoding together [64].")),
    (("--max-queued-requests",), "max_queued_requests", dict(type=int, help="Most requests waiting beyond the running ones; more get 503 (default: unbounded).")),
    (("--context-length",), "context_length", dict(type=int, help="Override the model's context length.")),
    (("--enable-mixed-chunk",), "enable_mixed_chunk", dict(is_flag=True, default=None, help="Let decodes ride in prefill batches.")),
    (("--kt-method", "--kt-amx-method"), "kt_method", dict(type=str, help="CPU expert format: INT4, INT8, BF16 (AMXINT4/AMXINT8/LLAMAFILE/MOE_INT4... accepted as aliases) [INT4].")),
    (("--kt-group-size",), "kt_group_size", dict(type=int, help="Quantization group size of CPU experts [64].")),
    (("--kt-weight-path", "--kt-amx-weight-path"), "kt_weight_path", dict(type=str, help="Folder of pre-converted CPU expert weights (`ktlite convert`).")),
    (("--kt-cpuinfer",), "kt_cpuinfer", dict(type=int, help="CPU threads for the experts (capped at the cores numba sees).")),
    (("--kt-threadpool-count",), "kt_threadpool_count", dict(type=int, help="Expert thread pools (one per NUMA node) [1].")),
    (("--kt-num-gpu-experts",), "kt_num_gpu_experts", dict(type=int, help="Routed experts per MoE layer kept on the GPU [0].")),
    (("--kt-gpu-experts-ratio",), "kt_gpu_experts_ratio", dict(type=float, help="Fraction of routed experts on the GPU (wins over the count).")),
    (("--kt-gpu-prefill-token-threshold",), "kt_gpu_prefill_token_threshold", dict(type=int, help="Prefills of at least this many tokens run all experts on the GPU, layer by layer.")),
    (("--kt-enable-dynamic-expert-update",), "kt_enable_dynamic_expert_update", dict(is_flag=True, default=None, help="Move hot experts to the GPU while serving.")),
    (("--kt-expert-update-interval",), "kt_expert_update_interval", dict(type=int, help="Steps between dynamic expert updates [32].")),
    (("--kt-expert-placement-strategy",), "kt_expert_placement_strategy", dict(type=str, help="Initial GPU expert choice: uniform, frequency, ... [uniform].")),
    (("--init-expert-location",), "init_expert_location", dict(type=str, help="Expert statistics file to place GPU experts from.")),
    (("--record-expert-distribution",), "record_expert_distribution", dict(type=str, help="Write expert routing statistics to this file at shutdown.")),
    (("--kt-max-deferred-experts-per-token",), "kt_max_deferred_experts_per_token", dict(type=int, help="Defer this many CPU experts per token to the next layer [0].")),
    (("--tensor-parallel-size", "--tp-size", "--tp"), "tensor_parallel_size", dict(type=int, help="GPUs to shard attention/dense over [1].")),
]

# Flags that change nothing in ktlite: accepted, with one info line each when given.
_NOOP_FLAGS: list[tuple[str, dict[str, Any], str]] = [
    ("--trust-remote-code", dict(is_flag=True), "ktlite reads config.json itself and runs no code from the checkpoint"),
    ("--attention-backend", dict(type=str), "ktlite always uses its own MLA kernels (Triton on GPU, torch on CPU)"),
    ("--enable-p2p-check", dict(is_flag=True), "ktlite does not use peer-to-peer GPU copies"),
    ("--disable-shared-experts-fusion", dict(is_flag=True), "ktlite runs the shared experts as their own GPU MLP, never fused into the routed ones"),
    ("--tool-call-parser", dict(type=str), "tools are passed to the chat template; tool calls are not parsed out of the text yet"),
    ("--reasoning-parser", dict(type=str), "reasoning text is returned as ordinary content"),
    ("--disable-cuda-graph", dict(is_flag=True), "ktlite does not capture CUDA graphs yet"),
    ("--cuda-graph-max-bs", dict(type=int), "ktlite does not capture CUDA graphs yet"),
    ("--disable-radix-cache", dict(is_flag=True), "ktlite has no prefix cache yet"),
    ("--enable-metrics", dict(is_flag=True), "/metrics is always on"),
]

_ENGINE_FIELDS = [field for _, field, _ in _ENGINE_FLAGS]
_NOOP_DESTS = [flag.lstrip("-").replace("-", "_") for flag, _, _ in _NOOP_FLAGS]


def engine_options(model_required: bool = True):
    """Decorator: the model path plus every engine flag; the command receives `engine_flags` (dict of the
    flags given, EngineConfig field names) and `model_path`."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            flags = {f: kwargs.pop(f) for f in _ENGINE_FIELDS}
            flags = {k: v for k, v in flags.items() if v is not None and v is not False}
            for (flag, _, why), dest in zip(_NOOP_FLAGS, _NOOP_DESTS):
                value = kwargs.pop(dest)
                if value not in (None, False):
                    shown = flag if value is True else f"{flag} {value}"
                    logger.info("%s: accepted, no effect (%s)", shown, why)
            model_path = kwargs.pop("model_path")
            if model_path is not None:
                model_path = _resolve_model_path(model_path)
            return fn(*args, model_path=model_path, engine_flags=flags, **kwargs)

        for flag, opts, _ in reversed(_NOOP_FLAGS):
            wrapper = click.option(flag, default=None, hidden=False, help=f"Accepted for SGLang compatibility; no effect.", **opts)(wrapper)
        for decls, field, opts in reversed(_ENGINE_FLAGS):
            wrapper = click.option(*decls, field, default=None, **opts)(wrapper) if "default" not in opts else \
                click.option(*decls, field, **opts)(wrapper)
        wrapper = click.option("--model-path", "--model", "model_path", required=model_required, type=str,
                               help="HF checkpoint folder (config.json, *.safetensors, tokenizer.json); "
                                    "'tiny' builds a small random demo model.")(wrapper)
        return wrapper

    return decorate


def _resolve_model_path(path: str) -> str:
    if os.path.isdir(path) or not path.startswith("tiny"):
        return path
    # "tiny" / "tiny:deepseek_v2": a cached random demo checkpoint (random text, for demos and smoke tests)
    arch = path.split(":", 1)[1] if ":" in path else "deepseek_v3"
    if arch not in _TINY_ARCHS:
        raise click.BadParameter(f"unknown tiny architecture {arch!r} (one of {', '.join(_TINY_ARCHS)})",
                                 param_hint="--model-path")
    cache = Path(os.environ.get("KTLITE_CACHE", Path.home() / ".cache" / "ktlite")) / f"tiny-{arch}"
    if not (cache / "config.json").is_file():
        from ktlite.runtime.tiny_model import write_tiny_model

        write_tiny_model(cache, arch)
    logger.info("--model-path %s: the tiny random %s demo checkpoint at %s (its replies are random text)", path, arch, cache)
    return str(cache)


def _make_engine(model_path: str, flags: dict[str, Any]):
    from ktlite import Engine
    from ktlite.errors import KtliteError

    try:
        return Engine(model_path, **flags)
    except KtliteError as exc:
        raise click.ClickException(str(exc)) from exc


# ---- serve ---------------------------------------------------------------------------------------
@main.command()
@engine_options()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 for all).")
@click.option("--port", default=30000, show_default=True, type=int, help="Port (0: any free port).")
@click.option("--api-key", default=None, envvar="KTLITE_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*.")
@click.option("--skip-server-warmup", is_flag=True, help="Skip the start-up prefill of --chunked-prefill-size tokens.")
@click.option("--max-request-bytes", type=click.IntRange(min=1024), default=8 * 2**20, show_default=True,
              help="Largest request body; bigger ones get 413.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False), default=None)
def serve(model_path: str, engine_flags: dict[str, Any], host: str, port: int, api_key: str | None,
          skip_server_warmup: bool, max_request_bytes: int, log_level: str | None) -> None:
    """OpenAI-compatible HTTP server (chat/completions, models, health, metrics)."""
    if log_level:
        logging.getLogger().setLevel(log_level.upper())
    from ktlite.server.app import ServerOptions, run_server, warmup

    t0 = time.perf_counter()
    engine = _make_engine(model_path, engine_flags)
    click.echo(f"loaded {model_path} in {time.perf_counter() - t0:.1f} s")
    options = ServerOptions(host=host, port=port, api_key=api_key, max_request_bytes=max_request_bytes)
    try:
        if not skip_server_warmup:
            n, secs = warmup(engine)
            click.echo(f"warmup: one prefill of {n} tokens in {secs:.2f} s")
    except BaseException:
        engine.shutdown()
        raise

    def ready(url: str) -> None:
        click.echo(f"ktlite listening on {url} (model '{engine.config.served_model_name or Path(model_path).resolve().name}'"
                   f"{', API key required' if api_key else ''}); Ctrl-C to stop")
        sys.stdout.flush()

    try:
        run_server(engine, options, on_ready=ready)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc} (pick another --port)") from exc
    click.echo("ktlite stopped")
    if sys.stdout is sys.__stdout__:  # a real process (not click's test runner): skip the slow interpreter teardown
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)  # the engine is shut down and the port released; native thread pools take seconds to unwind


# ---- generate ------------------------------------------------------------------------------------
def _sampling_options(fn):
    fn = click.option("--max-tokens", type=int, default=None, help="Most new tokens.")(fn)
    fn = click.option("--temperature", type=float, default=None, help="0 = greedy.")(fn)
    fn = click.option("--top-p", type=float, default=None)(fn)
    fn = click.option("--top-k", type=int, default=None)(fn)
    fn = click.option("--sampling-seed", "sampling_seed", type=int, default=None, help="Seed of the request's sampler.")(fn)
    return fn


def _sampling_dict(max_tokens, temperature, top_p, top_k, seed, defaults: dict[str, Any]) -> dict[str, Any]:
    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    return {**defaults, **{k: v for k, v in given.items() if v is not None}}


@main.command()
@click.argument("prompt")
@engine_options()
@click.option("--chat/--raw", default=True, show_default=True, help="Wrap PROMPT in the model's chat template.")
@_sampling_options
def generate(prompt: str, model_path: str, engine_flags: dict[str, Any], chat: bool, max_tokens, temperature,
             top_p, top_k, sampling_seed) -> None:
    """Generate a reply to PROMPT (greedy by default) and print it with timing."""
    from ktlite.errors import RequestError

    t0 = time.perf_counter()
    engine = _make_engine(model_path, engine_flags)
    load_s = time.perf_counter() - t0
    params = _sampling_dict(max_tokens, temperature, top_p, top_k, sampling_seed, {"max_tokens": 32, "temperature": 0.0})
    try:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else engine.tokenizer.encode(prompt)
        t1 = time.perf_counter()
        result = engine.generate(input_ids=ids, sampling_params=params)
        gen_s = time.perf_counter() - t1
    except RequestError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        engine.shutdown()
    click.echo(f"prompt ({len(ids)} tokens): {prompt}")
    click.echo(f"reply ({result.completion_tokens} tokens, {result.finish_reason}): {result.text}")
    click.echo(f"load {load_s:.2f} s, generate {gen_s * 1000:.0f} ms ({result.completion_tokens / max(gen_s, 1e-9):.1f} tok/s)")


# ---- chat ----------------------------------------------------------------------------------------
_CHAT_HELP = "commands: /clear (forget the history), /system TEXT (set the system prompt), /exit"


@main.command()
@engine_options(model_required=False)
@click.option("--url", default=None, help="Talk to a running server (e.g. http://127.0.0.1:30000) instead of a local engine.")
@click.option("--api-key", default=None, envvar="KTLITE_API_KEY", help="Bearer key for --url.")
@click.option("--system", "system_prompt", default=None, help="System prompt.")
@_sampling_options
def chat(model_path: str | None, engine_flags: dict[str, Any], url: str | None, api_key: str | None,
         system_prompt: str | None, max_tokens, temperature, top_p, top_k, sampling_seed) -> None:
    """Interactive chat with history; streams the reply. Reads stdin line by line (pipe-friendly)."""
    if (url is None) == (model_path is None):
        raise click.UsageError("give either --model-path (a local engine) or --url (a running server)")
    params = _sampling_dict(max_tokens, temperature, top_p, top_k, sampling_seed, {"max_tokens": 256, "temperature": 0.6, "top_p": 0.95})
    if url:
        backend: _ChatBackend = _RemoteChat(url.rstrip("/"), api_key, params)
    else:
        backend = _LocalChat(_make_engine(model_path, engine_flags), params)
    interactive = sys.stdin.isatty()
    history: list[dict[str, str]] = []
    loop = asyncio.new_event_loop()
    try:
        click.echo(f"ktlite chat with {backend.name} ({_CHAT_HELP})")
        while True:
            try:
                line = input(">>> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            if not interactive and line == "":
                break  # EOF
            line = line.strip()
            if not line:
                continue
            if line in ("/exit", "/quit", "/bye"):
                break
            if line == "/clear":
                history.clear()
                click.echo("(history cleared)")
                continue
            if line.startswith("/system"):
                system_prompt = line[len("/system"):].strip() or None
                click.echo(f"(system prompt {'set' if system_prompt else 'cleared'})")
                continue
            if line in ("/help", "/?"):
                click.echo(_CHAT_HELP)
                continue
            history.append({"role": "user", "content": line})
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + history
            if not interactive:
                click.echo(f">>> {line}")
            try:
                reply = loop.run_until_complete(backend.reply(messages))
            except KeyboardInterrupt:
                reply = None
                click.echo("\n(interrupted)")
            except click.ClickException as exc:
                history.pop()
                click.echo(f"error: {exc.message}", err=True)
                continue
            if reply is None:
                history.pop()
            else:
                history.append({"role": "assistant", "content": reply})
    finally:
        loop.run_until_complete(backend.close())
        loop.close()


class _ChatBackend:
    name = ""

    async def reply(self, messages: list[dict[str, str]]) -> str:
        raise NotImplementedError

    async def close(self) -> None:
        pass


def _print_delta(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class _LocalChat(_ChatBackend):
    def __init__(self, engine, params: dict[str, Any]):
        self.engine, self.params = engine, params
        self.name = Path(engine.config.model_path).name

    async def reply(self, messages):
        from ktlite.errors import RequestError

        try:
            ids = self.engine.tokenizer.encode_chat(messages)
            room = self.engine.runtime.context_length - len(ids)
            params = {**self.params, "max_tokens": max(1, min(self.params["max_tokens"], room))}
            parts = []
            agen = self.engine.stream(input_ids=ids, sampling_params=params)
            try:
                async for event in agen:
                    parts.append(event.text)
                    _print_delta(event.text)
            finally:
                await agen.aclose()
        except RequestError as exc:
            raise click.ClickException(str(exc)) from exc
        _print_delta("\n")
        return "".join(parts)

    async def close(self):
        self.engine.shutdown()


class _RemoteChat(_ChatBackend):
    def __init__(self, url: str, api_key: str | None, params: dict[str, Any]):
        self.url, self.params = url, params
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = None
        self.model: str | None = None
        self.name = url

    async def _session(self):
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(headers=self.headers, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
            try:
                async with self.session.get(self.url + "/v1/models") as r:
                    body = await r.json(content_type=None)
                    if r.status != 200:
                        raise click.ClickException(f"{self.url}/v1/models: HTTP {r.status}: {body.get('error', {}).get('message', body)}")
                    self.model = body["data"][0]["id"]
            except aiohttp.ClientError as exc:
                raise click.ClickException(f"cannot reach {self.url}: {exc}") from exc
        return self.session

    async def reply(self, messages):
        import aiohttp

        session = await self._session()
        body = {"model": self.model, "messages": messages, "stream": True, **self.params}
        parts: list[str] = []
        try:
            async with session.post(self.url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    err = await r.json(content_type=None)
                    raise click.ClickException(f"HTTP {r.status}: {err.get('error', {}).get('message', err)}")
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        raise click.ClickException(obj["error"].get("message", str(obj)))
                    for choice in obj.get("choices", []):
                        text = choice.get("delta", {}).get("content") or ""
                        parts.append(text)
                        _print_delta(text)
        except aiohttp.ClientError as exc:
            raise click.ClickException(f"connection to {self.url} failed: {exc}") from exc
        _print_delta("\n")
        return "".join(parts)

    async def close(self):
        if self.session is not None:
            await self.session.close()


# ---- bench ---------------------------------------------------------------------------------------
def _bench_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "bench"


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("name", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(name: str | None, args: tuple[str, ...]) -> None:
    """Run bench/NAME.py with ARGS (no NAME: list the benchmarks)."""
    folder = _bench_dir()
    scripts = sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_")) if folder.is_dir() else []
    if name is None:
        if not scripts:
            click.echo(f"no benchmarks found under {folder}")
            return
        click.echo(f"benchmarks in {folder} (run: ktlite bench NAME [ARGS]...):")
        for s in scripts:
            click.echo(f"  {s}")
        return
    name = name[:-3] if name.endswith(".py") else name
    if name not in scripts:
        raise click.ClickException(f"no benchmark {name!r} under {folder}; have: {', '.join(scripts) or 'none'}")
    rc = subprocess.call([sys.executable, str(folder / f"{name}.py"), *args])
    sys.exit(rc)

@main.command()
def version() -> None:
    """Versions of ktlite and its kernels' toolchains, CPU features and GPUs."""
    import torch

    def version_of(module: str) -> str:
        try:
            return __import__(module).__version__
        except Exception:  # noqa: BLE001 - a missing or broken toolchain is reported, not fatal
            return "not installed"

    click.echo(f"ktlite {__version__}")
    click.echo(f"python {platform.python_version()}, torch {torch.__version__}, numba {version_of('numba')}, "
               f"triton {version_of('triton')}")
    click.echo(f"cpu: {_cpu_model()}, {os.cpu_count()} logical cores ({_cpu_features()})")
    flags = _cpu_flags()
    click.echo(f"cpu experts: AVX512 {'yes' if 'avx512f' in flags else 'no'}, "
               f"AMX {'yes' if {'amx_tile', 'amx_int8'} <= flags else 'no'}")
    if torch.cuda.is_available():
        click.echo(f"cuda {torch.version.cuda}")
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            click.echo(f"gpu {i}: {props.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free), "
                       f"compute capability {props.major}.{props.minor}")
    else:
        click.echo("gpu: none (the GPU side runs on the CPU through the torch twins)")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_features() -> str:
    flags = _cpu_flags()
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"]
    return " ".join(f for f in wanted if f in flags) or "no AVX2/AVX512/AMX flags found"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@main.command()
@click.option("--model", "--model-path", "model", required=True, type=click.Path(exists=True, file_okay=False),
              help="HF folder; only its config.json is read.")
@click.option("--gpu-memory", help="Memory per GPU, e.g. 16GiB, 24GB, 800MiB [default: free memory of each CUDA GPU].")
@click.option("--mem-fraction-static", type=float, help="Fraction of GPU memory for weights + KV pool [0.80].")
@click.option("--max-total-tokens", type=int, help="KV pool size in tokens [what the static budget leaves].")
@click.option("--chunked-prefill-size", type=int, help="Prompt tokens per prefill forward, -1 = whole prompt [8192].")
@click.option("--max-running-requests", type=int, help="Requests batched together [64].")
@click.option("--context-length", type=int, help="Longest request [max_position_embeddings].")
@click.option("--kt-num-gpu-experts", type=int, help="Routed experts per MoE layer on the GPU(s) [0].")
@click.option("--kt-gpu-experts-ratio", type=float, help="Fraction of routed experts on the GPU(s); wins over the count.")
@click.option("--kt-gpu-prefill-token-threshold", type=int, help="Layerwise GPU prefill from this prompt length [off].")
@click.option("--tensor-parallel-size", type=int, help="GPUs, one table each [1].")
@click.option("--dtype", help="GPU weights: auto (fp8 for FP8 checkpoints, else bf16), fp8, bfloat16, float16, float32.")
@click.option("--kv-cache-dtype", help="auto (activation dtype), fp8_e4m3, bfloat16, float16, float32.")
def plan(model: str, **flags: object) -> None:
    """Print the GPU memory plan for --model and whether it fits (exit 1 if not)."""
    from ktlite.errors import ConfigError, PlanError
    from ktlite.runtime.memory import PlanInputs, make_plan
    from ktlite.runtime.models.config import load_config

    try:  # unset flags keep PlanInputs' defaults
        result = make_plan(load_config(model), PlanInputs(**{k: v for k, v in flags.items() if v is not None}))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    except PlanError as exc:
        click.echo(f"model: {model}\n{exc}", err=True)
        raise SystemExit(1) from exc
    click.echo(f"model: {model}\n{result.format_table()}")


@main.command()
@click.option("--model", "--model-path", "model", required=True, type=click.Path(exists=True, file_okay=False),
              help="HF checkpoint folder (bf16/fp16/fp32 or block-FP8).")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Folder for --kt-weight-path.")
@click.option("--method", default="INT4", show_default=True, help="INT4, INT8 or BF16 (KTransformers names accepted).")
@click.option("--group-size", type=int, default=64, show_default=True, help="Values per quantization group.")
def convert(model: str, output: str, method: str, group_size: int) -> None:
    """Quantize the routed experts for the CPU, layer by layer (resumable); serve with --kt-weight-path."""
    from ktlite.errors import KtliteError
    from ktlite.runtime.convert import convert_checkpoint

    try:
        manifest = convert_checkpoint(model, output, method, group_size)
    except (KtliteError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"converted experts written to {output} (manifest {manifest}); serve with --kt-weight-path {output}")


if __name__ == "__main__":
    main()
