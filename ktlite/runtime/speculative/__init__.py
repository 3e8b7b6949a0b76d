"""Speculative decoding: drafters propose tokens, the target model verifies them in one forward (see verify.py)."""

from ktlite.runtime.speculative.drafter import Drafter, Speculation, speculation_for
from ktlite.runtime.speculative.verify import accept_drafts, can_speculate

__all__ = ["Drafter", "Speculation", "accept_drafts", "can_speculate", "speculation_for"]
