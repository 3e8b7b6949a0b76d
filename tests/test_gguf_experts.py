"""--kt-method LLAMAFILE: routed experts from a GGUF written with the `gguf` package stay in their GGML
types (Q4_K, Q5_K, Q6_K, Q8_0), decode bit for bit like `gguf.quants.dequantize`, and the CPU experts'
outputs equal the MoE on those dequantized weights; other types are converted with one warning each."""

from __future__ import annotations

import json
import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from safetensors.torch import load_file, save_file

from ktlite import Engine
from ktlite.config import EngineConfig
from ktlite.errors import CheckpointError, ConfigError
from ktlite.kernels.cpu.gguf_quants import BLOCKS
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.kernels.triton.reference import fused_moe_torch
from ktlite.runtime.expert_sources import GGUFSource, open_source
from ktlite.runtime.models import load_config
from ktlite.runtime.tiny_model import _COMMON, ARCH_CONFIGS, write_tiny_model

H = I = 256  # K-quants hold whole 256-weight blocks
E, TOP_K = 8, 3
LAYERS = {1: ("Q4_K", "Q4_K", "Q6_K"), 2: ("Q8_0", "Q8_0", "Q5_K")}  # (gate, up, down) per MoE layer


def blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random [E, n, k] weights in GGML type `kind` as the file's bytes [E, n, bytes]. gguf-py quantizes
    Q8_0 itself; K-quant blocks are assembled here: any bytes are valid codes and packed scales, with
    the float16 d (and dmin) set to small finite values."""
    if kind == "Q8_0":
        return gguf.quants.quantize((rng.standard_normal((E, n, k)) * 0.05).astype(np.float32), T.Q8_0)
    dtype, qk = BLOCKS[kind]
    raw = rng.integers(0, 256, (E, n, k // qk * dtype.itemsize), dtype=np.uint8)
    b = raw.view(dtype)
    d = np.float16(rng.uniform(-2e-3, 2e-3, b.shape))
    b["d"] = np.where(rng.random(b.shape) < 0.2, np.float16(-3e-6), d).view(np.uint16)  # some subnormal
    if "dmin" in dtype.names:
        b["dmin"] = np.float16(rng.uniform(0, 2e-3, b.shape)).view(np.uint16)
    return raw


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, T]]) -> None:
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def expert_tensors(layers: dict[int, tuple[str, str, str]], seed: int = 0) -> dict[str, tuple[np.ndarray, T]]:
    rng = np.random.default_rng(seed)
    out = {}
    for layer, kinds in layers.items():
        for proj, kind, (n, k) in zip(("gate", "up", "down"), kinds, ((I, H), (I, H), (H, I))):
            data = blocks(kind, n, k, rng) if kind in BLOCKS else (rng.standard_normal((E, n, k)) * 0.05).astype(
                np.float16 if kind == "F16" else np.float32)
            out[f"blk.{layer}.ffn_{proj}_exps.weight"] = (data if kind in BLOCKS else
                                                          gguf.quants.quantize(data, T[kind]) if kind != "F16" else data,
                                                          T[kind])
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """config.json of a 3-layer model with 256-wide experts (MoE layers 1 and 2) and its GGUF experts."""
    root = tmp_path_factory.mktemp("gguf")
    raw = {**_COMMON, **ARCH_CONFIGS["deepseek_v3"], "hidden_size": H, "moe_intermediate_size": I,
           "n_routed_experts": E, "n_group": 4, "topk_group": 2, "num_experts_per_tok": TOP_K, "vocab_size": 1024}
    (root / "config.json").write_text(json.dumps(raw))
    write_gguf(root / "experts.gguf", expert_tensors(LAYERS))
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(a tiny checkpoint with 256-wide experts, its GGUF experts, the checkpoint with those experts
    replaced by gguf's dequantization of them: what transformers runs as the reference)."""
    root = tmp_path_factory.mktemp("gguf_engine")
    widths = {"hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E, "n_group": 4, "topk_group": 2,
              "num_experts_per_tok": TOP_K}
    model = write_tiny_model(root / "model", "deepseek_v3", overrides=widths)
    write_gguf(root / "experts.gguf", expert_tensors(LAYERS, seed=1))
    cfg = load_config(model)
    tensors = load_file(str(model / "model.safetensors"))
    for layer in LAYERS:
        w13, w2 = reference(root / "experts.gguf", layer)
        for e in range(E):
            gate, up = w13[e].split(I)
            for proj, w in zip(("gate", "up", "down"), (gate, up, w2[e])):
                tensors[cfg.expert_weight_name(layer, e, proj)] = w.contiguous()
    plain = root / "plain"
    plain.mkdir()
    save_file(tensors, str(plain / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (plain / f).write_bytes((model / f).read_bytes())
    return model, root / "experts.gguf", plain


@pytest.mark.parametrize("gpu_experts", [0, 3])
def test_engine_serves_gguf_experts_like_transformers_on_their_dequantization(served, gpu_experts):
    """The engine with --kt-method LLAMAFILE (experts from the GGUF, the rest from the checkpoint) equals
    transformers on the dequantized experts: logits within 1e-4 in fp32 and the same greedy tokens,
    with the CPU decoding the blocks and GPU experts taking the same values."""
    from hf_checkpoints import hf_last_logits_and_greedy, hf_model
    from test_tensor_parallel import logits_of

    model, experts, plain = served
    ref = hf_model(plain)
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(4, ref.config.vocab_size, (n,), generator=g).tolist() for n in (4, 19)]
    flags = {"dtype": "float32", "max_total_tokens": 1024, "chunked_prefill_size": 256, "gpu_memory": "1GiB"}
    greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    with Engine(str(model), **flags, kt_method="LLAMAFILE", kt_weight_path=str(experts),
                kt_num_gpu_experts=gpu_experts) as eng:
        assert {l: eng.runtime.cpu_moe.layers[l].down.method for l in LAYERS} == {l: k[2] for l, k in LAYERS.items()}
        got = logits_of(eng, batch)
        tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=greedy)]
    want, expected = hf_last_logits_and_greedy(ref, batch, 8)
    assert (got - want).abs().max().item() <= 1e-4
    assert tokens == expected


