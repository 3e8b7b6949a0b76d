"""Per-request state of recurrent layers (e.g. Gated DeltaNet's conv window and recurrent matrix).

A family declares what each running request keeps per layer (`RequestStateSpec`); the pool holds one
buffer per spec, `[len(spec.layers), max_requests, *spec.shape]`, indexed by the request's KV-pool
row, so a row is the request's identity for both pools and is allocated and freed with it. A
request's state is rebuilt from scratch whenever it (re)starts at position 0: the model zeroes the
row's state when a batch row has no cached prefix, so a finished, aborted or preempted request leaves
nothing to clean up (a preempted request recomputes its prompt, and with it its state).
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
                 alloc: Allocator = _plain_alloc):
        self.buffers: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, dict[int, int]] = {}
        for spec in specs:
            buf = alloc("state_pool", (len(spec.layers), max_requests, *spec.shape), spec.dtype, torch.device(device))
            self.buffers[spec.name] = buf.zero_()
            self._layer_index[spec.name] = {layer: j for j, layer in enumerate(spec.layers)}

    def state(self, name: str, layer_idx: int) -> torch.Tensor:
        """[max_requests, *shape] view of one layer's state `name`, indexed by KV-pool row."""
        return self.buffers[name][self._layer_index[name][layer_idx]]
