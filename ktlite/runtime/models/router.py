"""Routed-expert selection for MoE layers: softmax, sigmoid or sqrt(softplus) scores, optional correction bias,
optional group limits (group_limited_greedy, noaux_tc), normalisation and scaling (`RouterSpec`); and the weights of
experts chosen elsewhere (DeepSeek-V4's hash layers take them from the token id: `weigh_experts`)."""

from __future__ import annotations

import numpy as np
import torch

from ktlite.runtime.models.config import TOPK_METHODS, RouterSpec


def _group_mask(choice_scores: torch.Tensor, spec: RouterSpec, top2_sum: bool) -> torch.Tensor:
    """Bool [tokens, experts]: experts whose group is among the topk_group best groups."""
    tokens = choice_scores.shape[0]
    grouped = choice_scores.view(tokens, spec.n_group, -1)
    # noaux_tc scores a group by the sum of its top-2 experts, group_limited_greedy by its best.
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if top2_sum else grouped.max(-1).values
    best = group_scores.topk(spec.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)


def router_scores(router_logits: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """float32 scores [tokens, experts] of the logits under the spec's scoring function."""
    logits = router_logits.float()
    if spec.scoring == "sigmoid":
        return logits.sigmoid()
    if spec.scoring == "sqrtsoftplus":  # DeepSeek-V4
        return torch.nn.functional.softplus(logits).sqrt()
    return logits.softmax(dim=-1)


def weigh_experts(scores: torch.Tensor, topk_ids: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """The chosen experts' weights [tokens, k]: their unbiased scores, normalised and scaled as the spec says."""
    weights = scores.gather(1, topk_ids)
    if spec.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.scaling_factor != 1.0:
        weights = weights * spec.scaling_factor
    return weights


def select_experts(
    router_logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, experts] -> (topk_ids int64 [tokens, k], topk_weights float32 [tokens, k])."""
    scores = router_scores(router_logits, spec)
    # The bias steers which experts are chosen; the weights come from the unbiased scores.
    choice = scores + correction_bias if correction_bias is not None else scores
    if spec.method == "noaux_tc":
        choice = choice.masked_fill(~_group_mask(choice, spec, top2_sum=True), float("-inf"))
    elif spec.method == "group_limited_greedy":
        choice = choice.masked_fill(~_group_mask(choice, spec, top2_sum=False), 0.0)
    topk_ids = choice.topk(spec.top_k, dim=-1, sorted=False).indices
    return topk_ids, weigh_experts(scores, topk_ids, spec)


def route_args(spec: RouterSpec) -> tuple[bool, int, int, int, int, bool, np.float32]:
    """The spec as the compiled router takes it (device_blocks.route_rows: the same selection as select_experts)."""
    if spec.scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"the compiled router has no {spec.scoring!r} scoring")
    return (spec.scoring == "sigmoid", TOPK_METHODS.index(spec.method), spec.n_group, spec.topk_group, spec.top_k,
            spec.normalize, np.float32(spec.scaling_factor))
