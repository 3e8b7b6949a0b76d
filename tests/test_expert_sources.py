"""--kt-method / --kt-weight-path choose where the CPU experts come from (runtime/expert_sources.py):
FP8 and BF16 experts kept as the HF checkpoint stores them, and the errors that name what fits."""

from __future__ import annotations

import json
import shutil

import numba
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ktlite import Engine
from ktlite.errors import ConfigError
from ktlite.kernels.cpu.fp8 import E4M3
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.kernels.triton.reference import fp8_dequantize
from ktlite.runtime.expert_sources import HFSource, open_source
from ktlite.runtime.loader import CheckpointReader
from ktlite.runtime.models import load_config
from ktlite.runtime.tiny_model import _COMMON, ARCH_CONFIGS, _fp8_quantize
from hf_checkpoints import hf_last_logits_and_greedy, hf_model
from test_tensor_parallel import logits_of

GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
EXACT = {"dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 512, "gpu_memory": "1GiB"}


def prompts(vocab: int, lengths=(5, 17, 30, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def dequantized_copy(tiny_v3_fp8, tmp_path_factory):
    """The FP8 checkpoint with every weight dequantized to fp32: what transformers runs as the reference."""
    out = tmp_path_factory.mktemp("fp8_dequantized")
    reader = CheckpointReader(tiny_v3_fp8)
    save_file({n: reader.get(n, torch.float32) for n in reader.names()}, str(out / "model.safetensors"))
    config = json.loads((tiny_v3_fp8 / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_v3_fp8 / f, out / f)
    return out


@pytest.mark.parametrize("gpu_experts", [0, 5])
def test_fp8_experts_served_as_fp8_equal_transformers_on_dequantized_weights(tiny_v3_fp8, dequantized_copy, gpu_experts):
    ref = hf_model(dequantized_copy)
    batch = prompts(ref.config.vocab_size)
    with Engine(str(tiny_v3_fp8), **EXACT, kt_method="FP8", kt_weight_path=str(tiny_v3_fp8),
                kt_num_gpu_experts=gpu_experts) as eng:
        cpu = eng.runtime.cpu_moe
        assert all(l.gate_up.qweight.dtype == E4M3 and l.down.qweight.dtype == E4M3 for l in cpu.layers.values())
        got = logits_of(eng, batch)
        tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    want, expected = hf_last_logits_and_greedy(ref, batch, 12)
    assert (got - want).abs().max().item() <= 1e-4
    assert tokens == expected


def test_fp8_experts_dequantize_bit_exactly_like_the_gpu_path(tiny_v3_fp8):
    """Every stored FP8 expert decodes to fp8_dequantize's values (e4m3 * scale, one fp32 rounding), and
    dynamic placement refills a CPU slot from the checkpoint, not by re-quantizing."""
    cfg = load_config(tiny_v3_fp8)
    reader = CheckpointReader(tiny_v3_fp8)
    source = HFSource(cfg, tiny_v3_fp8, "FP8")
    with CPUMoE("FP8") as cpu:
        source.fill(cpu, {l: [3] for l in cfg.moe_layers}, progress=False)
        assert cpu.native_fill is not None
        layer = cfg.moe_layers[0]
        for e in (0, 7):
            gate_up, down = cpu.dequantized_expert(layer, e)
            w = {p: fp8_dequantize(reader.get_raw(n), reader.get_raw(n + "_scale_inv"), torch.float32)
                 for p in ("gate", "up", "down") for n in [cfg.expert_weight_name(layer, e, p)]}
            assert torch.equal(gate_up, torch.cat([w["gate"], w["up"]])) and torch.equal(down, w["down"])
        before = cpu.dequantized_expert(layer, 0)
        cpu.swap_expert(layer, 0, 3, *(torch.zeros(1),) * 3)  # 0 -> device, 3 back; the floats are not used
        after = cpu.dequantized_expert(layer, 3)
        assert all(torch.equal(a, b) for a, b in zip(after, source_fp8(source, layer, 3)))
        assert not torch.equal(after[0], before[0])


def source_fp8(source: HFSource, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up, down = source.dense(layer, expert)
    return torch.cat([gate, up]), down


def test_bf16_experts_are_copied_as_stored(tiny_v3):
    cfg = load_config(tiny_v3)
    reader = CheckpointReader(tiny_v3)
    with CPUMoE("BF16") as cpu:
        open_source(_config(tiny_v3, "BF16"), cfg).fill(cpu, {}, progress=False)
        layer = cfg.moe_layers[-1]
        stored = cpu.layers[layer].gate_up.qweight[2]
        gate = reader.get_raw(cfg.expert_weight_name(layer, 2, "gate"))
        assert gate.dtype == torch.bfloat16
        assert np.array_equal(stored[:cfg.moe_intermediate_size], gate.view(torch.int16).numpy().view(np.uint16))


def _config(path, method: str, weight_path=None):
    from ktlite.config import EngineConfig

    return EngineConfig(model_path=str(path), kt_method=method, kt_weight_path=None if weight_path is None else str(weight_path))


def test_methods_that_do_not_fit_the_weights_are_refused(tiny_v3, tiny_v3_fp8, tmp_path):
    cfg = load_config(tiny_v3)
    with pytest.raises(ConfigError, match="FP8 needs FP8 experts.*BF16"):
        open_source(_config(tiny_v3, "FP8"), cfg)
    with pytest.raises(ConfigError, match="LLAMAFILE reads GGUF"):
        open_source(_config(tiny_v3, "LLAMAFILE"), cfg)
    with pytest.raises(ConfigError, match="RAWINT4 reads compressed-tensors"):
        open_source(_config(tiny_v3, "RAWINT4"), cfg)
    (tmp_path / "kt_amx").mkdir()
    with pytest.raises(ConfigError, match="KTransformers' own converted AMX weights"):
        open_source(_config(tiny_v3, "AMXINT4", tmp_path / "kt_amx"), cfg)
    with pytest.raises(ConfigError, match="no such file"):
        open_source(_config(tiny_v3, "FP8", tmp_path / "missing"), cfg)


def test_bf16_of_fp8_experts_warns_that_it_rounds(tiny_v3_fp8, caplog):
    open_source(_config(tiny_v3_fp8, "BF16"), load_config(tiny_v3_fp8))
    assert any("rounded to bf16" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


_STORE_PROBE = """
import gc, json, sys, tracemalloc
from pathlib import Path
import torch
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.runtime.expert_sources import HFSource
from ktlite.runtime.models import load_config

def tensor_bytes():  # bytes of every live torch tensor (tracemalloc does not see torch's allocator)
    gc.collect()
    return sum(t.untyped_storage().nbytes() for t in gc.get_objects() if isinstance(t, torch.Tensor))

folder = Path(sys.argv[1])
cfg = load_config(folder)
cpu = CPUMoE("FP8")
source = HFSource(cfg, folder, "FP8")
tensors_before = tensor_bytes()
tracemalloc.start(64)
source.fill(cpu, {}, progress=False)
gc.collect()
# numpy's allocations still alive after the fill, less the modules it imported on the way
imports = [tracemalloc.Filter(False, f"<frozen importlib._bootstrap{s}>", all_frames=True) for s in ("", "_external")]
numpy_kept = sum(t.size for t in tracemalloc.take_snapshot().filter_traces(imports).traces)
tracemalloc.stop()
maps = [l for l in open("/proc/self/maps") if str(folder) in l]
print(json.dumps({"stored": cpu.nbytes(), "numpy_kept": numpy_kept, "tensors_kept": tensor_bytes() - tensors_before,
                  "dtypes": sorted({str(a.dtype) for l in cpu.layers.values() for a in (l.gate_up.qweight, l.down.qweight)}),
                  "maps": maps}))
"""


def test_fp8_experts_take_their_fp8_size_in_ram(tmp_path):
    """64 experts of 512 x 512 in block FP8 (48 MiB): the CPU store holds their e4m3 bytes and fp32 scales, and
    filling it leaves nothing else alive: the allocations still live after the fill (numpy's, traced by
    tracemalloc, and torch tensors, counted by the garbage collector) add up to the store's own bytes, not to the
    4x an fp32 copy would take, and no file of the checkpoint stays mapped. Every quantity is counted, not
    sampled from the process's RSS (which moved with the allocator and page cache from machine to machine)."""
    import subprocess
    import sys

    raw = {**_COMMON, **ARCH_CONFIGS["deepseek_v3"], "hidden_size": 512, "moe_intermediate_size": 512,
           "n_routed_experts": 64, "n_group": 4, "num_hidden_layers": 2, "first_k_dense_replace": 1,
           "vocab_size": 1024, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_config(tmp_path)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for e in range(64):
        for p in ("gate", "up", "down"):
            name = cfg.expert_weight_name(1, e, p)
            tensors[name], tensors[name + "_scale_inv"] = _fp8_quantize(torch.randn(512, 512, generator=g))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    del tensors
    fp8_bytes = 64 * 3 * 512 * 512
    out = subprocess.run([sys.executable, "-c", _STORE_PROBE, str(tmp_path)], capture_output=True, text=True,
                         check=True, timeout=300)
    probe = json.loads(out.stdout)
    assert probe["stored"] == fp8_bytes + 64 * 3 * 512 * 4 * 4  # + fp32 scales: 4 groups of 128 per row
    assert probe["dtypes"] == [str(E4M3)]
    # the store itself plus bookkeeping (index arrays, Python objects): far below one fp32 expert (1 MiB)
    assert probe["stored"] <= probe["numpy_kept"] < probe["stored"] + (1 << 20), probe
    assert probe["tensors_kept"] < (1 << 20), probe
    assert probe["maps"] == []


def test_every_e4m3_code_decodes_exactly():
    """All 254 finite e4m3 codes (subnormals included) x a block scale, through the kernels' decoder (fp32, and
    bf16 for the prefill path), against torch's float8_e4m3fn -> fp32 (the GPU path's fp8_dequantize)."""
    from ktlite.kernels.cpu.fp8 import fill_fp8_rows
    from ktlite.kernels.cpu.gemm import dequant_matrix
    from ktlite.kernels.cpu.quant import dequantize, empty_quantized

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] * 2, dtype=torch.uint8).reshape(4, 127)
    scale = torch.tensor([[0.37]])
    qw = empty_quantized("FP8", 128, (), 4, 127)
    fill_fp8_rows(qw.qweight, qw.scales, codes.numpy(), scale.numpy(), (128, 128))
    want = fp8_dequantize(codes.view(torch.float8_e4m3fn), scale, torch.float32)
    assert torch.equal(dequantize(qw), want)
    scratch = np.empty((numba.config.NUMBA_NUM_THREADS, 2, 128), np.float32)
    bf16 = dequant_matrix(qw.qweight, qw.scales, 7, 128, 127, torch.bfloat16, scratch)
    assert torch.equal(bf16.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
