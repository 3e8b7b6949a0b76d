"""CPUMoE: fused CPU expert kernels against plain torch on the dequantized weights."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

from ktlite.errors import KtliteError
from ktlite.kernels.cpu import activations, amx_tiles, int8_dots, moe_kernels, simd
from ktlite.kernels.cpu import moe as moe_module
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.kernels.cpu.quant import dequantize, relative_error

E, H, I, K = 8, 128, 96, 3  # I = 96 is padded to the 128-weight INT4 chunk: the padding path runs


def experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
            torch.randn(E, H, I, generator=g) / I**0.5)


def routing(t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    ids = torch.rand(t, E, generator=g).topk(K, dim=1).indices
    return x, ids, torch.rand(t, K, generator=g)


def reference(gate, up, down, x, ids, w, skip=None) -> torch.Tensor:
    """sum_j w[t, j] * down(SiLU(gate x) * up x) over selected, unskipped experts, fp32."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if skip is not None and skip[e]:
                continue
            xt = x[t].double()
            a = torch.nn.functional.silu(gate[e].double() @ xt) * (up[e].double() @ xt)
            out[t] += float(w[t, j]) * (down[e].double() @ a)
    return out.float()


def stored(moe: CPUMoE, layer: int = 0):
    """The weights exactly as the kernels see them."""
    lay = moe.layers[layer]
    gu, dn = dequantize(lay.gate_up), dequantize(lay.down)
    full = lambda t, shape: torch.zeros(E, *shape).index_copy_(0, torch.from_numpy(lay.experts), t)
    return full(gu[:, :I], (I, H)), full(gu[:, I:], (I, H)), full(dn, (H, I))


@pytest.fixture(scope="module", params=["INT8", "INT4", "BF16"])
def moe(request):
    m = CPUMoE(request.param, 64, prefill_threshold=8, prefill_dtype=torch.float32)
    m.add_layer(0, *experts())
    m.warmup()
    yield m
    m.close()


@pytest.mark.parametrize("t", [1, 5, 40])  # 1 and 5: GEMV kernel; 40: dequantize + matmul path
def test_matches_reference_on_dequantized_weights(moe, t):
    x, ids, w = routing(t)
    out = moe.forward(0, x, ids, w)
    assert out.shape == (t, H) and out.dtype == torch.float32
    assert relative_error(out, reference(*stored(moe), x, ids, w)) < 1e-5


def test_decode_and_prefill_paths_agree(moe):
    x, ids, w = routing(300)
    big = moe.forward(0, x, ids, w)  # T = 300: prefill path
    rows = [0, 7, 299]
    small = torch.cat([moe.forward(0, x[r:r + 1], ids[r:r + 1], w[r:r + 1]) for r in rows])  # T = 1
    assert relative_error(big[rows], small) < 1e-5


def test_mixed_paths_in_one_call(moe):
    x, ids, w = routing(12)
    ids[:, 0] = 2  # expert 2 gets all 12 tokens (matmul path), the others ~3 each (GEMV kernel)
    assert relative_error(moe.forward(0, x, ids, w), reference(*stored(moe), x, ids, w)) < 1e-5


def test_bf16_prefill_close(moe):
    x, ids, w = routing(40)
    fast = CPUMoE(moe.method, 64, prefill_threshold=8, prefill_dtype=torch.bfloat16)  # bf16 matmuls
    fast.layers = moe.layers
    try:
        assert relative_error(fast.forward(0, x, ids, w), reference(*stored(moe), x, ids, w)) < 2e-2
    finally:
        fast.pools.close()


