"""The batch of one forward step: every request adds `extend_len` new tokens after `prefix_len`
cached ones (a decode step is extend_len == 1, a chunked prefill more; a mixed batch holds both)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N] new tokens of all requests, concatenated in request order
    positions: torch.Tensor  # [N]
    out_cache_loc: torch.Tensor  # [N] pool slots of the new tokens
    req_pool_indices: torch.Tensor  # [B] rows of req_to_token
    prefix_lens: torch.Tensor  # [B] tokens already in the pool before this step
    extend_lens: torch.Tensor  # [B] new tokens per request
    logit_rows: torch.Tensor  # [R] indices into N whose next-token logits are wanted
    # speculative drafts verified behind each request's last token (its last drafts[i] new tokens); () for none
    drafts: tuple[int, ...] = ()
    # a drafter that reads the target's hidden states (MTP) sets capture_hidden; the forward then leaves its last
    # layer's output [N, hidden] (before the final norm) in hidden_states: a reference, no copy
    capture_hidden: bool = False
    hidden_states: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        # one new token per request (every request adds at least one): no tensor op, asked by every layer of a step
        return self.input_ids.shape[0] == self.extend_lens.shape[0]

    @classmethod
    def build(
        cls,
        token_chunks: list[list[int]],
        prefix_lens: list[int],
        rows: list[int],
        slots: list[torch.Tensor],
        want_logits: list[bool],
        device: torch.device,
        extra_rows: list[range] | None = None,
        drafts: list[int] | None = None,
        capture_hidden: bool = False,
    ) -> "ForwardBatch":
        """From per-request new tokens, prefix lengths, pool rows and freshly allocated slots.
        want_logits[i]: the logits of request i's last new token; extra_rows[i]: offsets into its
        chunk whose logits come before that one (prompt logprobs, speculative drafts to verify)."""
        extend = [len(c) for c in token_chunks]
        positions = [p + i for p, n in zip(prefix_lens, extend) for i in range(n)]
        logit_rows, start = [], 0
        for i, n in enumerate(extend):  # request order: its extra rows, then its last token's
            logit_rows += [start + k for k in (extra_rows[i] if extra_rows else ())]
            logit_rows += [start + n - 1] if want_logits[i] else []
            start += n

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            input_ids=tensor([t for c in token_chunks for t in c]),
            positions=tensor(positions),
            out_cache_loc=torch.cat(slots).to(device),
            req_pool_indices=tensor(rows),
            prefix_lens=tensor(prefix_lens),
            extend_lens=tensor(extend),
            logit_rows=tensor(logit_rows),
            drafts=tuple(drafts) if drafts and any(drafts) else (),
            capture_hidden=capture_hidden,
        )
