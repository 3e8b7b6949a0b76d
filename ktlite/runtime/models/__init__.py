"""Model definitions. `load(path)` builds the reference DeepSeek model from an HF folder."""

from __future__ import annotations

from pathlib import Path

import torch

from ktlite.runtime.models.config import DeepseekConfig, load_config
from ktlite.runtime.models.deepseek import DeepseekForCausalLM, Router
from ktlite.runtime.models.rope import inv_frequencies


def build(cfg: DeepseekConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DeepseekForCausalLM:
    """An uninitialised model on `device`: weights in `dtype`, router in float32 (as DeepSeek keeps it)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg).to(dtype)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
    model.to_empty(device=device)
    # to_empty leaves buffers uninitialised; the rope frequencies are derived, not loaded
    model.model.rotary.inv_freq.copy_(inv_frequencies(cfg.rope))
    return model.eval()


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, progress: bool = False) -> DeepseekForCausalLM:
    """Reference model with the checkpoint's weights: `model(input_ids [B, T]) -> logits [B, T, vocab]`."""
    from ktlite.runtime.loader import CheckpointReader, load_weights

    model = build(load_config(path), device, dtype)
    load_weights(model, CheckpointReader(path), progress=progress)
    return model


__all__ = ["DeepseekConfig", "DeepseekForCausalLM", "build", "load", "load_config"]
