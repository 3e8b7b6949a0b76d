"""A first run that explains itself: the demo says its model is random and how to run a real one,
`serve` with no knob logs the knob table, a value that cannot fit names its knob, a tensor-parallel
script without a main guard gets the fix, `--help` is sectioned, and the plan is verified by the
largest forwards before serving."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from ktlite.cli import main
from ktlite.config import EngineConfig
from ktlite.demo import is_random_demo_model
from ktlite.errors import PlanError
from ktlite.runtime import verify
from ktlite.runtime.assembly import assemble
from ktlite.runtime.knobs import choose_knobs
from ktlite.runtime.models import load_config

AUTO_FLAGS = ("--tensor-parallel-size", "--kt-num-gpu-experts", "--max-total-tokens", "--chunked-prefill-size",
              "--kt-cpuinfer", "--kt-threadpool-count")


def test_demo_says_the_model_is_random_and_serve_logs_the_knob_table(tiny_v3):
    """`make demo` runs this module; its server gets --model-path and --port only."""
    out = subprocess.run([sys.executable, "-m", "ktlite.demo", str(tiny_v3), "--max-tokens", "4"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "its weights are random" in text and "That reply is noise" in text
    assert "ktlite serve --model-path /path/to/checkpoint" in text and "ktlite plan --model" in text
    served = [line for line in text.splitlines() if "[serve]" in line]
    for flag in AUTO_FLAGS:
        assert any(flag in line and "chosen:" in line for line in served), (flag, served)
    assert not is_random_demo_model(str(tiny_v3.parent / "missing"))


def test_serve_with_a_value_that_cannot_fit_names_the_knob(tiny_v3):
    result = CliRunner().invoke(main, ["serve", "--model-path", str(tiny_v3), "--gpu-memory", "64MiB",
                                       "--max-total-tokens", "1000000"])
    assert result.exit_code == 1 and "--max-total-tokens <= " in result.output, result.output


def _run_script(tmp_path, name: str, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / name
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_tensor_parallel_engine_without_main_guard_gets_the_fix(tiny_v3, tmp_path):
    out = _run_script(tmp_path, "unguarded.py", f"""\
        from ktlite import Engine

        engine = Engine({str(tiny_v3)!r}, tensor_parallel_size=2)
        print(engine.generate("hi").text)
        """)
    assert out.returncode != 0
    assert 'if __name__ == "__main__":' in out.stderr and "line 3" in out.stderr, out.stderr
    assert "rank 1 failed" not in out.stderr and "(no report)" not in out.stderr


@pytest.mark.parametrize("tail, ok", [
    ("if __name__ == '__main__':\n    start()\n", True),
    ("if '__main__' == __name__:\n    start()\n", True),
    ("start()\n", False),  # a function that starts the engine, called at the top level
])
def test_main_guard_check_looks_at_where_the_script_starts_ranks(tmp_path, tail, ok):
    out = _run_script(tmp_path, "script.py", "from ktlite.runtime.parallel import require_main_guard\n\n\n"
                                             "def start():\n    require_main_guard(2)\n\n\n" + tail)
    assert (out.returncode == 0) == ok, out.stderr
    assert ok or "line 8 starts the engine outside" in out.stderr


def test_help_lists_flags_in_sections():
    out = CliRunner().invoke(main, ["serve", "--help"]).output
    order = ["Model:", "Memory (left out: chosen from the memory plan):", "CPU experts:", "Scheduling:", "Server:",
             "SGLang-compatible, no effect:"]
    positions = [out.index(title) for title in order]
    assert positions == sorted(positions)
    within = {"--model-path": 0, "--max-total-tokens": 1, "--kt-cpuinfer": 2, "--max-running-requests": 3,
              "--port": 4, "--trust-remote-code": 5}
    for flag, section in within.items():
        end = positions[section + 1] if section + 1 < len(positions) else len(out)
        assert positions[section] < out.index(flag) < end, flag


# ---- the verified plan -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(tiny_v3, tmp_path_factory):
    record = tmp_path_factory.mktemp("verify") / "experts.json"
    config = EngineConfig.from_kwargs(str(tiny_v3), max_running_requests=8, record_expert_distribution=str(record))
    config, _ = choose_knobs(config, load_config(tiny_v3))
    rt = assemble(config, progress=False)
    yield rt
    rt.close()


def test_verify_plan_runs_the_largest_forwards_and_frees_everything(runtime):
    pool = runtime.runner.kv_pool
    before = (pool.free_tokens, pool.free_rows)
    report = verify.verify_plan(runtime)
    prefill, decode = report.passes
    assert (prefill.tokens, prefill.requests) == (runtime.plan.chunk_tokens + 7, 8)  # a chunk + 7 riding decodes
    assert (decode.tokens, decode.requests) == (8, 8)
    assert (pool.free_tokens, pool.free_rows) == before
    assert runtime.stats.counts == {}  # dummy tokens are not expert traffic
    assert all(p.peak_bytes is None for p in report.passes)  # measured on CUDA only


def test_an_activation_peak_over_the_headroom_stops_startup(runtime, monkeypatch):
    """The CUDA measurement stands in for a GPU here: a peak twice the headroom."""
    allowed = runtime.plan.ranks[0].headroom_budget
    monkeypatch.setattr(verify, "_measure", lambda runner, batch: (0.0, 2 * allowed))
    pool = runtime.runner.kv_pool
    before = (pool.free_tokens, pool.free_rows)
    with pytest.raises(PlanError, match="--chunked-prefill-size <= about") as info:
        verify.verify_plan(runtime)
    assert "prefill check" in str(info.value) and (pool.free_tokens, pool.free_rows) == before
