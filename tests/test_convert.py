"""`ktlite convert`: routed experts quantized to disk, resumable, and loaded back with checks."""

from __future__ import annotations

import json

import pytest
import torch

import ktlite.runtime.convert as convert
from ktlite.errors import CheckpointError
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.runtime.convert import MANIFEST, convert_checkpoint, load_converted, moe_layer_indices
from ktlite.runtime.loader import CheckpointReader
from ktlite.runtime.models import parse_config


def direct_moe(model_dir, method: str, group: int) -> CPUMoE:
    """CPUMoE filled straight from the checkpoint (FP8 dequantized by the reader)."""
    reader = CheckpointReader(model_dir)
    cfg = parse_config(reader.config)
    moe = CPUMoE(method, group)
    for layer in moe_layer_indices(reader.config):
        stack = [torch.stack([reader.get(cfg.expert_weight_name(layer, e, p)) for e in range(cfg.n_routed_experts)])
                 for p in ("gate", "up", "down")]
        moe.add_layer(layer, *stack)
    return moe


@pytest.fixture(scope="module")
def converted(tiny_v3_fp8, tmp_path_factory):
    out = tmp_path_factory.mktemp("experts")
    return tiny_v3_fp8, out, convert_checkpoint(tiny_v3_fp8, out, "INT4", 32, progress=False)


def test_manifest(converted):
    model, out, manifest_path = converted
    manifest = json.loads(manifest_path.read_text())
    cfg = CheckpointReader(model).config
    assert manifest_path == out / MANIFEST
    assert manifest["method"] == "INT4" and manifest["group_size"] == 32 and manifest["complete"]
    assert manifest["moe_layers"] == moe_layer_indices(cfg) == [1, 2]
    assert (manifest["hidden_size"], manifest["moe_intermediate_size"]) == (cfg["hidden_size"], cfg["moe_intermediate_size"])
    assert len(manifest["source"]["fingerprint"]) == 64
    assert all((out / v["file"]).is_file() for v in manifest["layers"].values())


def test_loaded_equals_direct_quantization(converted):
    model, out, _ = converted
    cfg = CheckpointReader(model).config
    n = cfg["n_routed_experts"]
    cpu = {1: [0, 3, 5, 9], 2: list(range(n))}
    with CPUMoE("INT4", 32) as loaded, direct_moe(model, "INT4", 32) as direct:
        load_converted(out, loaded, cfg, cpu)
        assert loaded.layers[1].experts.tolist() == cpu[1]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, cfg["hidden_size"], generator=g)
        ids = torch.rand(4, n, generator=g).topk(3, dim=1).indices
        w = torch.rand(4, 3, generator=g)
        skip = torch.ones(n, dtype=torch.bool)
        skip[cpu[1]] = False
        for layer, mask in ((1, skip), (2, None)):
            torch.testing.assert_close(loaded.forward(layer, x, ids, w, mask), direct.forward(layer, x, ids, w, mask))


def test_resume_after_interruption(tiny_v2, tmp_path, monkeypatch):
    real_save = convert.save_file
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while writing the second layer
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(convert, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tiny_v2, tmp_path, "INT8", 64, progress=False)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert len(manifest["layers"]) == 1 and not manifest["complete"]
    first = tmp_path / next(iter(manifest["layers"].values()))["file"]
    stamp = first.stat().st_mtime_ns
    calls.clear()
    monkeypatch.setattr(convert, "save_file", real_save)
    convert_checkpoint(tiny_v2, tmp_path, "INT8", 64, progress=False)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["complete"] and len(manifest["layers"]) == len(manifest["moe_layers"])
    assert first.stat().st_mtime_ns == stamp  # the finished layer was not redone
    cfg = CheckpointReader(tiny_v2).config
    with CPUMoE("INT8", 64) as moe:
        load_converted(tmp_path, moe, cfg)
        assert sorted(moe.layers) == moe_layer_indices(cfg)


def test_other_method_into_same_dir_refused(converted):
    model, out, _ = converted
    with pytest.raises(CheckpointError, match="already holds a conversion"):
        convert_checkpoint(model, out, "INT8", 32, progress=False)


def test_load_mismatches(converted, tmp_path):
    model, out, _ = converted
    cfg = CheckpointReader(model).config
    with CPUMoE("INT8", 32) as moe, pytest.raises(CheckpointError, match="method=INT4 group_size=32"):
        load_converted(out, moe, cfg)
    with CPUMoE("INT4", 64) as moe, pytest.raises(CheckpointError, match="group_size"):
        load_converted(out, moe, cfg)
    with CPUMoE("INT4", 32) as moe, pytest.raises(CheckpointError, match="converted for"):
        load_converted(out, moe, {**cfg, "hidden_size": cfg["hidden_size"] * 2})
    with CPUMoE("INT4", 32) as moe, pytest.raises(CheckpointError, match="layer 3"):
        load_converted(out, moe, {**cfg, "num_hidden_layers": 4})
    with CPUMoE("INT4", 32) as moe, pytest.raises(CheckpointError, match="run `ktlite convert`"):
        load_converted(tmp_path, moe, cfg)


def test_wrong_tensor_shape_in_shard(converted, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    model, out, _ = converted
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    manifest = json.loads((bad / MANIFEST).read_text())
    shard = bad / manifest["layers"]["1"]["file"]
    tensors = load_file(shard)
    tensors["down.scales"] = tensors["down.scales"][:, :, :1].contiguous()
    save_file(tensors, shard)
    with CPUMoE("INT4", 32) as moe, pytest.raises(CheckpointError, match="down.scales has shape"):
        load_converted(bad, moe, CheckpointReader(model).config)
