"""Linear layers that keep block-scaled FP8 checkpoint weights as they are on the device.

The weight stays float8_e4m3fn with one float32 `weight_scale_inv` per 128x128 block (names as in
the checkpoint, so loading is a raw copy); the matmul goes through `fp8_linear` (Triton on CUDA,
the torch twin elsewhere). One byte per weight instead of two is what lets DeepSeek-V3's attention
and dense weights fit small GPUs (DeepSeek-V3, MiniMax-M2 and Qwen3 publish such checkpoints).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ktlite.kernels.triton import fp8_dequantize, fp8_linear

BLOCK = 128


class FP8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False)
        scales = (-(-out_features // BLOCK), -(-in_features // BLOCK))
        self.register_buffer("weight_scale_inv", torch.empty(scales, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return fp8_dequantize(self.weight, self.weight_scale_inv, dtype)


def linear_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight as a dense matrix in `dtype` (FP8 layers are dequantized)."""
    return layer.dequantized(dtype) if isinstance(layer, FP8Linear) else layer.weight


def _stored_in_fp8(parent: nn.Module, name: str) -> bool:
    """Whether block-FP8 checkpoints store this linear layer in FP8: every projection (`q_proj`,
    `kv_a_proj_with_mqa`, `in_proj_qkvz`), unless the parent module lists its FP8 layers itself
    (`fp8_linears`, e.g. the DSA indexer)."""
    listed = getattr(parent, "fp8_linears", None)
    if listed is not None:
        return name in listed
    return re.search(r"(?:^|_)proj(?:_|$)", name) is not None


def skipped(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether a checkpoint module name matches `modules_to_not_convert`, by transformers' rule
    (`quantizers_utils.should_convert_module`): a pattern matches from the start up to a module boundary,
    as a regex with that boundary ("model.layers.1" not "model.layers.11"), or as a suffix ("in_proj_ba")."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def swap_in_fp8(model: nn.Module, skip: tuple[str, ...] = ()) -> None:
    """Replace every nn.Linear that the block-FP8 checkpoint stores in FP8 with an FP8Linear, in place:
    the projections (`_stored_in_fp8`) but those its `modules_to_not_convert` (`skip`) keeps in high
    precision, matched on the checkpoint's names (`model.checkpoint_name`)."""
    checkpoint_name = getattr(model, "checkpoint_name", lambda n: n)
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not (isinstance(child, nn.Linear) and _stored_in_fp8(parent, name)):
                continue
            # families map tensor names, not module names, to the checkpoint's: map the weight's
            weight = checkpoint_name(f"{path}.{name}.weight" if path else f"{name}.weight")
            if not skipped(weight.removesuffix(".weight"), skip):
                fp8 = FP8Linear(child.in_features, child.out_features, bias=child.bias is not None)
                if fp8.bias is not None:
                    fp8.bias.data = fp8.bias.data.to(child.bias.dtype)  # the bias stays in the activation dtype
                setattr(parent, name, fp8)
