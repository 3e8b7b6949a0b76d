"""Fused MoE: Triton (under TRITON_INTERPRET on CPU) vs torch twin vs a per-token naive loop,
for dense and INT8/INT4 weight-only experts, with an expert mask and experts that get 0 tokens.

Tolerances (max abs; outputs are O(1)):
- twin vs naive (fp32): 1e-5.  Triton vs twin: fp32 1e-4; fp16 5e-3; bf16 3e-2 (both round the
  SiLU*up activations and each pair's down output to the activation dtype, at slightly different
  points); quantized experts are dequantized exactly the same way on both sides, so they use the
  same per-dtype tolerances.
- quantized twin vs dense twin (format sanity, ||q - dense|| / ||dense||): INT8 3 %, INT4 30 %
  (measured ~1 % and ~19 % through gate/up, SiLU and down on N(0,1) weights).
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ktlite.kernels.triton as kt
from ktlite.kernels.triton.quant import dequantize_expert, quantize_weight
from ktlite.kernels.triton.reference import fused_moe_torch

with kt.interpreted():
    from ktlite.kernels.triton.moe import fused_moe_triton, moe_align


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton reads it at launch too


E, H, INTER, TOP_K, T = 8, 128, 64, 3, 6
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
BLOCKS = dict(block_m=16, block_n=64, block_k=64)  # few programs: the interpreter's cost


def make_moe(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=g) / INTER**0.5).to(dtype)
    # experts 5 and 7 are never selected (0 tokens); expert 0 is selected by every token
    pool = torch.tensor([1, 2, 3, 4, 6])
    others = torch.stack([pool[torch.randperm(len(pool), generator=g)[: TOP_K - 1]] for _ in range(T)])
    topk_ids = torch.cat([torch.zeros(T, 1, dtype=torch.long), others], dim=1)
    topk_weights = torch.rand(T, TOP_K, generator=g).softmax(-1)
    return hidden, w13, w2, topk_ids.to(torch.int32), topk_weights


def naive_moe(hidden, w13, w2, topk_ids, topk_weights, expert_mask):
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if expert_mask is not None and not expert_mask[e]:
                continue
            gate_up = w13[e].double() @ hidden[t].double()
            act = F.silu(gate_up[:INTER]) * gate_up[INTER:]
            out[t] += topk_weights[t, j].double() * (w2[e].double() @ act)
    return out


MASK = torch.tensor([True, True, False, True, False, True, True, True])  # experts 2 and 4 on CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_mask", [False, True])
def test_dense_matches_twin_and_naive(dtype: torch.dtype, use_mask: bool) -> None:
    hidden, w13, w2, ids, weights = make_moe(dtype)
    mask = MASK if use_mask else None
    twin = fused_moe_torch(hidden, w13, w2, ids, weights, mask)
    tri = fused_moe_triton(hidden, w13, w2, ids, weights, mask, **BLOCKS)
    assert tri.shape == (T, H) and tri.dtype == dtype
    torch.testing.assert_close(tri.float(), twin.float(), atol=TOL[dtype], rtol=0)
    if dtype == torch.float32:
        naive = naive_moe(hidden, w13, w2, ids, weights, mask)
        torch.testing.assert_close(twin.double(), naive, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "bits,group,dtype,scale_dtype",
    [(8, 64, torch.float32, torch.float32), (8, 64, torch.bfloat16, torch.float16),
     (4, 64, torch.float32, torch.float16), (4, 64, torch.bfloat16, torch.float32),
     (4, 128, torch.float16, torch.float16)],
)
def test_quantized_matches_twin(bits: int, group: int, dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    hidden, w13, w2, ids, weights = make_moe(dtype, seed=1)
    # down's input dim (INTER=64) cannot hold a 128 group: keep that case's w2 at group 64
    q13 = quantize_weight(w13, bits, group, scale_dtype)
    q2 = quantize_weight(w2, bits, min(group, INTER), scale_dtype)
    twin = fused_moe_torch(hidden, q13, q2, ids, weights, MASK)
    tri = fused_moe_triton(hidden, q13, q2, ids, weights, MASK, **BLOCKS)
    torch.testing.assert_close(tri.float(), twin.float(), atol=TOL[dtype], rtol=0)
    dense = fused_moe_torch(hidden, w13, w2, ids, weights, MASK).float()
    rel = torch.linalg.norm(twin.float() - dense) / torch.linalg.norm(dense)
    assert rel < (0.03 if bits == 8 else 0.30), rel


def test_int4_nibble_layout() -> None:
    """Byte j of a group holds k = j (low nibble) and k = j + G/2 (high nibble), as q + 8."""
    g = 64
    w = torch.zeros(1, 1, 2 * g)
    w[0, 0, :] = torch.arange(2 * g) % 15 - 7.0  # q = w / scale with scale = 1
    qw = quantize_weight(w, 4, g, torch.float32)
    assert qw.qweight.shape == (1, 1, g) and qw.qweight.dtype == torch.uint8
    assert torch.allclose(qw.scales, torch.ones(1, 1, 2))
    packed = qw.qweight[0, 0].long()
    for grp in range(2):
        for j in (0, 5, g // 2 - 1):
            b = int(packed[grp * g // 2 + j])
            assert (b & 0xF) - 8 == w[0, 0, grp * g + j]
            assert (b >> 4) - 8 == w[0, 0, grp * g + g // 2 + j]
    torch.testing.assert_close(dequantize_expert(qw, 0, torch.float32), w[0])


def test_align_blocks_hold_one_enabled_expert() -> None:
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [6, 3]], dtype=torch.int32)
    mask = torch.tensor([True, True, True, True, True, False, True, True])  # expert 5 elsewhere
    sorted_ids, expert_ids, num_padded = moe_align(ids, mask, num_experts=8, block_m=4)
    n_pad = int(num_padded)
    assert n_pad == 3 * 4  # experts 0, 3, 6 -> one 4-row block each
    flat = ids.reshape(-1)
    used = sorted_ids[:n_pad]
    real = used[used < flat.numel()]
    assert sorted(real.tolist()) == [i for i in range(8) if flat[i] != 5]
    for blk in range(n_pad // 4):
        rows = sorted_ids[blk * 4 : (blk + 1) * 4]
        rows = rows[rows < flat.numel()]
        assert (flat[rows.long()] == expert_ids[blk]).all()
    assert (expert_ids[n_pad // 4 :] == 8).all()  # blocks past the end are skipped by the kernel


def test_compact_expert_stack_with_remapped_ids() -> None:
    """Only the GPU experts' weights, ids remapped to local indices, -1 / E for experts elsewhere:
    same result as the full stack with an expert mask."""
    hidden, w13, w2, ids, weights = make_moe(torch.float32)
    local = torch.nonzero(MASK).squeeze(1)  # global ids of the GPU experts
    remap = torch.full((E,), -1, dtype=torch.int32)
    remap[local] = torch.arange(len(local), dtype=torch.int32)
    local_ids = remap[ids.long()]
    t, j = torch.nonzero(local_ids < 0)[0].tolist()
    local_ids[t, j] = len(local)  # an id of E_local means "elsewhere" too
    full = fused_moe_torch(hidden, w13, w2, ids, weights, MASK)
    twin = fused_moe_torch(hidden, w13[local], w2[local], local_ids, weights)
    tri = fused_moe_triton(hidden, w13[local], w2[local], local_ids, weights, **BLOCKS)
    torch.testing.assert_close(twin, full, atol=1e-6, rtol=0)
    torch.testing.assert_close(tri, full, atol=1e-4, rtol=0)
    # the runtime's form: a mask one longer than the stack, its last slot (E_local) disabled
    mask = torch.ones(len(local) + 1, dtype=torch.bool)
    mask[-1] = False
    slot_ids = torch.where(local_ids < 0, len(local), local_ids)
    tri = fused_moe_triton(hidden, w13[local], w2[local], slot_ids, weights, mask, **BLOCKS)
    torch.testing.assert_close(tri, full, atol=1e-4, rtol=0)


def test_all_experts_elsewhere_gives_zeros() -> None:
    hidden, w13, w2, ids, weights = make_moe(torch.float32)
    none = torch.zeros(E, dtype=torch.bool)
    out = fused_moe_triton(hidden, w13, w2, ids, weights, none, **BLOCKS)
    assert torch.count_nonzero(out) == 0
    assert torch.count_nonzero(fused_moe_torch(hidden, w13, w2, ids, weights, none)) == 0


def test_dispatch_routes_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, w13, w2, ids, weights = make_moe(torch.float32)
    twin = fused_moe_torch(hidden, w13, w2, ids, weights, MASK)
    torch.testing.assert_close(kt.fused_moe(hidden, w13, w2, ids, weights, MASK), twin, atol=1e-4, rtol=0)
    monkeypatch.delenv("TRITON_INTERPRET")
    torch.testing.assert_close(kt.fused_moe(hidden, w13, w2, ids, weights, MASK), twin)


def test_kernels_compile_for_gpu() -> None:
    """ptxas compile of the GPU launch configurations (DeepSeek-V3 sizes) for sm90: catches
    what the interpreter accepts but a GPU rejects. Runs without TRITON_INTERPRET in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "ktlite.kernels.triton.aot_check", "--only", "moe", "--arch", "90"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_with_biases_matches_twin_and_naive(dtype: torch.dtype) -> None:
    """gpt-oss's experts: (clamp(up) + 1) * g * sigmoid(1.702 g), g = min(gate, limit), with gate/up and down
    biases; a limit of 0.5 clamps most gate/up values here."""
    from ktlite.kernels.expert_activation import ExpertActivation

    hidden, w13, w2, ids, weights = make_moe(dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    biases = ((0.3 * torch.randn(E, 2 * INTER, generator=g)).to(dtype), (0.3 * torch.randn(E, H, generator=g)).to(dtype))
    act = ExpertActivation("swiglu_oai", limit=0.5, alpha=1.702)
    twin = fused_moe_torch(hidden, w13, w2, ids, weights, MASK, act, biases)
    tri = fused_moe_triton(hidden, w13, w2, ids, weights, MASK, act, biases, **BLOCKS)
    torch.testing.assert_close(tri.float(), twin.float(), atol=TOL[dtype], rtol=0)
    if dtype == torch.float32:
        naive = torch.zeros(T, H, dtype=torch.float64)
        for t in range(T):
            for j in range(TOP_K):
                e = int(ids[t, j])
                if not MASK[e]:
                    continue
                gu = w13[e].double() @ hidden[t].double() + biases[0][e].double()
                gate, up = gu[:INTER].clamp(max=0.5), gu[INTER:].clamp(-0.5, 0.5)
                y = w2[e].double() @ (gate * torch.sigmoid(1.702 * gate) * (up + 1)) + biases[1][e].double()
                naive[t] += weights[t, j].double() * y
        torch.testing.assert_close(twin.double(), naive, atol=1e-5, rtol=0)
        assert not torch.allclose(twin, fused_moe_torch(hidden, w13, w2, ids, weights, MASK), atol=1e-2)
