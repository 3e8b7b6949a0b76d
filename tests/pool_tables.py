"""A request table for kernel tests: requests in shuffled rows of req_to_token over shuffled pool slots."""

from __future__ import annotations

import torch


def scattered_table(lens: list[int], slots: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(req_to_token, req_pool_indices): request i's positions at the next lens[i] entries of `slots` (a
    permutation of the pool), in a random row of a table with two spare rows and three spare columns."""
    req_to_token = torch.zeros(len(lens) + 2, max(lens) + 3, dtype=torch.int32)
    rows = torch.randperm(len(lens) + 2, generator=g)[: len(lens)]
    start = 0
    for row, n in zip(rows.tolist(), lens):
        req_to_token[row, :n] = slots[start : start + n].to(torch.int32)
        start += n
    return req_to_token, rows
