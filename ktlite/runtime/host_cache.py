"""Host-memory tier of the prefix cache: KV entries copied out of the device pool and back.

The radix cache (ktlite/runtime/radix_cache.py) backs every node it indexes up to host memory as soon
as the node exists (write-through), so evicting it from the device costs nothing and a later request
can copy it back instead of recomputing it. The host copy of each cache kind is one tensor
`[host_slots, layers, *per_token_shape]` (slot-major, so a run of consecutive host slots is one
contiguous block: one async copy per run), pinned when the device is CUDA.

On CUDA the copies run on their own stream, so they overlap the forward steps: a backup is queued
right after the step that computed the KV, a prefetched load while the step before its request's
admission runs. Every copy returns a ticket; `wait(ticket)` makes the compute stream wait for it,
which the radix cache does before a forward reads loaded slots and before evicted slots are
reused. On a CPU device the copies are plain synchronous copies and tickets are None.

Tensor parallelism: rank 0's radix cache decides; `save`/`load`/`wait` are recorded in the pool's
journal and every other rank replays them on its own shard of the KV and its own host tier, so
tickets (a counter) agree across ranks.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from ktlite.config import EngineConfig
from ktlite.errors import ConfigError
from ktlite.runtime.kv_cache import KVPool, kv_bytes_per_token

_GIB = 2**30


def host_cache_plan(per_token: int, size_gib: float) -> tuple[int, int, str]:
    """The memory plan's host-memory line for --hicache-size, per rank, from the KV pool's bytes per
    token on that rank: (tokens, bytes, note)."""
    tokens = int(size_gib * _GIB) // per_token
    note = f"--hicache-size {size_gib:g}: {tokens:,} tokens x {per_token:,} bytes in CPU RAM (pinned on CUDA)"
    return tokens, tokens * per_token, note


def runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values: (index in slots, first value, length)."""
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, s, 1))
    return out


class HostCache:
    def __init__(self, pool: KVPool, num_slots: int):
        if num_slots < 1:
            raise ConfigError("--hicache-size holds less than one token of KV; raise it")
        self.pool, self.num_slots = pool, num_slots
        cuda = pool.device.type == "cuda"
        # [host slots, layers, *shape] per cache kind; pinned so device copies are asynchronous
        self.buffers = {name: torch.empty((num_slots, buf.shape[0], *buf.shape[2:]), dtype=buf.dtype, pin_memory=cuda)
                        for name, buf in pool.buffers.items()}
        self._free = list(range(num_slots - 1, -1, -1))
        self._stream = torch.cuda.Stream(pool.device) if cuda else None
        self._events: dict[int, torch.cuda.Event] = {}
        self._tickets = itertools.count(1)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def alloc(self, n: int) -> list[int] | None:
        """n host slots, lowest first (long runs: few copies), or None when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))

    # ---- copies (recorded for the other tensor-parallel ranks) --------------------------------
    def save(self, device_slots: list[int], host_slots: list[int]) -> int | None:
        """Copy the KV of device_slots to host_slots (all cache kinds, all layers)."""
        self._log("save", device_slots, host_slots)
        with self._copy_stream():  # tensors made inside belong to the copy stream (no early reuse)
            index = torch.tensor(device_slots, device=self.pool.device)
            for name, buf in self.pool.buffers.items():
                staged = buf.index_select(1, index).transpose(0, 1).contiguous()  # [n, layers, *shape]
                for i, start, n in runs(host_slots):
                    self.buffers[name][start : start + n].copy_(staged[i : i + n], non_blocking=True)
        return self._ticket()

    def load(self, host_slots: list[int], device_slots: list[int]) -> int | None:
        """Copy the KV held at host_slots into device_slots."""
        self._log("load", host_slots, device_slots)
        with self._copy_stream():
            index = torch.tensor(device_slots, device=self.pool.device)
            for name, buf in self.pool.buffers.items():
                host = self.buffers[name]
                staged = torch.empty((len(host_slots), *host.shape[1:]), dtype=host.dtype, device=self.pool.device)
                for i, start, n in runs(host_slots):
                    staged[i : i + n].copy_(host[start : start + n], non_blocking=True)
                buf.index_copy_(1, index, staged.transpose(0, 1))
        return self._ticket()

    def wait(self, ticket: int | None) -> None:
        """Order the compute stream after copy `ticket` (a no-op once it is known to be done)."""
        if ticket is None:
            return
        self._log("wait", ticket)
        event = self._events.pop(ticket, None)
        if event is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(event)

    def _log(self, kind: str, *args) -> None:
        if self.pool.journal is not None:
            self.pool.journal.append((kind, *args))

    def _copy_stream(self):
        if self._stream is None:
            return contextlib.nullcontext()
        # the copy reads what earlier forwards wrote (and writes slots they may have read)
        self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        return torch.cuda.stream(self._stream)

    def _ticket(self) -> int | None:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        self._events = {t: e for t, e in self._events.items() if not e.query()}  # done: nothing to wait for
        ticket = next(self._tickets)
        self._events[ticket] = event
        return ticket


def make_host_cache(pool: KVPool, config: EngineConfig) -> HostCache | None:
    """The host tier --hicache-size asks for (None without it); each rank sizes its own shard."""
    if not config.hicache_size:
        return None
    tokens, _, _ = host_cache_plan(kv_bytes_per_token(list(pool.specs.values()), pool.dtype), config.hicache_size)
    return HostCache(pool, tokens)
