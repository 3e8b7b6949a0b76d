"""Routed-expert selection for DeepSeek MoE layers (greedy, group-limited, noaux_tc)."""

from __future__ import annotations

import torch

from ktlite.runtime.models.config import DeepseekConfig


def _group_mask(choice_scores: torch.Tensor, cfg: DeepseekConfig, top2_sum: bool) -> torch.Tensor:
    """Bool [tokens, experts]: experts whose group is among the topk_group best groups."""
    tokens = choice_scores.shape[0]
    grouped = choice_scores.view(tokens, cfg.n_group, -1)
    # V3 scores a group by the sum of its top-2 experts, V2 by its best expert.
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if top2_sum else grouped.max(-1).values
    best = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)


def select_experts(
    router_logits: torch.Tensor, cfg: DeepseekConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, experts] float32 -> (topk_ids int64 [tokens, k], topk_weights float32 [tokens, k])."""
    logits = router_logits.float()
    scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    k = cfg.num_experts_per_tok
    if cfg.topk_method == "noaux_tc":
        # The bias steers which experts are chosen; the weights come from the unbiased scores.
        choice = scores + correction_bias if correction_bias is not None else scores
        choice = choice.masked_fill(~_group_mask(choice, cfg, top2_sum=True), float("-inf"))
        topk_ids = choice.topk(k, dim=-1, sorted=False).indices
    elif cfg.topk_method == "group_limited_greedy":
        choice = scores.masked_fill(~_group_mask(scores, cfg, top2_sum=False), 0.0)
        topk_ids = choice.topk(k, dim=-1, sorted=False).indices
    else:
        topk_ids = scores.topk(k, dim=-1, sorted=False).indices
    weights = scores.gather(1, topk_ids)

    normalize = cfg.norm_topk_prob and (cfg.is_v3 or k > 1)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    # DeepSeek-V3 always scales; DeepSeek-V2 scales only when it did not normalise.
    if cfg.is_v3 or not normalize:
        weights = weights * cfg.routed_scaling_factor
    return topk_ids, weights
