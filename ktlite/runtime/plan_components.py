"""The memory plan's components and which of them owns each tensor of a built model.

Every static tensor counts against one component (`COMPONENTS`); the model's modules say which through
their `plan_component` tags. `components_of(model)` maps every parameter/buffer of a model to its
component through those tags; routed experts map to "gpu_experts" because a routed expert tensor that
lives on the GPU is a GPU expert. `allocated_by_component(model)` sums a built model's bytes per
component, to compare with what the plan (ktlite/runtime/memory.py) planned.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain

from torch import nn

# "mtp": the multi-token-prediction layer NEXTN drafts run (models/mtp.py), its routed experts included
WEIGHT_COMPONENTS = ("embeddings", "lm_head", "attention", "dense_mlp", "shared_experts", "norms_router", "mtp")
STATIC_COMPONENTS = WEIGHT_COMPONENTS + ("gpu_experts", "kv_pool", "state_pool", "request_table")
HEADROOM_COMPONENTS = ("prefill_workspace", "layerwise_buffer")
COMPONENTS = STATIC_COMPONENTS + HEADROOM_COMPONENTS


# a tag in here names a kind of tensor that counts as such wherever its module sits (a norm inside
# attention is a norm); every other tag names a role, which the outermost tagged module decides (an
# MLP, tagged dense_mlp, inside a shared expert belongs to the shared expert)
KIND_COMPONENTS = ("norms_router",)


def components_of(model: nn.Module) -> dict[str, str]:
    """{parameter or buffer name: plan component} from the modules' `plan_component` tags: a tensor
    counts against its outermost tagged module, unless a module on the way names a kind
    (KIND_COMPONENTS)."""
    out: dict[str, str] = {}

    def visit(module: nn.Module, prefix: str, component: str | None) -> None:
        tag = getattr(module, "plan_component", None)
        if tag is not None and (component is None or tag in KIND_COMPONENTS):
            component = tag
        for name, _ in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            if component is None:
                raise ValueError(f"{prefix}{name} has no memory-plan component: tag its module with plan_component")
            out.setdefault(prefix + name, component)
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.", component)

    visit(model, "", None)
    return out


def allocated_by_component(model: nn.Module) -> dict[str, int]:
    """Bytes per component of a model's parameters and buffers (a tied or shared tensor once)."""
    owner = components_of(model)
    out: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out[owner[name]] += tensor.numel() * tensor.element_size()
    return dict(out)
