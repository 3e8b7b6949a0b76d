"""Checkpoint reading: shards, FP8 blocks, and clear errors for missing or mis-shaped tensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ktlite.errors import CheckpointError
from ktlite.runtime import models
from ktlite.runtime.loader import CheckpointReader, dequantize_fp8_blocks
from ktlite.runtime.tiny_model import _fp8_quantize


def copy_checkpoint(src, dst, tensors=None):
    dst.mkdir(exist_ok=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_sharded_checkpoint_loads_like_single_file(tiny_v2, tmp_path):
    tensors = load_file(str(tiny_v2 / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    shard_dir = copy_checkpoint(tiny_v2, tmp_path / "sharded")
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(shard_dir / fname))
        weight_map.update({n: fname for n in part})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = torch.arange(12)[None] % 500
    assert torch.equal(models.load(tiny_v2)(ids), models.load(shard_dir)(ids))


def test_missing_tensor_is_named(tiny_v2, tmp_path):
    tensors = load_file(str(tiny_v2 / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    broken = copy_checkpoint(tiny_v2, tmp_path / "missing", tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight.*missing"):
        models.load(broken)


def test_misshaped_tensor_reports_expected_and_found(tiny_v2, tmp_path):
    tensors = load_file(str(tiny_v2 / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 63, dtype=torch.bfloat16)
    broken = copy_checkpoint(tiny_v2, tmp_path / "shape", tensors)
    with pytest.raises(CheckpointError, match=r"o_proj.*expected shape \(64, 64\), found \(64, 63\)"):
        models.load(broken)


def test_missing_shard_is_reported(tiny_v2, tmp_path):
    d = copy_checkpoint(tiny_v2, tmp_path / "noshard")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing"):
        CheckpointReader(d)


def test_fp8_block_dequantization_over_several_blocks():
    """300 x 200 spans 3 x 2 blocks with ragged edges; each block keeps its own scale."""
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    w[:128, :128] *= 100  # one block with a very different range
    q, scale_inv = _fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    back = dequantize_fp8_blocks(q, scale_inv, (128, 128))
    rel = (back - w).norm() / w.norm()
    assert rel < 0.05  # e4m3 keeps 3 mantissa bits: ~2-3 % relative error
    blockwise = (back[200:, 150:] - w[200:, 150:]).norm() / w[200:, 150:].norm()
    assert blockwise < 0.05  # the small-range block is not crushed by the large one
    with pytest.raises(CheckpointError, match="scale shape"):
        dequantize_fp8_blocks(q, scale_inv[:, :1], (128, 128))
