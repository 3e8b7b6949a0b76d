"""One MoE layer split between GPU experts and CPU experts.

The router runs on the device. The (token, expert) pairs of CPU experts go to the CPU store
asynchronously (`submit`), the device meanwhile runs its own experts (fused MoE) and the shared
experts, then the CPU result is added. A prefill chunk longer than `--kt-gpu-prefill-token-threshold`
instead copies the layer's CPU experts into the planned layerwise buffer and runs all experts on
the device: for long chunks the copy costs less than CPU compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from ktlite.kernels.cpu import moe_block
from ktlite.kernels.cpu.dense_linear import swiglu_weights
from ktlite.kernels.cpu.mx import MX_GROUP
from ktlite.kernels.cpu.quant import RAWINT4_GROUP
from ktlite.kernels.expert_activation import SWIGLU, ExpertActivation
from ktlite.kernels.triton import QuantizedWeight, fused_moe
from ktlite.kernels.triton.quant import expert_weight
from ktlite.runtime.compiled_decode import Block
from ktlite.runtime.models.layers import MLP, Router, plain_norm
from ktlite.runtime.models.router import route_args

# (layer, expert) -> (gate [I, H], up [I, H], down [H, I]) in full precision
ExpertSource = Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# (layer, experts) -> (w13 [E, 2I, H], w2 [E, H, I]) in a checkpoint's own INT4 codes (no re-quantization)
PackedSource = Callable[[int, Sequence[int]], tuple[QuantizedWeight, QuantizedWeight]]
# a stack of GPU experts [n, N, K]: dense in the activation dtype, or INT4 codes + scales
ExpertStack = torch.Tensor | QuantizedWeight


def alloc_gpu_experts(alloc: Callable[..., torch.Tensor], n: int, hidden: int, inter: int, dtype: torch.dtype,
                      device: torch.device, fmt: str) -> tuple[ExpertStack, ExpertStack]:
    """(w13 [n, 2I, H], w2 [n, H, I]) through the plan's `alloc` in the plan's GPU expert format (plan_inputs.
    GPU_EXPERT_FORMATS): dense, INT4 group-32 stacks, or MX stacks (codes and e8m0 scales per 32)."""
    if fmt == "dense":
        return (alloc("gpu_experts", (n, 2 * inter, hidden), dtype, device),
                alloc("gpu_experts", (n, hidden, inter), dtype, device))
    mx = fmt in ("mxfp4", "mxfp8")
    bits = 8 if fmt == "mxfp8" else 4
    group = MX_GROUP if mx else RAWINT4_GROUP

    def stack(rows: int, cols: int) -> QuantizedWeight:
        scales = alloc("gpu_experts", (n, rows, cols // group), torch.uint8 if mx else torch.float32, device)
        return QuantizedWeight(alloc("gpu_experts", (n, rows, cols * bits // 8), torch.uint8, device), scales, bits,
                               group, mx)

    return stack(2 * inter, hidden), stack(hidden, inter)


class CPUExperts(Protocol):
    """What HybridMoE calls on the CPU side's experts (kernels/cpu/moe.CPUMoE)."""

    def submit(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               skip_mask: torch.Tensor | None = None): ...

    def forward(self, layer_idx: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                skip_mask: torch.Tensor | None = None) -> torch.Tensor: ...

    def swap_expert(self, layer_idx: int, new: int, old: int, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor) -> None: ...

    def dequantized_expert(self, layer_idx: int, expert: int,
                           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode_experts(self, layer_idx: int, tokens: int, width: int, top_k: int) -> tuple | None: ...

    def run_here(self, fn: Callable, *args): ...


class HybridMoE:
    def __init__(
        self,
        layer_idx: int,
        router: Router,
        shared_experts: MLP | None,
        gpu_experts: list[int],
        w13: ExpertStack,  # [n_gpu, 2I, H] device buffer from the plan (alloc_gpu_experts)
        w2: ExpertStack,  # [n_gpu, H, I]
        cpu: CPUExperts | None,  # None: the CPU experts are run by another tensor-parallel rank
        source: ExpertSource,
        layerwise_threshold: int | None = None,
        layerwise_buffers: tuple[torch.Tensor, torch.Tensor] | None = None,  # [E, 2I, H], [E, H, I]
        observers: list[Callable[[int, torch.Tensor], None]] | None = None,
        remote_gpu_experts: list[int] = (),  # tensor parallel: GPU experts other ranks hold
        packed_source: PackedSource | None = None,  # fills INT4 stacks
        activation: ExpertActivation = SWIGLU,  # the routed experts' (MoE.activation)
        biases: tuple[torch.Tensor, torch.Tensor] | None = None,  # MoE.expert_biases(): by expert id, on the device
    ):
        self.layer_idx = layer_idx
        self.router, self.shared_experts = router, shared_experts
        self.num_experts = router.weight.shape[0]
        self.w13, self.w2 = w13, w2
        self.cpu, self.source, self.packed_source = cpu, source, packed_source
        self.layerwise_threshold = layerwise_threshold
        self.layerwise_buffers = layerwise_buffers
        self.observers = observers or []
        device = w13.device
        self.activation, self.biases = activation, biases
        if cpu is not None and (biases is not None or not activation.plain):
            cpu.set_activation(layer_idx, activation, biases)
        self.slot_of = torch.full((self.num_experts,), -1, dtype=torch.int64, device=device)
        self.expert_of = torch.zeros(len(gpu_experts), dtype=torch.int64, device=device)  # GPU slot -> expert id
        self.gpu_experts: list[int] = []
        for slot, e in enumerate(gpu_experts):
            self._install(slot, e)
        self.remote = torch.zeros(self.num_experts, dtype=torch.bool, device=device)
        if remote_gpu_experts:
            self.remote[torch.tensor(list(remote_gpu_experts), dtype=torch.int64)] = True
        self.has_remote = bool(remote_gpu_experts)

    def _install(self, slot: int, expert: int) -> None:
        if isinstance(self.w13, QuantizedWeight):  # the checkpoint's codes and scales, copied as they are
            for stack, one in zip((self.w13, self.w2), self.packed_source(self.layer_idx, [expert])):
                stack.qweight[slot], stack.scales[slot] = one.qweight[0], one.scales[0]
        else:
            gate, up, down = self.source(self.layer_idx, expert)
            self.w13[slot] = torch.cat((gate, up), dim=0).to(self.w13.dtype)
            self.w2[slot] = down.to(self.w2.dtype)
        self.slot_of[expert] = slot
        self.expert_of[slot] = expert
        if slot < len(self.gpu_experts):
            self.gpu_experts[slot] = expert
        else:
            self.gpu_experts.append(expert)

    @property
    def on_gpu(self) -> torch.Tensor:
        """[E] bool: the experts this layer runs on a device, this rank's or another's (the CPU skips them)."""
        return (self.slot_of >= 0) | self.remote

    def move(self, bring: list[int], evict: list[int]) -> None:
        """Swap experts: each evicted GPU expert's slot takes one incoming expert.

        The incoming expert's CPU slot takes the evicted one (quantized from the source), so every
        expert lives in exactly one place and neither side's memory grows.
        """
        for new, old in zip(bring, evict, strict=True):
            slot = int(self.slot_of[old])
            self.slot_of[old] = -1
            self.cpu.swap_expert(self.layer_idx, new, old, *self.source(self.layer_idx, old))
            self._install(slot, new)

    def __call__(self, x: torch.Tensor, defer: int = 0) -> tuple[torch.Tensor, object | None]:
        """x [N, hidden] on the device -> (routed + shared expert output [N, hidden], deferred handle).

        With `defer` = D > 0 (--kt-max-deferred-experts-per-token), each token's D lowest-weighted
        CPU experts are left running: the returned handle's `wait()` is their contribution, which
        the caller adds after the next layer so the CPU overlaps one more layer of GPU work.
        """
        topk_ids, topk_weights = self.router(x)
        for observe in self.observers:
            observe(self.layer_idx, topk_ids)
        deferred = None
        if self.layerwise_threshold is not None and x.shape[0] > self.layerwise_threshold:
            out = self._all_on_device(x, topk_ids, topk_weights)
        else:
            out, deferred = self._hybrid(x, topk_ids, topk_weights, defer)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out, deferred

    def compiled_residual(self, norm: nn.Module, tokens: int) -> Block | None:
        """This layer's block with its post-attention norm and the residual add as one compiled call on `tokens`
        decode tokens (moe_block.residual_block) where a CPU device runs every expert and each part has a compiled
        form for them; else None."""
        if not (self.cpu is not None and not (self.gpu_experts or self.has_remote) and plain_norm(norm)):
            return None
        if self.router.bias is not None or self.biases is not None or not self.activation.plain:
            return None  # the compiled router and block have neither a logit bias nor expert biases
        shared = None
        if self.shared_experts is not None:
            mlp = self.shared_experts
            if not isinstance(mlp, MLP) or mlp.gate_up_proj is None or not mlp.activation.plain:
                return None
            shared = swiglu_weights(mlp.gate_up_proj, mlp.down_proj, tokens)
            if shared is None:
                return None
        experts = self.cpu.decode_experts(self.layer_idx, tokens, norm.weight.shape[0], self.router.spec.top_k)
        if experts is None:
            return None
        bias = self.router.e_score_correction_bias
        return moe_block.residual_block(
            self.layer_idx, norm.weight.detach().numpy(), norm.eps, self.router.weight.detach().numpy(),
            None if bias is None else bias.numpy(), route_args(self.router.spec), experts, shared, self._observe)

    def _observe(self, topk_ids: np.ndarray) -> None:
        for observe in self.observers:
            observe(self.layer_idx, torch.from_numpy(topk_ids))

    def _split_deferred(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, defer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids run now, ids deferred): the D lowest-weighted CPU experts of each token; -1 = not here."""
        on_cpu = ~self.on_gpu[topk_ids]
        rank_key = torch.where(on_cpu, topk_weights.float(), float("inf"))  # GPU experts never deferred
        lowest = rank_key.argsort(dim=-1)[:, :defer]
        is_deferred = torch.zeros_like(on_cpu).scatter_(1, lowest, True) & on_cpu
        return topk_ids.masked_fill(is_deferred, -1), topk_ids.masked_fill(~is_deferred, -1)

    def _hybrid(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                defer: int) -> tuple[torch.Tensor, object | None]:
        if x.device.type == "cpu" and self.cpu is not None and not (self.gpu_experts or self.has_remote or defer > 0):
            # a CPU device: every expert is a CPU expert, nothing to mask, split or overlap
            return self.cpu.forward(self.layer_idx, x, topk_ids, topk_weights), None
        on_gpu = self.on_gpu
        now_ids, later_ids = (topk_ids, None) if defer <= 0 else self._split_deferred(topk_ids, topk_weights, defer)
        cpu_out = handle = deferred = None
        if self.cpu is not None and not bool(on_gpu[topk_ids].all()):
            x_cpu, w_cpu, mask_cpu = x.cpu(), topk_weights.cpu(), on_gpu.cpu()
            if x.device.type == "cpu":  # nothing runs beside the CPU experts: no thread hand-off
                cpu_out = self.cpu.forward(self.layer_idx, x_cpu, now_ids.cpu(), w_cpu, mask_cpu)
            else:
                handle = self.cpu.submit(self.layer_idx, x_cpu, now_ids.cpu(), w_cpu, mask_cpu)
            if later_ids is not None and bool((later_ids >= 0).any()):
                deferred = self.cpu.submit(self.layer_idx, x_cpu, later_ids.cpu(), w_cpu, mask_cpu)
        # Slots index the compact GPU stack; experts held elsewhere are slot -1, which fused_moe
        # skips (ids outside [0, E) are "not on this device").
        out = None
        if self.gpu_experts:
            biases = None if self.biases is None else tuple(b[self.expert_of] for b in self.biases)  # by GPU slot
            out = fused_moe(x, self.w13, self.w2, self.slot_of[topk_ids], topk_weights, None, self.activation, biases)
        if handle is not None:
            cpu_out = handle.wait()
        if cpu_out is not None:
            cpu_out = cpu_out.to(x.device, x.dtype)
            out = cpu_out if out is None else out + cpu_out
        return (torch.zeros_like(x) if out is None else out), deferred

    def _all_on_device(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        w13_all, w2_all = self.layerwise_buffers
        needed = torch.zeros(self.num_experts, dtype=torch.bool, device=x.device)
        needed[topk_ids.reshape(-1)] = True
        for e in needed.nonzero().flatten().tolist():  # only experts some token chose are copied
            slot = int(self.slot_of[e])
            if slot >= 0:
                w13_all[e], w2_all[e] = (expert_weight(w, slot, w13_all.dtype) for w in (self.w13, self.w2))
            else:
                # the CPU store's own (dequantized) weights, so results match the hybrid path
                w13_all[e], w2_all[e] = self.cpu.dequantized_expert(self.layer_idx, e, w13_all.dtype)
        return fused_moe(x, w13_all, w2_all, topk_ids, topk_weights, needed, self.activation, self.biases)
