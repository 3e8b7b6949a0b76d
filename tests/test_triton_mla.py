"""MLA decode/extend: Triton (under TRITON_INTERPRET on CPU) vs torch twin vs a naive reference
that decompresses K/V with random W_UK/W_UV and runs standard attention.

Tolerances (max abs error; outputs are averages of N(0,1) latents, |out| < ~2):
- twin vs naive (fp32 pool, float64 naive): 1e-4.
- Triton vs twin (atol + rtol * |twin|): fp32 1e-4 + 0; fp16 2e-3 + 2e-3; bf16 1.6e-2 + 1.6e-2
  (about 2 bf16 ulps at |out| ~ 2; measured max 0.0156 for extend, 0.004 for decode). The twin computes in fp32 from the stored
  values; Triton rounds the softmax probabilities to the pool dtype before the P @ V dot (as on
  a GPU), which is the error budget for fp16/bf16.
Packed FP8 pools (kv_fp8.latent_rows; the references read the values the rows hold, so the FP8
rounding itself is test_kv_fp8's): fp32 queries as the fp32 pool; bf16 queries as bf16 (Triton also
rounds each dequantized latent to bf16 for tl.dot; measured max 0.008 decode, 0.031 extend, within
atol + rtol * |twin| at |out| ~ 2).
"""

import math
import os

import subprocess
import sys

import pytest
import torch

import ktlite.kernels.triton as kt
from ktlite.kernels import attention

with kt.interpreted():
    from ktlite.kernels.triton.decode_attn import mla_decode_triton
    from ktlite.kernels.triton.extend_attn import mla_extend_triton
from ktlite.kernels.cpu import attention as cpu_attention
from ktlite.kernels.triton.kv_fp8 import latent_rows
from ktlite.kernels.triton.reference import mla_decode_torch, mla_extend_torch



@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    # triton also reads TRITON_INTERPRET at launch, so it must be set while the kernels run
    monkeypatch.setenv("TRITON_INTERPRET", "1")


