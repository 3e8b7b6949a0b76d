"""Token-level KV pool: per-token cache entries of every layer, in the layout the model declares.

A model family declares what it caches per token (`TokenCacheSpec`: MLA latent, GQA keys and values
per kv-head, DSA index keys, ...), each for a set of layers. The pool allocates one buffer per spec,
`[len(spec.layers), num_slots, *spec.shape]`, so slot s of every buffer holds one token's entry.
`req_to_token[row, pos]` maps a request's position to its slot, which is what the attention kernels
read. Slots and request rows come from free lists, so a request's tokens need not be contiguous and
freeing is O(tokens). All freeing of token slots goes through `free_slots`, the one place a prefix
cache puts reference counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ktlite.errors import KtliteError

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

    def buffer(self, name: str, layer_idx: int) -> torch.Tensor:
        """[num_slots, *shape] view of one layer's entries of cache kind `name`."""
        return self.buffers[name][self._layer_index[name][layer_idx]]

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
        return new_t.to(self.device)

    def num_tokens(self, row: int) -> int:
        return len(self._row_slots[row])

    def free_request(self, row: int) -> None:
        """Return all of a request's slots and its row."""
        self.free_slots(self._row_slots.pop(row))
        self._free_rows.append(row)

    def free_slots(self, slots: list[int]) -> None:
        self._free_slots.extend(reversed(slots))

    def write(self, name: str, layer_idx: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store values [n, *shape] of new tokens at their slots [n] in cache kind `name`."""
        buf = self.buffer(name, layer_idx)
        buf[slots] = values.to(buf.dtype)
