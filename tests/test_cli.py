"""The `ktlite` CLI: a KTransformers user's exact launch command, serve's lifecycle, chat, generate, bench."""

from __future__ import annotations

import fcntl
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import fields

import openai
import pytest
from click.testing import CliRunner

from conftest import STARTUP_GUARD_S
from ktlite.cli import _ENGINE_FIELDS, _resolve_model_path, main
from ktlite.config import EngineConfig

# The launch flags of a KTransformers + SGLang user, verbatim (plus an ephemeral port for the test).
KT_FLAGS = ("--kt-cpuinfer 36 --kt-threadpool-count 1 --kt-num-gpu-experts 0 --attention-backend triton "
            "--trust-remote-code --mem-fraction-static 0.98 --chunked-prefill-size 2048 --max-running-requests 16 "
            "--max-total-tokens 20000 --served-model-name X --enable-mixed-chunk --tensor-parallel-size 1 "
            "--enable-p2p-check --disable-shared-experts-fusion --kt-method AMXINT4").split()
SMALL = ["--kt-method", "BF16", "--max-total-tokens", "1024", "--chunked-prefill-size", "256", "--gpu-memory", "1GiB"]


class Server:
    """`python -m ktlite.launch_server ...` in a subprocess; waits for its 'listening on' line."""

    def __init__(self, args: list[str], tmp_path):
        self.stderr_path = tmp_path / "serve.stderr"
        self.port_lock = _hold_port(args)
        self.proc = subprocess.Popen([sys.executable, "-m", "ktlite.launch_server", *args], stdout=subprocess.PIPE,
                                     stderr=open(self.stderr_path, "w"), text=True, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = self._wait_listening(timeout=STARTUP_GUARD_S)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            self.stdout.append(line)
            m = re.search(r"ktlite listening on (http://\S+:\d+)", line)
            if m:
                return m.group(1)
            if line == "":
                break
        self.proc.kill()
        self._release()
        raise AssertionError(f"server did not start:\n{''.join(self.stdout)}\n{self.stderr_path.read_text()[-3000:]}")

    def stop(self, sig=signal.SIGINT) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=30)
        while True:
            line = self.lines.get(timeout=10)
            if line == "":
                break
            self.stdout.append(line)
        self._release()
        return rc

    def _release(self) -> None:
        if self.port_lock is not None:
            self.port_lock.close()  # closing the file drops its lock
            self.port_lock = None