@pytest.mark.parametrize("native", [True, False])
def test_default_prefill_dtype_follows_the_cpu(monkeypatch, native):
    """bf16 GEMMs only where they beat fp32 ones (without AVX512-BF16/AMX oneDNN's bf16 is ~3x its fp32)."""
    monkeypatch.setattr(moe_module, "bf16_gemm_wins", lambda: native)
    with CPUMoE("INT8") as m:
        assert m.prefill_dtype == (torch.bfloat16 if native else torch.float32)
        # fp32 GEMMs (twice the dequantized bytes, half the speed) win only from more tokens per expert
        assert m.prefill_threshold == (moe_module.DEFAULT_PREFILL_THRESHOLD["INT8"] if native
                                       else moe_module.FP32_PREFILL_THRESHOLD)
    # integer row dots on int8 activations stay faster for more tokens, against either GEMM; AMX tiles still more
    with CPUMoE("INT8", 32, activations="int8") as m:  # groups of 32: no AMX tiles
        fp32 = (moe_module.Q8_TILES_FP32_PREFILL_THRESHOLD if int8_dots.INT_TILES
                else moe_module.Q8_FP32_PREFILL_THRESHOLD)
        assert m.prefill_threshold == (moe_module.Q8_BF16_PREFILL_THRESHOLD if native else fp32)
    with CPUMoE("INT8", 64, activations="int8") as m, CPUMoE("INT8", 32, activations="int8") as no_amx:
        assert m.prefill_threshold == (moe_module.Q8_AMX_PREFILL_THRESHOLD["INT8"] if amx_tiles.AMX
                                       else no_amx.prefill_threshold)


def bf16_reference(moe: CPUMoE, x, ids, w) -> torch.Tensor:
    """The bf16 matmul path spelled out in torch: bf16 GEMMs on the stored weights, bf16 SiLU * mul, each
    expert's bf16 output weighted and summed in fp32."""
    gate, up, down = (t.bfloat16() for t in stored(moe))
    out = torch.zeros(x.shape[0], H)
    for e in torch.unique(ids).tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        xb = x[tok].bfloat16()
        y = (torch.nn.functional.silu(xb @ gate[e].T) * (xb @ up[e].T)) @ down[e].T
        out.index_add_(0, tok, y.float() * w[tok, j][:, None])
    return out


@pytest.mark.parametrize("pair_batch", [4096, 50])  # 50: experts are run in several batches
def test_bf16_prefill_path_is_the_bf16_torch_computation(moe, pair_batch, monkeypatch):
    monkeypatch.setattr(moe_module, "PAIR_BATCH", pair_batch)
    x, ids, w = routing(60)
    fast = CPUMoE(moe.method, 64, prefill_threshold=1, prefill_dtype=torch.bfloat16)  # all through bf16 matmuls
    fast.layers = moe.layers
    try:
        assert relative_error(fast.forward(0, x, ids, w), bf16_reference(moe, x, ids, w)) < 1e-5
    finally:
        fast.pools.close()


def test_bf16_hidden_in_bf16_out(moe):
    x, ids, w = routing(3)
    out = moe.forward(0, x.bfloat16(), ids, w)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference(*stored(moe), x.bfloat16().float(), ids, w)) < 1e-2


@pytest.mark.parametrize("t", [2, 40])
def test_masked_experts_contribute_nothing(moe, t):
    x, ids, w = routing(t)
    skip = torch.zeros(E, dtype=torch.bool)
    skip[[0, 3, 4]] = True
    out = moe.forward(0, x, ids, w, skip_mask=skip)
    assert relative_error(out, reference(*stored(moe), x, ids, w, skip)) < 1e-5
    assert torch.count_nonzero(moe.forward(0, x, ids, w, skip_mask=torch.ones(E, dtype=torch.bool))) == 0


def test_submit_wait_equals_forward(moe):
    x, ids, w = routing(4)
    handle = moe.submit(0, x, ids, w)
    assert torch.equal(handle.wait(), moe.forward(0, x, ids, w))


def test_padding_ids_ignored(moe):
    x, ids, w = routing(3)
    padded = ids.clone()
    padded[:, -1] = -1
    keep = w.clone()
    keep[:, -1] = 0
    torch.testing.assert_close(moe.forward(0, x, padded, w), moe.forward(0, x, ids, keep))


