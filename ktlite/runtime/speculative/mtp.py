"""NEXTN drafts: the checkpoint's multi-token-prediction layer (ktlite/runtime/models/mtp.py) run after each forward.

The MTP layer keeps its own latent per token in the KV pool (layer index num_hidden_layers, in the same slots as the
target's layers): its entry at position i is computed from the target's hidden state at i and token i + 1. So after
every forward, for every request that may draft, `MTPDrafts.step` extends the MTP layer over the positions whose
target KV this forward kept (a prefill chunk's, or a verify's last token and accepted drafts) with the tokens after
them, batched over the requests, in the forward's thread. A request whose forward ended at its newest token (it
sampled) then gets k drafts: the first from the extend's last row, the next k - 1 from a chain of one-token steps
that feed the layer's own output and the previous draft back in, as SGLang chains one MTP layer.

The chain's positions have no target KV yet (the next verify allocates it): its MTP entries go to slots borrowed from
the pool's free list for the chain and returned right after, the request's table entries past its kept tokens
pointing at them meanwhile (nothing reads a table entry past a request's length). The next step's extend rewrites
the MTP entries of the positions the target keeps, from the target's own hidden states, before anything reads them;
those of rejected drafts go back with their slots. A request's drafts are kept for the sequence length they follow;
`propose` hands them out only while the sequence still has that length.

A prefix taken from the prefix cache carries the MTP entries of the request that computed it; the one at its last
position was computed with that request's next token, which may differ: drafts can be worse, never the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ktlite.runtime.forward_batch import ForwardBatch


class MTPDrafter:
    """One request's drafts, written by MTPDrafts after a forward that ends at its newest token."""

    def __init__(self) -> None:
        self._seen = 0
        self.drafts: list[int] = []
        self.follows = -1  # the sequence length the drafts follow

    @property
    def seen(self) -> int:
        return self._seen

    def propose(self, new_tokens: Sequence[int], k: int) -> list[int]:
        self._seen += len(new_tokens)
        return self.drafts[:k] if self._seen == self.follows else []


@dataclass
class Span:
    """One request's rows of a forward whose target KV it keeps, and what the MTP layer reads there."""

    drafter: MTPDrafter
    row: int  # its KV-pool row
    start: int  # the position of its first row
    offset: int  # the index of its first row among the forward's tokens
    next_tokens: list[int]  # the token after each kept row (one per row)
    sampled: bool  # the rows end at its newest token and it may draft next step: it wants drafts


class MTPDrafts:
    def __init__(self, runner, num_drafts: int):
        self.runner, self.num_drafts = runner, num_drafts

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, spans: list[Span]) -> None:
        """After the target's forward of `batch` (its hidden_states captured): the MTP layer over every span's kept
        rows, then drafts for the spans that sampled."""
        spans = [s for s in spans if s.next_tokens]
        if not spans:
            return
        model, device = self.runner.model, self.runner.device
        lens = [len(s.next_tokens) for s in spans]
        rows = torch.cat([torch.arange(s.offset, s.offset + n) for s, n in zip(spans, lens)]).to(device)
        ends = torch.tensor(lens).cumsum(0) - 1
        drafting = [i for i, s in enumerate(spans) if s.sampled]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        extend = ForwardBatch(
            input_ids=tensor([t for s in spans for t in s.next_tokens]),
            positions=tensor([s.start + j for s, n in zip(spans, lens) for j in range(n)]),
            out_cache_loc=batch.out_cache_loc[rows], req_pool_indices=tensor([s.row for s in spans]),
            prefix_lens=tensor([s.start for s in spans]), extend_lens=tensor(lens),
            logit_rows=ends[drafting].to(device))
        hidden = model.model.norm(batch.hidden_states[rows])  # the target's final-normed states (SGLang's input)
        out, logits = model.draft_forward(extend, hidden, self.runner)
        if not drafting:
            return
        spans = [spans[i] for i in drafting]
        drafts = [[t] for t in logits.argmax(dim=-1).tolist()]
        self._chain(spans, drafts, out[extend.logit_rows], [s.start + len(s.next_tokens) for s in spans])
        for s, d in zip(spans, drafts):
            s.drafter.drafts, s.drafter.follows = d, s.start + len(s.next_tokens) + 1

    def _chain(self, spans: list[Span], drafts: list[list[int]], hidden: torch.Tensor, positions: list[int]) -> None:
        """Extend each request's drafts to num_drafts: one-token MTP steps at positions[i], positions[i] + 1, ...
        (the newest token's position on), each reading the previous step's output and draft."""
        pool, device = self.runner.kv_pool, self.runner.device
        steps = min(self.num_drafts - 1, pool.free_list_tokens // len(spans),
                    min(pool.max_context - p for p in positions))
        if steps <= 0:
            return
        borrowed = pool.take_slots(steps * len(spans), reclaim=False)
        try:
            slots = torch.tensor(borrowed, dtype=torch.int64).view(steps, len(spans))  # a step's slots contiguous
            for i, (s, p) in enumerate(zip(spans, positions)):
                pool.req_to_token[s.row, p:p + steps] = slots[:, i].to(pool.req_to_token.device, torch.int32)
            for j in range(steps):
                step = ForwardBatch(
                    input_ids=torch.tensor([d[-1] for d in drafts], dtype=torch.int64, device=device),
                    positions=torch.tensor([p + j for p in positions], dtype=torch.int64, device=device),
                    out_cache_loc=slots[j].to(device),
                    req_pool_indices=torch.tensor([s.row for s in spans], dtype=torch.int64, device=device),
                    prefix_lens=torch.tensor([p + j for p in positions], dtype=torch.int64, device=device),
                    extend_lens=torch.ones(len(spans), dtype=torch.int64, device=device),
                    logit_rows=torch.arange(len(spans), device=device))
                hidden, logits = self.runner.model.draft_forward(step, hidden, self.runner)
                for d, t in zip(drafts, logits.argmax(dim=-1).tolist()):
                    d.append(t)
        finally:
            pool.free_slots(borrowed)
