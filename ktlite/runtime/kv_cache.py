"""Token-level KV pool: per-token cache entries of every layer, in the layout the model declares.

A model family declares what it caches per token (`TokenCacheSpec`: MLA latent, GQA keys and values
per kv-head, DSA index keys, ...), each for a set of layers. The pool allocates one buffer per spec,
`[len(spec.layers), num_slots, *spec.shape]`, so slot s of every buffer holds one token's entry.
`req_to_token[row, pos]` maps a request's position to its slot, which is what the attention kernels
read. Slots and request rows come from free lists, so a request's tokens need not be contiguous and
freeing is O(tokens). All freeing of token slots goes through `free_slots`.

With a prefix cache (ktlite/runtime/radix_cache.py, which keeps the reference counts) some slots
belong to the cache rather than to a request: a request row can start with cached slots
(`assign_prefix`), a finished row hands its slots to the cache (`release_request`), and the cache's
unreferenced slots count as free: the pool asks its `reclaimer` to evict some when the free list runs
short. Under tensor parallelism rank 0 sets a
`journal`: table writes that no batch carries (cached prefixes) and the host tier's copies are
recorded there and replayed by every other rank before the next forward (`replay`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ktlite.errors import KtliteError
from ktlite.kernels.triton.kv_fp8 import Fp8Rows, is_packed

Allocator = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _plain_alloc(component: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class TokenCacheSpec:
    """One kind of per-token cache entry: `shape` values per token for each layer in `layers`.

    `dtype` None means the pool's KV dtype (--kv-cache-dtype); a spec can pin its own (e.g. fp32
    scales beside fp8 keys)."""

    name: str  # "latent", "k", "v", "index_key", ...
    layers: tuple[int, ...]
    shape: tuple[int, ...]  # per token per layer, on one tensor-parallel rank
    dtype: torch.dtype | None = None

    def bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        dtype = self.dtype or kv_dtype
        return len(self.layers) * math.prod(self.shape) * dtype.itemsize


def kv_bytes_per_token(specs: Sequence[TokenCacheSpec], kv_dtype: torch.dtype) -> int:
    return sum(s.bytes_per_token(kv_dtype) for s in specs)


class KVPoolFull(KtliteError):
    """Not enough free slots; the scheduler preempts or queues rather than letting this escape."""


class Reclaimer(Protocol):
    """Holds slots no request uses (a prefix cache) and gives them back on demand."""

    @property
    def reclaimable(self) -> int: ...

    def reclaim(self, n: int) -> None:
        """Return at least n slots to the pool through `free_slots` (n <= reclaimable)."""


class KVPool:
    def __init__(
        self,
        specs: Sequence[TokenCacheSpec],
        num_slots: int,
        max_requests: int,
        max_context: int,
        dtype: torch.dtype,
        device: torch.device | str,
        alloc: Allocator = _plain_alloc,
    ):
        device = torch.device(device)
        self.specs = {s.name: s for s in specs}
        self.num_slots, self.max_requests, self.max_context = num_slots, max_requests, max_context
        self.device, self.dtype = device, dtype
        # name -> [len(spec.layers), num_slots, *spec.shape]; dim 1 is the slot dim in every buffer
        self.buffers: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, dict[int, int]] = {}
        for spec in specs:
            buf = alloc("kv_pool", (len(spec.layers), num_slots, *spec.shape), spec.dtype or dtype, device)
            self.buffers[spec.name] = buf.zero_()
            self._layer_index[spec.name] = {layer: j for j, layer in enumerate(spec.layers)}
        self.req_to_token = alloc("request_table", (max_requests, max_context), torch.int32, device)
        self.req_to_token.zero_()
        # Free lists live on the host: allocation decisions are made by the scheduler in Python.
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._row_slots: dict[int, list[int]] = {}
        self.reclaimer: Reclaimer | None = None
        self.journal: list[tuple[Any, ...]] | None = None  # set on tensor-parallel rank 0 (see the module doc)

    def buffer(self, name: str, layer_idx: int) -> torch.Tensor:
        """[num_slots, *shape] view of one layer's entries of cache kind `name`."""
        return self.buffers[name][self._layer_index[name][layer_idx]]

    @property
    def free_tokens(self) -> int:
        """Slots that can be handed out now: the free list plus what the reclaimer can evict."""
        return len(self._free_slots) + (self.reclaimer.reclaimable if self.reclaimer is not None else 0)

    @property
    def used_tokens(self) -> int:
        """Slots requests hold (cached slots no request uses count as free)."""
        return self.num_slots - self.free_tokens

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
        new = self.take_slots(n)
        slots.extend(new)
        new_t = torch.tensor(new, dtype=torch.int64)
        self.req_to_token[row, start : start + n] = new_t.to(self.req_to_token.device, torch.int32)
        return new_t.to(self.device)

    def num_tokens(self, row: int) -> int:
        return len(self._row_slots[row])

    def free_request(self, row: int) -> None:
        """Return all of a request's slots and its row."""
        self.free_slots(self._row_slots.pop(row))
        self._free_rows.append(row)

    def truncate(self, row: int, n: int) -> None:
        """Keep request `row`'s first n positions and free the slots after them (rejected speculative drafts)."""
        slots = self._row_slots[row]
        self.free_slots(slots[n:])
        del slots[n:]

    def free_slots(self, slots: list[int]) -> None:
        self._free_slots.extend(reversed(slots))

    def take_slots(self, n: int, reclaim: bool = True) -> list[int]:
        """n slots owned by nobody yet (the caller keeps track of them); evicts from the reclaimer
        when the free list is short, unless `reclaim` is False."""
        available = self.free_tokens if reclaim else len(self._free_slots)
        if n > available:
            raise KVPoolFull(f"need {n} KV slots, {available} free")
        if n > len(self._free_slots):
            self.reclaimer.reclaim(n - len(self._free_slots))
        return [self._free_slots.pop() for _ in range(n)]

    @property
    def free_list_tokens(self) -> int:
        """Slots on the free list itself (what can be taken without evicting anything)."""
        return len(self._free_slots)

    def assign_prefix(self, row: int, slots: list[int]) -> None:
        """Point the empty request `row`'s first positions at existing (cached) slots; the row does
        not own them: `release_request` hands them back with the rest."""
        if self._row_slots[row]:
            raise ValueError(f"request row {row} already holds {len(self._row_slots[row])} tokens")
        if len(slots) > self.max_context:
            raise KVPoolFull(f"request needs {len(slots)} positions, the context holds {self.max_context}")
        self._row_slots[row] = list(slots)
        self.write_table(row, 0, slots)

    def write_table(self, row: int, start: int, slots: list[int]) -> None:
        """req_to_token[row, start:start + len(slots)] = slots, recorded for the other ranks."""
        if slots:
            self.req_to_token[row, start : start + len(slots)] = torch.tensor(slots, dtype=torch.int32)
            if self.journal is not None:
                self.journal.append(("table", row, start, list(slots)))

    def row_slots(self, row: int) -> list[int]:
        """The slots of request `row`'s positions 0..num_tokens-1 (do not modify)."""
        return self._row_slots[row]

    def release_request(self, row: int) -> list[int]:
        """Free the row and hand its slots to the caller instead of the free list."""
        slots = self._row_slots.pop(row)
        self._free_rows.append(row)
        return slots

    def take_journal(self) -> list[tuple[Any, ...]]:
        """The entries recorded since the last call (rank 0 sends them with the next batch)."""
        ops, self.journal = self.journal, []
        return ops

    def replay(self, ops: list[tuple[Any, ...]], host=None) -> None:
        """Apply rank 0's journal on another tensor-parallel rank: the same table writes, and the same
        copies between these slots and this rank's own host tier (`host`, a HostCache)."""
        for kind, *args in ops:
            if kind == "table":
                self.write_table(*args)
            elif kind in ("save", "load", "wait"):
                getattr(host, kind)(*args)
            else:
                raise ValueError(f"unknown journal entry {kind!r}")

    def write(self, name: str, layer_idx: int, slots: torch.Tensor, values: torch.Tensor,
              rows: Fp8Rows | None = None) -> None:
        """Store values [n, ...] of new tokens at their slots [n] in cache kind `name`; a buffer of packed FP8
        rows (an FP8 pool's uint8 spec) takes them quantized into the `rows` layout the spec was sized with."""
        buf = self.buffer(name, layer_idx)
        if is_packed(buf):
            assert rows is not None, f"cache kind {name!r} is packed FP8 rows: its writer must give their layout"
            values = rows.pack(values)
        buf[slots] = values.to(buf.dtype)
