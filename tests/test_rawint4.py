"""--kt-method RAWINT4: compressed-tensors pack-quantized INT4 experts (Kimi-K2-Thinking's format, written
here by the `compressed-tensors` package) load into the CPU INT4 store and the GPU INT4 fused MoE with the
same codes and scales, and the model equals transformers on the decompressed weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import ktlite.kernels.triton as kt

with kt.interpreted():  # before anything imports triton (compressed-tensors does): triton reads it at import
    from ktlite.kernels.triton.moe import fused_moe_triton

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

from ktlite import Engine
from ktlite.config import EngineConfig
from ktlite.errors import ConfigError
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.kernels.triton.reference import fused_moe_torch
from ktlite.runtime.expert_sources import CompressedInt4Source, open_source
from ktlite.runtime.loader import CheckpointReader
from ktlite.runtime.models import load_config
from hf_checkpoints import hf_last_logits_and_greedy, hf_model
from test_tensor_parallel import logits_of

ARGS = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
SCHEME = QuantizationScheme(targets=["Linear"], weights=ARGS)
QUANT_CONFIG = {  # as Kimi-K2-Thinking's config.json has it
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "observer": "minmax"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
EXACT = {"dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 512, "gpu_memory": "1GiB"}


def compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert matrix through compressed-tensors: weight_packed, weight_scale (bf16), weight_shape."""
    groups = w.float().reshape(w.shape[0], -1, 32)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS)
    return PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero}, SCHEME)