def reference(path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) by gguf's own reader and dequantization."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    w = {p: torch.from_numpy(gguf.quants.dequantize(tensors[f"blk.{layer}.ffn_{p}_exps.weight"].data,
                                                    tensors[f"blk.{layer}.ffn_{p}_exps.weight"].tensor_type).copy())
         for p in ("gate", "up", "down")}
    return torch.cat([w["gate"], w["up"]], dim=1), w["down"]


def test_gguf_experts_kept_in_their_types_equal_gguf_dequantize(model_dir):
    cfg = load_config(model_dir)
    source = open_source(EngineConfig(model_path=str(model_dir), kt_method="LLAMAFILE",
                                      kt_weight_path=str(model_dir / "experts.gguf")), cfg)
    assert isinstance(source, GGUFSource)
    with CPUMoE("LLAMAFILE", prefill_dtype=torch.float32) as cpu:
        source.fill(cpu, {}, progress=False)
        cpu.warmup()
        g = torch.Generator().manual_seed(0)
        for layer, (gate, _, down) in LAYERS.items():
            stored = cpu.layers[layer]
            assert (stored.gate_up.method, stored.down.method) == (gate, down)
            w13, w2 = reference(model_dir / "experts.gguf", layer)
            for e in (0, 5):  # the kernels' decoder, bit for bit
                got13, got2 = cpu.dequantized_expert(layer, e)
                assert torch.equal(got13, w13[e]) and torch.equal(got2, w2[e])
            # GEMV on the blocks (decode, and up to the fp32 crossover) and dequantize + matmul (~60 per expert)
            for t in (1, 3, 40, 160):
                x = torch.randn(t, H, generator=g)
                ids = torch.rand(t, E, generator=g).topk(TOP_K, dim=1).indices
                weights = torch.rand(t, TOP_K, generator=g)
                want = fused_moe_torch(x, w13, w2, ids, weights)
                # fp32 sums in another order: rounding relative to the outputs' scale (K-quant blocks subtract
                # their mins from the scaled codes, so single outputs can be far smaller than the terms)
                scale = want.abs().max().item()
                torch.testing.assert_close(cpu.forward(layer, x, ids, weights), want, atol=1e-6 * scale, rtol=1e-4)


