"""Multimodal wrapper checkpoints (Kimi-K2.5): the language model's config nested in `text_config`, and the
language model's tensors stored under the wrapper's names (`ModelConfig.weight_renames`: (stored prefix, our
prefix) pairs), which readers map to the model's names and writers back."""

from __future__ import annotations

from typing import Any


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a multimodal wrapper (e.g. Kimi-K2.5) that nests it in `text_config`,
    with the wrapper's quantization_config where the text config has none; other configs as they are."""
    text = raw.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text and "num_hidden_layers" not in raw:
        return {**text, "quantization_config": text.get("quantization_config") or raw.get("quantization_config")}
    return raw


def our_name(renames: tuple[tuple[str, str], ...], stored: str) -> str:
    """A checkpoint tensor's name in the model: the longest stored prefix of `renames` that matches is
    replaced by its own prefix (several checkpoint dialects map onto one model)."""
    matches = [(s, o) for s, o in renames if stored.startswith(s)]
    if not matches:
        return stored
    s, o = max(matches, key=lambda pair: len(pair[0]))
    return o + stored[len(s):]


def stored_name(renames: tuple[tuple[str, str], ...], ours: str) -> str:
    """The name a writer stores one of the model's tensors under: the first pair of `renames` whose own prefix
    matches (a family lists its hub dialect first)."""
    for s, o in renames:
        if ours.startswith(o):
            return s + ours[len(o):]
    return ours
