"""`ktlite convert`: quantize an HF checkpoint's routed experts for the CPU, and load them back.

Output folder (`--kt-weight-path` at serve time):
    ktlite_experts.json           manifest: method, group size, shapes, source fingerprint, layers
    layer_{l:03d}.safetensors     all experts of MoE layer l, stacked in expert order:
        gate_up.qweight [E, 2I, *], gate_up.scales [E, 2I, G'], down.qweight [E, H, *], down.scales
        (the formats of ktlite/kernels/cpu/quant.py; gate rows then up rows, as CPUMoE stores them)

Conversion streams: one expert tensor is read (bf16 as stored; FP8 sources dequantized by
CheckpointReader) and quantized (numba, kernels/cpu/quantizer.py) at a time into the current layer's arrays, so RAM holds one quantized layer plus one
source tensor. Each layer file is written to a temporary name and renamed, then recorded in the
manifest, so an interrupted run resumes at the first layer that is not recorded. The source
fingerprint is a sha256 of config.json's model keys and the names/shapes/dtypes of the expert
tensors (hashing ~700 GB of data would cost as much as the conversion).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ktlite.errors import CheckpointError
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.kernels.cpu.quant import QuantizedWeight, check_group_size, empty_quantized, normalize_kt_method, quantize_into
from ktlite.runtime.loader import CheckpointReader
from ktlite.runtime.models.config import parse_config

logger = logging.getLogger(__name__)

MANIFEST = "ktlite_experts.json"
FORMAT_VERSION = 1
_PROJS = ("gate", "up", "down")


def moe_layer_indices(config: Mapping) -> list[int]:
    """MoE layers of a config.json (any supported family)."""
    return parse_config(dict(config)).moe_layers


def _dims(config: Mapping) -> tuple[int, int, int]:
    """(routed experts, hidden size, expert intermediate size) of a config.json."""
    cfg = parse_config(dict(config))
    if not cfg.n_routed_experts:
        raise CheckpointError(f"config.json of {cfg.architecture} has no routed experts")
    return cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size


def _fingerprint(reader: CheckpointReader, layers: Sequence[int], n_experts: int) -> str:
    cfg = parse_config(reader.config)
    h = hashlib.sha256(repr(cfg).encode())
    for layer in layers:
        for e in range(n_experts):
            for proj in _PROJS:
                name = cfg.expert_weight_name(layer, e, proj)
                if name not in reader:
                    raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {reader.model_dir}")
                h.update(f"{name}{reader.shape(name)}{reader.is_fp8(name)}".encode())
    return h.hexdigest()


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _layer_tensors(gate_up: QuantizedWeight, down: QuantizedWeight) -> dict[str, torch.Tensor]:
    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16 else torch.from_numpy(a)

    return {"gate_up.qweight": t(gate_up.qweight), "gate_up.scales": t(gate_up.scales),
            "down.qweight": t(down.qweight), "down.scales": t(down.scales)}


def convert_checkpoint(model_dir: str | Path, output_dir: str | Path, method: str, group_size: int | None = None,
                       progress: bool = True) -> Path:
    """Quantize every routed expert of `model_dir` into `output_dir` (group_size None: the method's default); returns
    the manifest path."""
    method = normalize_kt_method(method)
    group_size = check_group_size(method, group_size)
    reader = CheckpointReader(model_dir)
    cfg = parse_config(reader.config)
    n_experts, hidden, inter = _dims(reader.config)
    layers = moe_layer_indices(reader.config)
    if not layers:
        raise CheckpointError(f"{model_dir} has no MoE layers (n_routed_experts is 0 or missing)")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    manifest = {
        "format_version": FORMAT_VERSION, "method": method, "group_size": group_size,
        "n_routed_experts": n_experts, "hidden_size": hidden, "moe_intermediate_size": inter,
        "source": {"model_dir": str(Path(model_dir).resolve()),
                   "fingerprint": _fingerprint(reader, layers, n_experts)},
        "moe_layers": layers, "layers": {}, "complete": False,
    }
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        keys = ("format_version", "method", "group_size", "n_routed_experts", "hidden_size", "moe_intermediate_size")
        if any(old.get(k) != manifest[k] for k in keys) or old["source"]["fingerprint"] != manifest["source"]["fingerprint"]:
            raise CheckpointError(
                f"{out} already holds a conversion with method={old.get('method')} group_size={old.get('group_size')} "
                f"of another source or shape; pick a new --output or delete it")
        manifest["layers"] = {k: v for k, v in old["layers"].items() if (out / v["file"]).is_file()}
    todo = [l for l in layers if str(l) not in manifest["layers"]]
    if len(todo) < len(layers):
        logger.info("resuming conversion in %s: %d of %d layers already done", out, len(layers) - len(todo), len(layers))
    bar = tqdm(total=len(layers), initial=len(layers) - len(todo), unit="layer", desc=f"convert {method}",
               disable=not progress)
    read_bytes, start = 0, time.perf_counter()
    for layer in todo:
        gate_up = empty_quantized(method, group_size, (n_experts,), 2 * inter, hidden)
        down = empty_quantized(method, group_size, (n_experts,), hidden, inter)
        stacks: dict[str, torch.Tensor] = {}  # a checkpoint that stacks the layer's experts: each tensor read once
        for e in range(n_experts):
            gate, up, dn = (_expert_matrix(reader, cfg, layer, e, p, stacks) for p in _PROJS)
            if gate.shape != (inter, hidden) or up.shape != (inter, hidden) or dn.shape != (hidden, inter):
                raise CheckpointError(f"layer {layer} expert {e}: shapes {tuple(gate.shape)}, {tuple(up.shape)}, "
                                      f"{tuple(dn.shape)} do not match config ({inter}, {hidden}) / ({hidden}, {inter})")
            quantize_into(gate_up, (e, slice(0, inter)), gate)  # straight into the stack's halves: no concatenation
            quantize_into(gate_up, (e, slice(inter, 2 * inter)), up)
            quantize_into(down, (e,), dn)
            read_bytes += 3 * inter * hidden * _source_bytes(reader, cfg.expert_weight_name(layer, e, "gate"))
        name = f"layer_{layer:03d}.safetensors"
        tmp = out / (name + ".tmp")
        save_file(_layer_tensors(gate_up, down), str(tmp), metadata={"method": method, "group_size": str(group_size)})
        os.replace(tmp, out / name)
        manifest["layers"][str(layer)] = {"file": name, "experts": n_experts}
        _write_json_atomic(manifest_path, manifest)
        bar.update(1)
        bar.set_postfix(GBps=f"{read_bytes / max(time.perf_counter() - start, 1e-9) / 1e9:.2f}")
    bar.close()
    manifest["complete"] = True
    _write_json_atomic(manifest_path, manifest)
    return manifest_path


def _expert_matrix(reader: CheckpointReader, cfg, layer: int, expert: int, proj: str,
                   stacks: dict[str, torch.Tensor]) -> torch.Tensor:
    """An expert's [out, in] matrix as stored: its own tensor, or its columns of a stacked one (cfg.stacked_expert,
    read once into `stacks`)."""
    stacked = cfg.stacked_expert(layer, expert, proj)
    if stacked is None:
        return _source_tensor(reader, cfg.expert_weight_name(layer, expert, proj))
    if stacked.name not in stacks:
        stacks[stacked.name] = _source_tensor(reader, stacked.name)
    return stacked.take(stacks[stacked.name], expert).contiguous()


def _source_tensor(reader: CheckpointReader, name: str) -> torch.Tensor:
    """An expert weight as stored (bf16 stays bf16: the quantizer reads its bits), FP8 dequantized to fp32."""
    return reader.get(name) if reader.is_fp8(name) else reader.get_raw(name)


def _source_bytes(reader: CheckpointReader, name: str) -> int:
    """Bytes per element as stored, for the GB/s display: 1 for FP8, else 2 (checkpoints are bf16)."""
    return 1 if reader.is_fp8(name) else 2


def read_manifest(weight_dir: str | Path) -> dict:
    path = Path(weight_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{weight_dir} has no {MANIFEST}: run `ktlite convert` into it first")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {manifest.get('format_version')}, this ktlite reads "
                              f"{FORMAT_VERSION}; convert again")
    return manifest


def load_converted(weight_dir: str | Path, moe: CPUMoE, config: Mapping,
                   cpu_experts: Mapping[int, Sequence[int]] | None = None) -> None:
    """Fill `moe` with the converted experts of every MoE layer of `config` (config.json as a dict).

    cpu_experts[layer] lists the experts that run on CPU (layers not listed, or None: all); only those
    are read.
    Raises CheckpointError when method, group size, shapes or layers do not match.
    """
    manifest = read_manifest(weight_dir)
    if manifest["method"] != moe.method or manifest["group_size"] != moe.group_size:
        raise CheckpointError(
            f"{weight_dir} holds method={manifest['method']} group_size={manifest['group_size']}, but "
            f"--kt-method {moe.method} with group size {moe.group_size} was asked for; convert again or change the flags")
    n_experts, hidden, inter = _dims(config)
    got = (manifest["n_routed_experts"], manifest["hidden_size"], manifest["moe_intermediate_size"])
    if got != (n_experts, hidden, inter):
        raise CheckpointError(f"{weight_dir} was converted for (experts, hidden, moe_intermediate) = {got}, "
                              f"the model has {(n_experts, hidden, inter)}")
    for layer in moe_layer_indices(config):
        entry = manifest["layers"].get(str(layer))
        path = Path(weight_dir) / entry["file"] if entry else None
        if path is None or not path.is_file():
            raise CheckpointError(f"{weight_dir} has no converted experts for layer {layer}; "
                                  f"finish `ktlite convert` (it resumes) first")
        stored = moe.reserve_layer(layer, n_experts, hidden, inter, None if cpu_experts is None else cpu_experts.get(layer))
        with safe_open(path, framework="pt") as f:
            for key, qw in (("gate_up", stored.gate_up), ("down", stored.down)):
                for part, dst in (("qweight", qw.qweight), ("scales", qw.scales)):
                    sl = f.get_slice(f"{key}.{part}")
                    shape = tuple(sl.get_shape())
                    if shape[1:] != dst.shape[1:] or shape[0] != n_experts:
                        raise CheckpointError(f"{path}: {key}.{part} has shape {shape}, expected "
                                              f"{(n_experts, *dst.shape[1:])} for method {moe.method}")
                    for slot, e in enumerate(stored.experts.tolist()):
                        t = sl[e:e + 1]
                        dst[slot] = (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16
                                     else t.numpy())[0]
