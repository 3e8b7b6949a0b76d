"""GQA decode/extend: Triton (under TRITON_INTERPRET on CPU) vs torch twin vs a dense causal
softmax reference written here (float64, one query head at a time, kv head = h // group).

Pools are token pools as the runtime has them: each request's K/V rows sit in shuffled slots,
requests in shuffled rows of req_to_token, index tensors int64 (as ForwardBatch builds them).

FP8 pools are packed rows (kv_fp8.head_rows: e4m3 codes and an fp32 scale per token and kv head) whose scales
differ from token to token: channel 3 of every head is K x 8 and, in V, 500 to 1,000 (past e4m3's 448; of one
sign, so its averages cannot cancel below the rounding of the terms). The reference reads the rows unpacked.

Tolerances (max abs error; outputs are averages of N(0,1) values, |out| < ~3, the FP8 pools' channel 3
500 to 1,000):
- twin vs dense (fp32 or fp8 pool, float64 dense): 1e-5 (+ 1e-6 relative, for the outlier channel).
- Triton vs twin (atol + rtol * |twin|): fp32 1e-5 + 0; fp16 2e-3 + 2e-3; bf16 and fp8 pools (bf16
  queries) 1.6e-2 + 1.6e-2 (about 2 bf16 ulps at |out| ~ 2). The twin computes in fp32 from the
  stored values; Triton rounds the softmax probabilities (and an FP8 pool's dequantized V tiles) to q's
  dtype before the P @ V dot (as on a GPU), which is the error budget.
bf16 runs under the interpreter too: common.dot widens the operands to fp32 there (the
interpreter's own bf16 tl.dot multiplies bit patterns), so the bf16 cases test the kernel's
roundings, not the interpreter's bug.
"""

import os
import subprocess
import sys

import pytest
import torch

import ktlite.kernels.triton as kt
from ktlite.kernels import attention

with kt.interpreted():
    from ktlite.kernels.triton.gqa_decode_attn import gqa_decode_triton
    from ktlite.kernels.triton.gqa_extend_attn import gqa_extend_triton
from ktlite.kernels.triton.kv_fp8 import FP8_MAX, head_rows
from ktlite.kernels.triton.reference import gather_heads, gqa_decode_torch, gqa_extend_torch


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    # triton also reads TRITON_INTERPRET at launch, so it must be set while the kernels run
    monkeypatch.setenv("TRITON_INTERPRET", "1")


FP8 = torch.float8_e4m3fn  # stands for a packed FP8 pool (uint8 rows)
TOL = {torch.float32: (1e-5, 0.0), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2), FP8: (1.6e-2, 1.6e-2)}
OUTLIER = 500.0  # channel 3 of every V head in an FP8 pool is 500 to 1,000


