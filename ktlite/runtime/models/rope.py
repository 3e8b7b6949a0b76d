"""Rotary position embedding (full or partial, interleaved or half-split), with YaRN scaling."""

from __future__ import annotations

import math

import torch

from ktlite.runtime.models.config import RopeConfig


def _yarn_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    dim, base = cfg.head_dim, cfg.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (cfg.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep_extrapolated = 1 - ramp  # high-frequency dims keep their original frequency
    return interpolation * (1 - keep_extrapolated) + extrapolation * keep_extrapolated


def inv_frequencies(cfg: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] float32 angular frequencies."""
    if cfg.kind == "yarn":
        return _yarn_inv_freq(cfg)
    return 1.0 / (cfg.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, cfg: RopeConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", inv_frequencies(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., head_dim // 2] (float32, YaRN-scaled)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        scale = self.cfg.cos_sin_scale
        return freqs.cos() * scale, freqs.sin() * scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [..., heads, head_dim] with cos/sin [..., rot // 2] (broadcast over heads)."""
        return apply_rope(x, cos.unsqueeze(-2), sin.unsqueeze(-2), self.cfg.interleave)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] values of x's last dim (the rest passes through unrotated);
    cos/sin broadcast against x[..., :rot // 2].

    Interleaved models rotate pairs (x[2i], x[2i+1]) and keep that layout; otherwise the halves
    (x[i], x[i + d/2]) are paired. Keys and queries use the same layout, so scores are equal.
    """
    rot = 2 * cos.shape[-1]
    if x.shape[-1] > rot:  # partial rotary
        return torch.cat((apply_rope(x[..., :rot], cos, sin, interleave), x[..., rot:]), dim=-1)
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
