"""Accepting drafts from the target model's logits over them, without changing what the model would output.

A request with k drafts runs the last sampled token and its drafts through the model as one extend of 1 + k tokens;
row j of its logits is the model's next-token prediction after draft j - 1 (row 0: after the last sampled token).
Greedy: drafts are kept while each equals the argmax of the row before it, then the next row's argmax is added, so
the output is the one plain decoding gives. Sampling (speculative sampling, Leviathan et al. 2023 / Chen et al.
2023) with a deterministic drafter, whose draft distribution is a point mass on draft x: x is kept with probability
p(x) under the row's target distribution p; when it is not, the token is drawn from p with x removed (renormalised)
and the rest is dropped; when every draft is kept, one more token is drawn from the last row. Each output token is
then distributed as p exactly. The uniform draws come from the request's own generator, so a seeded request is
reproducible, though its tokens differ from plain decoding's (it consumes the draws differently).

Only requests whose token choice depends on nothing but the logits row may draft (`can_speculate`): penalties,
grammar masks, a thinking budget, unmet min_tokens and logprobs would need each row adjusted for the drafts before it.
"""

from __future__ import annotations

import torch

from ktlite.runtime.sampling import SamplerState, SamplingParams, target_probs


def may_speculate(params: SamplingParams) -> bool:
    """Whether a request with these params drafts at all (once its min_tokens are out: can_speculate)."""
    return (params.json_schema is None and not params.has_penalties and params.thinking_budget is None
            and not params.logprobs)


def can_speculate(params: SamplingParams, state: SamplerState) -> bool:
    return may_speculate(params) and len(state.output_ids) >= params.min_tokens


def accept_drafts(logits: torch.Tensor, drafts: list[int], params: SamplingParams, state: SamplerState) -> list[int]:
    """logits [k + 1, V] over a request's last token and its k drafts -> the tokens it keeps: the accepted drafts
    and one token from the model (1 to k + 1 tokens)."""
    if params.is_greedy:
        best = logits.argmax(dim=-1).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == best[kept]:
            kept += 1
        return drafts[:kept] + [best[kept]]
    probs = target_probs(logits, [params] * logits.shape[0]).cpu()
    for j, x in enumerate(drafts):
        if torch.rand(1, generator=state.generator).item() < probs[j, x].item():
            continue
        residual = probs[j].clone()
        residual[x] = 0.0
        return drafts[:j] + [_draw(residual, state.generator)]
    return drafts + [_draw(probs[len(drafts)], state.generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalised weights [V] (inverse CDF, one uniform from `generator`)."""
    cdf = weights.cumsum(dim=0)
    target = (1.0 - torch.rand(1, generator=generator)) * cdf[-1]  # in (0, total]: lands on a nonzero weight
    return int(torch.searchsorted(cdf, target).clamp_(max=weights.shape[0] - 1))