KV_LORA, ROPE, NOPE, V_DIM = 32, 16, 24, 20
TOL = {torch.float32: (1e-4, 0.0), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


class Pool:
    """A token pool with requests scattered over non-contiguous slots and req rows; `packed`: FP8 rows
    (uint8), whose values (what the references read) are `values`."""

    def __init__(self, lens: list[int], dtype: torch.dtype, kv_lora: int = KV_LORA, rope: int = ROPE, seed: int = 0,
                 packed: bool = False):
        g = torch.Generator().manual_seed(seed)
        total = sum(lens)
        num_slots = total + 11
        values = torch.randn(num_slots, kv_lora + rope, generator=g)
        if packed:
            rows = latent_rows(kv_lora, rope)
            self.kv_buffer = rows.pack(values)
            self.values = rows.unpack(self.kv_buffer)
        else:
            self.kv_buffer = self.values = values.to(dtype)
        slots = torch.randperm(num_slots, generator=g)[:total]
        self.req_to_token = torch.zeros(len(lens) + 3, max(lens) + 5, dtype=torch.int32)
        # requests live in shuffled rows of req_to_token
        self.req_pool_indices = torch.randperm(len(lens) + 3, generator=g)[: len(lens)].to(torch.int32)
        start = 0
        for row, n in zip(self.req_pool_indices.tolist(), lens):
            self.req_to_token[row, :n] = slots[start : start + n].to(torch.int32)
            start += n
        self.kv_lora = kv_lora


def absorbed_inputs(num_tokens: int, heads: int, dtype: torch.dtype, kv_lora: int = KV_LORA, rope: int = ROPE):
    """Random q_nope/q_pe, W_UK/W_UV and the absorbed query [N, H, kv_lora + rope]."""
    g = torch.Generator().manual_seed(1)
    q_nope = torch.randn(num_tokens, heads, NOPE, generator=g) * 0.3
    q_pe = torch.randn(num_tokens, heads, rope, generator=g) * 0.3
    w_uk = torch.randn(heads, NOPE, kv_lora, generator=g) / math.sqrt(NOPE)
    w_uv = torch.randn(heads, V_DIM, kv_lora, generator=g) / math.sqrt(kv_lora)
    q = torch.cat([torch.einsum("nhd,hdc->nhc", q_nope, w_uk), q_pe], dim=-1).to(dtype)
    return q, q_nope, q_pe, w_uk, w_uv


def naive_attention(pool: Pool, q_nope, q_pe, w_uk, w_uv, prefix_lens, extend_lens, sm_scale):
    """Decompressed MLA: k = [latent_c @ W_UK^T, k_pe], v = latent_c @ W_UV^T, causal softmax (float64)."""
    outs = []
    start = 0
    for row, prefix, n in zip(pool.req_pool_indices.tolist(), prefix_lens, extend_lens):
        kv = pool.values[pool.req_to_token[row, : prefix + n].long()].double()
        latent, k_pe = kv[:, : pool.kv_lora], kv[:, pool.kv_lora :]
        k_nope = torch.einsum("lc,hdc->lhd", latent, w_uk.double())
        v = torch.einsum("lc,hdc->lhd", latent, w_uv.double())
        qn, qp = q_nope[start : start + n].double(), q_pe[start : start + n].double()
        scores = (torch.einsum("nhd,lhd->nhl", qn, k_nope) + torch.einsum("nhd,ld->nhl", qp, k_pe)) * sm_scale
        causal = torch.arange(prefix + n)[None, :] > (torch.arange(n) + prefix)[:, None]
        scores.masked_fill_(causal[:, None, :], float("-inf"))
        outs.append(torch.einsum("nhl,lhd->nhd", scores.softmax(-1), v))
        start += n
    return torch.cat(outs)


def yarn_scale() -> float:
    mscale = 0.1 * 1.0 * math.log(40.0) + 1.0  # yarn mscale(factor=40, mscale_all_dim=1)
    return mscale * mscale / math.sqrt(NOPE + ROPE)


DECODE_LENS = [1, 37, 64, 100]  # length 1, non-multiples of block_n=16, a multiple
EXTEND_CASES = [  # (prefix_lens, extend_lens): prefix 0, chunk of 1, ragged, an empty chunk
    ([0, 5, 33, 0, 7], [1, 17, 8, 40, 0]),
]


LAYOUTS = [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False), (torch.float32, True),
           (torch.bfloat16, True)]  # (q dtype, packed FP8 pool)