class Pool:
    """K/V pools [slots, Hkv, D] with requests scattered over non-contiguous slots and req rows.
    An fp8 pool holds packed rows [slots, Hkv, D + 4] uint8 of values with an outlier channel."""

    def __init__(self, lens: list[int], kv_heads: int, head_d: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        total = sum(lens)
        num_slots = total + 13
        k = torch.randn(num_slots, kv_heads, head_d, generator=g)
        v = torch.randn(num_slots, kv_heads, head_d, generator=g)
        if dtype == FP8:
            k[..., 3] *= 8.0
            v[..., 3] = OUTLIER * (1 + torch.rand(num_slots, kv_heads, generator=g))
            self.k_buffer, self.v_buffer = head_rows(head_d).pack(k), head_rows(head_d).pack(v)
        else:
            self.k_buffer, self.v_buffer = k.to(dtype), v.to(dtype)
        slots = torch.randperm(num_slots, generator=g)[:total]
        self.req_to_token = torch.zeros(len(lens) + 3, max(lens) + 5, dtype=torch.int32)
        self.req_pool_indices = torch.randperm(len(lens) + 3, generator=g)[: len(lens)]
        start = 0
        for row, n in zip(self.req_pool_indices.tolist(), lens):
            self.req_to_token[row, :n] = slots[start : start + n].to(torch.int32)
            start += n

    def args(self) -> tuple:
        return self.k_buffer, self.v_buffer, self.req_to_token, self.req_pool_indices

    def real(self, buf: torch.Tensor, row: int, n: int) -> torch.Tensor:
        """The first n tokens' values of request row in float64, [n, Hkv, D] (packed rows unpacked)."""
        return gather_heads(buf, self.req_to_token[row, :n].long()).double()


def queries(num_tokens: int, heads: int, head_d: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """[N, H, D] in dtype (bf16 for fp8 pools), as a non-contiguous view like q split from a gate."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, heads, 2 * head_d, generator=g).to(torch.bfloat16 if dtype == FP8 else dtype)
    return q[..., :head_d]


def dense_attention(q: torch.Tensor, pool: Pool, prefix_lens: list[int], extend_lens: list[int],
                    sm_scale: float, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """float64 [N, Hq, D]: each query token attends to its request's positions 0..its own (the last `window` of
    them when window > 0); sinks [Hq]: a logit per head with value 0, in the softmax's denominator only."""
    heads, group = q.shape[1], q.shape[1] // pool.k_buffer.shape[1]
    out = torch.zeros(q.shape[0], heads, q.shape[2], dtype=torch.float64)
    start = 0
    for row, prefix, n in zip(pool.req_pool_indices.tolist(), prefix_lens, extend_lens):
        k = pool.real(pool.k_buffer, row, prefix + n)
        v = pool.real(pool.v_buffer, row, prefix + n)
        pos_k, pos_q = torch.arange(prefix + n)[None, :], torch.arange(prefix, prefix + n)[:, None]
        hidden = (pos_k > pos_q) | ((pos_k <= pos_q - window) if window else False)  # [n, L]
        for h in range(heads):
            scores = (q[start : start + n, h].double() @ k[:, h // group].T * sm_scale).masked_fill(hidden, float("-inf"))
            sink = float("-inf") if sinks is None else float(sinks[h])
            probs = torch.cat([scores, torch.full((n, 1), sink, dtype=torch.float64)], -1).softmax(-1)[:, :-1]
            out[start : start + n, h] = probs @ v[:, h // group]
        start += n
    return out


def assert_close(tri: torch.Tensor, twin: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(tri.float(), twin.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])


DECODE_LENS = [1, 37, 64, 130]  # length 1 (an empty chunk of 2), partial tiles, a full tile, 3 tiles
PREFIX_LENS, EXTEND_LENS = [0, 5, 33, 0, 7], [1, 17, 8, 40, 0]  # no prefix, 1-token chunk, ragged, empty
# (kv heads, query heads per kv head, head dim): kv heads 1/2/4/8, groups 1..8, head dims 64 and 128
SHAPES = [(1, 1, 64), (1, 8, 128), (2, 3, 64), (2, 6, 128), (4, 2, 128), (4, 5, 64), (8, 4, 64), (1, 7, 64)]
SCALE = 0.125


def shape_id(shape: tuple[int, int, int]) -> str:
    return "kv{}x{}_d{}".format(*shape)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_decode_matches_twin(shape: tuple[int, int, int]) -> None:
    kv_heads, group, head_d = shape
    pool = Pool(DECODE_LENS, kv_heads, head_d, torch.float32)
    q = queries(len(DECODE_LENS), kv_heads * group, head_d, torch.float32)
    seq_lens = torch.tensor(DECODE_LENS)
    twin = gqa_decode_torch(q, *pool.args(), seq_lens, SCALE)
    tri = gqa_decode_triton(q, *pool.args(), seq_lens, SCALE, num_kv_splits=2)
    assert tri.shape == (len(DECODE_LENS), kv_heads * group, head_d) and tri.dtype == torch.float32
    assert_close(tri, twin, torch.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_extend_matches_twin(shape: tuple[int, int, int]) -> None:
    kv_heads, group, head_d = shape
    pool = Pool([p + e for p, e in zip(PREFIX_LENS, EXTEND_LENS)], kv_heads, head_d, torch.float32)
    q = queries(sum(EXTEND_LENS), kv_heads * group, head_d, torch.float32)
    lens = torch.tensor(PREFIX_LENS), torch.tensor(EXTEND_LENS)
    twin = gqa_extend_torch(q, *pool.args(), *lens, SCALE)
    tri = gqa_extend_triton(q, *pool.args(), *lens, SCALE, block_n=32)
    assert tri.shape == (sum(EXTEND_LENS), kv_heads * group, head_d)
    assert_close(tri, twin, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, FP8], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 64), (4, 2, 128)], ids=shape_id)
def test_twin_matches_dense_reference(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    kv_heads, group, head_d = shape
    pool = Pool([p + e for p, e in zip(PREFIX_LENS, EXTEND_LENS)], kv_heads, head_d, dtype)
    q = queries(sum(EXTEND_LENS), kv_heads * group, head_d, torch.float32)
    twin = gqa_extend_torch(q, *pool.args(), torch.tensor(PREFIX_LENS), torch.tensor(EXTEND_LENS), SCALE)
    dense = dense_attention(q, pool, PREFIX_LENS, EXTEND_LENS, SCALE)
    torch.testing.assert_close(twin.double(), dense, atol=1e-5, rtol=1e-6)
    # decode: the last token of each request after its whole context
    rows = torch.tensor([p + e for p, e in zip(PREFIX_LENS, EXTEND_LENS)])
    twin_dec = gqa_decode_torch(q[: len(rows)], *pool.args(), rows, SCALE)
    dense_dec = dense_attention(q[: len(rows)], pool, (rows - 1).tolist(), [1] * len(rows), SCALE)
    torch.testing.assert_close(twin_dec.double(), dense_dec, atol=1e-5, rtol=1e-6)
    if dtype == FP8:  # the pool really holds values e4m3 alone would clip
        assert pool.real(pool.v_buffer, pool.req_pool_indices[3].item(), 40).abs().max() > FP8_MAX


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8], ids=str)
def test_pool_dtypes(dtype: torch.dtype) -> None:
    """Half-precision pools and a packed FP8 pool with outliers (bf16 queries), decode and extend."""
    kv_heads, group, head_d = 2, 4, 64
    pool = Pool([p + e for p, e in zip(PREFIX_LENS, EXTEND_LENS)], kv_heads, head_d, dtype)
    q = queries(sum(EXTEND_LENS), kv_heads * group, head_d, dtype)
    lens = torch.tensor(PREFIX_LENS), torch.tensor(EXTEND_LENS)
    tri = gqa_extend_triton(q, *pool.args(), *lens, SCALE)
    assert tri.dtype == q.dtype
    assert_close(tri, gqa_extend_torch(q, *pool.args(), *lens, SCALE), dtype)
    seq_lens = lens[0] + lens[1].clamp(min=1)
    q_dec = q[: len(seq_lens)]
    tri_dec = gqa_decode_triton(q_dec, *pool.args(), seq_lens, SCALE, num_kv_splits=3)
    assert_close(tri_dec, gqa_decode_torch(q_dec, *pool.args(), seq_lens, SCALE), dtype)
    if dtype == FP8:  # the pre-sm89 path: fp8 bytes decoded with integer ops (value / 256, scale x 256): same values
        bits = gqa_extend_triton(q, *pool.args(), *lens, SCALE, e4m3_bits=True)
        torch.testing.assert_close(bits, tri, atol=0, rtol=0)
        bits_dec = gqa_decode_triton(q_dec, *pool.args(), seq_lens, SCALE, num_kv_splits=3, e4m3_bits=True)
        torch.testing.assert_close(bits_dec, tri_dec, atol=0, rtol=0)


def test_group_split_over_head_blocks() -> None:
    """block_h below the group: a kv head's 6 query heads over two programs (4 + 2 padded rows),
    small token tiles (8 tokens x 4 heads) and one chunk per request."""
    kv_heads, group, head_d = 2, 6, 64
    pool = Pool([p + e for p, e in zip(PREFIX_LENS, EXTEND_LENS)], kv_heads, head_d, torch.float32)
    q = queries(sum(EXTEND_LENS), kv_heads * group, head_d, torch.float32)
    lens = torch.tensor(PREFIX_LENS), torch.tensor(EXTEND_LENS)
    tri = gqa_extend_triton(q, *pool.args(), *lens, SCALE, block_t=8, block_h=4, block_n=32)
    assert_close(tri, gqa_extend_torch(q, *pool.args(), *lens, SCALE), torch.float32)
    seq_lens = lens[0] + lens[1].clamp(min=1)
    tri_dec = gqa_decode_triton(q[:5], *pool.args(), seq_lens, SCALE, num_kv_splits=1, block_h=4, block_n=16)
    assert_close(tri_dec, gqa_decode_torch(q[:5], *pool.args(), seq_lens, SCALE), torch.float32)


def test_decode_padding_row_of_length_zero_is_zero() -> None:
    """A seq_len-0 row (padding in a fixed-size, CUDA-graph batch) gives zeros, not NaN, and leaves
    the other rows alone."""
    pool = Pool([1, 20], 2, 64, torch.float32)
    q = queries(2, 4, 64, torch.float32)
    tri = gqa_decode_triton(q, *pool.args(), torch.tensor([0, 20]), SCALE, num_kv_splits=2)
    assert torch.count_nonzero(tri[0]) == 0
    torch.testing.assert_close(tri[1], gqa_decode_torch(q, *pool.args(), torch.tensor([1, 20]), SCALE)[1],
                               atol=1e-5, rtol=0)


def test_extend_last_token_equals_decode_and_empty_batches() -> None:
    """Chunked prefill then decode see the same context: extend's last row == decode of that token;
    a batch without new tokens returns an empty result."""
    pool = Pool([9, 70], 2, 64, torch.float32)
    q = queries(2, 6, 64, torch.float32)
    dec = gqa_decode_triton(q, *pool.args(), torch.tensor([9, 70]), SCALE, num_kv_splits=2)
    ext = gqa_extend_triton(q, *pool.args(), torch.tensor([8, 69]), torch.tensor([1, 1]), SCALE)
    torch.testing.assert_close(ext, dec, atol=1e-5, rtol=0)
    none = gqa_extend_triton(q[:0], *pool.args(), torch.tensor([8, 69]), torch.tensor([0, 0]), SCALE)
    assert none.shape == (0, 6, 64)
    assert gqa_decode_triton(q[:0], *pool.args(), torch.tensor([], dtype=torch.int64), SCALE).shape == (0, 6, 64)


def test_dispatch_routes_gqa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton under the interpreter, through the attention interface (CPU selection: test_attention_backends.py);
    the interface's gqa_decode/gqa_extend stay callable after the kernel modules are imported."""
    pool = Pool([5, 9], 2, 64, torch.float32)
    q = queries(2, 4, 64, torch.float32)
    dec_args = (q, *pool.args(), torch.tensor([5, 9]), SCALE)
    ext_args = (q, *pool.args(), torch.tensor([4, 8]), torch.tensor([1, 1]), SCALE)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention.select("gqa_extend", *ext_args) == "triton"
    torch.testing.assert_close(attention.gqa_decode(*dec_args), gqa_decode_torch(*dec_args), atol=1e-5, rtol=0)
    torch.testing.assert_close(attention.gqa_extend(*ext_args), gqa_extend_torch(*ext_args), atol=1e-5, rtol=0)
    assert callable(attention.gqa_decode) and callable(attention.gqa_extend)


def test_gqa_kernels_compile_for_gpu() -> None:
    """ptxas compile for sm90 of the GQA launch configurations (head dim 128; bf16 pool, fp8 pool and
    fp8 bytes decoded with integer ops): catches what the interpreter accepts but a GPU rejects.
    Runs without TRITON_INTERPRET in a subprocess; `aot_check --only gqa` also covers sm80."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "ktlite.kernels.triton.aot_check", "--only", "gqa", "--arch", "90"],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 9, proc.stdout  # stage 2 + (decode, extend) x (3 pool kinds + sinks)


# windows: 1 (only itself), 5 (inside a tile), 40 (across tiles of 32 and splits); prefixes longer than each
WINDOWS = [1, 5, 40]
WINDOW_PREFIX, WINDOW_EXTEND = [0, 41, 50, 9], [13, 9, 1, 30]


def sinks_for(heads: int) -> torch.Tensor:
    return torch.randn(heads, generator=torch.Generator().manual_seed(4)) * 2


@pytest.mark.parametrize("window, with_sinks", [(1, False), (5, True), (40, True)])
def test_window_and_sinks_twin_matches_dense(window: int, with_sinks: bool) -> None:
    kv_heads, group, head_d = 2, 3, 64
    pool = Pool([p + e for p, e in zip(WINDOW_PREFIX, WINDOW_EXTEND)], kv_heads, head_d, torch.float32)
    q = queries(sum(WINDOW_EXTEND), kv_heads * group, head_d, torch.float32)
    sinks = sinks_for(kv_heads * group) if with_sinks else None
    twin = gqa_extend_torch(q, *pool.args(), torch.tensor(WINDOW_PREFIX), torch.tensor(WINDOW_EXTEND), SCALE,
                            sinks=sinks, window=window)
    dense = dense_attention(q, pool, WINDOW_PREFIX, WINDOW_EXTEND, SCALE, sinks, window)
    torch.testing.assert_close(twin.double(), dense, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("window, dtype", [(0, torch.bfloat16), (1, torch.float32), (5, torch.float32),
                                           (40, torch.bfloat16)])
def test_window_and_sinks_triton_matches_twin(window: int, dtype: torch.dtype) -> None:
    """Ragged batches whose prefixes are longer than the window, extend (tiles of 32 keys, 8 tokens x 4 heads) and
    decode (3 splits), with sinks."""
    kv_heads, group, head_d = 2, 4, 64
    pool = Pool([p + e for p, e in zip(WINDOW_PREFIX, WINDOW_EXTEND)], kv_heads, head_d, dtype)
    q = queries(sum(WINDOW_EXTEND), kv_heads * group, head_d, dtype)
    lens = torch.tensor(WINDOW_PREFIX), torch.tensor(WINDOW_EXTEND)
    sinks = sinks_for(kv_heads * group)
    twin = gqa_extend_torch(q, *pool.args(), *lens, SCALE, sinks=sinks, window=window)
    tri = gqa_extend_triton(q, *pool.args(), *lens, SCALE, sinks=sinks, window=window, block_t=8, block_h=4,
                            block_n=32)
    assert_close(tri, twin, dtype)
    seq_lens = lens[0] + lens[1]
    q_dec = q[: len(seq_lens)]
    twin_dec = gqa_decode_torch(q_dec, *pool.args(), seq_lens, SCALE, sinks=sinks, window=window)
    tri_dec = gqa_decode_triton(q_dec, *pool.args(), seq_lens, SCALE, sinks=sinks, window=window, num_kv_splits=3,
                                block_n=16)
    assert_close(tri_dec, twin_dec, dtype)
