"""`ktlite` command line: tiny-model, generate, convert, version."""

from __future__ import annotations

import logging
import platform
import time
from pathlib import Path

import click

from ktlite import __version__


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """ktlite: DeepSeek-class MoE inference with CPU experts and GPU attention."""
    _setup_logging(verbose)


@main.command("tiny-model")
@click.argument("path", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(["deepseek_v3", "deepseek_v2"]), default="deepseek_v3", show_default=True)
@click.option("--fp8", is_flag=True, help="Store linear weights as DeepSeek-V3 block-scaled float8_e4m3fn.")
@click.option("--seed", type=int, default=0, show_default=True)
def tiny_model(path: Path, arch: str, fp8: bool, seed: int) -> None:
    """Write a small random HF-format checkpoint (with tokenizer and chat template) to PATH."""
    from ktlite.runtime.tiny_model import write_tiny_model

    write_tiny_model(path, arch, fp8=fp8, seed=seed)
    click.echo(f"wrote {arch} tiny checkpoint to {path}")


@main.command()
@click.argument("prompt")
@click.option("--model", "--model-path", "model", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--chat/--raw", default=True, show_default=True, help="Wrap PROMPT in the model's chat template.")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
def generate(prompt: str, model: str, chat: bool, max_tokens: int, dtype: str) -> None:
    """Greedy-generate a reply to PROMPT and print it with timing."""
    import torch

    from ktlite.runtime import models
    from ktlite.runtime.tokenizer import Tokenizer

    t0 = time.perf_counter()
    tokenizer = Tokenizer(model)
    net = models.load(model, dtype=getattr(torch, dtype), progress=True)
    load_s = time.perf_counter() - t0
    ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    stops = tokenizer.eos_token_ids or net.config.eos_token_ids
    t1 = time.perf_counter()
    out = net.generate_greedy(torch.tensor([ids]), max_tokens, stop_ids=stops)[0].tolist()
    gen_s = time.perf_counter() - t1
    reply = [t for t in out if t not in stops]
    click.echo(f"prompt ({len(ids)} tokens): {prompt}")
    click.echo(f"reply ({len(out)} tokens): {tokenizer.decode(reply)}")
    click.echo(f"load {load_s:.2f} s, generate {gen_s * 1000:.0f} ms ({len(out) / gen_s:.1f} tok/s)")


@main.command()
def version() -> None:
    """Versions of ktlite and its kernels' toolchains, CPU features and GPUs."""
    import numba
    import torch
    import triton

    click.echo(f"ktlite {__version__}")
    click.echo(f"python {platform.python_version()}, torch {torch.__version__}, numba {numba.__version__}, triton {triton.__version__}")
    click.echo(f"cpu: {_cpu_model()} ({_cpu_features()})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            click.echo(f"gpu {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
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


if __name__ == "__main__":
    main()
