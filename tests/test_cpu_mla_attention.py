"""The compiled CPU MLA kernels (kernels/cpu/attention.py, latent_attention.py) against the torch twins
(reference.mla_extend_torch / mla_decode_torch / sparse_mla_torch), on fp32, bf16 and packed FP8 pools.

Both sides compute in fp32 from the same stored values (the twins unpack FP8 rows exactly as the kernels
decode them), so they differ only in summation order and in the query being scaled before the dot rather
than the score after: fp32 outputs (|out| < ~3) agree within atol 2e-5; bf16 queries are compared after both
round to bf16 (one bf16 ulp at |out| < 4: atol 1.6e-2).

Shapes reach every path of the kernels: latent blocks of 64 positions (lengths 1, 63, 64, 65, 300), query
items of 64 rows (4 heads: 16 tokens per item; 80 heads: a full and a partial head group per token),
kv_lora 32 (16-lane chunks of the vector product) and 72 (a scalar tail; a partial FP8 scale group).
"""

import math
from types import SimpleNamespace

import pytest
import torch
from pool_tables import scattered_table

from ktlite.kernels.cpu import attention as cpu_attention
from ktlite.kernels.triton.kv_fp8 import latent_rows
from ktlite.kernels.triton.reference import mla_decode_torch, mla_extend_torch, sparse_mla_torch

POOLS = ["fp32", "bf16", "fp8"]
DIMS = [(32, 16), (72, 8)]  # (kv_lora, rope)
FP32_TOL = 2e-5


def make_pool(kind: str, lens: list[int], kv_lora: int, rope: int, seed: int = 0):
    """(kv_buffer, req_to_token, req_pool_indices): requests in shuffled rows over shuffled slots."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 9
    values = torch.randn(num_slots, kv_lora + rope, generator=g)
    if kind == "fp8":
        kv = latent_rows(kv_lora, rope).pack(values)
    else:
        kv = values.to(torch.bfloat16 if kind == "bf16" else torch.float32)
    slots = torch.randperm(num_slots, generator=g)
    req_to_token, rows = scattered_table(lens, slots, g)
    return kv, req_to_token, rows


def queries(n: int, heads: int, width: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, heads, width, generator=torch.Generator().manual_seed(seed)) * 0.5


SCALE = 1 / math.sqrt(24)


@pytest.mark.parametrize("kind", POOLS)
@pytest.mark.parametrize("kv_lora,rope", DIMS)
@pytest.mark.parametrize("heads", [4, 80])
def test_extend_matches_twin(kind: str, kv_lora: int, rope: int, heads: int) -> None:
    """Ragged requests with radix-cache prefixes: a fresh prompt, a 1-token chunk, chunks crossing block
    boundaries, a 130-token chunk after a 70-token prefix, an empty chunk."""
    prefix, extend = [0, 5, 63, 70, 4], [1, 17, 2, 130, 0]
    if heads == 80:  # many heads: fewer tokens keep the test small
        prefix, extend = [0, 63, 3], [3, 2, 0]
    kv, req_to_token, rows = make_pool(kind, [p + e + 1 for p, e in zip(prefix, extend)], kv_lora, rope)
    q = queries(sum(extend), heads, kv_lora + rope)
    args = (q, kv, req_to_token, rows, torch.tensor(prefix), torch.tensor(extend), SCALE, kv_lora)
    torch.testing.assert_close(cpu_attention.mla_extend(*args), mla_extend_torch(*args), atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("kind", POOLS)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_twin(kind: str, splits: int) -> None:
    """Lengths 1 (later runs empty), 63, 64, 65 (block edges) and 300, one run or three merged."""
    lens = [1, 63, 64, 65, 300]
    kv, req_to_token, rows = make_pool(kind, lens, 32, 16)
    q = queries(len(lens), 16, 48)
    args = (q, kv, req_to_token, rows, torch.tensor(lens), SCALE, 32)
    torch.testing.assert_close(cpu_attention.mla_decode(*args, splits=splits), mla_decode_torch(*args),
                               atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("kind", POOLS)
def test_sparse_matches_twin(kind: str) -> None:
    """Each query's own slots in any order, -1 padding anywhere, a query with none (zeros), more slots than
    one latent block."""
    kv, _, _ = make_pool(kind, [200], 32, 16)
    g = torch.Generator().manual_seed(2)
    topk = torch.stack([torch.randperm(200, generator=g)[:70] for _ in range(5)])
    topk[1, 10:] = -1
    topk[2, ::3] = -1
    topk[3] = -1
    q = queries(5, 16, 48)
    args = (q, kv, topk, SCALE, 32)
    got = cpu_attention.sparse_mla(*args)
    torch.testing.assert_close(got, sparse_mla_torch(*args), atol=FP32_TOL, rtol=0)
    assert not got[3].any()


def test_bf16_queries_round_like_the_twin() -> None:
    """bf16 queries over a bf16 pool (a bf16 model's call): fp32 inside, the result in bf16."""
    kv, req_to_token, rows = make_pool("bf16", [40, 9], 32, 16)
    q = queries(12, 4, 48).bfloat16()
    args = (q, kv, req_to_token, rows, torch.tensor([30, 0]), torch.tensor([10, 2]), SCALE, 32)
    got = cpu_attention.mla_extend(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), mla_extend_torch(*args).float(), atol=1.6e-2, rtol=0)


