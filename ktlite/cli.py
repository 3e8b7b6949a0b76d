"""`ktlite` command line: serve, chat, generate, plan, doctor, convert, tiny-model, bench, version.

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


def _tiny_archs() -> list[str]:
    """`ktlite tiny-model --arch` names: every family's TINY_CONFIGS (importing the families, and torch)."""
    from ktlite.runtime.models.registry import tiny_configs

    return list(tiny_configs())


class _TinyArch(click.ParamType):
    """A tiny checkpoint's family, listed from the registry only when used or shown: `ktlite --help` and the
    serving commands do not import every family for it."""

    name = "arch"

    def get_metavar(self, param: click.Parameter, ctx: click.Context) -> str:
        return "[" + "|".join(_tiny_archs()) + "]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if value not in _tiny_archs():
            self.fail(f"unknown tiny architecture {value!r} (one of {', '.join(_tiny_archs())})", param, ctx)
        return value


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """ktlite: MoE inference (the model families of the README's table) with CPU experts and GPU attention."""
    _setup_logging(verbose)


@main.command("tiny-model")
@click.argument("path", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=_TinyArch(), default="deepseek_v3", show_default=True,
              help="Model family of the checkpoint.")
@click.option("--fp8", is_flag=True, help="Store linear weights as block-scaled float8_e4m3fn (as DeepSeek-V3, MiniMax-M2 and Qwen3 FP8 checkpoints do).")
@click.option("--fp4", is_flag=True, help="Store the routed experts as FP4: e2m1 codes with an e8m0 scale per 32 (as DeepSeek-V4's checkpoints do; serve with --kt-method FP4).")
@click.option("--seed", type=int, default=0, show_default=True)
def tiny_model(path: Path, arch: str, fp8: bool, fp4: bool, seed: int) -> None:
    """Write a small random HF-format checkpoint (with tokenizer and chat template) to PATH."""
    from ktlite.runtime.tiny_model import write_tiny_model

    try:
        write_tiny_model(path, arch, fp8=fp8, fp4=fp4, seed=seed)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"wrote {arch} tiny checkpoint to {path}")


