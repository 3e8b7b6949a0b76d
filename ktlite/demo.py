"""`make demo`: serve a model, stream one chat reply with curl, print it with timing, stop.

    python -m ktlite.demo MODEL_DIR [--prompt TEXT] [--max-tokens N]

What a new user would do by hand: `ktlite serve`, wait for the "listening on" line, `curl -N` an
OpenAI streaming request, read the `data:` lines, Ctrl-C the server. The default model (`make demo`)
is ktlite's tiny random checkpoint, so the demo says that its text is noise and how to run a real one.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

READY = re.compile(r"listening on (http://\S+)")
REAL_MODEL_STEPS = """To run a real model (an HF folder with config.json, *.safetensors and tokenizer.json):
  ktlite doctor                                  # is this machine ready (CPU flags, RAM, GPUs, threading)?
  ktlite plan --model /path/to/checkpoint        # the knobs ktlite picks for it here (reads config.json only)
  ktlite serve --model-path /path/to/checkpoint  # the same server, on the real weights
  python -m ktlite.demo /path/to/checkpoint      # or this demo against it"""


def is_random_demo_model(model: str) -> bool:
    """Whether `model` is a `ktlite tiny-model` checkpoint (random weights): its config.json carries
    exactly one family's tiny shapes, which no trained checkpoint has."""
    from ktlite.runtime.tiny_model import ARCH_CONFIGS, CONTEXT, VOCAB_SIZE

    try:
        raw = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if raw.get("vocab_size") != VOCAB_SIZE or raw.get("max_position_embeddings") != CONTEXT:
        return False
    return any(all(raw.get(k) == v for k, v in fields.items()) for fields in ARCH_CONFIGS.values())


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen(
        [sys.executable, "-m", "ktlite.launch_server", "--model-path", model, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
    )
    for line in server.stdout:
        print(f"  [serve] {line.rstrip()}")
        match = READY.search(line)
        if match:
            return server, match.group(1)
    raise SystemExit(f"ktlite serve exited with code {server.wait()} before it listened")


def main() -> None:
    ap = argparse.ArgumentParser(description="Serve, stream one chat reply with curl, stop.")
    ap.add_argument("model")
    ap.add_argument("--prompt", default="Tell me about Mixture-of-Experts models.")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    random_weights = is_random_demo_model(args.model)
    if random_weights:
        print(f"{args.model} is ktlite's tiny demo model: its weights are random, so the server, streaming and "
              "batching are real but the reply text will be noise.\n")

    t0 = time.perf_counter()
    server, url = start_server(args.model)
    ready_s = time.perf_counter() - t0
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": args.prompt}],
                       "stream": True, "stream_options": {"include_usage": True},
                       "max_tokens": args.max_tokens, "temperature": 0})
    cmd = ["curl", "-sS", "-N", f"{url}/v1/chat/completions", "-H", "Content-Type: application/json", "-d", body]
    print(f"\n$ curl -N {url}/v1/chat/completions -d '{body}'")
    try:
        t1 = time.perf_counter()
        stream = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
        total_s = time.perf_counter() - t1
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    lines = [l for l in stream.splitlines() if l.startswith("data: ")]
    print("\n".join(lines))
    chunks = [json.loads(l[6:]) for l in lines if l != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    tokens = next(c["usage"]["completion_tokens"] for c in chunks if c.get("usage"))
    print(f"\nreply: {text!r}")
    print(f"server ready in {ready_s:.1f} s; {len(chunks)} chunks, {tokens} tokens in {total_s * 1000:.0f} ms "
          f"({tokens / total_s:.1f} tok/s, prefill included); stream ended with [DONE]: {lines[-1] == 'data: [DONE]'}")
    if random_weights:
        print("\nThat reply is noise because the demo model's weights are random.")
    print(f"\n{REAL_MODEL_STEPS}")


if __name__ == "__main__":
    main()
