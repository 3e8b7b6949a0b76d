"""FP8 KV cache for MLA (`--kv-cache-dtype fp8_e4m3`): the packed rows (kernels/triton/kv_fp8.py), the
engine on tiny DeepSeek-V3 and V3.2 checkpoints, and what the memory plan makes of it.

Error of the packed rows against float64 (test_round_trip_error_bound): per value
|dequantized - x| <= 2^-4 |x| + 2^-10 s, s = amax(group) / 448: e4m3 keeps 3 mantissa bits (half an ulp is
at most 2^-4 of the value) down to its smallest normal 2^-6 s, below which values sit on the subnormal
grid of step 2^-9 s. Rounding to a step of 2^-3 of the binade's base, for values spread evenly over
the binade, is an RMS relative error of 2^-3 / sqrt(24) = 2.55 % (measured 2.57 % on Gaussian values);
the bf16 rope tail is exact for bf16 inputs.

Engine tolerances (test_engine_fp8_kv_close_to_bf16_kv): the first MLA layer, whose input the cache
cannot change, is where the cache's error shows undistorted: its output stays within 6 % (V3: the
latent's 2.6 % through the scores and the values, measured 3.6-3.9 %) or 25 % (V3.2: the rounded index keys also flip some of each query's
top 6 of <= 40 tokens, measured 11-19 %) of the bf16-KV output. The logits are bounded more loosely,
40 % (V3, measured 28-29 %) and 80 % (V3.2, measured 60-66 %) relative (Frobenius), because these tiny
random checkpoints amplify any cache perturbation: their 3 layers of gain-1.5 random weights and top-4
routing turn bf16 KV's 0.25 % rounding into 5-24 % logit changes. That the fp8 engine differs from the
bf16 one only by the rounding is tested exactly (test_engine_fp8_kv_is_the_rounded_cache).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ktlite import Engine
from ktlite.cli import main
from ktlite.errors import ConfigError
from ktlite.kernels.triton.kv_fp8 import FP8_MAX, Fp8Rows, latent_rows
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.memory import PlanDoesNotFit, make_plan
from ktlite.runtime.plan_inputs import PlanInputs
from ktlite.runtime.models import load_config
from ktlite.runtime.models.deepseek import MLAttention
from ktlite.runtime.tiny_model import write_tiny_model
from test_gqa_engine import EXACT, GREEDY, prompts

DATA = Path(__file__).parent / "data"
FLAGS = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 256, "chunked_prefill_size": 256,
         "gpu_memory": "1GiB", "max_running_requests": 4}
IDS = torch.randint(4, 100, (40,), generator=torch.Generator().manual_seed(1)).tolist()


# ---- the packed rows ------------------------------------------------------------------------------

def test_round_trip_error_bound() -> None:
    """Groups of very different ranges (outliers, tiny values on the subnormal grid, an all-zero group,
    a short last group) against float64, within the bound in the module docstring."""
    rows = Fp8Rows(dim=200, group=64, tail=8)  # groups of 64, 64, 64 and 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 208, generator=g, dtype=torch.float64)
    x[:, :64] *= torch.logspace(-6, 3, 64, dtype=torch.float64)[:, None]  # every range, row by row
    x[:5, 70] = 1e4  # an outlier: the rest of its group lands near or below e4m3's smallest normal
    x[7, 128:192] = 0.0
    packed = rows.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (64, rows.row_bytes) and rows.row_bytes == 200 + 16 + 16
    got = rows.unpack(packed).double()
    vals, deq = x[:, :200], got[:, :200]
    groups = torch.nn.functional.pad(vals.abs(), (0, 56)).view(64, 4, 64).amax(-1)
    scale = (groups / FP8_MAX).repeat_interleave(64, -1)[:, :200]
    bound = 2**-4 * vals.abs() + 2**-10 * scale + 1e-6 * vals.abs()  # 1e-6: the float32 steps in between
    assert ((deq - vals).abs() <= bound).all()
    assert torch.equal(deq[7, 128:192], torch.zeros(64, dtype=torch.float64))
    assert torch.equal(got[:, 200:], x[:, 200:].to(torch.bfloat16).double())  # the tail: bf16, nothing else


def test_gaussian_latent_error_and_sizes() -> None:
    """The MLA latent at DeepSeek-V3 sizes: 656 bytes per token per layer, RMS relative error of N(0, 1)
    values 2^-3 / sqrt(24) (module docstring); index keys: 132 bytes."""
    rows = latent_rows(512, 64)
    assert rows.row_bytes == 656 and Fp8Rows(128, 128).row_bytes == 132
    x = torch.randn(256, 576, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    err = rows.unpack(rows.pack(x)).double()[:, :512] - x[:, :512]
    rms = (err.norm() / x[:, :512].norm()).item()
    assert abs(rms - 2**-3 / math.sqrt(24)) < 0.05 * 2**-3 / math.sqrt(24), rms


def test_packed_rows_need_aligned_fields() -> None:
    with pytest.raises(ConfigError, match="--kv-cache-dtype auto"):
        latent_rows(30, 8)


# ---- the engine -----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def tiny_mla(request, tmp_path_factory):
    return request.param, write_tiny_model(tmp_path_factory.mktemp("fp8kv") / request.param, request.param, seed=1)


def stepped(engine: Engine, prefill: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of IDS fed as one prefill chunk then one token per decode forward, and the first layer's
    attention output over those forwards (the scheduler is idle)."""
    runner = engine.runtime.runner
    pool, attn = runner.kv_pool, runner.model.model.layers[0].self_attn
    first_layer: list[torch.Tensor] = []
    forward = attn.forward_batch

    def record(*args, **kwargs):
        first_layer.append(forward(*args, **kwargs))
        return first_layer[-1]

    attn.forward_batch = record
    row = pool.alloc_request()
    logits = []
    try:
        for start, chunk in [(0, IDS[:prefill])] + [(i, IDS[i : i + 1]) for i in range(prefill, len(IDS))]:
            slots = pool.alloc_tokens(row, len(chunk))
            logits.append(runner.forward(ForwardBatch.build([chunk], [start], [row], [slots], [True], runner.device)))
    finally:
        pool.free_request(row)
        del attn.forward_batch
    return torch.cat(logits), torch.cat(first_layer)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_engine_fp8_kv_is_the_rounded_cache(tiny_mla, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine with an FP8 pool (packed rows, read in place by the kernels and the indexer) equals the
    engine with an fp32 pool that stores each latent and index key already rounded through the rows."""
    arch, path = tiny_mla
    # compare storage through one attention implementation, the twins (the compiled CPU kernels against them, on
    # both pools: test_cpu_mla_attention's)
    monkeypatch.setenv("KTLITE_FORCE_TORCH_KERNELS", "1")
    with Engine(str(path), **FLAGS, kv_cache_dtype="fp8_e4m3") as eng:
        buffers = eng.runtime.runner.kv_pool.buffers
        widths = {"latent": 52} | ({"index_key": 36} if arch == "deepseek_v32" else {})  # 32 + 4 + 8*2; 32 + 4
        assert {k: (v.dtype, v.shape[-1]) for k, v in buffers.items()} == {k: (torch.uint8, w)
                                                                           for k, w in widths.items()}
        assert eng.runtime.plan.mismatches(eng.runtime.plan.allocated()) == {}
        packed = stepped(eng)

    def rounded(self, pool, name, layer_idx, slots, values):
        rows = self.cfg.fp8_rows(name)
        pool.write(name, layer_idx, slots, rows.unpack(rows.pack(values)))

    monkeypatch.setattr(MLAttention, "store", rounded)
    with Engine(str(path), **FLAGS) as eng:
        simulated = stepped(eng)
    torch.testing.assert_close(packed[0], simulated[0], atol=1e-5, rtol=0)


def test_engine_fp8_kv_close_to_bf16_kv(tiny_mla) -> None:
    """Tolerances and why: the module docstring."""
    arch, path = tiny_mla
    with Engine(str(path), **FLAGS, kv_cache_dtype="bfloat16") as eng:
        ref_logits, ref_first = stepped(eng)
    with Engine(str(path), **FLAGS, kv_cache_dtype="fp8_e4m3") as eng:
        logits, first = stepped(eng)
    layer_tol, logits_tol = (0.06, 0.4) if arch == "deepseek_v3" else (0.25, 0.8)
    assert relative(first, ref_first) <= layer_tol
    assert relative(logits, ref_logits) <= logits_tol


def test_engine_fp8_kv_chunked_prefill_and_preemption(tiny_mla) -> None:
    """Chunks of 5 tokens and a pool of 48 slots that forces preemption give the tokens of one whole
    prefill (a token's row is quantized on its own, so chunking cannot change what is stored)."""
    _, path = tiny_mla
    batch = prompts(load_config(path).vocab_size)
    with Engine(str(path), **EXACT, kv_cache_dtype="fp8_e4m3") as eng:
        want = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    flags = {**EXACT, "kt_num_gpu_experts": 8, "chunked_prefill_size": 5, "max_total_tokens": 48}
    with Engine(str(path), **flags, kv_cache_dtype="fp8_e4m3") as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        assert eng.scheduler.preemptions > 0
        assert eng.runtime.runner.kv_pool.used_tokens == 0
    assert got == want


# ---- the plan -------------------------------------------------------------------------------------

def test_plan_shows_packed_bytes_per_token() -> None:
    """`ktlite plan --kv-cache-dtype fp8_e4m3` on DeepSeek-V3.2: 61 x (656 + 132) bytes per token."""
    out = CliRunner().invoke(main, ["plan", "--model", str(DATA / "deepseek-v3.2"), "--kv-cache-dtype", "fp8_e4m3",
                                    "--gpu-memory", "16GiB", "--gpus", "2", "--tensor-parallel-size", "2",
                                    "--cpu-memory", "768GiB"])
    assert out.exit_code == 0, out.output
    assert f"x {61 * (656 + 132):,} B (61 layers x (latent 656 B + index_key 132 B), fp8_e4m3 rows with fp32 scales)" \
        in out.output


def test_fp8_kv_nearly_doubles_the_pool_on_two_16gib_gpus() -> None:
    """The seed user's flags on two 16 GiB GPUs, the pool sized by what is left: 85,888 -> 48,068 bytes per
    token, so 1.79x the tokens."""
    flags = dict(gpu_memory="16GiB", tensor_parallel_size=2, mem_fraction_static=0.96, chunked_prefill_size=2048,
                 max_running_requests=16, context_length=20000)
    cfg = load_config(DATA / "deepseek-v3.2")
    bf16, fp8 = (make_plan(cfg, PlanInputs(**flags, kv_cache_dtype=kv)) for kv in ("auto", "fp8_e4m3"))
    assert (bf16.kv_bytes_per_token, fp8.kv_bytes_per_token) == (61 * 1408, 61 * 788)
    assert fp8.kv_pool_tokens >= 1.78 * bf16.kv_pool_tokens


def test_suggestions_offer_fp8_kv_when_the_pool_does_not_fit() -> None:
    """A --max-total-tokens the bf16 pool cannot hold but an FP8 one can: the suggestions name
    --kv-cache-dtype fp8_e4m3, and taking it fits. When the weights alone do not fit, they do not."""
    cfg = load_config(DATA / "deepseek-v3.2")
    base = dict(gpu_memory="16GiB", tensor_parallel_size=2, mem_fraction_static=0.96, chunked_prefill_size=2048,
                max_running_requests=16, context_length=20000)
    tokens = make_plan(cfg, PlanInputs(**base, kv_cache_dtype="fp8_e4m3")).kv_pool_tokens
    with pytest.raises(PlanDoesNotFit) as err:
        make_plan(cfg, PlanInputs(**base, max_total_tokens=tokens))
    fix = [s for s in err.value.suggestions if s.field == "kv_cache_dtype"]
    assert [s.value for s in fix] == ["fp8_e4m3"] and "--kv-cache-dtype fp8_e4m3" in str(err.value)
    assert make_plan(cfg, PlanInputs(**base, max_total_tokens=tokens, kv_cache_dtype="fp8_e4m3")).fits
    with pytest.raises(PlanDoesNotFit) as err:
        make_plan(cfg, PlanInputs(**{**base, "tensor_parallel_size": 1}, max_total_tokens=20000))
    assert not [s for s in err.value.suggestions if s.field == "kv_cache_dtype"]