@pytest.mark.parametrize("method", ["INT8", "INT4"])
def test_only_cpu_experts_stored_and_run(method):
    gate, up, down = experts()
    cpu = [1, 2, 5, 6]
    with CPUMoE(method, 32, prefill_threshold=8, prefill_dtype=torch.float32) as part, \
            CPUMoE(method, 32) as full:
        part.add_layer(0, gate, up, down, cpu_experts=cpu)
        full.add_layer(0, gate, up, down)
        assert part.nbytes() * E == full.nbytes() * len(cpu)
        skip = torch.ones(E, dtype=torch.bool)
        skip[cpu] = False
        for t in (2, 40):
            x, ids, w = routing(t)
            ref = reference(*stored(part), x, ids, w, skip)
            assert relative_error(part.forward(0, x, ids, w, skip_mask=skip), ref) < 1e-5
            with pytest.raises(KtliteError, match="neither on CPU nor in skip_mask"):
                part.forward(0, x, ids, w)


def test_streamed_experts_equal_add_layer():
    gate, up, down = experts()
    with CPUMoE("INT4") as a, CPUMoE("INT4") as b:
        a.add_layer(3, gate, up, down, cpu_experts=[0, 2])
        b.reserve_layer(3, E, H, I, cpu_experts=[0, 2])
        for e in range(E):  # experts not reserved are ignored
            b.set_expert(3, e, gate[e], up[e], down[e])
        x, ids, w = routing(2)
        skip = torch.ones(E, dtype=torch.bool)
        skip[[0, 2]] = False
        assert torch.equal(a.forward(3, x, ids, w, skip), b.forward(3, x, ids, w, skip))


@pytest.mark.parametrize("t", [3, 40])
def test_two_pools_equal_one(t):
    gate, up, down = experts()
    x, ids, w = routing(t)
    with CPUMoE("INT8", num_threads=2, threadpool_count=1, prefill_threshold=8) as one, \
            CPUMoE("INT8", num_threads=2, threadpool_count=2, prefill_threshold=8) as two:
        one.add_layer(0, gate, up, down)
        two.add_layer(0, gate, up, down)
        assert two.pools.count == 2 and set(two.layers[0].pool_of.tolist()) == {0, 1}
        assert relative_error(two.forward(0, x, ids, w), one.forward(0, x, ids, w)) < 1e-5


def test_quantized_moe_error_beats_per_row_int4():
    # MoE-output error against the unquantized experts (three matrices compound): INT8 ~1 %,
    # group-wise INT4 ~15 %, per-row INT4 (KTransformers' layout) ~26 %
    gate, up, down = experts()
    x, ids, w = routing(8)
    exact = reference(gate, up, down, x, ids, w)
    errs = {}
    for method in ("INT8", "INT4"):
        with CPUMoE(method) as m:
            m.add_layer(0, gate, up, down)
            errs[method] = relative_error(m.forward(0, x, ids, w), exact)
    row = lambda t: (t / (s := t.abs().amax(-1, keepdim=True) / 7)).round().clamp(-8, 7) * s
    per_row = relative_error(reference(row(gate), row(up), row(down), x, ids, w), exact)
    assert errs["INT8"] < 0.015
    assert errs["INT4"] < 0.75 * per_row


def test_errors():
    with CPUMoE("INT8") as m:
        with pytest.raises(KtliteError, match="no CPU experts"):
            m.forward(5, torch.zeros(1, H), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1))
    with pytest.raises(ValueError, match="threadpool count"):
        CPUMoE("INT8", num_threads=1, threadpool_count=2)


def test_swap_expert_and_dequantized_expert():
    gate, up, down = experts()
    with CPUMoE("INT8", 64) as m, CPUMoE("INT8", 64) as want:
        m.add_layer(0, gate, up, down, cpu_experts=[1, 2])
        m.swap_expert(0, 2, 5, gate[5], up[5], down[5])  # 2 goes to the GPU, 5 comes to the CPU
        want.add_layer(0, gate, up, down, cpu_experts=[1, 5])
        assert m.nbytes() == want.nbytes()
        for e in (1, 5):
            for a, b in zip(m.dequantized_expert(0, e), want.dequantized_expert(0, e)):
                assert torch.equal(a, b)
        w13, w2 = m.dequantized_expert(0, 5, torch.bfloat16)
        assert w13.shape == (2 * I, H) and w2.shape == (H, I) and w13.dtype == torch.bfloat16
        skip = torch.ones(E, dtype=torch.bool)
        skip[[1, 5]] = False
        x, ids, w = routing(3)
        assert torch.equal(m.forward(0, x, ids, w, skip), want.forward(0, x, ids, w, skip))
        with pytest.raises(KtliteError, match="not on CPU"):
            m.dequantized_expert(0, 2)
        with pytest.raises(KtliteError, match="already on CPU"):
            m.swap_expert(0, 1, 5, gate[5], up[5], down[5])