# ---- engine flags shared by serve / generate / chat ---------------------------------------------
# (decls, EngineConfig field, click kwargs). Defaults are None: a flag not given keeps EngineConfig's.
_ENGINE_FLAGS: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
    (("--served-model-name",), "served_model_name", dict(type=str, help="Name in /v1/models and responses (default: the folder name).")),
    (("--device",), "device", dict(type=str, help="Device for attention/dense: auto, cuda, cuda:N or cpu.")),
    (("--dtype",), "dtype", dict(type=click.Choice(["auto", "bfloat16", "float16", "float32"]), help="Activation/weight dtype on the device side.")),
    (("--kv-cache-dtype",), "kv_cache_dtype", dict(type=str, help="KV cache dtype: auto (the activation dtype), bfloat16, float16, float32, or fp8_e4m3 (1 byte per value, packed with fp32 scales: per 128 MLA latent values, per DSA index key, per GQA kv head).")),
    (("--weight-dtype",), "weight_dtype", dict(type=click.Choice(["auto", "fp8"]), help="Block-FP8 checkpoints: auto keeps FP8 on CUDA and dequantizes on CPU; fp8 keeps FP8 anywhere.")),
    (("--cpu-dense-method",), "cpu_dense_method", dict(type=str, help="CPU device only: the attention projections, dense MLP, shared experts and lm_head are quantized at load (INT8 or INT4, group 64) and run by the CPU expert kernels; none keeps them as torch weights in --dtype; auto: INT8, or none with --dtype float32 [auto].")),
    (("--cpu-activations",), "cpu_activations", dict(type=click.Choice(["auto", "int8", "fp32"], case_sensitive=False), help="What INT4/INT8 CPU weights (experts, --cpu-dense-method layers) multiply: int8 activations quantized per 32 values with integer dot products (as llama.cpp and kt-kernel's AMX methods; ~0.5 % relative error per matmul, 1.4-1.8x faster INT4 decode kernels on AVX2), or fp32; auto: int8 where the CPU has AVX2, fp32 with --dtype float32 [auto].")),
    (("--random-seed", "--seed"), "seed", dict(type=int, help="Engine seed (expert placement; requests bring their own).")),
    (("--gpu-memory",), "gpu_memory", dict(type=str, help="Plan against this much device memory (e.g. 24GiB) instead of what the device reports.")),
    (("--mem-fraction-static",), "mem_fraction_static", dict(type=float, help="Fraction of device memory for weights, GPU experts and KV pool [0.80].")),
    (("--max-total-tokens",), "max_total_tokens", dict(type=int, help="KV pool size in tokens [chosen: what the GPU memory leaves after weights and GPU experts].")),
    (("--chunked-prefill-size",), "chunked_prefill_size", dict(type=int, help="Most new prompt tokens per prefill step; -1: no chunking [chosen: 8192, lowered to what the workspace allows].")),
    (("--max-running-requests",), "max_running_requests", dict(type=int, help="Most requests decoding together [64].")),
    (("--max-queued-requests",), "max_queued_requests", dict(type=int, help="Most requests waiting beyond the running ones; more get 503 (default: unbounded).")),
    (("--context-length",), "context_length", dict(type=int, help="Override the model's context length.")),
    (("--enable-mixed-chunk",), "enable_mixed_chunk", dict(is_flag=True, default=None, help="Let decodes ride in prefill batches.")),
    (("--disable-radix-cache",), "disable_radix_cache", dict(is_flag=True, default=None, help="Turn off the prefix cache (every request prefills its whole prompt).")),
    (("--schedule-policy",), "schedule_policy", dict(type=click.Choice(["fcfs", "lpm"]), help="Admission order: fcfs (arrival), lpm (longest cached prefix first, none starved) [fcfs].")),
    (("--max-mamba-cache-size",), "max_mamba_cache_size", dict(type=int, help="Models with recurrent layers (Qwen3-Next): snapshots of their state the prefix cache keeps, one per reusable prefix; 0 turns their prefix cache off [min(8, --max-running-requests)].")),
    (("--hicache-size",), "hicache_size", dict(type=float, help="GiB of CPU RAM for KV evicted from the GPU pool, copied back instead of recomputed [0: off].")),
    (("--kt-method", "--kt-amx-method"), "kt_method", dict(type=str, help="CPU expert format, KTransformers names: FP8, BF16, RAWINT4 (compressed-tensors INT4), LLAMAFILE (GGUF), MXFP4 / FP4, MXFP8 keep the checkpoint's weights; INT4/INT8 (AMXINT4, MOE_INT8, ...) quantize group-wise [INT4; an MX checkpoint's own format].")),
    (("--kt-group-size",), "kt_group_size", dict(type=int, help="Quantization group size of CPU experts [64 for INT4, 128 for INT8].")),
    (("--kt-weight-path", "--kt-amx-weight-path"), "kt_weight_path", dict(type=str, help="Where the CPU experts come from: an HF folder (default: --model), a `ktlite convert` folder, or a GGUF file/folder (LLAMAFILE).")),
    (("--kt-cpuinfer",), "kt_cpuinfer", dict(type=int, help="CPU threads for the experts [chosen: physical cores].")),
    (("--kt-threadpool-count",), "kt_threadpool_count", dict(type=int, help="Expert thread pools, each owning a share of the experts, pinned to a NUMA node's cpus with its experts' pages there [chosen: NUMA nodes].")),
    (("--kt-num-gpu-experts",), "kt_num_gpu_experts", dict(type=int, help="Routed experts per MoE layer kept on the GPU [chosen: the most that fit beside the KV pool].")),
    (("--kt-gpu-experts-ratio",), "kt_gpu_experts_ratio", dict(type=float, help="Fraction of routed experts on the GPU (wins over the count).")),
    (("--kt-gpu-prefill-token-threshold",), "kt_gpu_prefill_token_threshold", dict(type=int, help="Prefills of at least this many tokens run all experts on the GPU, layer by layer.")),
    (("--kt-enable-dynamic-expert-update",), "kt_enable_dynamic_expert_update", dict(is_flag=True, default=None, help="Move hot experts to the GPU while serving.")),
    (("--kt-expert-update-interval",), "kt_expert_update_interval", dict(type=int, help="Steps between dynamic expert updates [32].")),
    (("--kt-expert-placement-strategy",), "kt_expert_placement_strategy", dict(type=str, help="Initial GPU expert choice: uniform, frequency, ... [uniform].")),
    (("--init-expert-location",), "init_expert_location", dict(type=str, help="Expert statistics file to place GPU experts from.")),
    (("--record-expert-distribution",), "record_expert_distribution", dict(type=str, help="Write expert routing statistics to this file at shutdown.")),
    (("--kt-max-deferred-experts-per-token",), "kt_max_deferred_experts_per_token", dict(type=int, help="Defer this many CPU experts per token to the next layer [0].")),
    (("--tensor-parallel-size", "--tp-size", "--tp"), "tensor_parallel_size", dict(type=int, help="GPUs to shard attention/dense over [chosen: 1, or every GPU when one cannot hold the model].")),
    (("--speculative-algorithm",), "speculative_algorithm", dict(type=str, help="Speculative decoding: NGRAM drafts tokens by matching the output's last tokens against the prompt and output so far, verified in one forward (greedy output unchanged, sampling keeps the model's distribution); NEXTN (EAGLE: the same) drafts with the checkpoint's MTP layer, on checkpoints that have one (DeepSeek-V3/R1/V3.2, GLM-4.5/4.6/4.7, GLM-5: num_nextn_predict_layers >= 1; Qwen3-Next, Qwen3.5-MoE: mtp_num_hidden_layers >= 1; its routed experts are placed as every MoE layer's). On models with recurrent layers (Qwen3-Next, Qwen3.5, GLM-5.3-Flash) rejected drafts rewind the layers' state (not under tensor parallelism) [off].")),
    (("--speculative-num-steps",), "speculative_num_steps", dict(type=int, help="Drafts proposed per request per decode step [chosen each step from 1..4 by the verify cost measured at start-up and the request's acceptance].")),
    (("--speculative-num-draft-tokens",), "speculative_num_draft_tokens", dict(type=int, help="Tokens one verify holds per request: the last token and its drafts (--speculative-num-steps + 1) [4].")),
    (("--speculative-eagle-topk",), "speculative_eagle_topk", dict(type=int, help="Draft branches per step: only 1 (a chain) [1].")),
]