def _hold_port(args: list[str]):
    """A launch line with a fixed --port (the users' verbatim ones: 30000) holds a lock file for that port until the
    server stops, so tests running in parallel processes (pytest -n) take the port in turn; --port 0 holds none."""
    port = args[args.index("--port") + 1] if "--port" in args else "0"
    if port == "0":
        return None
    lock = open(os.path.join(tempfile.gettempdir(), f"ktlite-tests-port-{port}.lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


@pytest.fixture(scope="module")
def kt_server(tiny_v3, tmp_path_factory):
    server = Server(["--model", str(tiny_v3), *KT_FLAGS, "--host", "127.0.0.1", "--port", "0"],
                    tmp_path_factory.mktemp("serve"))
    yield server
    if server.proc.poll() is None:
        server.proc.kill()


def test_kt_launch_command_serves(kt_server):
    client = openai.OpenAI(base_url=kt_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["X"]
    reply = client.chat.completions.create(model="X", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                           temperature=0)
    assert reply.model == "X" and reply.choices[0].message.content
    chunks = list(client.chat.completions.create(model="X", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    out = "".join(kt_server.stdout)
    assert "warmup: one prefill of" in out
    log = kt_server.stderr_path.read_text()
    assert "memory plan" in log
    for flag in ("--trust-remote-code", "--attention-backend triton", "--enable-p2p-check",
                 "--disable-shared-experts-fusion"):
        assert log.count(f"{flag}: accepted, no effect") == 1, flag


def test_chat_repl_against_url(kt_server):
    result = CliRunner().invoke(main, ["chat", "--url", kt_server.url, "--max-tokens", "5", "--temperature", "0"],
                                input="hello\n/clear\n\nsecond question\n/exit\nnever sent\n")
    assert result.exit_code == 0, result.output
    assert ">>> hello" in result.output and ">>> second question" in result.output
    assert "(history cleared)" in result.output and "never sent" not in result.output


def test_serve_stops_cleanly_on_sigint(kt_server):
    port = int(kt_server.url.rsplit(":", 1)[1])
    assert kt_server.stop(signal.SIGINT) == 0
    assert "ktlite stopped" in "".join(kt_server.stdout)
    with socket.socket() as s:  # the port is released
        s.bind(("127.0.0.1", port))


def test_serve_sigterm_and_api_key(tiny_v3, tmp_path):
    server = Server(["--model-path", str(tiny_v3), *SMALL, "--port", "0", "--api-key", "k1",
                     "--skip-server-warmup"], tmp_path)
    try:
        req = urllib.request.Request(server.url + "/v1/models")
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=30)
        assert exc.value.code == 401
        req = urllib.request.Request(server.url + "/v1/models", headers={"Authorization": "Bearer k1"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == tiny_v3.name
    finally:
        assert server.stop(signal.SIGTERM) == 0


def test_generate_uses_engine_flags(tiny_v3):
    result = CliRunner().invoke(main, ["generate", "Hello", "--model-path", str(tiny_v3), *SMALL, "--max-tokens", "5",
                                       "--trust-remote-code"])
    assert result.exit_code == 0, result.output
    assert re.search(r"reply \(5 tokens, length\): ", result.output)
    assert "tok/s" in result.output


def test_chat_repl_local_engine(tiny_v3):
    result = CliRunner().invoke(main, ["chat", "--model-path", str(tiny_v3), *SMALL, "--max-tokens", "4"],
                                input="hello\n/system be brief\nhow are you\n")
    assert result.exit_code == 0, result.output
    assert result.output.count(">>> ") == 2 and "(system prompt set)" in result.output


def test_chat_needs_model_or_url():
    result = CliRunner().invoke(main, ["chat"])
    assert result.exit_code == 2 and "--model-path" in result.output


def test_serve_reports_bad_flags_without_traceback(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--model-path", str(tmp_path / "missing")])
    assert result.exit_code == 1 and "not a folder" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["serve", "--model-path", str(tmp_path), "--no-such-flag"])
    assert result.exit_code == 2 and "no-such-flag" in result.output


def test_engine_flags_are_engine_config_fields():
    names = {f.name for f in fields(EngineConfig)}
    assert set(_ENGINE_FIELDS) <= names
    # every engine option but the ones set by other means has a flag
    missing = names - set(_ENGINE_FIELDS) - {"model_path", "user_set"}
    assert not missing, f"EngineConfig fields without a CLI flag in ktlite/cli.py _ENGINE_FLAGS: {missing}"


def test_tiny_model_shortcut(tmp_path, monkeypatch):
    monkeypatch.setenv("KTLITE_CACHE", str(tmp_path))
    path = _resolve_model_path("tiny")
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert _resolve_model_path("tiny") == path  # cached


def test_version_and_bench():
    result = CliRunner().invoke(main, ["version"])
    assert result.exit_code == 0 and "ktlite " in result.output and "torch" in result.output
    result = CliRunner().invoke(main, ["bench"])
    assert result.exit_code == 0 and "bench" in result.output
    result = CliRunner().invoke(main, ["bench", "no_such_bench"])
    assert result.exit_code == 1 and "no benchmark" in result.output


def test_launch_server_module_help():
    out = subprocess.run([sys.executable, "-m", "ktlite.launch_server", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--kt-cpuinfer" in out.stdout and "--served-model-name" in out.stdout