@pytest.mark.parametrize("method", ["INT8", "INT4"])
@pytest.mark.parametrize("group", [32, 128])
def test_group_sizes_both_paths(method, group):
    """The vector row kernels pick scales per 32-weight block by shifts: G = 32 and 128 as well as 64."""
    with CPUMoE(method, group, prefill_threshold=8, prefill_dtype=torch.float32) as m:
        m.add_layer(0, *experts(3))
        for t in (1, 4, 40):  # GEMV kernel (one and several tokens per expert), dequantize + matmul
            x, ids, w = routing(t, seed=t)
            assert relative_error(m.forward(0, x, ids, w), reference(*stored(m), x, ids, w)) < 1e-5


def test_silu_mul_matches_torch():
    """simd.silu_mul (the AMX path's vector SiLU; run here on any CPU), on a 2-D array as moe_amx passes it:
    g u / (1 + exp(-g)) to float rounding, also where exp(-g) leaves fp32's range (clamped: |g| > 87)."""
    g = torch.cat([torch.linspace(-120.0, 120.0, 2392), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 300.0,
                                                                       -300.0])]).reshape(150, 16)
    u = torch.randn(150, 16, generator=torch.Generator().manual_seed(0))
    got = g.numpy().copy()
    numba.njit(lambda g, u: simd.silu_mul(g, u))(got, u.numpy())  # an intrinsic: callable from jitted code only
    want = torch.nn.functional.silu(g.double()) * u.double()
    torch.testing.assert_close(torch.from_numpy(got).double(), want, rtol=1e-6, atol=1e-30)


def test_transpose_sums_matches_numpy():
    """amx_tiles.transpose_sums (the AMX path's sums of one activation tile, rows x tokens, turned tokens x rows so each
    token's results are one contiguous run; vector shuffles, run here on any CPU): exactly numpy's transpose."""
    src = torch.randn(amx_tiles.AMX_BLOCK_ROWS, amx_tiles.AMX_ROWS, generator=torch.Generator().manual_seed(1)).numpy()
    got = np.empty((amx_tiles.AMX_ROWS, amx_tiles.AMX_BLOCK_ROWS), np.float32)
    numba.njit(lambda a, b: amx_tiles.transpose_sums(a, b))(src, got)
    assert (got == src.T).all()


@pytest.mark.parametrize("skip", [0, 5, 16, 21])
@pytest.mark.parametrize("weighted", [False, True], ids=["act-stored", "out-added"])
def test_tile_into_rows_matches_numpy(weighted, skip):
    """amx_tiles.tile_into_rows (the AMX path's write of one tile's results into its pairs' rows; masked vector
    stores, run here on any CPU): pairs p0..p0 + n - 1 write columns col0 + skip .. col0 + 31 of their rows, stored
    (gate_up's act) or added with the pair's weight (down's out); every other value of dst is left as it was."""
    gen = torch.Generator().manual_seed(2)
    by_token = torch.randn(amx_tiles.AMX_ROWS, amx_tiles.AMX_BLOCK_ROWS, generator=gen).numpy()
    dst = torch.randn(9, 80, generator=gen).numpy()
    rows = np.array([7, 3, 3, 0, 8, 1, 5, 2], np.int64)  # a row twice: two pairs of one token add up
    w = torch.rand(8, generator=gen).numpy() if weighted else np.empty(0, np.float32)
    p0, n, col0 = 1, 5, 40
    want = dst.astype(np.float64)
    for c in range(n):
        v = by_token[c, skip:].astype(np.float64)
        cols = slice(col0 + skip, col0 + amx_tiles.AMX_BLOCK_ROWS)
        want[rows[p0 + c], cols] = want[rows[p0 + c], cols] + w[p0 + c] * v if weighted else v
    numba.njit(lambda *a: amx_tiles.tile_into_rows(*a))(by_token, dst, rows, p0, n, w, col0, skip)
    np.testing.assert_allclose(dst, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("group", [64, 128, 384])
def test_quantize_groups_to_nearest_code(group):
    """activations.quantize_groups (the AMX tiles' activations, each row once): per group of values (a weight group, or
    the whole row: 384) the scale max |x| / 127 (to fp32 rounding: fastmath divides by a reciprocal) and each code the
    nearest one, the largest value at +-127 (an all-zero group: scale 0, zeros)."""
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(group)).numpy()
    x[1, :64] = 0.0
    x[2] = 0.0
    xq, xd = activations.quantize_groups(x, group)
    groups = x.reshape(5, -1, group)
    np.testing.assert_allclose(xd, np.abs(groups).max(-1) / 127, rtol=1e-6)
    codes = xq.reshape(groups.shape).astype(np.float64)
    step = xd[..., None].astype(np.float64)
    assert (np.abs(codes * step - groups) <= 0.5 * step * (1 + 1e-5)).all()
    assert (np.abs(codes).max(-1) == np.where(xd > 0, 127, 0)).all()


