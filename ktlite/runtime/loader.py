"""Read HF safetensors checkpoints tensor by tensor and copy them into a model.

Handles one `model.safetensors`, shards listed by `model.safetensors.index.json`, and
block-quantized FP8 weights (float8_e4m3fn + `<name>_scale_inv`, one float32 scale per 128x128
block), which `get()` dequantizes. Nothing is read before it is asked for (`safe_open`), so RAM
holds one tensor at a time beyond the model itself.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ktlite.errors import CheckpointError
from ktlite.kernels.triton import fp8_dequantize
from ktlite.runtime.models.config import parse_config
from ktlite.runtime.models.wrapper import our_name

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] float8 with scale_inv [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    n, k = weight.shape
    bn, bk = block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"fp8 scale shape {tuple(scale_inv.shape)} does not match weight {n}x{k} in {bn}x{bk} blocks")
    return fp8_dequantize(weight, scale_inv, torch.float32, block)


class CheckpointReader:
    """Lazy access to the tensors of an HF checkpoint folder by name."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        config_path = self.model_dir / "config.json"
        self.config: dict = json.loads(config_path.read_text()) if config_path.is_file() else {}
        cfg = parse_config(self.config) if self.config else None
        self.fp8_block = cfg.stored_fp8_block if cfg else None
        # a wrapper's checkpoint (Kimi-K2.5) keeps the language model under other names: every tensor is
        # known by the model's name, and read under its stored one
        renames = cfg.weight_renames if cfg else ()
        stored = self._index()
        self._stored = {our_name(renames, name): name for name in stored}
        self._file_of = {ours: stored[name] for ours, name in self._stored.items()}
        self._handles: dict[Path, object] = {}

    def _index(self) -> dict[str, Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            missing = {f for f in weight_map.values() if not (self.model_dir / f).is_file()}
            if missing:
                raise CheckpointError(f"{index} lists shards that are missing: {sorted(missing)}")
            return {name: self.model_dir / f for name, f in weight_map.items()}
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.model_dir}")
        mapping: dict[str, Path] = {}
        for f in files:
            with safe_open(f, framework="pt") as h:
                mapping.update({name: f for name in h.keys()})
        return mapping

    def _handle(self, name: str):
        path = self._file_of.get(name)
        if path is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def _view(self, name: str):
        """The stored tensor's lazy slice view (safetensors' `get_slice`)."""
        return self._handle(name).get_slice(self._stored[name])

    def names(self) -> list[str]:
        return [n for n in self._file_of if not n.endswith(SCALE_SUFFIX)]

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._view(name).get_shape())

    def scale_name(self, name: str) -> str | None:
        """The block scales of FP8 weight `name`: `<name>_scale_inv` (DeepSeek-V3's, transformers'), or `<base>.scale`
        beside a float8_e4m3fn `<base>.weight` (DeepSeek-V4's hub files: e8m0 scales); None: not FP8."""
        if (name + SCALE_SUFFIX) in self._file_of:
            return name + SCALE_SUFFIX
        hub = name.removesuffix("weight") + "scale"
        if name.endswith(".weight") and hub in self._file_of and self._view(name).get_dtype() == "F8_E4M3":
            return hub
        return None

    def is_fp8(self, name: str) -> bool:
        return self.scale_name(name) is not None

    def get_raw(self, name: str) -> torch.Tensor:
        """The stored tensor as is (float8 stays float8)."""
        return self._handle(name).get_tensor(self._stored[name])

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor in `dtype`; FP8 block-quantized weights are dequantized first."""
        tensor = self.get_raw(name)
        if self.is_fp8(name):
            scale = self.get_raw(self.scale_name(name)).float()  # e8m0 scales (DeepSeek-V4) read as their values
            tensor = dequantize_fp8_blocks(tensor, scale, self.fp8_block or (128, 128))
        return tensor.to(dtype)

    def get_raw_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) start:stop of the stored tensor; only those are read."""
        view = self._view(name)
        return view[start:stop] if dim == 0 else view[:, start:stop]

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`get(name)[start:stop]` along `dim` (0 or 1) without reading the rest (a tensor-parallel shard).
        FP8 weights read the covering scale blocks and are dequantized."""
        tensor = self.get_raw_slice(name, dim, start, stop)
        if self.is_fp8(name):
            block = self.fp8_block or (128, 128)
            b = block[dim]
            lo, hi = start // b, -(-stop // b)
            scale = self.get_raw_slice(self.scale_name(name), dim, lo, hi).float()
            scale = scale.repeat_interleave(b, dim)
            scale = scale.narrow(dim, start - lo * b, stop - start)
            other = 1 - dim
            scale = scale.repeat_interleave(block[other], other).narrow(other, 0, tensor.shape[other])
            tensor = tensor.float() * scale
        return tensor.to(dtype)


# name -> (dim, start, stop): the part of the checkpoint tensor a tensor-parallel rank holds; a target
# larger than stop - start (the last rank of an uneven split) is zero-padded
Shards = dict[str, tuple[int, int, int]]


def _copy_shard(target: torch.Tensor, reader: CheckpointReader, source: str, shard: tuple[int, int, int],
                raw: bool, scale_of: str | None) -> None:
    dim, start, stop = shard
    if scale_of is not None:  # an FP8 weight_scale_inv: the blocks covering the weight's shard
        b = (reader.fp8_block or (128, 128))[dim]
        if start % b:
            raise CheckpointError(f"tensor {scale_of!r}: the tensor-parallel shard starts at {start}, not on a "
                                  f"{b}-block boundary, so FP8 weights cannot stay FP8 (use --weight-dtype auto on CPU "
                                  "or a tensor-parallel size that splits the blocks evenly)")
        start, stop = start // b, -(-stop // b)
    part = reader.get_raw_slice(source, dim, start, stop) if raw else reader.get_slice(source, dim, start, stop, target.dtype)
    expected = list(target.shape)
    expected[dim] = part.shape[dim]
    if list(part.shape) != expected or part.shape[dim] > target.shape[dim]:
        raise CheckpointError(f"tensor {source!r}: shard {tuple(part.shape)} does not fit {tuple(target.shape)}")
    target.zero_()
    target.narrow(dim, 0, part.shape[dim]).copy_(part)


def load_weights(model: torch.nn.Module, reader: CheckpointReader, progress: bool = True,
                 shards: Shards | None = None) -> None:
    """Copy every tensor of `model.state_dict()` from the checkpoint, in the tensor's own dtype.

    Names match the HF checkpoint (FP8 layers' `weight_scale_inv` included); a tied lm_head falls
    back to the embedding. Checkpoint tensors the
    model does not have (e.g. multi-token-prediction layers) are not read. Model tensor names map to
the checkpoint's through `model.checkpoint_name` (families whose hub names differ define it).
    """
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    checkpoint_name = getattr(model, "checkpoint_name", lambda n: n)  # families whose checkpoints differ
    targets = model.state_dict()
    shards = shards or {}
    for name, target in tqdm(targets.items(), desc="loading weights", unit="tensor", disable=not progress):
        source = checkpoint_name(name)
        if name == "lm_head.weight" and tied and source not in reader:
            source = checkpoint_name("model.embed_tokens.weight")
        weight_of = name.removesuffix(SCALE_SUFFIX) if name.endswith(SCALE_SUFFIX) else None
        shard = shards.get(weight_of if weight_of is not None else name)
        if shard is not None:  # a tensor-parallel rank reads only its part
            fp8 = target.dtype == torch.float8_e4m3fn or weight_of is not None
            with torch.no_grad():
                _copy_shard(target, reader, source, shard, fp8, weight_of)
            continue
        found = reader.shape(source)
        if tuple(found) != tuple(target.shape):
            raise CheckpointError(f"tensor {source!r}: expected shape {tuple(target.shape)}, found {tuple(found)}")
        with torch.no_grad():
            # FP8 targets take the stored bytes as they are; everything else is converted
            fp8 = target.dtype == torch.float8_e4m3fn or name.endswith(SCALE_SUFFIX)
            target.copy_(reader.get_raw(source) if fp8 else reader.get(source, target.dtype))
