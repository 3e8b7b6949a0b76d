"""Per-request state of recurrent layers (e.g. Gated DeltaNet's conv window and recurrent matrix).

A family declares what each running request keeps per layer (`RequestStateSpec`); the pool holds one
buffer per spec, `[len(spec.layers), max_requests, *spec.shape]`, indexed by the request's KV-pool
row, so a row is the request's identity for both pools and is allocated and freed with it. A
request's state is rebuilt from scratch whenever it (re)starts at position 0: the model zeroes the
row's state when a batch row has no cached prefix, so a finished, aborted or preempted request leaves
nothing to clean up (a preempted request recomputes its prompt, and with it its state).

Snapshots (the prefix cache on such a model): a token prefix restores the KV of attention layers but not
the recurrent layers' state, which depends on every token before it. The pool therefore holds
`snapshots` rows beyond the requests' ones; `StateSnapshots` copies a request's state into one of them
where the prefix cache indexes the end of a prompt or of a finished request, and copies it back into the
row of a request that starts from that prefix (SGLang keeps such states in its mamba cache the same way).

Speculative verifies: a verify runs the recurrent layers over a request's last token and its drafts, but only
the accepted ones may stay in its state. With `verify_rows`, each request row has a verify row beside it where
the layers keep the state from before the verify; when drafts are rejected, the layer's `rewind` copies it
back and replays the accepted tokens over it (gated_deltanet.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ktlite.runtime.kv_cache import Allocator, _plain_alloc


@dataclass(frozen=True)
class RequestStateSpec:
    name: str  # "conv", "recurrent", ...
    layers: tuple[int, ...]
    shape: tuple[int, ...]  # per request per layer, on one tensor-parallel rank
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_request(self) -> int:
        return len(self.layers) * math.prod(self.shape) * self.dtype.itemsize


def state_bytes_per_request(specs: Sequence[RequestStateSpec]) -> int:
    return sum(s.bytes_per_request for s in specs)


class StatePool:
    def __init__(self, specs: Sequence[RequestStateSpec], max_requests: int, device: torch.device | str,
                 alloc: Allocator = _plain_alloc, snapshots: int = 0, verify_rows: int = 0):
        self.buffers: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, dict[int, int]] = {}
        # rows max_requests.. hold snapshots (none without state to keep), then one verify row per request row
        self.snapshot_rows = range(max_requests, max_requests + snapshots) if specs else range(0)
        self._verify_base = max_requests + len(self.snapshot_rows)
        self.verify_rows = verify_rows if specs else 0  # max_requests where speculative verifies run, else 0
        rows = self._verify_base + self.verify_rows
        for spec in specs:
            buf = alloc("state_pool", (len(spec.layers), rows, *spec.shape), spec.dtype, torch.device(device))
            self.buffers[spec.name] = buf.zero_()
            self._layer_index[spec.name] = {layer: j for j, layer in enumerate(spec.layers)}

    def state(self, name: str, layer_idx: int) -> torch.Tensor:
        """[max_requests, *shape] view of one layer's state `name`, indexed by KV-pool row."""
        return self.buffers[name][self._layer_index[name][layer_idx]]

    def verify_row(self, row: int) -> int:
        """Where request row `row`'s state from before a speculative verify is kept."""
        return self._verify_base + row

    def copy_row(self, src: int, dst: int) -> None:
        """Every layer's state of row src into row dst."""
        for buf in self.buffers.values():
            buf[:, dst].copy_(buf[:, src])


class StateSnapshots:
    """The pool's snapshot rows: `save` copies a request row's state into a free one (None when none is
    free: the prefix cache evicts a snapshot first), `load` copies one back into a request row."""

    def __init__(self, pool: StatePool):
        self.pool = pool
        self.free = list(reversed(pool.snapshot_rows))

    def save(self, row: int) -> int | None:
        if not self.free:
            return None
        slot = self.free.pop()
        self.pool.copy_row(row, slot)
        return slot

    def load(self, slot: int, row: int) -> None:
        self.pool.copy_row(slot, row)

    def drop(self, slot: int) -> None:
        self.free.append(slot)
