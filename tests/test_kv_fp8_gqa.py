"""FP8 KV for the GQA families (`--kv-cache-dtype fp8_e4m3`): each token's K and V are stored per kv head as
head_dim e4m3 codes and one fp32 scale = amax(head) / 448 (kernels/triton/kv_fp8.head_rows), so a head whose values
reach far past e4m3's largest finite 448 keeps 3 mantissa bits on every value instead of being clipped to 448.

The engine tests make K and V outliers by multiplying two channels of every head by OUTLIER after the projections,
norms and rope (GQAttention.qkv), in every engine compared; the pool then holds values up to ~10^3. An engine with
an FP8 pool must equal the same engine whose pool (in the activation dtype, fp32 here) holds those values already
rounded through the packed rows: both attend over the same fp32 values through the same torch twin, so logits agree
to fp32 summation noise (atol 1e-4 on logits of magnitude ~10) and greedy tokens are equal. Before per-head scales
the FP8 pool clipped the outliers to 448 and neither held.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ktlite import Engine
from ktlite.cli import main
from ktlite.kernels.triton.kv_fp8 import FP8_MAX, Fp8Rows
from ktlite.runtime.memory import make_plan
from ktlite.runtime.plan_inputs import PlanInputs
from ktlite.runtime.models import load_config
from ktlite.runtime.models.gqa import GQAttention
from ktlite.runtime.tiny_model import write_tiny_model
from test_gqa_engine import GREEDY, prompts
from test_kv_fp8 import FLAGS, stepped

DATA = Path(__file__).parent / "data"
OUTLIER = 300.0  # channels 1 and 5 of every K and V head, after the norms and rope: |values| up to ~10^3
ARCHS = ("qwen3_moe", "minimax_m2", "glm4_moe", "qwen3_next")  # qwen3_next: its full-attention layers


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] through one packed FP8 row per head (e4m3 codes + an fp32 scale), back in x's dtype."""
    rows = Fp8Rows(x.shape[-1], x.shape[-1])
    return rows.unpack(rows.pack(x)).to(x.dtype)


def test_outliers_survive_the_round_trip() -> None:
    """Heads with |x| up to 10^4: every value within e4m3's half ulp (2^-4 |x|) or the subnormal step of its head's
    scale (2^-10 amax / 448) of itself; clipping at 448 would miss by ~95 %."""
    x = torch.randn(64, 4, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[..., 3] *= torch.logspace(0, 4, 64, dtype=torch.float64)[:, None]  # outliers from 1 to 10^4
    got = rounded(x.float()).double()
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
    assert ((got - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale + 1e-6 * x.abs()).all()
    assert x.abs().max() > 10 * FP8_MAX


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fp8gqa") / request.param, request.param, seed=5)


@pytest.fixture
def outliers(monkeypatch: pytest.MonkeyPatch):
    """Boost two channels of K and V in every GQA layer; `.round = True` also rounds them through the FP8 rows
    (the simulated pool). Records the largest |K| and |V| stored."""
    qkv = GQAttention.qkv

    class Patch:
        round = False
        peak = 0.0

    def boosted(self, h, cos, sin):
        q, gate, k, v = qkv(self, h, cos, sin)
        boost = torch.ones(k.shape[-1], dtype=k.dtype)
        boost[[1, 5]] = OUTLIER
        k, v = k * boost, v * boost
        Patch.peak = max(Patch.peak, k.abs().max().item(), v.abs().max().item())
        return (q, gate, rounded(k), rounded(v)) if Patch.round else (q, gate, k, v)

    monkeypatch.setattr(GQAttention, "qkv", boosted)
    return Patch


def test_engine_fp8_pool_is_the_rounded_cache(tiny: Path, outliers) -> None:
    """The FP8 pool engine (packed rows, planned == allocated) against the fp32-pool engine holding the rounded
    values: logits of a prefill and decode steps (atol 1e-4), and greedy tokens with chunked prefill of 5."""
    batch = prompts(load_config(tiny).vocab_size)
    flags = {**FLAGS, "chunked_prefill_size": 5}
    with Engine(str(tiny), **flags, kv_cache_dtype="fp8_e4m3") as eng:
        plan = eng.runtime.plan
        mismatches = plan.mismatches(plan.allocated())
        layout = {k: (v.dtype, tuple(v.shape[2:])) for k, v in eng.runtime.runner.kv_pool.buffers.items()}
        fp8_logits, _ = stepped(eng)
        fp8_tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    assert outliers.peak > 2 * FP8_MAX
    outliers.round = True
    with Engine(str(tiny), **flags) as eng:
        ref_logits, _ = stepped(eng)
        ref_tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    torch.testing.assert_close(fp8_logits, ref_logits, atol=1e-4, rtol=0)
    assert fp8_tokens == ref_tokens
    assert layout == {name: (torch.uint8, (2, 16 + 4)) for name in ("k", "v")}  # 2 kv heads of 16 + their scales
    assert mismatches == {}


def test_planned_bytes_per_token() -> None:
    """Qwen3-235B-A22B (94 layers, 4 kv heads of 128) and Qwen3-Next-80B (12 full-attention layers, 2 kv heads of
    256): K and V per kv head are head_dim codes + a 4-byte scale."""
    cases = {"qwen3-235b-a22b": (94 * 2 * 4 * (128 + 4), 94 * 2 * 4 * 128 * 2),
             "qwen3-next-80b-a3b": (12 * 2 * 2 * (256 + 4), 12 * 2 * 2 * 256 * 2)}
    for name, (fp8, bf16) in cases.items():
        cfg = load_config(DATA / name)
        plans = {kv: make_plan(cfg, PlanInputs(gpu_memory="80GiB", kv_cache_dtype=kv)) for kv in ("fp8_e4m3", "bfloat16")}
        assert (plans["fp8_e4m3"].kv_bytes_per_token, plans["bfloat16"].kv_bytes_per_token) == (fp8, bf16), name
    out = CliRunner().invoke(main, ["plan", "--model", str(DATA / "qwen3-235b-a22b"), "--kv-cache-dtype", "fp8_e4m3",
                                    "--gpu-memory", "80GiB", "--cpu-memory", "768GiB"])
    assert out.exit_code == 0, out.output
    assert f"x {94 * 2 * 4 * 132:,} B (94 layers x (k 4x132 B + v 4x132 B), fp8_e4m3 rows with fp32 scales)" in out.output