def test_accepts() -> None:
    """fp32, bf16 and packed FP8 pools on the CPU; an fp16 pool stays with the twin."""
    q = torch.zeros(1, 2, 48)
    assert all(cpu_attention.accepts(q, make_pool(k, [3], 32, 16)[0]) for k in POOLS)
    assert not cpu_attention.accepts(q, torch.zeros(4, 48, dtype=torch.float16))


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16", "fp8_e4m3"])
def test_tiny_v3_engine_same_as_twins(tiny_v3, kv_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny DeepSeek-V3 on a CPU device (fp32 activations; "auto" = an fp32 pool) with the compiled kernels
    against KTLITE_FORCE_TORCH_KERNELS=1 (the twins, and the modules instead of the compiled decode block), in
    one engine: the same greedy tokens through chunked prefill (chunks of 16 after a prefix) and decode, and
    prefill logits within 1e-4 over an fp32 pool. Over a bf16 or FP8 pool a 1e-6 difference in a layer's
    output can move a later layer's stored latent across a rounding boundary (one bf16 ulp is 2^-8 of it:
    measured 3e-3 in the logits): 1e-2 there. The prompts' prefill runs decompressed (gqa_extend) with fp32
    products here: the bf16 block products are test_decompressed_extend_over_bf16_values' case."""
    from test_tensor_parallel import logits_of

    from ktlite import Engine
    from ktlite.kernels.cpu import gqa_attention

    monkeypatch.setattr(gqa_attention, "pool_products", lambda k_buffer: gqa_attention.FP32_PRODUCTS)

    flags = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 256, "chunked_prefill_size": 16,
             "gpu_memory": "1GiB", "max_running_requests": 4, "disable_radix_cache": True,
             "kv_cache_dtype": kv_dtype}
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(4, 100, (n,), generator=g).tolist() for n in (40, 23)]
    greedy = {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True}
    with Engine(str(tiny_v3), **flags) as eng:
        runs = []
        for forced in ("0", "1"):
            monkeypatch.setenv("KTLITE_FORCE_TORCH_KERNELS", forced)
            tokens = [r.token_ids for r in eng.generate(input_ids=ids, sampling_params=greedy)]
            runs.append((tokens, logits_of(eng, ids)))
    (tokens, logits), (want_tokens, want_logits) = runs
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=1e-4 if kv_dtype == "auto" else 1e-2, rtol=0)


@pytest.mark.parametrize("dense", [None, "INT8"])  # kv_b_proj as a Linear, or W_UK / W_UV stored quantized
def test_decompressed_extend_equals_absorbed(tiny_v3, dense, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's prefill on a CPU device takes the decompressed form (deepseek.decompressed_cheaper) once a
    compiled gqa_extend is registered (here pretended: the GQA twin runs it); with it ruled out (no bytes for its
    K / V) the absorbed form gives the same logits within 1e-4 (fp32, different summation order and roundings),
    and decode or a short chunk after a long prefix stays absorbed."""
    from test_tensor_parallel import logits_of

    from ktlite import Engine
    from ktlite.runtime.models import deepseek

    cfg = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)  # V2 / V3
    assert deepseek.decompressed_cheaper(cfg, [0], [1]) and deepseek.decompressed_cheaper(cfg, [3584], [512])
    assert not deepseek.decompressed_cheaper(cfg, [4095], [1]) and not deepseek.decompressed_cheaper(cfg, [4000], [64])
    flags = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 256, "gpu_memory": "1GiB",
             "max_running_requests": 4, "disable_radix_cache": True, **({"cpu_dense_method": dense} if dense else {})}
    monkeypatch.setattr(deepseek, "compiled_gqa_extend", lambda: True)
    calls = []
    decompressed = deepseek.MLAttention.decompressed_extend
    monkeypatch.setattr(deepseek.MLAttention, "decompressed_extend", lambda *a: calls.append(1) or decompressed(*a))
    ids = [torch.randint(4, 100, (n,), generator=torch.Generator().manual_seed(6)).tolist() for n in (40, 23)]
    with Engine(str(tiny_v3), **flags) as eng:
        got = logits_of(eng, ids)
        assert calls
        monkeypatch.setattr(deepseek, "DECOMPRESS_BYTES", 0)
        want = logits_of(eng, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_decompressed_extend_over_bf16_values(tiny_v3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a bf16 latent pool the decompressed form's K and V are bf16 (deepseek.decompressed_dtype; on a CPU
    with AMX-BF16 or AVX512-BF16 gqa_extend then runs in bf16 products, and kv_b_proj's GEMM in bf16 where that is
    faster). Its prefill logits against the absorbed form's over the same pool: within 0.1 (measured 0.06 with fp32 products,
    0.07 on the tiles, of logits up to 4.9: each K / V value rounded to bf16, 2^-9 of it, through this random
    model's layers; a wiring error, a head or a position off, moves them by their own size). An FP8 pool keeps
    them fp32 (decompressed_dtype's docstring says why)."""
    from test_tensor_parallel import logits_of

    from ktlite import Engine
    from ktlite.runtime.models import deepseek

    flags = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 512, "gpu_memory": "1GiB",
             "max_running_requests": 4, "disable_radix_cache": True, "kv_cache_dtype": "bfloat16"}
    calls = []
    decompressed = deepseek.MLAttention.decompressed_extend
    monkeypatch.setattr(deepseek.MLAttention, "decompressed_extend", lambda *a: calls.append(1) or decompressed(*a))
    kv_dtypes, extend = [], deepseek.gqa_extend
    monkeypatch.setattr(deepseek, "gqa_extend", lambda q, k, *a: kv_dtypes.append(k.dtype) or extend(q, k, *a))
    ids = [torch.randint(4, 100, (n,), generator=torch.Generator().manual_seed(7)).tolist() for n in (90, 61)]
    with Engine(str(tiny_v3), **flags) as eng:
        got = logits_of(eng, ids)
        assert calls and set(kv_dtypes) == {torch.bfloat16}
        monkeypatch.setattr(deepseek, "DECOMPRESS_BYTES", 0)
        want = logits_of(eng, ids)
    torch.testing.assert_close(got, want, atol=0.1, rtol=0)