# Flags that change nothing in ktlite: accepted, with one info line each when given.
_NOOP_FLAGS: list[tuple[str, dict[str, Any], str]] = [
    ("--trust-remote-code", dict(is_flag=True), "ktlite reads config.json itself and runs no code from the checkpoint"),
    ("--attention-backend", dict(type=str), "ktlite always uses its own MLA kernels (Triton on GPU, torch on CPU)"),
    ("--enable-p2p-check", dict(is_flag=True), "ktlite does not use peer-to-peer GPU copies"),
    ("--disable-shared-experts-fusion", dict(is_flag=True), "ktlite runs the shared experts as their own GPU MLP, never fused into the routed ones"),
    ("--disable-cuda-graph", dict(is_flag=True), "ktlite does not capture CUDA graphs yet"),
    ("--cuda-graph-max-bs", dict(type=int), "ktlite does not capture CUDA graphs yet"),
    ("--cuda-graph-bs", dict(type=str), "ktlite does not capture CUDA graphs yet"),
    ("--watchdog-timeout", dict(type=float), "ktlite runs no watchdog over its forward passes"),
    ("--max-prefill-tokens", dict(type=int), "a prefill step's new tokens are bounded by --chunked-prefill-size alone"),
    ("--speculative-moe-runner-backend", dict(type=str), "ktlite's drafts run the MoE layers as the model does"),
    ("--enable-metrics", dict(is_flag=True), "/metrics is always on"),
    ("--fp8-gemm-backend", dict(type=str), "ktlite's FP8 GEMM is its own Triton kernel on CUDA (the torch twin elsewhere)"),
]

_ENGINE_FIELDS = [field for _, field, _ in _ENGINE_FLAGS]
_NOOP_DESTS = [flag.lstrip("-").replace("-", "_") for flag, _, _ in _NOOP_FLAGS]

# `--help` sections: option name -> section (kt_* options not listed are CPU-expert options; the rest "Options")
_HELP_SECTIONS: dict[str, list[str]] = {
    "Model": ["model_path", "served_model_name", "device", "dtype", "weight_dtype", "cpu_dense_method", "cpu_activations", "kv_cache_dtype",
              "context_length", "seed", "tensor_parallel_size"],
    "Memory (left out: chosen from the memory plan)": ["gpu_memory", "mem_fraction_static", "max_total_tokens",
                                                       "chunked_prefill_size", "hicache_size"],
    "CPU experts": ["init_expert_location", "record_expert_distribution"],
    "Scheduling": ["max_running_requests", "max_queued_requests", "enable_mixed_chunk", "schedule_policy",
                   "disable_radix_cache"],
    "Speculative decoding": ["speculative_algorithm", "speculative_num_steps", "speculative_num_draft_tokens",
                             "speculative_eagle_topk"],
    "Machine to plan for (default: this one)": ["gpus", "cpu_memory", "cpu_cores", "numa_nodes"],
    "Server": ["host", "port", "api_key", "skip_server_warmup", "max_request_bytes", "log_level"],
    "SGLang-compatible, no effect": _NOOP_DESTS,
}