def decompress(packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompression, with the bf16 scales widened to fp32 (exact) first."""
    return PackedQuantizationCompressor.decompress({**packed, "weight_scale": packed["weight_scale"].float()},
                                                   SCHEME)["weight"]


EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def write_int4_twins(src: Path, root: Path) -> tuple[Path, Path]:
    """(`src` with its routed experts compressed by compressed-tensors and QUANT_CONFIG in config.json, at the
    top level as the hub's Kimi checkpoints have it; the decompressed twin, for transformers). Tensors keep
    their stored names (a wrapper's too)."""
    packed_dir, plain_dir = root / "int4", root / "decompressed"
    packed, plain = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if EXPERT_WEIGHT.search(name):
            parts = compress(w)
            packed.update({name.removesuffix("weight") + k: v for k, v in parts.items()})
            plain[name] = decompress(parts)
        else:
            packed[name] = plain[name] = w
    config = json.loads((src / "config.json").read_text())
    for folder, tensors, extra in ((packed_dir, packed, {"quantization_config": QUANT_CONFIG}), (plain_dir, plain, {})):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / f, folder / f)
    return packed_dir, plain_dir


@pytest.fixture(scope="module")
def kimi(tiny_v3, tmp_path_factory):
    """(compressed-tensors checkpoint, its decompressed twin for transformers)."""
    return write_int4_twins(tiny_v3, tmp_path_factory.mktemp("kimi"))


@pytest.mark.parametrize("flags", [
    {"kt_num_gpu_experts": 0},
    {"kt_num_gpu_experts": 5},
    # experts move between the INT4 stacks and the CPU store mid-run; long chunks run layerwise on the device
    {"kt_num_gpu_experts": 4, "kt_enable_dynamic_expert_update": True, "kt_expert_update_interval": 3,
     "kt_gpu_prefill_token_threshold": 16},
], ids=["cpu", "gpu5", "dynamic+layerwise"])
def test_rawint4_model_equals_transformers_on_the_decompressed_weights(kimi, flags):
    packed, plain = kimi
    ref = hf_model(plain)
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(4, ref.config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 30)]
    with Engine(str(packed), **EXACT, kt_method="RAWINT4", **flags) as eng:
        layer = next(iter(eng.runtime.cpu_moe.layers.values()))
        assert (layer.gate_up.method, layer.gate_up.group_size) == ("INT4", 32)
        before = eng.runtime.placement()
        got = logits_of(eng, batch)
        tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        if flags["kt_num_gpu_experts"]:  # the GPU experts hold the checkpoint's INT4 codes, planned at their size
            check_gpu_int4_stacks(eng, packed)
        if flags.get("kt_enable_dynamic_expert_update"):
            assert eng.runtime.placement() != before  # experts really moved mid-run
    want, expected = hf_last_logits_and_greedy(ref, batch, 12)
    assert (got - want).abs().max().item() <= 1e-4
    assert tokens == expected


def check_gpu_int4_stacks(eng: Engine, packed) -> None:
    """Each MoE layer's GPU stacks are INT4 group 32 with the checkpoint's codes, and the plan counted
    them at that size (half a byte per weight plus an fp32 scale per 32), as allocated."""
    cfg = load_config(packed)
    source = CompressedInt4Source(cfg, packed)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    for l, moe in eng.runtime.moe_layers.items():
        assert (moe.w13.bits, moe.w13.group_size, moe.w2.bits) == (4, 32, 4)
        w13, w2 = source.gpu_weights(l, moe.gpu_experts)
        assert torch.equal(moe.w13.qweight, w13.qweight) and torch.equal(moe.w2.scales, w2.scales)
    plan = eng.runtime.plan
    per_expert = 3 * h * i // 2 + 3 * h * i // 32 * 4
    assert plan.bytes("gpu_experts") == plan.gpu_experts_total * len(cfg.moe_layers) * per_expert
    assert plan.allocated()["gpu_experts"] == plan.bytes("gpu_experts")


def test_cpu_store_holds_the_checkpoint_values_exactly(kimi):
    packed, plain = kimi
    cfg = load_config(packed)
    ref = CheckpointReader(plain)
    with CPUMoE("RAWINT4", prefill_dtype=torch.float32) as cpu:  # fp32: the exact prefill path
        CompressedInt4Source(cfg, packed).fill(cpu, {}, progress=False)
        layer = cfg.moe_layers[-1]
        for e in (0, 9):
            gate_up, down = cpu.dequantized_expert(layer, e)
            w = [ref.get(cfg.expert_weight_name(layer, e, p)) for p in ("gate", "up", "down")]
            assert torch.equal(gate_up, torch.cat(w[:2])) and torch.equal(down, w[2])
        # the experts' outputs, decode (GEMV) and prefill (dequantize + matmul) paths, vs the decompressed math
        g = torch.Generator().manual_seed(0)
        for t in (1, 24):
            x = torch.randn(t, cfg.hidden_size, generator=g)
            ids = torch.rand(t, cfg.n_routed_experts, generator=g).topk(4, dim=1).indices
            weights = torch.rand(t, 4, generator=g)
            dense = [cpu.dequantized_expert(layer, e) for e in range(cfg.n_routed_experts)]
            want = fused_moe_torch(x, torch.stack([d[0] for d in dense]), torch.stack([d[1] for d in dense]), ids, weights)
            torch.testing.assert_close(cpu.forward(layer, x, ids, weights), want, atol=1e-5, rtol=1e-5)


def test_gpu_int4_fused_moe_takes_the_same_codes(kimi, monkeypatch):
    """The GPU INT4 format built from the checkpoint (no re-quantization), through the Triton kernel under the
    interpreter, equals the fused MoE on the decompressed weights."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    packed, _ = kimi
    cfg = load_config(packed)
    source = CompressedInt4Source(cfg, packed)
    layer, experts = cfg.moe_layers[0], list(range(cfg.n_routed_experts))
    w13, w2 = source.gpu_weights(layer, experts)
    dense = [source.dense(layer, e) for e in experts]
    d13 = torch.stack([torch.cat([g, u]) for g, u, _ in dense])
    d2 = torch.stack([d for _, _, d in dense])
    assert torch.equal(kt.dequantize_expert(w13, 3, torch.float32), d13[3])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, cfg.hidden_size, generator=g)
    ids = torch.rand(6, len(experts), generator=g).topk(4, dim=1).indices.to(torch.int32)
    weights = torch.rand(6, 4, generator=g)
    want = fused_moe_torch(x, d13, d2, ids, weights)
    got = fused_moe_triton(x, w13, w2, ids, weights, block_m=16, block_n=64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_other_compressed_tensors_schemes_are_refused(kimi, tmp_path):
    packed, _ = kimi
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(packed / f, tmp_path / f)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="symmetric, group 32"):
        open_source(EngineConfig(model_path=str(tmp_path), kt_method="RAWINT4"), load_config(tmp_path))
