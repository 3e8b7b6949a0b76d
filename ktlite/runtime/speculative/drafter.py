"""The drafter seam: what proposes draft tokens for one request, and the engine's speculation settings.

A drafter belongs to one request and sees its sequence (prompt + output) grow: each call hands it the tokens added
since the previous call, and it proposes up to k tokens to follow. The scheduler verifies them with the target model
(ktlite/runtime/speculative/verify.py), so a drafter only affects speed, never the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ktlite.config import EngineConfig
from ktlite.errors import ConfigError
from ktlite.runtime.models.config import ModelConfig
from ktlite.runtime.speculative.auto_k import Acceptance
from ktlite.runtime.speculative.mtp import MTPDrafter, MTPDrafts
from ktlite.runtime.speculative.ngram import NgramDrafter


class Drafter(Protocol):
    @property
    def seen(self) -> int:
        """Tokens of the request's sequence handed to `propose` so far."""

    def propose(self, new_tokens: Sequence[int], k: int) -> list[int]:
        """new_tokens: the sequence's tokens from position `seen` to its end; -> at most k tokens to follow it."""


@dataclass(frozen=True)
class Speculation:
    num_drafts: int  # k: the most drafts a request verifies per decode step
    new_drafter: Callable[[], Drafter]  # one per request
    auto: bool = False  # the user gave no draft count: each step's is chosen from `cost` (auto_k.py)
    cost: dict[int, float] | None = None  # k -> c(k), a verify of k drafts in plain decode steps (once measured)
    # drafts from a model that reads the target's hidden states (MTP): built on the runner, run after every forward
    # (`step(batch, spans)`, see mtp.py); None: the drafters need nothing from the forward
    draft_model: Callable[[Any, int], MTPDrafts] | None = None

    def drafts_for(self, acceptance: Acceptance) -> int:
        """How many drafts a request with this acceptance so far verifies this step."""
        if self.cost is None:
            return self.num_drafts
        return acceptance.drafts(self.cost)


def speculation_for(config: EngineConfig, model: ModelConfig) -> Speculation | None:
    """The engine's speculation from its flags (None: off). On a model with per-request recurrent state (Gated
    DeltaNet) a verify keeps each request's state from before it in a state-pool row and rewinds to the accepted
    tokens (state_cache.py); under tensor parallelism the other ranks do not rewind yet, and a family whose state
    has no rewind (DeepSeek-V4's compressors, `ModelConfig.state_rewinds`) is refused. MTP drafts (NEXTN / EAGLE)
    run in one process only."""
    if config.speculative_algorithm is None:
        return None
    if model.request_state_specs() and not model.state_rewinds:
        raise ConfigError(f"--speculative-algorithm {config.speculative_algorithm}: this model keeps per-request "
                          "state (DeepSeek-V4's compressors') that a rejected draft would leave advanced; speculative "
                          "decoding does not roll that state back yet: leave the flag out for this model")
    if model.request_state_specs() and config.tensor_parallel_size > 1:
        raise ConfigError(f"--speculative-algorithm {config.speculative_algorithm}: this model has recurrent "
                          "(linear-attention) layers, whose state a rejected draft must rewind, which tensor-parallel "
                          "ranks do not do yet: use --tensor-parallel-size 1 or leave the speculative flag out")
    auto = config.speculative_drafts_auto
    if not config.drafts_from_mtp:
        return Speculation(config.speculative_drafts, NgramDrafter, auto=auto)
    if config.tensor_parallel_size > 1:
        raise ConfigError(f"--speculative-algorithm {config.speculative_algorithm} with --tensor-parallel-size "
                          f"{config.tensor_parallel_size}: MTP drafts are built for one GPU (one process) only")
    return Speculation(config.speculative_drafts, MTPDrafter, auto=auto, draft_model=MTPDrafts)
