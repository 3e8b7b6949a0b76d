"""Speculative decoding: drafters propose tokens, the target model verifies them in one forward (see verify.py)."""

from ktlite.runtime.speculative.drafter import Drafter, Speculation, speculation_for
from ktlite.runtime.speculative.mtp import MTPDrafter, MTPDrafts, Span
from ktlite.runtime.speculative.verify import accept_drafts, can_speculate, may_speculate

__all__ = ["Drafter", "MTPDrafter", "MTPDrafts", "Span", "Speculation", "accept_drafts", "can_speculate",
           "may_speculate", "speculation_for"]
