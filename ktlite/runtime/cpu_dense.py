"""CPU-only device path: the device side's Linear layers quantized at load and run by the CPU kernels.

When the device is the CPU, the attention projections, dense MLPs, shared experts and lm_head are torch
matmuls on the same cores and memory bus as the CPU experts; in fp32 (the CPU default dtype) they stream
4 bytes per weight each decode step. `--cpu-dense-method` INT8 or INT4 swaps every eligible `nn.Linear`
for a QuantizedLinear (kernels/cpu/dense_linear.py: group-wise weights as the CPU experts store them,
the same quantizer and kernels) right after the weights are loaded; none keeps the torch layers as
they are (in --dtype); auto (the default) is INT8 unless --dtype float32 asks for exact fp32 math
(EngineConfig.cpu_dense_quantization). On CUDA nothing changes.

Eligible: every `nn.Linear` (subclasses included, e.g. the lm_head) except those its parent module lists
in `keep_linears` (layers whose weight a family reads as matrices rather than calling the layer, like
MLA's kv_b_proj, split into the absorbed W_UK / W_UV). Such a parent offers those matrices through
`head_matrices() -> {attribute: w [G, N, K]}`: each is stored as a QuantizedHeads module under that
attribute (y[..., g, :] = x[..., g, :] @ w[g].T), which the parent then calls, and its keep_linears are
dropped. Linears reading the same input that a parent lists in `fused_linears` ({attribute: (part names)}, e.g.
an MLP's gate and up) are stored as one QuantizedLinear under that attribute, their rows stacked in the order
named, which the parent calls instead of the parts (set to None): one kernel call where there were several, each
a parallel region whose threads wake up first (~20 us on a 2-core VM), and every row quantized as it was alone.
Routers (`Router`, fp32), norms, embeddings (rows looked up, not multiplied) and FP8Linear layers
(kept FP8 by --weight-dtype fp8) are not nn.Linear and stay as they are. Under tensor parallelism each
rank quantizes its own shard after loading it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from ktlite.config import EngineConfig
from ktlite.kernels.cpu.dense_linear import DenseWorkspace, QuantizedHeads, QuantizedLinear
from ktlite.kernels.cpu.quant import check_group_size, matrix_bytes, quantize
from ktlite.runtime.plan_components import allocated_by_component, components_of

logger = logging.getLogger(__name__)


def eligible_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    """(qualified name, parent, attribute name, layer) of every Linear the CPU dense path quantizes. The
    caller may replace each layer as it comes: only parents and names are held, so a replaced layer's
    weight is freed at once."""
    parents = [(prefix, m) for prefix, m in model.named_modules() if next(m.children(), None) is not None]
    for prefix, parent in parents:
        keep = getattr(parent, "keep_linears", ())
        names = [name for name, child in parent.named_children() if isinstance(child, nn.Linear) and name not in keep]
        for name in names:
            yield f"{prefix}.{name}" if prefix else name, parent, name, getattr(parent, name)


def fused_groups(model: nn.Module) -> Iterator[tuple[nn.Module, str, tuple[str, ...]]]:
    """(parent, attribute, part names) of every `fused_linears` entry whose parts are all eligible Linears
    without bias reading inputs of one width (an FP8Linear part, kept FP8, leaves its group unfused)."""
    for _, parent in list(model.named_modules()):
        keep = getattr(parent, "keep_linears", ())
        for attribute, names in getattr(parent, "fused_linears", {}).items():
            parts = [getattr(parent, name, None) for name in names]
            if all(isinstance(p, nn.Linear) and p.bias is None and name not in keep for p, name in zip(parts, names)) \
                    and len({p.in_features for p in parts}) == 1:
                yield parent, attribute, names


def head_matrix_owners(model: nn.Module) -> Iterator[tuple[str, nn.Module, dict[str, torch.Tensor]]]:
    """(qualified name, module, its head_matrices()) of every module offering per-head matrices."""
    for prefix, module in model.named_modules():
        offer = getattr(module, "head_matrices", None)
        matrices = offer() if offer is not None else {}
        if matrices:
            yield prefix, module, matrices


def quantize_dense(model: nn.Module, method: str, group_size: int | None = None, int8_activations: bool = False) -> int:
    """Swap every eligible Linear of `model` (weights loaded, on the CPU) for a QuantizedLinear in `method`
    (INT8 or INT4; dotted with int8 activations if asked), in place, one layer (or fused group) at a time (the
    full-precision weight is freed as its replacement arrives), and store every offered set of head matrices as
    QuantizedHeads (dropping the Linears they came from); -> the number of Linears replaced and head stacks stored."""
    workspace = DenseWorkspace()
    count = 0
    for parent, attribute, names in list(fused_groups(model)):
        weight = torch.cat([getattr(parent, name).weight.detach() for name in names])
        for name in names:
            setattr(parent, name, None)
        setattr(parent, attribute, QuantizedLinear(quantize(weight, method, group_size), None, workspace,
                                                   int8_activations=int8_activations))
        count += len(names)
    for _, parent, name, layer in eligible_linears(model):
        setattr(parent, name, QuantizedLinear.from_linear(layer, method, group_size, workspace, int8_activations))
        count += 1
    for _, module, matrices in list(head_matrix_owners(model)):
        for name, w in matrices.items():
            setattr(module, name, QuantizedHeads.from_matrices(w, method, group_size, workspace, int8_activations))
            count += 1
        for name in module.keep_linears:
            setattr(module, name, None)
    return count


def apply_cpu_dense(model: nn.Module, config: EngineConfig) -> None:
    """The load-time hook: on a CPU device, quantize the device-side Linears per --cpu-dense-method."""
    method = config.cpu_dense_quantization
    if method is None:
        return
    int8 = config.cpu_int8_activations
    count = quantize_dense(model, method, int8_activations=int8)
    logger.info("--cpu-dense-method %s: %d device-side linear layers / head stacks quantized (group %d), %s activations", method,
                count, check_group_size(method, None), "int8" if int8 else "fp32")


def planned_weight_bytes(model: nn.Module, method: str, group_size: int | None = None) -> dict[str, int]:
    """Bytes per memory-plan component of `model`'s parameters and buffers once `quantize_dense(model,
    method)` has run (what `allocated_by_component` then reports); works on a meta-device model, as the
    memory plan builds it."""
    group_size = check_group_size(method, group_size)
    out = allocated_by_component(model)
    owner = components_of(model)
    for qualified, _, _, layer in eligible_linears(model):
        n, k = layer.weight.shape
        before = layer.weight.numel() * layer.weight.element_size()
        out[owner[f"{qualified}.weight"]] += matrix_bytes(method, group_size, n, k) - before
    for prefix, module, matrices in head_matrix_owners(model):
        for name in module.keep_linears:  # dropped
            for pname, t in getattr(module, name).named_parameters():
                out[owner[f"{prefix}.{name}.{pname}"]] -= t.numel() * t.element_size()
        component = owner[f"{prefix}.{module.keep_linears[0]}.weight"]  # the module's own, as its head stacks'
        for w in matrices.values():
            heads, n, k = w.shape
            out[component] += heads * matrix_bytes(method, group_size, n, k)
    return out
