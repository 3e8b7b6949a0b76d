"""Token log-probabilities from a step's logits.

Values are the log-softmax of the model's raw logits, the model's own distribution before
temperature, penalties, top-k/p or grammar masks (vLLM's default too), gathered for the wanted token
of each row together with the row's `top` most likely tokens.

Memory: a row of logits is vocab * 4 bytes (float32). Prompt logprobs want a row per prompt position,
so the scheduler caps a step's prompt rows at `prompt_logit_rows(vocab)` (PROMPT_LOGIT_BYTES of
logits, on top of the step's peak that `verify_plan` measured with one row per request), and `gather`
takes the log-softmax BLOCK_ROWS rows at a time, so only the gathered values outlive a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs (the legacy completions API allows 5)
PROMPT_LOGIT_BYTES = 128 << 20
BLOCK_ROWS = 64


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def prompt_logit_rows(vocab: int) -> int:
    """How many prompt-logprob rows of logits one step may hold."""
    return max(1, PROMPT_LOGIT_BYTES // (4 * vocab))


def gather(logits: torch.Tensor, targets: list[int], top: list[int]) -> list[TokenLogprob]:
    """logits [R, vocab]; targets[i]: the token whose logprob row i reports; top[i]: how many alternatives."""
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), BLOCK_ROWS):
        block = logits[start:start + BLOCK_ROWS].float().log_softmax(dim=-1)
        ids, ks = targets[start:start + BLOCK_ROWS], top[start:start + BLOCK_ROWS]
        chosen = block.gather(1, torch.tensor(ids, device=block.device)[:, None])[:, 0].tolist()
        k = max(ks)
        values, indices = block.topk(k, dim=-1) if k else (block[:, :0], block[:, :0].long())
        values, indices = values.tolist(), indices.tolist()
        out.extend(TokenLogprob(t, lp, list(zip(indices[i][:n], values[i][:n])))
                   for i, (t, lp, n) in enumerate(zip(ids, chosen, ks)))
    return out
