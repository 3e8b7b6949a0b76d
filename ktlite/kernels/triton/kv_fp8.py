"""FP8 rows of the token cache (`--kv-cache-dtype fp8_e4m3` for caches that need scales).

One uint8 row per token per layer (SGLang's FP8 MLA layout, generalised):

    [ dim x float8_e4m3fn | ceil(dim / group) x fp32 scale | tail x bf16 ]

- MLA latent: dim = kv_lora_rank in groups of 128, tail = the rope'd key (qk_rope_head_dim), kept in
  bf16 because it carries the position (FlashMLA's FP8 cache does the same). At kv_lora_rank 512 and
  rope 64: 512 + 4 x 4 + 64 x 2 = 656 bytes instead of 1,152 in bf16.
- DSA index key: dim = index_head_dim in one group, no tail: 128 + 4 = 132 bytes instead of 256.
- GQA key or value: one row per kv head, dim = head_dim in one group, no tail (`head_rows`): a K or V buffer is
  [slots, kv_heads, head_dim + 4]; at head_dim 128, 132 bytes per head instead of 256.

Quantize on write: scale = amax(group) / 448 (e4m3's largest finite value), stored = round(x / scale)
to nearest even; dequantize: stored * scale. Error per value: at most 2^-4 |x| (3 mantissa bits) for
normal fp8 values, and 2^-10 scale below e4m3's smallest normal (2^-6 scale), where it rounds to the
subnormal grid. Nothing is clipped: the scale follows the group's range, however far past 448 it reaches.
The kernels read these rows directly (reference.gather_latents / gather_heads for the twins,
latent_tile.load_latent and head_tile for Triton); `pack` is the one writer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ktlite.errors import ConfigError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
LATENT_GROUP = 128  # MLA latent values per fp32 scale
_TINY = torch.finfo(torch.float32).tiny  # an all-zero group keeps scale 0 without dividing by it


@dataclass(frozen=True)
class Fp8Rows:
    """The packed row layout of one cache kind: `dim` fp8 values, an fp32 scale per `group` of them
    (the last group may be shorter), then `tail` bf16 values."""

    dim: int
    group: int
    tail: int = 0

    def __post_init__(self) -> None:
        # the scales and the bf16 tail are read in place as fp32 / bf16, so they must stay aligned
        if self.dim % 4 or self.tail % 2:
            raise ConfigError(f"--kv-cache-dtype fp8_e4m3 packs {self.dim} fp8 values + {self.tail} bf16 values per "
                              "token; that needs a multiple of 4 and an even number: use --kv-cache-dtype auto")

    @property
    def groups(self) -> int:
        return -(-self.dim // self.group)

    @property
    def row_bytes(self) -> int:
        return self.dim + 4 * self.groups + 2 * self.tail

    @property
    def width(self) -> int:
        """Values per row once unpacked."""
        return self.dim + self.tail

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim + tail] (any float dtype) -> uint8 rows [..., row_bytes]."""
        lead = x.shape[:-1]
        x = x.reshape(-1, self.width)
        n, padded = x.shape[0], self.groups * self.group
        vals = F.pad(x[:, : self.dim].float(), (0, padded - self.dim)).view(n, self.groups, self.group)
        scale = vals.abs().amax(-1) / FP8_MAX  # [n, groups]
        q = (vals / scale.clamp(min=_TINY)[..., None]).clamp(-FP8_MAX, FP8_MAX)
        q = q.view(n, padded)[:, : self.dim].to(torch.float8_e4m3fn)
        tail = x[:, self.dim :].to(torch.bfloat16).contiguous()
        rows = torch.cat((q.view(torch.uint8), scale.view(torch.uint8), tail.view(torch.uint8)), dim=-1)
        return rows.view(*lead, self.row_bytes)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 rows [..., row_bytes] -> float32 [..., dim + tail]."""
        end = self.dim + 4 * self.groups
        q = rows[..., : self.dim].view(torch.float8_e4m3fn).float()
        scale = rows[..., self.dim : end].contiguous().view(torch.float32)  # [..., groups]
        vals = q * scale.repeat_interleave(self.group, dim=-1)[..., : self.dim]
        return torch.cat((vals, rows[..., end:].contiguous().view(torch.bfloat16).float()), dim=-1)

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A pool buffer [..., row_bytes] read in place: (values float8_e4m3fn [..., dim],
        scales fp32 [..., groups], tail bf16 [..., tail]), each keeping the buffer's leading strides."""
        assert buffer.dtype == torch.uint8 and buffer.shape[-1] == self.row_bytes and buffer.stride(-1) == 1
        first_scale = self.dim // 4
        return (buffer[..., : self.dim].view(torch.float8_e4m3fn),
                buffer.view(torch.float32)[..., first_scale : first_scale + self.groups],
                buffer.view(torch.bfloat16)[..., (self.dim + 4 * self.groups) // 2 :])


def latent_rows(kv_lora_rank: int, rope: int) -> Fp8Rows:
    """The packed layout of an MLA latent: kv_lora_rank fp8 values in groups of 128, the rope'd key in bf16."""
    return Fp8Rows(kv_lora_rank, LATENT_GROUP, rope)


def head_rows(head_dim: int) -> Fp8Rows:
    """The packed layout of one GQA key or value head: head_dim fp8 values and their one fp32 scale."""
    return Fp8Rows(head_dim, head_dim)


def packed_head_rows(buffer: torch.Tensor) -> Fp8Rows:
    """The head_rows layout of a packed K or V pool buffer [..., head_dim + 4] uint8."""
    return head_rows(buffer.shape[-1] - 4)


def is_packed(buffer: torch.Tensor) -> bool:
    """Whether a cache buffer holds Fp8Rows (uint8) rather than plain values."""
    return buffer.dtype == torch.uint8


def e4m3_as_bytes(buffer: torch.Tensor) -> bool:
    """Whether Triton must read this buffer's e4m3 codes as raw bytes: a CUDA GPU before sm89 has no e4m3 type."""
    return buffer.is_cuda and torch.cuda.get_device_capability(buffer.device) < (8, 9)


def packs_fp8(kv_dtype: torch.dtype | None) -> bool:
    """Whether a pool of this KV dtype stores caches that need scales as Fp8Rows."""
    return kv_dtype == torch.float8_e4m3fn
