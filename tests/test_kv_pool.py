"""Token-level KV pool: exact slot accounting, request rows, and refusal instead of corruption."""

from __future__ import annotations

import pytest
import torch

from ktlite.runtime.kv_cache import KVPool, KVPoolFull, TokenCacheSpec, kv_bytes_per_token


def make_pool(slots: int = 10, rows: int = 3, context: int = 8) -> KVPool:
    return KVPool([TokenCacheSpec("latent", (0, 1), (4,))], num_slots=slots, max_requests=rows, max_context=context,
                  dtype=torch.float32, device="cpu")


def test_alloc_and_free_account_exactly():
    pool = make_pool()
    a, b = pool.alloc_request(), pool.alloc_request()
    sa = pool.alloc_tokens(a, 3)
    sb = pool.alloc_tokens(b, 4)
    sa2 = pool.alloc_tokens(a, 2)
    assert pool.free_tokens == 10 - 9 and pool.used_tokens == 9
    assert len(set(sa.tolist() + sb.tolist() + sa2.tolist())) == 9  # no slot handed out twice
    assert pool.req_to_token[a, :5].tolist() == sa.tolist() + sa2.tolist()
    assert pool.num_tokens(a) == 5
    pool.free_request(a)
    assert pool.free_tokens == 6 and pool.free_rows == 2
    pool.free_request(b)
    assert pool.free_tokens == 10 and pool.free_rows == 3


def test_full_pool_refuses_without_side_effects():
    pool = make_pool(slots=4)
    r = pool.alloc_request()
    pool.alloc_tokens(r, 3)
    with pytest.raises(KVPoolFull):
        pool.alloc_tokens(r, 2)
    assert pool.free_tokens == 1 and pool.num_tokens(r) == 3


def test_context_and_rows_are_bounded():
    pool = make_pool(slots=20, rows=1, context=5)
    r = pool.alloc_request()
    with pytest.raises(KVPoolFull, match="context"):
        pool.alloc_tokens(r, 6)
    with pytest.raises(KVPoolFull, match="max-running-requests"):
        pool.alloc_request()


def test_write_lands_in_the_right_slots():
    pool = make_pool()
    r = pool.alloc_request()
    slots = pool.alloc_tokens(r, 3)
    latent = torch.arange(12, dtype=torch.float32).view(3, 4)
    pool.write("latent", 1, slots, latent)
    assert torch.equal(pool.buffer("latent", 1)[pool.req_to_token[r, :3].long()], latent)
    assert pool.buffer("latent", 0).abs().sum() == 0


def test_several_cache_kinds_on_their_own_layers():
    """GQA-style K and V per kv-head on some layers, another kind on all: one buffer per kind, the
    slot dimension shared, each layer index mapped to its row of the kind's buffer."""
    specs = [TokenCacheSpec("k", (1, 3), (2, 8)), TokenCacheSpec("v", (1, 3), (2, 8)),
             TokenCacheSpec("scale", (0, 1, 2, 3), (1,), torch.float32)]
    pool = KVPool(specs, num_slots=6, max_requests=2, max_context=4, dtype=torch.bfloat16, device="cpu")
    assert pool.buffers["k"].shape == (2, 6, 2, 8) and pool.buffers["k"].dtype == torch.bfloat16
    assert pool.buffers["scale"].dtype == torch.float32
    assert kv_bytes_per_token(specs, torch.bfloat16) == 2 * (2 * 2 * 8 * 2) + 4 * 4
    r = pool.alloc_request()
    slots = pool.alloc_tokens(r, 2)
    k = torch.randn(2, 2, 8)
    pool.write("k", 3, slots, k)
    assert torch.equal(pool.buffers["k"][1, slots], k.bfloat16())
    assert pool.buffer("k", 1).abs().sum() == 0
    with pytest.raises(KeyError):
        pool.buffer("k", 2)  # layer 2 caches no K
