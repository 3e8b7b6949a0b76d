"""Token-level KV pool: exact slot accounting, request rows, and refusal instead of corruption."""

from __future__ import annotations

import pytest
import torch

from ktlite.runtime.kv_cache import KVPool, KVPoolFull


def make_pool(slots: int = 10, rows: int = 3, context: int = 8) -> KVPool:
    return KVPool(num_layers=2, num_slots=slots, latent_dim=4, max_requests=rows, max_context=context,
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
    pool.write(1, slots, latent)
    assert torch.equal(pool.layer(1)[pool.req_to_token[r, :3].long()], latent)
    assert pool.layer(0).abs().sum() == 0