@pytest.mark.parametrize("pools", [1, 3])
def test_pairs_grouped_by_pool_then_slot_then_token(pools):
    """The compiled grouping against the obvious Python one: padding / out-of-range ids and skipped
    experts dropped, each pool's slots ascending, each slot's tokens in order."""
    g = torch.Generator().manual_seed(pools)
    n_experts, stored_experts = 12, [0, 2, 3, 5, 7, 8, 11]
    slot_of = torch.full((n_experts,), -1, dtype=torch.int64)
    slot_of[stored_experts] = torch.arange(len(stored_experts))
    pool_of = torch.arange(len(stored_experts)) % pools
    ids = torch.tensor(stored_experts)[torch.randint(0, len(stored_experts), (9, 4), generator=g)]
    ids[0, 1], ids[4, 2], ids[6, 0] = -1, n_experts, 4  # padding, out of range, skipped (not stored)
    weights = torch.rand(9, 4, generator=g)
    skip = torch.zeros(n_experts, dtype=torch.bool)
    skip[[4, 8]] = True
    slots, tok_ptr, tok_idx, tok_w, pool_ptr, missing = moe_kernels.group_pairs(
        ids.numpy(), weights.numpy(), slot_of.numpy(), pool_of.numpy(), skip.numpy(), pools)
    assert missing == -1
    expected = {}  # slot -> [(token, weight)]
    for t in range(9):
        for j in range(4):
            e = int(ids[t, j])
            if 0 <= e < n_experts and not skip[e]:
                expected.setdefault(int(slot_of[e]), []).append((t, float(weights[t, j])))
    order = sorted(expected, key=lambda s: (int(pool_of[s]), s))
    assert slots.tolist() == order
    for p in range(pools):
        assert all(int(pool_of[s]) == p for s in slots[pool_ptr[p]:pool_ptr[p + 1]])
    got = {int(s): list(zip(tok_idx[tok_ptr[m]:tok_ptr[m + 1]].tolist(), tok_w[tok_ptr[m]:tok_ptr[m + 1]].tolist()))
           for m, s in enumerate(slots)}
    assert got == {s: [(t, pytest.approx(w)) for t, w in pairs] for s, pairs in expected.items()}
    skip[4] = False  # expert 4 is selected, not stored, not skipped: reported
    assert moe_kernels.group_pairs(ids.numpy(), weights.numpy(), slot_of.numpy(), pool_of.numpy(), skip.numpy(),
                                   pools)[-1] == 4


_LAYER_SCRIPT = """
import numba, torch
from ktlite.kernels.cpu.quant import quantize
quantize(torch.randn(8, 64), "INT4", 32)  # a parallel kernel: numba starts its threading layer
print(numba.threading_layer())
"""


def _tbb_installed() -> bool:
    try:
        importlib.metadata.distribution("tbb")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.parametrize("asked", [None, "tbb", "omp"])