@pytest.mark.parametrize("dtype,packed", LAYOUTS)
def test_decode_matches_twin_and_naive(dtype: torch.dtype, packed: bool) -> None:
    heads = 6  # not a multiple of block_h=4: masked head group
    pool = Pool(DECODE_LENS, dtype, packed=packed)
    q, q_nope, q_pe, w_uk, w_uv = absorbed_inputs(len(DECODE_LENS), heads, dtype)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    args = (q, pool.kv_buffer, pool.req_to_token, pool.req_pool_indices, seq_lens, yarn_scale(), KV_LORA)
    twin = mla_decode_torch(*args)
    # 4 splits: the length-1 request has three empty chunks
    tri = mla_decode_triton(*args, num_kv_splits=4, block_h=4, block_n=16)
    assert tri.shape == (len(DECODE_LENS), heads, KV_LORA) and tri.dtype == dtype
    torch.testing.assert_close(tri.float(), twin.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    if dtype == torch.float32:
        naive = naive_attention(pool, q_nope, q_pe, w_uk, w_uv, [n - 1 for n in DECODE_LENS], [1] * 4, yarn_scale())
        absorbed = torch.einsum("nhc,hdc->nhd", twin.double(), w_uv.double())
        torch.testing.assert_close(absorbed, naive, atol=1e-4, rtol=0)


def test_decode_single_split_and_odd_dims() -> None:
    """One chunk per request and a latent/rope width that is not a power of two (masked lanes)."""
    kv_lora, rope = 24, 8
    pool = Pool([3, 50], torch.float32, kv_lora, rope)
    q = absorbed_inputs(2, 4, torch.float32, kv_lora, rope)[0]
    args = (q, pool.kv_buffer, pool.req_to_token, pool.req_pool_indices, torch.tensor([3, 50]), 0.2, kv_lora)
    tri = mla_decode_triton(*args, num_kv_splits=1, block_h=4, block_n=32)
    torch.testing.assert_close(tri, mla_decode_torch(*args), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype,packed", [layout for layout in LAYOUTS if layout[0] != torch.float16])
@pytest.mark.parametrize("prefix_lens,extend_lens", EXTEND_CASES)
def test_extend_matches_twin_and_naive(dtype: torch.dtype, packed: bool, prefix_lens: list[int],
                                       extend_lens: list[int]) -> None:
    heads = 6
    pool = Pool([p + e for p, e in zip(prefix_lens, extend_lens)], dtype, packed=packed)
    q, q_nope, q_pe, w_uk, w_uv = absorbed_inputs(sum(extend_lens), heads, dtype)
    args = (
        q, pool.kv_buffer, pool.req_to_token, pool.req_pool_indices,
        torch.tensor(prefix_lens, dtype=torch.int32), torch.tensor(extend_lens, dtype=torch.int32),
        yarn_scale(), KV_LORA,
    )
    twin = mla_extend_torch(*args)
    tri = mla_extend_triton(*args, block_t=8, block_h=4, block_n=32)
    assert tri.shape == (sum(extend_lens), heads, KV_LORA)
    torch.testing.assert_close(tri.float(), twin.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    if dtype == torch.float32:
        naive = naive_attention(pool, q_nope, q_pe, w_uk, w_uv, prefix_lens, extend_lens, yarn_scale())
        absorbed = torch.einsum("nhc,hdc->nhd", twin.double(), w_uv.double())
        torch.testing.assert_close(absorbed, naive, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_lora,rope", [(32, 16), (24, 8), (256, 16)])
def test_packed_pool_fp8_bytes_path_and_partial_scale_groups(kv_lora: int, rope: int) -> None:
    """The pre-sm89 path (fp8 bytes decoded with integer ops) gives the native fp8 path's result, and
    both equal the twin, for a latent in one scale group narrower than 128 (24, 32) and in two groups.
    The buffer is the second layer of a pool's [layers, slots, bytes] tensor, as the model passes it."""
    pool = Pool([7, 40], torch.float32, kv_lora, rope, packed=True)
    layers = torch.zeros(2, *pool.kv_buffer.shape, dtype=torch.uint8)
    layers[1] = pool.kv_buffer
    q = absorbed_inputs(2, 4, torch.float32, kv_lora, rope)[0]
    common = (q, layers[1], pool.req_to_token, pool.req_pool_indices)
    twin = mla_decode_torch(*common, torch.tensor([7, 40]), 0.3, kv_lora)
    for bits in (False, True):
        dec = mla_decode_triton(*common, torch.tensor([7, 40]), 0.3, kv_lora, num_kv_splits=2, block_h=4, block_n=16,
                                e4m3_bits=bits)
        ext = mla_extend_triton(*common, torch.tensor([6, 39]), torch.tensor([1, 1]), 0.3, kv_lora, block_t=4,
                                block_h=4, block_n=16, e4m3_bits=bits)
        torch.testing.assert_close(dec, twin, atol=1e-4, rtol=0)
        torch.testing.assert_close(ext, twin, atol=1e-4, rtol=0)


def test_decode_padding_row_of_length_zero_is_zero() -> None:
    """A seq_len-0 row (padding in a fixed-size, CUDA-graph batch) gives zeros, not NaN, and leaves
    the other rows alone."""
    pool = Pool([1, 20], torch.float32)
    q = absorbed_inputs(2, 4, torch.float32)[0]
    common = (q, pool.kv_buffer, pool.req_to_token, pool.req_pool_indices)
    tri = mla_decode_triton(*common, torch.tensor([0, 20]), 0.3, KV_LORA, num_kv_splits=2, block_h=4, block_n=16)
    assert torch.count_nonzero(tri[0]) == 0
    torch.testing.assert_close(tri[1], mla_decode_torch(*common, torch.tensor([1, 20]), 0.3, KV_LORA)[1], atol=1e-5, rtol=0)


def test_extend_last_token_equals_decode() -> None:
    """Chunked prefill then decode see the same context: extend's last row == decode of that token."""
    pool = Pool([9, 30], torch.float32)
    q = absorbed_inputs(2, 4, torch.float32)[0]
    common = (pool.kv_buffer, pool.req_to_token, pool.req_pool_indices)
    dec = mla_decode_triton(q, *common, torch.tensor([9, 30]), 0.3, KV_LORA, num_kv_splits=2, block_h=4, block_n=16)
    ext = mla_extend_triton(
        q, *common, torch.tensor([8, 29]), torch.tensor([1, 1]), 0.3, KV_LORA, block_t=4, block_h=4, block_n=16
    )
    torch.testing.assert_close(ext, dec, atol=1e-5, rtol=0)


def test_dispatch_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool([5], torch.float32)
    q = absorbed_inputs(1, 2, torch.float32)[0]
    args = (q, pool.kv_buffer, pool.req_to_token, pool.req_pool_indices, torch.tensor([5]), 0.3, KV_LORA)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kt.use_triton(q) and cpu_attention.accepts(q, pool.kv_buffer)  # fp32 on CPU: the compiled kernel
    torch.testing.assert_close(attention.mla_decode(*args), mla_decode_torch(*args))
    assert not cpu_attention.accepts(q.bfloat16(), pool.kv_buffer.bfloat16())  # bf16: the twin
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kt.use_triton(q)
    torch.testing.assert_close(attention.mla_decode(*args), mla_decode_torch(*args), atol=1e-4, rtol=0)
    monkeypatch.setenv("KTLITE_FORCE_TORCH_KERNELS", "1")
    assert not kt.use_triton(q)
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_kernels_compile_for_gpu() -> None:
    """ptxas compile of the GPU launch configurations (DeepSeek-V3 sizes) for sm90: catches
    what the interpreter accepts but a GPU rejects. Runs without TRITON_INTERPRET in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "ktlite.kernels.triton.aot_check", "--only", "mla", "--arch", "90"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("splits", [1, 3, 8])  # one run per request; runs merged; more runs than some requests' positions
@pytest.mark.parametrize("heads", [4, 16])
def test_compiled_cpu_decode(splits: int, heads: int) -> None:
    """The compiled CPU decode kernel against the float64 naive attention (and the twin), over split
    runs: lengths 1 (runs left empty), 37, 64, 300."""
    lens = [1, 37, 64, 300]
    pool = Pool(lens, torch.float32)
    q, q_nope, q_pe, w_uk, w_uv = absorbed_inputs(len(lens), heads, torch.float32)
    seq_lens = torch.tensor(lens)
    args = (q, pool.kv_buffer, pool.req_to_token, pool.req_pool_indices, seq_lens, yarn_scale(), KV_LORA)
    out = cpu_attention.mla_decode(*args, splits=splits)
    ref = naive_attention(pool, q_nope, q_pe, w_uk, w_uv, [n - 1 for n in lens], [1] * len(lens), yarn_scale())
    got = torch.einsum("nhc,hdc->nhd", out.double(), w_uv.double())
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(out, mla_decode_torch(*args), atol=1e-5, rtol=0)


@pytest.mark.parametrize("shared, heads, want", [(232448, 128, (64, 64, 8)), (232448, 16, (16, 64, 8)),
                                                 (166912, 32, (32, 64, 8)), (101376, 128, (16, 32, 4))])
def test_decode_tiles_follow_the_gpu_shared_memory(monkeypatch, shared, heads, want):
    """Wide stage-1 tiles (147-148 KB of shared memory) only where the GPU has that much per block; the head block
    never exceeds the (power-of-two rounded, >= 16) head count; the CPU (interpreter) keeps the narrow tiles."""
    from types import SimpleNamespace

    from ktlite.kernels.triton import decode_attn

    props = SimpleNamespace(shared_memory_per_block_optin=shared, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert decode_attn.stage1_tiles(torch.device("cuda", 0), heads) == want
    assert decode_attn.stage1_tiles(torch.device("cpu"), heads) == decode_attn.NARROW_TILES
