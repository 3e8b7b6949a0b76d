"""Sparse MLA (each query attends to its own selected pool slots): Triton under TRITON_INTERPRET vs
the torch twin, the twin vs a dense masked reference written here, and full selection vs dense MLA.

Tolerances (max abs error; outputs are averages of N(0,1) latents): fp32 1e-4; fp16 2e-3 + 2e-3 rel;
bf16 1.6e-2 + 1.6e-2 rel (as in test_triton_mla: Triton rounds the probabilities to the pool dtype
before the P @ V dot, the twin stays in fp32). bf16 runs here because common.dot widens operands to
fp32 under the interpreter, whose own bf16 tl.dot is broken. Packed FP8 pools (kv_fp8.latent_rows): the
twin reads the values the rows hold; fp32 and bf16 queries with those tolerances.
"""

import os
import subprocess
import sys

import pytest
import torch

import ktlite.kernels.triton as kt
from ktlite.kernels import attention

with kt.interpreted():
    from ktlite.kernels.triton.sparse_mla_attn import sparse_mla_triton
from ktlite.kernels.triton.kv_fp8 import latent_rows
from ktlite.kernels.triton.reference import mla_extend_torch, sparse_mla_torch


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    # triton also reads TRITON_INTERPRET at launch, so it must be set while the kernels run
    monkeypatch.setenv("TRITON_INTERPRET", "1")


KV_LORA, ROPE, SLOTS, TOPK, HEADS = 32, 16, 80, 37, 6  # TOPK not a multiple of block_n; HEADS of block_h
SCALE = 0.2
TOL = {torch.float32: (1e-4, 0.0), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def make_inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [8, HEADS, 48], kv [SLOTS, 48] and [8, TOPK] slot lists, each a duplicate-free random subset of
    the pool: full rows, a row with -1s scattered inside, rows padded with -1 at the tail (the indexer's
    form), a row whose first 16 entries are -1 (a whole leading tile), and a row of only -1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(8, HEADS, KV_LORA + ROPE, generator=g).to(dtype)
    kv = torch.randn(SLOTS, KV_LORA + ROPE, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(SLOTS, generator=g)[:TOPK] for _ in range(8)])
    slots[2, torch.randperm(TOPK, generator=g)[:10]] = -1
    slots[3, 5:] = -1
    slots[4, 1:] = -1
    slots[5, :16] = -1
    slots[6] = -1
    slots[7, 20:] = -1
    return q, kv, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits,e4m3_bits", [(1, False), (3, False), (3, True)])
def test_packed_fp8_pool_matches_twin(dtype: torch.dtype, num_splits: int, e4m3_bits: bool) -> None:
    """FP8 rows read in place (native e4m3, or bytes decoded with integer ops as before sm89); the twin on
    the rows equals the dense reference on the values they hold."""
    q, kv, slots = make_inputs(dtype, seed=3)
    rows = latent_rows(KV_LORA, ROPE)
    packed = rows.pack(kv.float())
    tri = sparse_mla_triton(q, packed, slots, SCALE, KV_LORA, num_splits=num_splits, block_h=4, block_n=16,
                            e4m3_bits=e4m3_bits)
    twin = sparse_mla_torch(q, packed, slots, SCALE, KV_LORA)
    assert torch.count_nonzero(tri[6]) == 0
    torch.testing.assert_close(tri.float(), twin.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
    if dtype == torch.float32:
        torch.testing.assert_close(twin.double(), dense_reference(q, rows.unpack(packed), slots), atol=1e-5, rtol=0)


def dense_reference(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Attention over the whole pool (float64) with every unselected slot masked out."""
    selected = torch.zeros(q.shape[0], kv.shape[0], dtype=torch.bool)
    for n, row in enumerate(slots):
        selected[n, row[row >= 0]] = True
    scores = torch.einsum("nhd,sd->nhs", q.double(), kv.double()) * SCALE
    probs = scores.masked_fill(~selected[:, None, :], float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("nhs,sc->nhc", probs, kv[:, :KV_LORA].double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_twin(dtype: torch.dtype, num_splits: int) -> None:
    """One chunk (direct write) and three chunks merged by stage 2 (a chunk of row 4 or 6 is empty)."""
    q, kv, slots = make_inputs(dtype)
    tri = sparse_mla_triton(q, kv, slots, SCALE, KV_LORA, num_splits=num_splits, block_h=4, block_n=16)
    twin = sparse_mla_torch(q, kv, slots, SCALE, KV_LORA)
    assert tri.shape == (8, HEADS, KV_LORA) and tri.dtype == dtype
    assert torch.count_nonzero(tri[6]) == 0  # no valid slot: zeros, not NaN
    torch.testing.assert_close(tri.float(), twin.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_twin_matches_dense_reference() -> None:
    q, kv, slots = make_inputs(torch.float32, seed=1)
    twin = sparse_mla_torch(q, kv, slots, SCALE, KV_LORA)
    torch.testing.assert_close(twin.double(), dense_reference(q, kv, slots), atol=1e-5, rtol=0)


def test_selecting_every_causal_token_equals_dense_mla() -> None:
    """With top-k covering the whole causal context (the early tokens of a request), sparse MLA is
    dense MLA: one extend of 5 prefix + 6 new tokens, slots from a scattered req_to_token row,
    called through the dispatch (its default chunking)."""
    g = torch.Generator().manual_seed(2)
    prefix, new, topk = 5, 6, 16
    kv = torch.randn(SLOTS, KV_LORA + ROPE, generator=g)
    row = torch.randperm(SLOTS, generator=g)[: prefix + new]
    req_to_token = torch.zeros(2, 20, dtype=torch.int32)
    req_to_token[1, : prefix + new] = row.to(torch.int32)
    q = torch.randn(new, HEADS, KV_LORA + ROPE, generator=g)
    slots = torch.full((new, topk), -1, dtype=torch.int64)
    for t in range(new):
        seen = row[: prefix + t + 1]
        slots[t, : seen.numel()] = seen[torch.randperm(seen.numel(), generator=g)]  # order is irrelevant
    assert kt.use_triton(q)
    sparse = attention.sparse_mla(q, kv, slots, SCALE, KV_LORA)
    # importing the kernel module must not shadow the package's sparse_mla function
    assert callable(attention.sparse_mla)
    dense = mla_extend_torch(q, kv, req_to_token, torch.tensor([1]), torch.tensor([prefix]), torch.tensor([new]),
                             SCALE, KV_LORA)
    torch.testing.assert_close(sparse, dense, atol=1e-4, rtol=0)


def test_dispatch_picks_twin_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    q, kv, slots = make_inputs(torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kt.use_triton(q)
    twin = sparse_mla_torch(q, kv, slots, SCALE, KV_LORA)
    torch.testing.assert_close(attention.sparse_mla(q, kv, slots, SCALE, KV_LORA), twin)


def test_kernels_compile_for_gpu() -> None:
    """ptxas compile of the GPU launch configurations (DeepSeek-V3.2 sizes) for sm80 and sm90: catches
    what the interpreter accepts but a GPU rejects. Runs without TRITON_INTERPRET in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "ktlite.kernels.triton.aot_check", "--only", "sparse_mla", "--arch", "80", "90"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