def _help_section(name: str) -> str:
    for section, names in _HELP_SECTIONS.items():
        if name in names:
            return section
    return "CPU experts" if name.startswith("kt_") else "Options"


# SGLang flags that take several values (argparse nargs="+"), e.g. `--cuda-graph-bs 1 2 4`: click options take one,
# so the values are joined with commas before parsing
_MULTI_VALUE_FLAGS = ("--cuda-graph-bs",)


def _join_multi_values(args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        out.append(args[i])
        i += 1
        if out[-1] in _MULTI_VALUE_FLAGS:
            end = i
            while end < len(args) and not args[end].startswith("-"):
                end += 1
            out.append(",".join(args[i:end]))
            i = end
    return out


class _SectionedCommand(click.Command):
    """A command whose --help lists its options in sections (model, memory, CPU experts, ...), and which reads
    SGLang's several-valued flags (_MULTI_VALUE_FLAGS)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _join_multi_values(args))

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {name: [] for name in [*_HELP_SECTIONS, "Options"]}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections[_help_section(param.name)].append(record)
        for title, records in sections.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


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
            wrapper = click.option(flag, default=None, hidden=False, help="Accepted for SGLang compatibility; no effect.", **opts)(wrapper)
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
    if arch not in _tiny_archs():
        raise click.BadParameter(f"unknown tiny architecture {arch!r} (one of {', '.join(_tiny_archs())})",
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
@main.command(cls=_SectionedCommand)
@engine_options()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 for all).")
@click.option("--port", default=30000, show_default=True, type=int, help="Port (0: any free port).")
@click.option("--api-key", default=None, envvar="KTLITE_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on /v1/*.")
@click.option("--tool-call-parser", default=None,
              help="Take tool calls out of chat replies in this model format (SGLang's names: qwen3_coder, deepseekv3, "
                   "deepseekv31, deepseekv32, kimi_k2, glm45, glm47, minimax-m2 (also minimax-m3, minimax), gpt-oss).")
@click.option("--reasoning-parser", default=None,
              help="Split thinking into reasoning_content (deepseek-r1, deepseek-v3, qwen3, kimi, kimi_k2, glm45, minimax, "
                   "gpt-oss).")
@click.option("--skip-server-warmup", is_flag=True, help="Skip the start-up request (a short prefill and a decode step).")
@click.option("--max-request-bytes", type=click.IntRange(min=1024), default=8 * 2**20, show_default=True,
              help="Largest request body; bigger ones get 413.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False), default=None)
def serve(model_path: str, engine_flags: dict[str, Any], host: str, port: int, api_key: str | None,
          tool_call_parser: str | None, reasoning_parser: str | None, skip_server_warmup: bool,
          max_request_bytes: int, log_level: str | None) -> None:
    """OpenAI- and Anthropic-compatible HTTP server (chat/completions, messages, models, health, metrics)."""
    if log_level:
        logging.getLogger().setLevel(log_level.upper())
    from ktlite.errors import ConfigError
    from ktlite.server.app import ServerOptions, run_server, warmup
    from ktlite.server.reasoning import think_format
    from ktlite.server.tool_parsers.stream import tool_format

    for flag, name, check in (("--tool-call-parser", tool_call_parser, tool_format),
                              ("--reasoning-parser", reasoning_parser, think_format)):
        try:
            if name:
                check(name)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint=flag) from exc

    t0 = time.perf_counter()
    engine = _make_engine(model_path, engine_flags)
    click.echo(f"loaded {model_path} in {time.perf_counter() - t0:.1f} s")
    options = ServerOptions(host=host, port=port, api_key=api_key, max_request_bytes=max_request_bytes,
                            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    try:
        if not skip_server_warmup:
            n, secs = warmup(engine)
            click.echo(f"warmup: one prefill of {n} tokens and a decode step in {secs:.2f} s")
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


@main.command(cls=_SectionedCommand)
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


@main.command(cls=_SectionedCommand)
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
    from ktlite.machine import cpu_features, cpu_flags, cpu_model

    click.echo(f"cpu: {cpu_model()}, {os.cpu_count()} logical cores ({cpu_features()})")
    flags = cpu_flags()
    click.echo(f"cpu experts: AVX512 {'yes' if 'avx512f' in flags else 'no'}, "
               f"AMX {'yes' if {'amx_tile', 'amx_int8'} <= flags else 'no'}")
    from ktlite.kernels.cpu.target import configure_numba

    click.echo(f"numba compiles for: {configure_numba().describe()}")
    if torch.cuda.is_available():
        click.echo(f"cuda {torch.version.cuda}")
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            click.echo(f"gpu {i}: {props.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free), "
                       f"compute capability {props.major}.{props.minor}")
    else:
        click.echo("gpu: none (the GPU side runs on the CPU through the torch twins)")


@main.command(cls=_SectionedCommand)
@engine_options()
@click.option("--gpus", type=click.IntRange(min=0),
              help="GPUs of the machine, 0 for none [--tensor-parallel-size or 1 with --gpu-memory, else this machine's].")
@click.option("--cpu-memory", help="RAM available for the CPU experts, e.g. 768GiB [this machine's available RAM].")
@click.option("--cpu-cores", type=click.IntRange(min=1), help="Physical CPU cores [this machine's].")
@click.option("--numa-nodes", type=click.IntRange(min=1), help="NUMA nodes [this machine's].")
def plan(model_path: str, engine_flags: dict[str, Any], gpus: int | None, cpu_memory: str | None,
         cpu_cores: int | None, numa_nodes: int | None) -> None:
    """Choose the knobs you leave out, print them, the GPU memory plan and whether the routed experts
    fit in RAM (exit 1 if anything does not fit). Reads only config.json; takes serve's flags.

    \b
    ktlite plan --model /path/DeepSeek-V3 --gpu-memory 16GiB --gpus 2 --cpu-memory 768GiB
    """
    from ktlite.config import EngineConfig
    from ktlite.errors import ConfigError, PlanError
    from ktlite.runtime.knobs import Hardware, format_rows, resolve
    from ktlite.runtime.models import serving_config

    try:
        config = EngineConfig.from_kwargs(model_path, **engine_flags)
        hardware = Hardware.describe(gpus, config.gpu_memory, cpu_memory, cpu_cores, numa_nodes,
                                     engine_flags.get("tensor_parallel_size"))
        head = f"model: {model_path}\nmachine: {hardware.summary()}"
        choice = resolve(config, serving_config(config), hardware)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    except PlanError as exc:
        click.echo(f"{head}\n{exc}", err=True)
        raise SystemExit(1) from exc
    # a GPU described without --cpu-memory asks about the GPU: this machine's RAM is shown, not judged
    judge_ram = cpu_memory is not None or (gpus is None and config.gpu_memory is None)
    note = "" if judge_ram else " (this machine's RAM; --cpu-memory describes the target's)"
    click.echo(f"{head}\nknobs:\n{format_rows(choice.rows)}\n\n{choice.plan.format_table()}\n{choice.cpu.text()}{note}")
    if judge_ram and not choice.cpu.fits:
        click.echo(choice.cpu.error(), err=True)
        raise SystemExit(1)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON: a list of {name, status, value, fix}.")
def doctor(as_json: bool) -> None:
    """Check this machine for ktlite: CPU, cores, NUMA, vector flags and Numba's target, RAM, huge
    pages, GPUs, versions, threading layer; each line ok / warn / fail with the fix (exit 1 on a fail)."""
    from ktlite.doctor import FAIL, format_checks, run_checks, to_json

    checks = run_checks()
    click.echo(to_json(checks) if as_json else format_checks(checks))
    if any(c.status == FAIL for c in checks):
        raise SystemExit(1)


@main.command()
@click.option("--model", "--model-path", "model", required=True, type=click.Path(exists=True, file_okay=False),
              help="HF checkpoint folder (bf16/fp16/fp32 or block-FP8).")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Folder for --kt-weight-path.")
@click.option("--method", default="INT4", show_default=True, help="INT4, INT8 or BF16 (KTransformers names accepted).")
@click.option("--group-size", type=int, default=None, help="Values per quantization group [64 for INT4, 128 for INT8].")
def convert(model: str, output: str, method: str, group_size: int | None) -> None:
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
