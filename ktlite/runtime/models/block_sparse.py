"""Block-sparse key selection (MiniMax-M3's lightning indexer), as transformers' `MiniMaxM3VLIndexer` computes it.

Keys are grouped in blocks of `block` consecutive positions (block b holds positions b * block .. (b + 1) * block - 1).
Each query scores every earlier key with each index head (a plain dot product of the index query and the one index
key per token), a block's score is the best score of its keys, the query's own block and the `local - 1` blocks before
it always win, and the query attends only to the keys of its top `topk` blocks (causal): one selection per index
head, which is one per kv head (a GQA group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_blocks(idx_q: torch.Tensor, idx_k: torch.Tensor, positions: torch.Tensor, block: int, topk: int,
                  local: int) -> torch.Tensor:
    """idx_q [n, H, D] (one request's new queries), idx_k [L, D] (its keys at positions 0..L-1), positions [n] ->
    [n, H, min(topk, blocks)] selected block ids, -1 where fewer blocks hold an earlier key."""
    n, heads, _ = idx_q.shape
    length = idx_k.shape[0]
    blocks = -(-length // block)
    scores = torch.einsum("nhd,ld->nhl", idx_q.float(), idx_k.float())
    future = torch.arange(length, device=idx_q.device)[None, :] > positions[:, None]
    scores.masked_fill_(future[:, None, :], float("-inf"))
    scores = F.pad(scores, (0, blocks * block - length), value=float("-inf"))
    block_scores = scores.view(n, heads, blocks, block).amax(-1)  # [n, H, blocks]
    if local > 0:  # the query's own block and the ones before it: always kept
        near = (positions[:, None] // block - torch.arange(local, device=idx_q.device)).clamp(min=0)
        block_scores.scatter_(-1, near[:, None, :].expand(-1, heads, -1), float("inf"))
    best = block_scores.topk(min(topk, blocks), dim=-1)
    return best.indices.masked_fill(best.values == float("-inf"), -1)


def block_mask(selected: torch.Tensor, positions: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """selected [n, H, k] block ids (-1: none) -> [n, H, length] bool: the keys of the selected blocks at or before
    each query's position."""
    n, heads, _ = selected.shape
    blocks = -(-length // block)
    keep = torch.zeros(n, heads, blocks + 1, dtype=torch.bool, device=selected.device)
    keep.scatter_(-1, selected.masked_fill(selected < 0, blocks), True)  # -1 lands in a dropped column
    keys = keep[..., :blocks].repeat_interleave(block, dim=-1)[..., :length]
    return keys & (torch.arange(length, device=selected.device) <= positions[:, None, None])
