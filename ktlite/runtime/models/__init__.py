"""Model families. `load(path)` builds the reference model of any supported family from an HF folder;
`build(cfg, ...)` an uninitialised one (the runtime's device-side model)."""

from __future__ import annotations

from pathlib import Path

import torch

from ktlite.runtime.models.base import CausalLM
from ktlite.runtime.models.config import ModelConfig, load_config, parse_config
from ktlite.runtime.models.fp8 import swap_in_fp8
from ktlite.runtime.models.layers import Router
from ktlite.runtime.models.registry import family_of, supported
from ktlite.runtime.models.rope import RotaryEmbedding, inv_frequencies


def build(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    routed_experts: bool = True,
    fp8_weights: bool = False,
    tp=None,
) -> CausalLM:
    """An uninitialised model on `device`: weights in `dtype`, routers (and a module's `fp32_params`) in float32.

    `routed_experts=False` leaves the routed expert weights out (the runtime places them itself);
    `fp8_weights=True` keeps the projections of an FP8 checkpoint in FP8 (1 byte + block scales), but those
    its quantization_config's `modules_to_not_convert` names, which stay in `dtype`;
    `tp` (a `tp_layers.TPContext`) builds one tensor-parallel rank's shard, and `model.tp_shards` then
    tells the loader which slice of each split tensor to read. `device="meta"` builds shapes only
    (what the memory plan counts)."""
    from ktlite.runtime.models.registry import model_class

    with torch.device("meta"):
        model = model_class(cfg)(cfg, routed_experts).to(dtype)
        if fp8_weights:
            swap_in_fp8(model, cfg.fp8_skip)  # after .to(dtype), which would otherwise cast the fp8 weights
        if tp is not None:
            from ktlite.runtime.models.tp_layers import shard_model

            model.tp_shards = shard_model(model, cfg, tp)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
        for name in getattr(module, "fp32_params", ()):  # parameters a family keeps fp32 in any weight dtype
            setattr(module, name, torch.nn.Parameter(getattr(module, name).float()))
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
    # to_empty leaves buffers uninitialised; the rope frequencies are derived, not loaded, and stay
    # float32 whatever the weights' dtype (bf16 angles drift at long positions)
    for module in model.modules():  # every rope table (DeepSeek-V4 has two)
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = inv_frequencies(module.cfg).to(device)
    return model.eval()


def serving_config(config) -> ModelConfig:
    """The model config an EngineConfig serves: the checkpoint's, with its MTP layer for NEXTN drafts (ConfigError
    where the family or the checkpoint has none)."""
    cfg = load_config(config.model_path)
    return cfg.with_mtp() if config.drafts_from_mtp else cfg


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         progress: bool = False, mtp: bool = False) -> CausalLM:
    """Reference model with the checkpoint's weights: `model(input_ids [B, T]) -> logits [B, T, vocab]`; with `mtp`
    its multi-token-prediction layer too (`model.mtp`)."""
    from ktlite.runtime.loader import CheckpointReader, load_weights

    cfg = load_config(path)
    model = build(cfg.with_mtp() if mtp else cfg, device, dtype)
    load_weights(model, CheckpointReader(path), progress=progress)
    return model


__all__ = ["CausalLM", "ModelConfig", "build", "family_of", "load", "load_config", "parse_config",
           "serving_config", "supported"]
