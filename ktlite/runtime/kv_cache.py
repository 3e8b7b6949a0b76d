"""Token-level KV pool in the MLA latent layout.

Each layer has a buffer [num_slots, kv_lora_rank + qk_rope_head_dim]: slot s holds one token's
latent. `req_to_token[row, pos]` maps a request's position to its slot, which is what the MLA
kernels read. Slots and request rows come from free lists, so a request's tokens need not be
contiguous and freeing is O(tokens). All freeing goes through `free_slots`, the one place a future
prefix cache will put reference counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ktlite.errors import KtliteError

Allocator = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _plain_alloc(component: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


class KVPoolFull(KtliteError):
    """Not enough free slots; the scheduler preempts or queues rather than letting this escape."""


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        latent_dim: int,
        max_requests: int,
        max_context: int,
        dtype: torch.dtype,
        device: torch.device | str,
        alloc: Allocator = _plain_alloc,
    ):
        device = torch.device(device)
        self.num_slots, self.max_requests, self.max_context = num_slots, max_requests, max_context
        self.buffer = alloc("kv_pool", (num_layers, num_slots, latent_dim), dtype, device)  # [L, S, D]
        self.buffer.zero_()
        self.req_to_token = alloc("request_table", (max_requests, max_context), torch.int32, device)
        self.req_to_token.zero_()
        # Free lists live on the host: allocation decisions are made by the scheduler in Python.
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._row_slots: dict[int, list[int]] = {}

    def layer(self, layer_idx: int) -> torch.Tensor:
        """[num_slots, latent_dim] view of one layer's latents."""
        return self.buffer[layer_idx]

    @property
    def free_tokens(self) -> int:
        return len(self._free_slots)

    @property
    def used_tokens(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_request(self) -> int:
        if not self._free_rows:
            raise KVPoolFull("no free request rows (raise --max-running-requests)")
        row = self._free_rows.pop()
        self._row_slots[row] = []
        return row

    def alloc_tokens(self, row: int, n: int) -> torch.Tensor:
        """Append n slots to request `row` (positions len..len+n-1); returns the slots [n] int64."""
        slots = self._row_slots[row]
        start = len(slots)
        if start + n > self.max_context:
            raise KVPoolFull(f"request needs {start + n} positions, the context holds {self.max_context}")
        if n > len(self._free_slots):
            raise KVPoolFull(f"need {n} KV slots, {len(self._free_slots)} free")
        new = [self._free_slots.pop() for _ in range(n)]
        slots.extend(new)
        new_t = torch.tensor(new, dtype=torch.int64)
        self.req_to_token[row, start : start + n] = new_t.to(self.req_to_token.device, torch.int32)
        return new_t.to(self.buffer.device)

    def num_tokens(self, row: int) -> int:
        return len(self._row_slots[row])

    def free_request(self, row: int) -> None:
        """Return all of a request's slots and its row."""
        self.free_slots(self._row_slots.pop(row))
        self._free_rows.append(row)

    def free_slots(self, slots: list[int]) -> None:
        self._free_slots.extend(reversed(slots))

    def write(self, layer_idx: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """Store latent [n, latent_dim] of new tokens at their slots [n]."""
        self.buffer[layer_idx, slots] = latent.to(self.buffer.dtype)
