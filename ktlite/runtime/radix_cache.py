"""Prefix cache: a token-level radix tree over the KV pool's slots.

Chats and coding agents resend the whole conversation every turn; prefill is the expensive part on a
CPU/GPU hybrid box. The tree indexes the tokens whose KV sits in the pool (of finished requests, and
of running ones after each prefill chunk): edge labels are token ids, each node holds the slots of its
tokens. A new request takes the longest cached prefix of its sequence (never its last token: the
model must run at least one token to produce logits), points its request row at those slots and
prefills only the rest.

Ownership: the tree owns the slots it indexes; a request owns the slots it computed until it hands
them to the tree (`extend` after a prefill chunk, `release` when it ends: finished, preempted or
aborted). Where the tree already held the same tokens under other slots (two requests computed them
at once), the request keeps its own copy until it ends and `release` returns it for freeing, so a
request never switches slots mid-flight. Reference counts are per node (`lock`, held along the path
from the root by every request using the node): unreferenced nodes are evicted least recently used,
leaves first, when the pool needs room (the pool's `reclaimer` hook, so eviction comes before any
preemption); their slots count as free meanwhile.

Host tier (ktlite/runtime/host_cache.py, --hicache-size): every new node is backed up to host memory
right away (the copy overlaps the following steps); evicting a backed-up node frees its device slots
but keeps it in the tree as host-only, and a request matching it copies it back into fresh slots
instead of recomputing it. Device residency stays prefix-closed (a node on the device has its parent
on the device), so a request's cached prefix is a device part followed by a host part. When host
memory is full, the least recently used host copies go: of nodes still on the device, or host-only
leaves (which leave the tree).

Recurrent state (models whose linear-attention layers keep a per-request state): a
prefix is usable only where a snapshot of that state was taken (runtime/state_cache.py). `save_state`
attaches one to the node ending at a request's prompt, and `release` to the node ending at a finished
request's computed tokens; a match is cut back to the deepest node holding one, whose snapshot the
request copies into its row (`Hit.state`). Snapshots go with their node's device slots; when none is
free, the least recently used node's snapshot is dropped (its KV stays: deeper nodes may need it).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from ktlite.runtime.host_cache import HostCache
from ktlite.runtime.kv_cache import KVPool
from ktlite.runtime.state_cache import StateSnapshots


@dataclass(eq=False)
class Node:
    key: list[int]  # token ids on the edge into this node
    parent: Node | None
    slots: list[int] | None = None  # device slots of those tokens; None: held only by the host tier
    host: list[int] | None = None  # host-tier slots of a copy; None: no copy
    children: dict[int, Node] = field(default_factory=dict)
    lock: int = 0  # requests using this node (each holds every node from its deepest one to the root)
    last_use: int = 0
    load_ticket: int | None = None  # host->device copy into `slots` that readers must wait for
    save_ticket: int | None = None  # device->host copy reading `slots` that must end before they are reused
    state: int | None = None  # snapshot row of the recurrent state after this node's last token


@dataclass
class Hit:
    node: Node  # locked for the caller; hand it back to extend/release
    slots: list[int]  # device slots of the cached prefix, positions 0..length-1
    length: int
    state: int | None = None  # snapshot row to copy into the request's state row (recurrent models)


@dataclass
class CacheStats:
    query_tokens: int = 0  # sequence tokens of admitted requests
    hit_tokens: int = 0  # of those, served from the cache
    evicted_tokens: int = 0  # device slots given back by eviction
    host_saved_tokens: int = 0  # tokens backed up to the host tier
    host_loaded_tokens: int = 0  # tokens copied back from the host tier instead of recomputed


def prefix_cache_enabled(config, runtime) -> bool:
    """Whether an engine (EngineConfig, Runtime) runs the prefix cache: not --disable-radix-cache, and a
    model whose cache is per token only, or whose per-request recurrent state (linear attention) the state
    pool can snapshot (runtime.supports_prefix_cache)."""
    return not config.disable_radix_cache and runtime.supports_prefix_cache


def _common(key: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix of key and tokens[start:]."""
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start : start + n]:
        return n
    return next(i for i in range(n) if key[i] != tokens[start + i])


