"""CPUMoE: the routed experts that live in CPU RAM, quantized, for every MoE layer, and their runs.

API (what the runtime calls):

    moe = CPUMoE(method="INT4", group_size=None, num_threads=None, threadpool_count=1,
                 prefill_threshold=None, prefill_dtype=None,  # None: bf16 where it beats fp32 here
                 activations="fp32")  # --cpu-activations: int8, fp32 or auto (quant.int8_activations)
    moe.add_layer(layer_idx, gate[E, I, H], up[E, I, H], down[E, H, I], cpu_experts=None)
    # or, streaming tensor by tensor (the loader / converted weights):
    moe.reserve_layer(layer_idx, n_experts, hidden, inter, cpu_experts=None)
    moe.set_expert(layer_idx, expert, gate[I, H], up[I, H], down[H, I])
    # or a checkpoint's own encoding (FP8, GGUF blocks, compressed-tensors INT4: expert_sources.py):
    moe.reserve_layer(layer_idx, ..., formats=(("FP8", 128), ("FP8", 128)))
    gate_up, down = moe.slot_views(layer_idx, expert)       # the slot's storage, filled in place
    moe.native_fill = fn(layer_idx, expert, gate_up, down)  # refills a slot on dynamic placement
    out = moe.forward(layer_idx, hidden[T, H], topk_ids[T, k], topk_weights[T, k], skip_mask[E])
    handle = moe.submit(...same args...);  ...GPU work...;  out = handle.wait()
    moe.set_activation(layer_idx, activation, biases)       # the experts' (kernels/expert_activation.py), if not SiLU * up
    moe.warmup(); moe.nbytes(); moe.close()
    moe.swap_expert(layer_idx, new, old, gate, up, down)   # dynamic placement: new -> GPU, old -> CPU
    moe.dequantized_expert(layer_idx, expert, dtype)       # (gate_up [2I, H], down [H, I]) as stored

`out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])` over the selected experts
that run here, in hidden's dtype and device. `skip_mask[e] = True` marks an expert that is not on
CPU (e.g. on the GPU): it contributes nothing here. Only `cpu_experts` are stored (no resident copy
of GPU experts); selecting an expert that is neither stored nor masked raises KtliteError, since
that means the placement and the mask disagree. Ids < 0 (padding) are ignored.

Each layer keeps its own storage formats (quant.py: INT4/INT8/BF16 quantized by ktlite, or FP8 / GGUF
blocks as a checkpoint ships them; gate_up and down may differ, e.g. GGUF Q4_K and Q6_K); the kernels
dispatch on the stored dtype. Paths, per expert and call: an expert with fewer than `prefill_threshold`
tokens (default_prefill_threshold: per method, prefill dtype and activations) runs in the fused GEMV kernel
(moe_kernels.py over rowdots.py: vector row dots straight from the stored bytes, fp32 math on the exact dequantized weights, or, with int8 `activations`, INT4/INT8 rows
dotted with activations quantized per 32 values in integer math, as 4-row x 4-token tiles for an expert with 2 or
more tokens where the CPU has AVX512-VNNI, and where it has AMX, from AMX_MIN_TOKENS on, as AMX-INT8 tiles
(moe_kernels.moe_amx, activations quantized per weight group of >= 64); decode is always the row dots); one
with more is dequantized once (into per-thread buffers reused across experts and calls) and runs
torch.matmul in `prefill_dtype` (gemm.py; fp32 is the exact choice; bf16 halves the bytes and is the
fast one with AMX and on some AVX512-BF16 cores, and 3x slower than fp32 where oneDNN must convert: the default
follows the CPU, target.bf16_gemm_wins); those experts
run in batches of at most PAIR_BATCH (token, expert) pairs, so the element-wise SiLU * mul and the
weighted scatter-add are one call per batch, not one per expert. Choosing
per expert rather than by T matters: at T=16, V2-Lite experts see ~1.5 tokens each, V3's ~16.

Threads: `num_threads` (--kt-cpuinfer) numba threads split into `threadpool_count`
(--kt-threadpool-count) pools; each pool owns a contiguous block of a layer's slots, runs its
share of a call in its own worker thread, and the results are summed. Kernels release the GIL, so
`submit` returns at once and the caller's thread keeps running (torch matmuls in the prefill path
use torch's own intra-op threads). `forward` runs every pool's share on the calling thread instead, with
all the threads: for a caller with nothing to overlap (a CPU device), where the hand-off only costs.

NUMA: pool p runs on its node's cpus (threads.py) and the rows of every layer's arrays for the slots it owns get
its node's memory policy before they are first written (ktlite.numa.bind_rows, through empty_quantized's `place`);
`numa_report()` says, per pool, what was done and where sampled pages of its experts are.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numba
import numpy as np
import torch

from ktlite import numa
from ktlite.errors import KtliteError
from ktlite.kernels.cpu import gemm, moe_kernels
from ktlite.kernels.cpu.quant import (
    INT_DOT_METHODS,
    QUANTIZED_METHODS,
    QuantizedWeight,
    check_group_size,
    dequantize,
    empty_quantized,
    int8_activations,
    normalize_kt_method,
    quantize_into,
)
from ktlite.kernels.cpu.target import bf16_gemm_wins
from ktlite.kernels.cpu.threads import ExpertPools, pinned_threads
from ktlite.kernels.expert_activation import SWIGLU, ExpertActivation

logger = logging.getLogger(__name__)

# tokens per expert from which dequantize + oneDNN beats the GEMV kernel (one V2-Lite expert, 2 cores:
# INT4 4 tokens 1.7 ms GEMV vs 1.9 ms, 6 tokens 2.6 vs 2.1 ms; the vectorized dequantize costs about one
# T=1 GEMV, while the kernel's per-token fp32 dots run ~10x fewer FLOP/s than oneDNN's bf16 GEMM)
DEFAULT_PREFILL_THRESHOLD = {"INT4": 5, "INT8": 5, "BF16": 4, "FP8": 5, "RAWINT4": 5, "LLAMAFILE": 4,
                             "MXFP4": 5, "MXFP8": 5}  # MX: FP8's (decoded alike), not measured on their own
# with fp32 GEMMs (a CPU whose bf16 GEMM loses) the dequantized weights are twice the bytes and the GEMM
# half the speed: on a Zen 3 the fused kernel stayed faster up to ~32 tokens per expert (bench/history/)
FP32_PREFILL_THRESHOLD = 32
# int8 activations against fp32 GEMMs: the integer row dots stayed faster up to 128 tokens per expert (Zen 3,
# bench/history/: V3 INT4 at 128 tokens 1.03 s vs 1.11 s, V2-Lite at ~48 tokens 0.86 s vs 1.00 s)
Q8_FP32_PREFILL_THRESHOLD = 128
# the AVX512-VNNI tiles against fp32 GEMMs (2-core Emerald Rapids VM, bench/history/): tiles won at 48 tokens per
# expert (V2-Lite T=512 411 vs 431 ms), lost at 128 (V3 T=512 2.41 vs 2.16 s)
Q8_TILES_FP32_PREFILL_THRESHOLD = 64
# against bf16 GEMMs (a 2-core AVX512-BF16 Xeon, bench/history/): the AVX-512 integer row dots won at 12 tokens
# per expert (V2-Lite INT4 168 vs 241 ms), tied at 32 (V3: 244-286 vs 252-269 ms), lost at 48 (682 vs 486 ms).
# Where bf16 GEMMs win over fp32 (AMX, Zen 5: 400+ GMAC/s, 4x the tiles' ~100) the tiles do not move this much.
Q8_BF16_PREFILL_THRESHOLD = 24
Q8_METHODS = (*INT_DOT_METHODS, "RAWINT4")  # --kt-method values stored as INT4/INT8 rows
# with AMX an expert with this many tokens or more runs on AMX tiles (moe_kernels.moe_amx); fewer: the row dots or VNNI
# tiles, without the AMX tiles' fixed cost per 32 rows and weight group (2-core Sapphire Rapids VM, V2-Lite layer,
# every expert on one path: INT4 at 3 tokens per expert 27.4 vs 27.4 ms, at 4 29.6 vs 32.9 ms; INT8 at 2 36.9 vs
# 37.6 ms, at 3 39.9 vs 45.0 ms). Not from a tie on: the AMX tiles quantize activations per weight group, the row
# dots per 32 values, so an expert's output depends on how many tokens share it from here on.
AMX_MIN_TOKENS = {"INT4": 4, "INT8": 3}
# the AMX tiles against bf16 (AMX) GEMMs (dequantize + oneDNN), same VM, V3 layer (8 experts, each token to all),
# ms at 256 / 512 / 1024 / 2048 tokens per expert: INT4 (scales folded) 85.7 / 158.8 / 325.4 / 745 vs 167.0 / 270.3 /
# 447.2 / 821 (0.51x rising to 0.91x: oneDNN from 4096, the trend's tie); INT8 (groups of 128, sums in tiles) at
# 512 / 1024 / 2048 222.5 / 427.0 / 858.1 vs 254.3 / 453.0 / 792.3 (0.88x, 0.94x, 1.08x: oneDNN from 1536). INT4
# weights whose scales do not fold run their tiles per group, slower.
Q8_AMX_PREFILL_THRESHOLD = {"INT4": 4096, "INT8": 1536}


def default_prefill_threshold(method: str, prefill_dtype: torch.dtype, int8_activations: bool = False,
                              amx: bool = False) -> int:
    """Tokens per expert (or per matrix) from which dequantize + torch.matmul beats the fused kernel; amx: the
    fused kernel has AMX tiles for these weights (CPUMoE with groups of >= 64 on an AMX CPU)."""
    q8 = int8_activations and method in Q8_METHODS
    if q8 and amx:
        return Q8_AMX_PREFILL_THRESHOLD[method]
    if prefill_dtype == torch.bfloat16:
        return Q8_BF16_PREFILL_THRESHOLD if q8 else DEFAULT_PREFILL_THRESHOLD[method]
    if q8:
        return Q8_TILES_FP32_PREFILL_THRESHOLD if moe_kernels.INT_TILES else Q8_FP32_PREFILL_THRESHOLD
    return FP32_PREFILL_THRESHOLD
# (token, expert) pairs per batch of the matmul path: bounds its buffers (V3: 4096 x 7168 bf16 = 58 MB)
PAIR_BATCH = 4096
Format = tuple[str, int]  # (storage format, group size) of a stored matrix, as quant.empty_quantized takes them
# fills a slot with an expert in the checkpoint's own encoding: (layer, expert, gate_up view, down view)
NativeFill = Callable[[int, int, QuantizedWeight, QuantizedWeight], None]


@dataclass
class ExpertLayer:
    """The CPU experts of one MoE layer, stacked in slot order."""

    n_experts: int
    hidden: int
    inter: int
    experts: np.ndarray  # [S] global expert id of each slot
    slot_of: np.ndarray  # [E] slot of each expert, -1 if not on CPU
    pool_of: np.ndarray  # [S] pool that owns each slot
    gate_up: QuantizedWeight  # [S, 2I, H]: gate rows then up rows
    down: QuantizedWeight  # [S, H, I]
    activation: ExpertActivation = SWIGLU
    biases: tuple[np.ndarray, np.ndarray] | None = None  # fp32 gate_up [E, 2I], down [E, H] by expert id
    # moe_kernels.fold_steps of gate_up / down per slot, and whether each slot's scales fold; slots written since the
    # last check are checked again (a dynamic placement swap re-checks one slot, not the layer)
    _steps: list[np.ndarray] = field(default_factory=list)
    _folds: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), bool))
    _unchecked: set[int] = field(default_factory=set)
    _checking: threading.Lock = field(default_factory=threading.Lock)  # the pools' threads share the layer
    _answer: tuple[np.ndarray, np.ndarray] | None = None  # fold_steps' until a slot is written (every decode step asks)

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()

    @property
    def plain(self) -> bool:
        """SiLU(gate) * up without biases: the AMX / VNNI tiles run only this."""
        return self.activation.plain and self.biases is None

    def activation_args(self) -> tuple:
        """The activation as moe_kernels.moe_rows takes it (the slots' experts read in place: swaps update them)."""
        return moe_kernels.activation_args(self.activation, self.biases, self.experts)

    def fold_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """The steps (moe_kernels.fold_steps) of gate_up and of down where every slot's INT4 scales fold, else NO_STEPS
        (also for INT8 and off AMX): the AMX tiles then sum whole rows."""
        with self._checking:
            if self._answer is None:
                self._answer = self._checked_steps()
            return self._answer

    def _checked_steps(self) -> tuple[np.ndarray, np.ndarray]:
        folding = [w if w.method == "INT4" and amx_fits(self) else None for w in (self.gate_up, self.down)]
        if not self._steps:
            self._steps = [np.zeros((self.experts.size, 0 if w is None else w.scales.shape[1], 1), np.float32)
                           for w in folding]
            self._folds = np.zeros((2, self.experts.size), bool)
            self._unchecked = set(range(self.experts.size))
        for slot in self._unchecked:
            for i, w in enumerate(folding):
                steps = moe_kernels.NO_STEPS if w is None else moe_kernels.fold_steps(w.scales[slot:slot + 1])
                self._folds[i, slot] = steps.shape[0] > 0
                if steps.shape[0]:
                    self._steps[i][slot] = steps[0]
        self._unchecked.clear()
        unfolded = [w is not None and not folds.all() for w, folds in zip(folding, self._folds)]
        if any(unfolded):
            _warn_unfolded()
        return tuple(moe_kernels.NO_STEPS if w is None or off else steps
                     for w, steps, off in zip(folding, self._steps, unfolded))

    def written(self, slot: int) -> None:
        """The slot was (or is about to be) written: fold_steps checks it again."""
        with self._checking:
            self._unchecked.add(slot)
            self._answer = None


@functools.lru_cache(maxsize=None)
def _warn_unfolded() -> None:  # once per process
    logger.warning("INT4 experts whose group scales are not whole multiples of one step per row (quantized before "
                   "ktlite made them so, e.g. an older `ktlite convert`): their AMX tiles rescale each group's sums, "
                   "~1.6-2.3x slower in prefill; convert them again to fold the scales into the weights")


def amx_fits(layer: ExpertLayer) -> bool:
    """Whether the layer's experts can run on AMX tiles here (moe_kernels.moe_amx: INT4/INT8, groups >= 64, 32+ rows)."""
    return (moe_kernels.AMX and min(layer.gate_up.group_size, layer.down.group_size) >= moe_kernels.AMX_MIN_GROUP
            and min(layer.inter, layer.hidden) >= moe_kernels.AMX_BLOCK_ROWS)


@dataclass
class _PoolWork:
    """One pool's share of a call: pairs (token, weight) grouped by slot."""

    slots: np.ndarray  # [M] int64
    tok_ptr: np.ndarray  # [M + 1] int64: pairs of slots[m] are tok_ptr[m]:tok_ptr[m + 1]
    tok_idx: np.ndarray  # [P] int64
    tok_w: np.ndarray  # [P] float32

    def batches(self, max_pairs: int) -> list[_PoolWork]:
        """Runs of consecutive slots with at most `max_pairs` pairs each (a slot with more is alone)."""
        out, m0 = [], 0
        for m1 in range(1, self.slots.size + 1):
            if m1 == self.slots.size or self.tok_ptr[m1 + 1] - self.tok_ptr[m0] > max_pairs:
                lo, hi = self.tok_ptr[m0], self.tok_ptr[m1]
                out.append(_PoolWork(self.slots[m0:m1], self.tok_ptr[m0:m1 + 1] - lo, self.tok_idx[lo:hi],
                                     self.tok_w[lo:hi]))
                m0 = m1
        return out

    def select(self, which: np.ndarray) -> _PoolWork:
        """The slots where `which` [M] is True."""
        pair = np.repeat(which, np.diff(self.tok_ptr))
        counts = np.diff(self.tok_ptr)[which]
        return _PoolWork(self.slots[which], np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                         self.tok_idx[pair], self.tok_w[pair])


_NO_SKIP = np.zeros(0, np.bool_)


def _routing_arrays(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    skip_mask: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The router's output as the grouping kernel takes it: ids int64 [T, k], weights fp32 [T, k] (contiguous, on the
    CPU) and the skip mask [E] (empty: skip nothing)."""
    ids = np.ascontiguousarray(topk_ids.detach().to("cpu", torch.int64).numpy())
    weights = np.ascontiguousarray(topk_weights.detach().to("cpu", torch.float32).numpy())
    skip = _NO_SKIP if skip_mask is None else skip_mask.detach().to("cpu", torch.bool).numpy()
    return ids, weights, skip


def _summed(parts: list[torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """The pools' fp32 outputs summed, in hidden's dtype and device (zeros if no pool had work)."""
    out = torch.zeros(hidden.shape[0], hidden.shape[1]) if not parts else parts[0]
    for part in parts[1:]:
        out.add_(part)
    return out.to(device=hidden.device, dtype=hidden.dtype)


def _where(place: numa.PoolPlacement, arrays: list[tuple[np.ndarray, np.ndarray]]) -> str:
    """Where sampled resident pages of a pool's rows of `arrays` ((array, rows it owns)) are."""
    try:
        seen = sum((numa.page_nodes(a, rows) for a, rows in arrays), Counter())
    except numa.NumaError as exc:
        return f"not checked ({exc})"
    nodes = ",".join(map(str, place.nodes))
    return f"{sum(seen[n] for n in place.nodes)}/{sum(seen.values())} sampled pages on node{'s' * (len(place.nodes) > 1)} {nodes}"


class CPUMoEHandle:
    """A submitted call; `wait()` returns the summed output."""

    def __init__(self, futures: list[Future], hidden: torch.Tensor):
        self._futures, self._hidden = futures, hidden

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> torch.Tensor:
        return _summed([f.result() for f in self._futures], self._hidden)


class CPUMoE:
    def __init__(
        self,
        method: str,
        group_size: int | None = None,
        num_threads: int | None = None,
        threadpool_count: int = 1,
        prefill_threshold: int | None = None,
        prefill_dtype: torch.dtype | None = None,
        activations: str = "fp32",
        topology: numa.Topology | None = None,
    ):
        self.method = normalize_kt_method(method)
        self.int8_activations = int8_activations(activations)
        self.group_size = check_group_size(self.method, group_size)
        # methods that keep a checkpoint's own encoding are filled through slot_views by an expert source,
        # which also sets native_fill so dynamic placement refills a slot the same way
        self.native_fill: NativeFill | None = None
        if prefill_dtype is None:
            prefill_dtype = torch.bfloat16 if bf16_gemm_wins() else torch.float32
        if prefill_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"prefill_dtype must be torch.bfloat16 or torch.float32, got {prefill_dtype}")
        self.prefill_dtype = prefill_dtype
        amx = moe_kernels.AMX and self.group_size >= moe_kernels.AMX_MIN_GROUP
        self.prefill_threshold = (default_prefill_threshold(self.method, prefill_dtype, self.int8_activations, amx)
                                  if prefill_threshold is None
                                  else prefill_threshold)
        self.pools = ExpertPools(num_threads, threadpool_count, topology)
        self.bind_error: str | None = None  # why the experts' pages are not on their pools' nodes
        self.layers: dict[int, ExpertLayer] = {}
        self._scratch_bufs: dict[int, np.ndarray] = {}
        self._bufs: dict[tuple[int, str], torch.Tensor] = {}

    # ---- storing experts ----
    def reserve_layer(
        self, layer_idx: int, n_experts: int, hidden: int, inter: int, cpu_experts: Sequence[int] | None = None,
        formats: tuple[Format, Format] | None = None,
    ) -> ExpertLayer:
        """Allocate (zeroed) storage for the CPU experts of a layer, to be filled by set_expert, or, with
        `formats` ((format, group) of gate_up and of down), through slot_views."""
        self.layers[layer_idx] = self._new_layer(n_experts, hidden, inter, cpu_experts, formats)
        return self.layers[layer_idx]

    def _new_layer(self, n_experts: int, hidden: int, inter: int, cpu_experts: Sequence[int] | None,
                   formats: tuple[Format, Format] | None = None) -> ExpertLayer:
        experts = np.arange(n_experts) if cpu_experts is None else np.unique(np.asarray(cpu_experts, np.int64))
        if experts.size and (experts[0] < 0 or experts[-1] >= n_experts):
            raise ValueError(f"cpu_experts must lie in [0, {n_experts}), got {experts.tolist()}")
        if formats is None:
            if self.method not in QUANTIZED_METHODS:
                raise KtliteError(f"--kt-method {self.method} keeps the checkpoint's encoding: reserve_layer needs "
                                  "its formats (see ktlite/runtime/expert_sources.py)")
            formats = ((self.method, self.group_size),) * 2
        slot_of = np.full(n_experts, -1, np.int64)
        slot_of[experts] = np.arange(experts.size)
        s = experts.size
        # pool p owns a contiguous block of slots: one mbind (one memory mapping) per pool per array; slots dealt
        # round-robin would cut every array into a mapping per slot, ~60k for 58 MoE layers of 256 experts x 4 arrays
        # (vm.max_map_count: 65530)
        pool_of = np.arange(s) * self.pools.count // max(s, 1)
        place = functools.partial(self._bind, owners=pool_of)
        return ExpertLayer(
            n_experts, hidden, inter, experts, slot_of, pool_of,
            empty_quantized(*formats[0], (s,), 2 * inter, hidden, place),
            empty_quantized(*formats[1], (s,), hidden, inter, place),
        )

    def _bind(self, array: np.ndarray, owners: np.ndarray) -> None:
        """Rows of a new, untouched [slots, ...] array -> their pools' NUMA nodes; after a refusal, nothing more is
        tried (one warning, and numa_report says why)."""
        if self.bind_error is None:
            try:
                numa.bind_rows(array, owners, self.pools.placements)
            except numa.NumaError as exc:
                self.bind_error = str(exc)
                logger.warning("CPU experts' pages are not placed on their pools' NUMA nodes (%s): they go where "
                               "the kernel's default policy puts them", exc)

    def numa_report(self) -> list[str]:
        """One line per pool: its node(s) and cpus, what was pinned, and where its experts' pages are (a sample of
        up to 4 pages per expert matrix, through move_pages)."""
        lines = []
        arrays = [(w.qweight, w.scales, layer.pool_of) for layer in self.layers.values()
                  for w in (layer.gate_up, layer.down)]
        for place, pin_error in zip(self.pools.placements, self.pools.pin_errors):
            pinned = f"not pinned ({pin_error})" if pin_error else pinned_threads()
            mine = [(a, owners == place.pool) for q, sc, owners in arrays for a in (q, sc)]
            size = sum(int(np.diff(numa.row_ranges(a)[rows], axis=1).sum()) for a, rows in mine)
            pages = (f"experts' pages not placed ({self.bind_error})" if self.bind_error else
                     f"{size / 2**30:.2f} GiB of experts' pages placed, {_where(place, mine)}")
            lines.append(f"CPU expert {place.describe()}; {pinned}; {pages}")
        return lines

    def set_expert(self, layer_idx: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Quantize one expert into its slot; experts not reserved for CPU are ignored."""
        self._fill(self._layer(layer_idx), expert, gate, up, down)

    @staticmethod
    def _fill(layer: ExpertLayer, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        slot = int(layer.slot_of[expert])
        if slot >= 0:
            layer.written(slot)
            # gate and up straight into their halves of the stack: no concatenated copy
            quantize_into(layer.gate_up, (slot, slice(0, layer.inter)), gate)
            quantize_into(layer.gate_up, (slot, slice(layer.inter, 2 * layer.inter)), up)
            quantize_into(layer.down, (slot,), down)

    def set_activation(self, layer_idx: int, activation: ExpertActivation,
                       biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The layer's experts compute `activation` (default SiLU(gate) * up) with these biases (gate_up [E, 2I] gate
        then up, down [E, H], by expert id; None: none)."""
        layer = self._layer(layer_idx)
        layer.activation = activation
        layer.biases = None if biases is None else tuple(
            np.ascontiguousarray(b.detach().to("cpu", torch.float32).numpy()) for b in biases)

    def slot_views(self, layer_idx: int, expert: int) -> tuple[QuantizedWeight, QuantizedWeight] | None:
        """(gate_up [2I, H], down [H, I]) storage of an expert's slot, to fill in place; None if not on CPU."""
        layer = self._layer(layer_idx)
        slot = int(layer.slot_of[expert])
        if slot >= 0:
            layer.written(slot)
        return None if slot < 0 else (layer.gate_up[slot], layer.down[slot])

    def add_layer(
        self,
        layer_idx: int,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        cpu_experts: Sequence[int] | None = None,
    ) -> None:
        """gate/up [E, I, H], down [E, H, I]; only `cpu_experts` (default: all) are kept."""
        n_experts, inter, hidden = gate.shape
        layer = self.reserve_layer(layer_idx, n_experts, hidden, inter, cpu_experts)
        for e in layer.experts.tolist():
            self.set_expert(layer_idx, e, gate[e], up[e], down[e])

    def swap_expert(self, layer_idx: int, new: int, old: int, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor) -> None:
        """Dynamic placement: expert `new` leaves the CPU (to the GPU) and `old` (gate/up/down, source
        weights) takes its slot, so the CPU store never grows."""
        layer = self._layer(layer_idx)
        slot = int(layer.slot_of[new])
        if slot < 0:
            raise KtliteError(f"layer {layer_idx}: expert {new} is not on CPU, it cannot be swapped out")
        if layer.slot_of[old] >= 0:
            raise KtliteError(f"layer {layer_idx}: expert {old} is already on CPU")
        layer.slot_of[new], layer.slot_of[old] = -1, slot
        layer.experts[slot] = old
        layer.written(slot)
        if self.native_fill is not None:  # the checkpoint's own encoding, not a re-quantization
            self.native_fill(layer_idx, old, layer.gate_up[slot], layer.down[slot])
        else:
            self._fill(layer, old, gate, up, down)

    def dequantized_expert(self, layer_idx: int, expert: int,
                           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored weights of a CPU expert as (gate_up [2I, H], down [H, I]) in `dtype`: exactly the
        values the kernels compute with."""
        layer = self._layer(layer_idx)
        slot = int(layer.slot_of[expert])
        if slot < 0:
            raise KtliteError(f"layer {layer_idx}: expert {expert} is not on CPU")
        return dequantize(layer.gate_up[slot]).to(dtype), dequantize(layer.down[slot]).to(dtype)

    def _layer(self, layer_idx: int) -> ExpertLayer:
        if layer_idx not in self.layers:
            raise KtliteError(f"layer {layer_idx} has no CPU experts loaded (have {sorted(self.layers)})")
        return self.layers[layer_idx]

    def nbytes(self) -> int:
        """Resident bytes of all stored experts."""
        return sum(layer.nbytes() for layer in self.layers.values())

    # ---- running ----
    def forward(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                skip_mask: torch.Tensor | None = None) -> torch.Tensor:
        """submit(...).wait(), computed on the calling thread (ExpertPools.run_here): for a caller with
        nothing to overlap."""
        experts = (self.decode_experts(layer_idx, hidden.shape[0], hidden.shape[-1], topk_ids.shape[-1])
                   if hidden.dim() == 2 else None)
        if experts is not None:
            return self.pools.run_here(self._one_call, layer_idx, experts, hidden, topk_ids, topk_weights, skip_mask)
        layer, works, x = self._prepare(layer_idx, hidden, topk_ids, topk_weights, skip_mask)
        parts = [self.pools.run_here(self._run_pool, layer, w, x) for w in works if w.slots.size]
        return _summed(parts, hidden)

    def decode_experts(self, layer_idx: int, tokens: int, width: int, top_k: int) -> tuple | None:
        """moe_kernels.moe_rows_routed's `experts` for the layer where `forward` takes `tokens` rows of `width` (each
        routed to `top_k` experts: the fused kernels' intermediate rows are a reused buffer) in that one
        compiled call, else None. It does where there are too few tokens for any expert to reach the matmul path, so
        every pool's work is the fused kernels' anyway, split between the row dots and the AMX tiles as _run_pool
        splits it (a decode step; the general path spends ~15 numpy / torch operations a layer choosing that, ~130 us
        on a 2-core VM)."""
        layer = self._layer(layer_idx)
        if not (width == layer.hidden and tokens < self.prefill_threshold):
            return None
        gu, dn = layer.gate_up, layer.down
        tiles_from = self._amx_tokens(layer)
        return (layer.slot_of, layer.pool_of, self.pools.count, gu.qweight, gu.scales, dn.qweight, dn.scales,
                gu.group_shift, dn.group_shift, gu.kp, dn.kp, self._int8_dots(layer), self._scratch(layer),
                tokens + 1 if tiles_from is None else tiles_from, numba.config.NUMBA_NUM_THREADS, *layer.fold_steps(),
                self._buffer("fused_act", tokens * top_k * dn.kp, torch.float32).numpy(), layer.activation_args())

    def run_here(self, fn: Callable, *args):
        """fn(*args) on the calling thread with every pool's numba threads (ExpertPools.run_here)."""
        return self.pools.run_here(fn, *args)

    def _one_call(self, layer_idx: int, experts: tuple, hidden: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, skip_mask: torch.Tensor | None) -> torch.Tensor:
        ids, weights, skip = _routing_arrays(topk_ids, topk_weights, skip_mask)
        x = hidden.detach().to("cpu", torch.float32).contiguous().numpy()
        out, missing = moe_kernels.moe_rows_routed(x, ids, weights, skip, experts)
        if missing >= 0:
            self._route(self._layer(layer_idx), topk_ids, topk_weights, skip_mask)  # raises, naming the experts
        return torch.from_numpy(out).to(device=hidden.device, dtype=hidden.dtype)

    def submit(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               skip_mask: torch.Tensor | None = None) -> CPUMoEHandle:
        layer, works, x = self._prepare(layer_idx, hidden, topk_ids, topk_weights, skip_mask)
        futures = [self.pools.submit(p, self._run_pool, layer, w, x) for p, w in enumerate(works) if w.slots.size]
        return CPUMoEHandle(futures, hidden)

    def _prepare(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 skip_mask: torch.Tensor | None) -> tuple[ExpertLayer, list[_PoolWork], torch.Tensor]:
        layer = self._layer(layer_idx)
        if hidden.dim() != 2 or hidden.shape[1] != layer.hidden:
            raise ValueError(f"hidden must be [T, {layer.hidden}], got {tuple(hidden.shape)}")
        return layer, self._route(layer, topk_ids, topk_weights, skip_mask), hidden.detach().to("cpu")

    def _route(self, layer: ExpertLayer, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               skip_mask: torch.Tensor | None) -> list[_PoolWork]:
        """One _PoolWork per pool: its (token, weight) pairs grouped by slot."""
        ids, weights, skip = _routing_arrays(topk_ids, topk_weights, skip_mask)
        slots, tok_ptr, tok_idx, tok_w, pool_ptr, missing = moe_kernels.group_pairs(
            ids, weights, layer.slot_of, layer.pool_of, skip, self.pools.count)
        if missing >= 0:
            chosen = ids[(ids >= 0) & (ids < layer.n_experts)]
            if skip_mask is not None:
                chosen = chosen[~skip[chosen]]
            absent = sorted(set(chosen[layer.slot_of[chosen] < 0].tolist()))
            raise KtliteError(f"experts {absent} were selected but are neither on CPU nor in skip_mask")
        works = []
        for a, b in zip(pool_ptr[:-1], pool_ptr[1:]):
            lo, hi = tok_ptr[a], tok_ptr[b]
            works.append(_PoolWork(slots[a:b], tok_ptr[a:b + 1] - lo, tok_idx[lo:hi], tok_w[lo:hi]))
        return works

    def _int8_dots(self, layer: ExpertLayer) -> bool:
        """Whether the layer's row kernels dot int8 activations (asked for, and both its formats take them)."""
        return self.int8_activations and {layer.gate_up.method, layer.down.method} <= set(INT_DOT_METHODS)

    def _amx_tokens(self, layer: ExpertLayer) -> int | None:
        """Tokens per expert from which the layer's experts run on AMX tiles (moe_kernels.moe_amx); None: never here."""
        return (AMX_MIN_TOKENS[layer.gate_up.method] if self._int8_dots(layer) and amx_fits(layer) and layer.plain
                else None)

    def _run_pool(self, layer: ExpertLayer, work: _PoolWork, x: torch.Tensor) -> torch.Tensor:
        """One pool's share (in the pool's thread, or the caller's for `forward`): experts with fewer than prefill_threshold
        tokens go through the fused kernels (AMX tiles from AMX_MIN_TOKENS on where they fit, else the row dots / VNNI
        tiles), the others through dequantize + matmul."""
        heavy = np.diff(work.tok_ptr) >= self.prefill_threshold
        out = torch.zeros(x.shape[0], layer.hidden)
        light = work.select(~heavy) if heavy.any() else work  # decode: no selection to build
        if light.slots.size:
            gu, dn = layer.gate_up, layer.down
            xp = moe_kernels.padded_rows(np.ascontiguousarray(x.float().numpy()), gu.kp)
            q8 = self._int8_dots(layer)
            tiles_from = self._amx_tokens(layer)
            tiles = np.diff(light.tok_ptr) >= tiles_from if tiles_from is not None else np.zeros(0, bool)
            rows = light.select(~tiles) if tiles.any() else light
            if rows.slots.size:
                act = self._act_buffer(rows.tok_idx.size, layer)
                moe_kernels.moe_rows(xp, rows.slots, rows.tok_ptr, rows.tok_idx, rows.tok_w, gu.qweight, gu.scales,
                                 dn.qweight, dn.scales, gu.group_shift, dn.group_shift, q8, self._scratch(layer), act,
                                 out.numpy(), layer.activation_args())
            if tiles.any():
                on_amx = light.select(tiles)
                act = self._act_buffer(on_amx.tok_idx.size, layer)
                gu_steps, d_steps = layer.fold_steps()
                moe_kernels.moe_amx(xp, on_amx.slots, on_amx.tok_ptr, on_amx.tok_idx, on_amx.tok_w, gu.qweight, gu.scales,
                                gu_steps, dn.qweight, dn.scales, d_steps, gu.group_shift, dn.group_shift,
                                numba.config.NUMBA_NUM_THREADS, act, out.numpy())
        if heavy.any():
            self._run_matmul(layer, work.select(heavy), x.to(self.prefill_dtype), out)
        return out

    def _run_matmul(self, layer: ExpertLayer, w: _PoolWork, x: torch.Tensor, out: torch.Tensor) -> None:
        """Experts with many tokens, a batch of experts at a time: their tokens gathered grouped by expert,
        gate_up per expert into one [pairs, 2I] buffer, one activation over the batch (SiLU * mul in place; other
        activations and biases: expert_activation.py), down per expert, one weighted scatter-add. Batching the element-wise work and the scatter (instead of small torch ops
        per expert, interleaved with numba's parallel regions) made them ~3x cheaper."""
        gu, dn = layer.gate_up, layer.down
        inter, hidden, dtype = layer.inter, layer.hidden, self.prefill_dtype
        scratch = self._scratch(layer)
        weight = None if gu.method == "BF16" else self._buffer("weight", 2 * inter * hidden)
        for batch in w.batches(PAIR_BATCH):
            idx = torch.from_numpy(batch.tok_idx)
            pairs = idx.numel()
            xs = torch.index_select(x, 0, idx, out=self._buffer("x", pairs * hidden).view(pairs, hidden))
            h = self._buffer("gate_up", pairs * 2 * inter).view(pairs, 2 * inter)
            self._per_expert_matmul(layer, batch, gu, xs, h, scratch, weight)
            self._add_biases(layer, batch, h, 0)
            if layer.activation.plain:
                gate = torch.nn.functional.silu(h[:, :inter], inplace=True)  # in place: no fresh [pairs, I] array
                act = torch.mul(gate, h[:, inter:], out=self._buffer("act", pairs * inter).view(pairs, inter))
            else:
                act = layer.activation(h[:, :inter], h[:, inter:])
            ys = self._buffer("down", pairs * hidden).view(pairs, hidden)
            self._per_expert_matmul(layer, batch, dn, act, ys, scratch, weight)
            self._add_biases(layer, batch, ys, 1)
            if dtype == torch.bfloat16:  # straight from the bf16 rows: no fp32 copy of ys
                moe_kernels.scatter_add_bf16(gemm.numpy_bits(ys), batch.tok_idx, batch.tok_w, out.numpy())
            else:
                out.index_add_(0, idx, ys * torch.from_numpy(batch.tok_w)[:, None])

    @staticmethod
    def _add_biases(layer: ExpertLayer, batch: _PoolWork, rows: torch.Tensor, which: int) -> None:
        """Each expert's rows += its bias (`which`: 0 gate_up, 1 down), where the layer has biases."""
        if layer.biases is None:
            return
        bias = torch.from_numpy(layer.biases[which])
        for m, slot in enumerate(batch.slots.tolist()):
            rows[batch.tok_ptr[m]:batch.tok_ptr[m + 1]] += bias[layer.experts[slot]].to(rows.dtype)

    def _per_expert_matmul(self, layer: ExpertLayer, batch: _PoolWork, qw: QuantizedWeight, inp: torch.Tensor,
                           res: torch.Tensor, scratch: np.ndarray, weight: torch.Tensor | None) -> None:
        """Each expert's rows of `res` = its rows of `inp` @ its stored matrix of `qw`, transposed."""
        for m, slot in enumerate(batch.slots.tolist()):
            lo, hi = batch.tok_ptr[m], batch.tok_ptr[m + 1]
            gemm.stored_matmul(inp[lo:hi], qw.qweight[slot], qw.scales[slot], qw.group_shift, qw.kp, qw.k,
                               scratch, weight, res[lo:hi])

    def _scratch(self, layer: ExpertLayer) -> np.ndarray:
        # one pair of fp32 row buffers per numba thread, per calling (pool) thread, reused across calls
        size = max(layer.gate_up.kp, layer.down.kp)
        key = threading.get_ident()
        buf = self._scratch_bufs.get(key)
        if buf is None or buf.shape[2] < size:
            buf = self._scratch_bufs[key] = np.empty((numba.config.NUMBA_NUM_THREADS, 2, size), np.float32)
        return buf

    def _buffer(self, name: str, size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A reused flat buffer of >= `size` elements in dtype (default prefill_dtype), per calling (pool) thread
        and name: fresh 10-60 MB arrays per expert page-faulted on first touch, which cost as much as the work."""
        dtype = dtype or self.prefill_dtype
        key = (threading.get_ident(), name)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < size or buf.dtype != dtype:
            buf = self._bufs[key] = torch.empty(size, dtype=dtype)
        return buf[:size]

    def _act_buffer(self, pairs: int, layer: ExpertLayer) -> np.ndarray:
        """The fused kernels' [pairs, Kp] fp32 intermediate: every row is written up to I, the padding read as
        zeros (reused: at 512 tokens a fresh one is 17 MB of page faults per call)."""
        return moe_kernels.pair_rows(self._buffer("fused_act", pairs * layer.down.kp, torch.float32).numpy(), pairs,
                                 layer.down.kp, layer.inter)

    def warmup(self) -> None:
        """Compile (or load from numba's cache) and run both paths once in every pool, for every pair of
        storage formats the layers hold (the kernels specialise on them)."""
        formats = {((l.gate_up.method, l.gate_up.group_size), (l.down.method, l.down.group_size))
                   for l in self.layers.values()}
        if not formats and self.method in QUANTIZED_METHODS:
            formats = {((self.method, self.group_size),) * 2}
        size = 256  # a whole GGUF block and two groups of any group size
        t = max(self.prefill_threshold, 1)
        x = torch.randn(t, size, generator=torch.Generator().manual_seed(0))
        ids = torch.zeros(t, 2, dtype=torch.int64)
        ids[0, 1] = 1  # expert 0 gets every token (matmul path), expert 1 one token (GEMV kernel)
        for pair in sorted(formats):
            layer = self._new_layer(2, size, size, None, pair)  # zero weights: compiling is the point
            work = self._route(layer, ids, torch.ones(t, 2), None)
            for p in range(self.pools.count):
                for w in work:
                    if w.slots.size:
                        self.pools.submit(p, self._run_pool, layer, w, x).result()

    def close(self) -> None:
        self.pools.close()
        self.layers.clear()
        self._bufs.clear()

    def __enter__(self) -> CPUMoE:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