def test_threading_layer(asked):
    """tbb wherever the tbb package is installed (threads.py: OpenMP's sleeping workers cost ~1 ms a parallel
    region launched from the engine's thread), also when NUMBA_THREADING_LAYER asks for it (numba alone would not
    find the wheel's library); omp when asked for."""
    if asked != "omp" and not _tbb_installed():
        pytest.skip("the tbb package is not installed (a dependency on x86-64 only)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    if asked:
        env["NUMBA_THREADING_LAYER"] = asked
    res = subprocess.run([sys.executable, "-c", _LAYER_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == (asked or "tbb")


_PARALLEL_SCRIPT = """
import sys, warnings
import numpy as np, torch
from numba.core.errors import NumbaPerformanceWarning
from ktlite.kernels.cpu import moe_kernels
from ktlite.kernels.cpu.quant import quantize
warnings.simplefilter("error", NumbaPerformanceWarning)
method, q8 = sys.argv[1], sys.argv[2] == "1"
gu, dn = quantize(torch.randn(1, 128, 64), method, 64), quantize(torch.randn(1, 64, 64), method, 64)
moe_kernels.moe_rows(np.zeros((1, gu.kp), np.float32), np.zeros(1, np.int64), np.array([0, 1]),
                     np.zeros(1, np.int64), np.ones(1, np.float32), gu.qweight, gu.scales, dn.qweight, dn.scales,
                     gu.group_shift, dn.group_shift, q8,
                     np.zeros((2, 2, max(gu.kp, dn.kp)), np.float32), np.zeros((1, dn.kp), np.float32),
                     np.zeros((1, 64), np.float32), moe_kernels.PLAIN)
print("parallel")
"""


@pytest.mark.parametrize("method, q8", [("BF16", False), ("INT4", True)], ids=["BF16-rows", "INT4-int8-activations"])
def test_row_kernel_loops_stay_parallel(method, q8, tmp_path):
    """moe_rows compiled afresh (its own numba cache) raises no NumbaPerformanceWarning: a `raise` reachable inside a
    prange body (once tile_dot_q8's guard for non-integer rows) makes numba run the loop on one thread, and BF16 /
    FP8 / GGUF experts decoded 2.3x slower on 2 cores without any result changing."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", _PARALLEL_SCRIPT, method, "1" if q8 else "0"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.split()[-1] == "parallel", res.stderr[-3000:]


@pytest.fixture(scope="module")
def biased_activation():
    """gpt-oss's clamped SwiGLU (limit 0.5: most values are clamped) with gate_up and down biases."""
    from ktlite.kernels.expert_activation import ExpertActivation

    g = torch.Generator().manual_seed(9)
    return ExpertActivation("swiglu_oai", limit=0.5, alpha=1.702), (0.3 * torch.randn(E, 2 * I, generator=g),
                                                                     0.3 * torch.randn(E, H, generator=g))


@pytest.mark.parametrize("t", [1, 5, 40])  # 1, 5: the row kernels (forward's one compiled call, submit's pools); 40: matmul
def test_activation_and_biases_in_every_path(moe, biased_activation, t):
    activation, (b13, b2) = biased_activation
    layer = moe.layers[0]
    moe.set_activation(0, activation, (b13, b2))
    try:
        x, ids, w = routing(t, seed=3)
        gate, up, down = stored(moe)
        want = torch.zeros(t, H, dtype=torch.float64)
        for tok in range(t):
            for j in range(K):
                e = int(ids[tok, j])
                g = (gate[e].double() @ x[tok].double() + b13[e, :I].double()).clamp(max=0.5)
                u = (up[e].double() @ x[tok].double() + b13[e, I:].double()).clamp(-0.5, 0.5)
                want[tok] += float(w[tok, j]) * (down[e].double() @ (g * torch.sigmoid(1.702 * g) * (u + 1))
                                                 + b2[e].double())
        assert relative_error(moe.forward(0, x, ids, w), want.float()) < 1e-5
        assert relative_error(moe.submit(0, x, ids, w).wait(), want.float()) < 1e-5
    finally:
        layer.activation, layer.biases = moe_module.SWIGLU, None