class RadixCache:
    def __init__(self, pool: KVPool, host: HostCache | None = None, snapshots: StateSnapshots | None = None):
        self.pool, self.host, self.snapshots = pool, host, snapshots
        self._stateful: set[Node] = set()  # nodes holding a snapshot
        self.root = Node([], None, slots=[], lock=1)  # never evicted
        self._reclaimable = 0  # device tokens of unlocked nodes
        self.device_tokens = 0  # device tokens in the tree
        self.host_tokens = 0  # host copies in the tree
        self._clock = itertools.count(1)
        self.stats = CacheStats()
        pool.reclaimer = self

    # ---- what requests call ---------------------------------------------------------------------
    def match_len(self, sequence: list[int]) -> int:
        """Cached prefix length of a sequence (host-held part included), without changing anything."""
        tokens, node, i, usable = sequence[:-1], self.root, 0, 0
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            k = _common(child.key, tokens, i)
            i += k
            if k < len(child.key):
                break
            node = child
            usable = i if self.snapshots is None or node.state is not None else usable
        return i if self.snapshots is None else usable

    def acquire(self, sequence: list[int], reserve: int) -> Hit:
        """Lock the longest cached prefix of sequence[:-1] for a request. Its host-held part is copied
        into device slots when the pool can spare them beyond `reserve` (slots promised elsewhere);
        otherwise the prefix ends where the device part does."""
        node, length = self._usable(*self._match(sequence[:-1]))
        self._lock(node)
        path = self._path(node)
        todo = [x for x in path if x.slots is None]
        need = sum(len(x.key) for x in todo)
        if need and self.pool.free_tokens - reserve < need:
            keep, length = self._usable(todo[0].parent, length - need)
            self._lock(keep)
            self._unlock(node)
            node, path, todo = keep, self._path(keep), []
        for x in todo:
            self._load(x, self.pool.take_slots(len(x.key)))
        for x in path:
            if x.load_ticket is not None:  # loaded (or prefetched): the forward reads it next
                self.host.wait(x.load_ticket)
                x.load_ticket = None
        self._touch(path)
        self.stats.query_tokens += len(sequence)
        self.stats.hit_tokens += length
        return Hit(node, [s for x in path for s in x.slots], length, node.state)

    def save_state(self, node: Node, row: int) -> None:
        """Snapshot request row `row`'s recurrent state at `node` (which ends at the row's computed tokens)."""
        if self.snapshots is None or node is self.root or node.state is not None:
            return  # a node's tokens decide its state: one snapshot serves every request reaching it
        slot = self.snapshots.save(row)
        if slot is None:
            self._drop_state(min(self._stateful, key=lambda x: x.last_use))
            slot = self.snapshots.save(row)
        node.state = slot
        self._stateful.add(node)

    def extend(self, node: Node, tokens: list[int], slots: list[int]) -> Node:
        """Index a running request's computed tokens (all of its sequence so far, at `slots`); it
        moves its lock from `node` to the returned one."""
        last, _ = self._insert(tokens, slots)
        self._lock(last)
        self._unlock(node)
        return last

    def release(self, node: Node, tokens: list[int], slots: list[int], state_row: int | None = None) -> list[int]:
        """A request is done with its row: index its computed tokens (with the recurrent state of
        `state_row`, which holds their state) and unlock. -> its slots the tree did not take (the tree
        held those tokens under other slots); the caller frees them."""
        last, unused = self._insert(tokens, slots)
        if state_row is not None:
            self.save_state(last, state_row)
        self._unlock(node)
        return unused

    def prefetch(self, sequence: list[int]) -> int:
        """Start copying the host-held part of sequence's cached prefix into slots from the free list
        (evicting nothing), so the copy overlaps the step about to run. -> tokens started."""
        if self.host is None:
            return 0
        node, _ = self._match(sequence[:-1])
        todo = [x for x in self._path(node) if x.slots is None]
        need = sum(len(x.key) for x in todo)
        if not need or need > self.pool.free_list_tokens:
            return 0
        for x in todo:
            self._load(x, self.pool.take_slots(len(x.key), reclaim=False))
        return need

    # ---- the pool's reclaimer -------------------------------------------------------------------
    @property
    def reclaimable(self) -> int:
        return self._reclaimable

    def reclaim(self, n: int) -> None:
        """Evict unlocked device nodes, least recently used leaves first, until n slots are freed."""
        tie = itertools.count()
        heap = [(x.last_use, next(tie), x) for x in self.nodes() if x.lock == 0 and self._device_leaf(x)]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, x = heapq.heappop(heap)
            parent = x.parent
            freed += len(x.key)
            self._evict(x)
            if parent is not self.root and parent.lock == 0 and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_use, next(tie), parent))
        if freed < n:
            raise RuntimeError(f"prefix cache: asked for {n} slots, could evict only {freed} "
                               f"(reclaimable count {self._reclaimable} is wrong)")

    # ---- tree -----------------------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            yield x

    def _usable(self, node: Node, length: int) -> tuple[Node, int]:
        """(node, length) cut back to the deepest node holding a snapshot, for a model with recurrent state."""
        while self.snapshots is not None and node is not self.root and node.state is None:
            length -= len(node.key)
            node = node.parent
        return node, length

    def _drop_state(self, x: Node) -> None:
        if x.state is not None:
            self.snapshots.drop(x.state)
            x.state = None
            self._stateful.discard(x)

    def _path(self, node: Node) -> list[Node]:
        """Nodes from the root's child down to node."""
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent
        return out[::-1]

    def _touch(self, path: list[Node]) -> None:
        now = next(self._clock)
        for x in path:
            x.last_use = now

    def _match(self, tokens: list[int]) -> tuple[Node, int]:
        """The node ending exactly where the cached prefix of tokens ends (splitting one if needed)."""
        node, i = self.root, 0
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            k = _common(child.key, tokens, i)
            if k < len(child.key):
                child = self._split(child, k)
            node, i = child, i + k
        return node, i

    def _split(self, child: Node, k: int) -> Node:
        """Cut child's edge after k tokens; -> the new node holding the first k."""
        top = Node(child.key[:k], child.parent, None if child.slots is None else child.slots[:k],
                   None if child.host is None else child.host[:k], {child.key[k]: child}, child.lock,
                   child.last_use, child.load_ticket, child.save_ticket)
        child.parent.children[top.key[0]] = top
        child.key, child.parent = child.key[k:], top
        child.slots = None if child.slots is None else child.slots[k:]
        child.host = None if child.host is None else child.host[k:]
        return top

    def _insert(self, tokens: list[int], slots: list[int]) -> tuple[Node, list[int]]:
        """Index tokens at slots. -> (the node ending at the last token, slots not taken)."""
        node, i, unused = self.root, 0, []
        path = []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = Node(tokens[i:], node)
                node.children[tokens[i]] = child
                self._set_slots(child, slots[i:])
                self._backup(child)
                path.append(child)
                node, i = child, len(tokens)
                break
            k = _common(child.key, tokens, i)
            if k < len(child.key):
                child = self._split(child, k)
            if child.slots is None:  # held only by the host tier: take the freshly computed slots
                self._set_slots(child, slots[i : i + k])
            else:
                unused += [s for s, t in zip(slots[i : i + k], child.slots) if s != t]
            path.append(child)
            node, i = child, i + k
        self._touch(path)
        return node, unused

    def _lock(self, node: Node | None) -> None:
        while node is not None:
            if node.lock == 0 and node.slots is not None:
                self._reclaimable -= len(node.key)
            node.lock += 1
            node = node.parent

    def _unlock(self, node: Node | None) -> None:
        while node is not None:
            node.lock -= 1
            if node.lock == 0 and node.slots is not None:
                self._reclaimable += len(node.key)
            node = node.parent

    def _set_slots(self, node: Node, slots: list[int]) -> None:
        node.slots = slots
        self.device_tokens += len(slots)
        if node.lock == 0:
            self._reclaimable += len(slots)

    @staticmethod
    def _device_leaf(x: Node) -> bool:
        return x.slots is not None and all(c.slots is None for c in x.children.values())

    def _evict(self, x: Node) -> None:
        n = len(x.key)
        if self.host is not None:  # copies touching these slots end before anyone reuses them
            self.host.wait(x.load_ticket)
            self.host.wait(x.save_ticket)
            x.load_ticket = x.save_ticket = None
        self.pool.free_slots(x.slots)
        self._drop_state(x)  # the state is of no use without the KV before it
        x.slots = None
        self._reclaimable -= n
        self.device_tokens -= n
        self.stats.evicted_tokens += n
        if x.host is None:
            self._delete(x)

    def _delete(self, x: Node) -> None:
        """Drop x (on no device) and its subtree (host-only, as device residency is prefix-closed)."""
        del x.parent.children[x.key[0]]
        for y in [x, *self._subtree(x)]:
            if y.host is not None:
                self.host.free(y.host)
                self.host_tokens -= len(y.key)
                y.host = None

    @staticmethod
    def _subtree(x: Node) -> Iterator[Node]:
        stack = list(x.children.values())
        while stack:
            y = stack.pop()
            stack.extend(y.children.values())
            yield y

    # ---- host tier ------------------------------------------------------------------------------
    def _backup(self, x: Node) -> None:
        if self.host is None:
            return
        host_slots = self._host_alloc(len(x.key))
        if host_slots is None:  # host memory full of copies in use: evicting x will drop it
            return
        x.host = host_slots
        self.host_tokens += len(x.key)
        x.save_ticket = self.host.save(x.slots, host_slots)
        self.stats.host_saved_tokens += len(x.key)

    def _load(self, x: Node, slots: list[int]) -> None:
        x.load_ticket = self.host.load(x.host, slots)
        self._set_slots(x, slots)
        self.stats.host_loaded_tokens += len(x.key)

    def _host_alloc(self, n: int) -> list[int] | None:
        """n host slots, dropping the least recently used unlocked host copies to make room."""
        if n > self.host.num_slots:
            return None
        if self.host.free_slots < n:
            tie = itertools.count()
            heap = [(x.last_use, next(tie), x) for x in self.nodes() if self._host_droppable(x)]
            heapq.heapify(heap)
            while self.host.free_slots < n and heap:
                _, _, x = heapq.heappop(heap)
                parent = x.parent
                self.host.free(x.host)
                self.host_tokens -= len(x.key)
                x.host = None
                if x.slots is None:
                    del parent.children[x.key[0]]
                    if parent is not self.root and self._host_droppable(parent):
                        heapq.heappush(heap, (parent.last_use, next(tie), parent))
        return self.host.alloc(n)

    @staticmethod
    def _host_droppable(x: Node) -> bool:
        """A copy that can go: unlocked, and either still on the device or a host-only leaf."""
        return x.host is not None and x.lock == 0 and (x.slots is not None or not x.children)