def test_split_gguf_files_are_read_together(model_dir, tmp_path):
    tensors = expert_tensors(LAYERS)
    parts = [{k: v for k, v in tensors.items() if k.startswith(f"blk.{layer}.")} for layer in LAYERS]
    for i, part in enumerate(parts, 1):
        write_gguf(tmp_path / f"m-{i:05d}-of-00002.gguf", part)
    cfg = load_config(model_dir)
    for path in (tmp_path / "m-00001-of-00002.gguf", tmp_path):  # the first part, or the folder
        with CPUMoE("LLAMAFILE") as cpu:
            GGUFSource(cfg, path).fill(cpu, {1: [0, 1]}, progress=False)
            assert cpu.layers[1].experts.tolist() == list(range(2, E))
            assert torch.equal(cpu.dequantized_expert(2, 4)[1], reference(model_dir / "experts.gguf", 2)[1][4])
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        GGUFSource(cfg, tmp_path / "m-00001-of-00002.gguf")


def test_types_without_a_kernel_are_converted_with_one_warning_each(model_dir, tmp_path, caplog):
    layers = {1: ("Q5_0", "Q5_0", "F16"), 2: ("Q5_0", "Q5_0", "Q6_K")}
    write_gguf(tmp_path / "odd.gguf", expert_tensors(layers, seed=1))
    caplog.set_level(logging.WARNING, logger="ktlite.runtime.expert_sources")
    source = GGUFSource(load_config(model_dir), tmp_path / "odd.gguf")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2
    assert "blk.1.ffn_gate_exps.weight is Q5_0" in warnings[0] and "again as INT8" in warnings[0]
    assert "blk.1.ffn_down_exps.weight is F16" in warnings[1] and "again as BF16" in warnings[1]
    with CPUMoE("LLAMAFILE") as cpu:
        source.fill(cpu, {}, progress=False)
        assert (cpu.layers[1].gate_up.method, cpu.layers[1].down.method) == ("INT8", "BF16")
        assert (cpu.layers[2].gate_up.method, cpu.layers[2].down.method) == ("INT8", "Q6_K")
        w13, _ = reference(tmp_path / "odd.gguf", 1)
        err = (cpu.dequantized_expert(1, 0)[0] - w13[0]).norm() / w13[0].norm()
        assert 0 < err < 0.01  # re-quantized: close, not equal


def test_names_and_shapes_are_checked_against_config_json(model_dir, tmp_path):
    cfg = load_config(model_dir)
    write_gguf(tmp_path / "one.gguf", {k: v for k, v in expert_tensors(LAYERS).items() if k.startswith("blk.1.")})
    with pytest.raises(CheckpointError, match="no 'blk.2.ffn_gate_exps.weight'.*MoE layer 2"):
        GGUFSource(cfg, tmp_path / "one.gguf")
    tensors = expert_tensors(LAYERS)
    tensors["blk.2.ffn_down_exps.weight"] = (blocks("Q6_K", H // 2, I, np.random.default_rng(0)), T.Q6_K)
    write_gguf(tmp_path / "bad.gguf", tensors)
    with pytest.raises(CheckpointError, match=r"blk.2.ffn_down_exps.weight has dims \(256, 128, 8\).*\(256, 256, 8\)"):
        GGUFSource(cfg, tmp_path / "bad.gguf")
    bare = tmp_path / "hf"  # an HF folder without GGUF files
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="LLAMAFILE reads GGUF"):
        open_source(EngineConfig(model_path=str(bare), kt_method="LLAMAFILE"), cfg)
