"""MX expert weights kept as stored: MXFP4 (gpt-oss `*_blocks`), FP4 (DeepSeek-V4's per-expert e2m1 + ue8m0) and
MXFP8 (e4m3 + e8m0 per 32). References are transformers' own dequantizers: `convert_moe_packed_tensors`
(integrations/mxfp4.py, gpt-oss) and `Fp8Dequantize._dequantize_one` (integrations/finegrained_fp8.py: the FP4
path DeepSeek-V4's experts load through, and the mxfp8 quantizer's); MXFP8 weights are quantized by transformers'
`Fp8Quantize` (ue8m0 scales, [1, 32] blocks). transformers has no quantizer for e2m1 that runs here (gpt-oss's needs
the triton_kernels hub), so FP4 weights are rounded here to the nearest e2m1 value under the OCP MX v1.0 shared
scale 2^(floor(log2 amax) - 2); the codes are what the tests read, whatever rounded them. The layouts are written
into a DeepSeek-V3 checkpoint (the families that ship them are built elsewhere)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numba
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from ktlite import Engine
from ktlite.config import EngineConfig
from ktlite.errors import CheckpointError, ConfigError
from ktlite.kernels.cpu.gemm import dequant_matrix, expert_mlp_matmul, stored_matmul
from ktlite.kernels.cpu.linear_kernels import linear_rows
from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.kernels.cpu.mx import MXFP8_MAX_SCALE_BYTE, fill_mx_rows
from ktlite.kernels.cpu.quant import dequantize, empty_quantized, matrix_bytes, normalize_kt_method
from ktlite.runtime.expert_sources import PROJS, MXSource, open_source
from ktlite.runtime.knobs import cpu_expert_bytes
from ktlite.runtime.loader import CheckpointReader
from ktlite.runtime.models import load_config
from ktlite.runtime.models.wrapper import stored_name
from hf_checkpoints import hf_last_logits_and_greedy, hf_model
from test_tensor_parallel import logits_of

EXACT = {"dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 512, "gpu_memory": "1GiB"}
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
THREADS = numba.config.NUMBA_NUM_THREADS


def _finegrained_fp8():
    """transformers.integrations.finegrained_fp8, imported on first use: it imports torch._dynamo, which (imported
    while pytest collects, before test_triton_*.py import their kernels under TRITON_INTERPRET) leaves the Triton
    interpreter unable to run them for the rest of the session."""
    from transformers.integrations import finegrained_fp8

    return finegrained_fp8


def transformers_fp8_path(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' dequantization of per-expert FP4 (int8 codes) or MXFP8 (e4m3) with e8m0 scales, in fp32."""
    return _finegrained_fp8().Fp8Dequantize(None)._dequantize_one(codes, scales, output_dtype=torch.float32)


def transformers_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """transformers' gpt-oss dequantization of `*_blocks` [E, N, K/32, 16] / `*_scales` [E, N, K/32] -> [E, N, K]
    (it returns [E, K, N], the layout of GptOssExperts' parameters)."""
    return convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)


def stored(method: str, codes: np.ndarray, scales: np.ndarray, k: int):
    qw = empty_quantized(method, 32, (), codes.shape[0], k)
    fill_mx_rows(qw.qweight, qw.scales, codes, scales, method)
    return qw


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def test_every_e2m1_code_times_every_e8m0_scale_decodes_as_transformers():
    """Row r holds all 256 bytes (each of the 16 codes in both nibbles) under e8m0 scale r, r = 0..254 (255 is the
    spec's NaN): the CPU decoders (fp32, and bf16 for the prefill path) equal transformers' gpt-oss and DeepSeek-V4
    dequantization bit for bit (signed zeros, subnormal scales and overflow to inf included)."""
    assert FP4_VALUES == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    n, k = 255, 512
    codes = torch.arange(256, dtype=torch.uint8).repeat(n, 2)  # [255, 512] bytes: K = 1024 codes
    k = 2 * codes.shape[1]
    scales = torch.arange(n, dtype=torch.uint8)[:, None].expand(n, k // 32).contiguous()
    qw = stored("MXFP4", codes.numpy(), scales.numpy(), k)
    gpt_oss = transformers_blocks(codes.reshape(1, n, k // 32, 16), scales[None])[0]
    v4 = transformers_fp8_path(codes.view(torch.int8), scales.view(torch.float8_e8m0fnu))
    assert torch.equal(bits(gpt_oss), bits(v4))
    assert torch.equal(bits(dequantize(qw)), bits(gpt_oss))
    scratch = np.empty((THREADS, 2, qw.kp), np.float32)
    bf16 = dequant_matrix(qw.qweight, qw.scales, qw.group_shift, qw.kp, k, torch.bfloat16, scratch)
    assert torch.equal(bits(bf16), bits(transformers_blocks(codes.reshape(1, n, k // 32, 16), scales[None],
                                                            torch.bfloat16)[0]))


def test_every_e4m3_code_times_every_e8m0_scale_decodes_as_transformers():
    """All 254 finite e4m3 codes (subnormals included) under each e8m0 scale 0..246 (MXFP8_MAX_SCALE_BYTE: the kernels
    fold 2^8 into the scale): MXFP8's decoders equal transformers' mxfp8 dequantization (uint8 scales, and
    float8_e8m0fnu ones) bit for bit, fp32 and bf16."""
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    n = MXFP8_MAX_SCALE_BYTE + 1
    codes = torch.cat([finite, finite[:2]]).repeat(n, 1)  # [255, 256]
    k = codes.shape[1]
    scales = torch.arange(n, dtype=torch.uint8)[:, None].expand(n, k // 32).contiguous()
    qw = stored("MXFP8", codes.numpy(), scales.numpy(), k)
    want = transformers_fp8_path(codes.view(torch.float8_e4m3fn), scales)
    assert torch.equal(bits(want), bits(transformers_fp8_path(codes.view(torch.float8_e4m3fn),
                                                              scales.view(torch.float8_e8m0fnu))))
    assert torch.equal(bits(dequantize(qw)), bits(want))
    scratch = np.empty((THREADS, 2, qw.kp), np.float32)
    bf16 = dequant_matrix(qw.qweight, qw.scales, qw.group_shift, qw.kp, k, torch.bfloat16, scratch)
    assert torch.equal(bits(bf16), bits(want.to(torch.bfloat16)))


@pytest.mark.parametrize("byte", [MXFP8_MAX_SCALE_BYTE + 1, 254])
def test_mxfp8_scales_the_kernels_cannot_hold_are_refused(byte):
    codes = np.zeros((2, 64), np.uint8)
    scales = np.full((2, 2), 120, np.uint8)
    scales[1, 1] = byte
    with pytest.raises(CheckpointError, match=f"scale byte {byte}"):
        stored("MXFP8", codes, scales, 64)


def fp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes uint8 [N, K/2], low nibble the even k; e8m0 scales uint8 [N, K/32]): OCP MX's shared
    scale 2^(floor(log2 amax) - 2) per 32 weights and the nearest e2m1 value."""
    blocks = w.float().reshape(w.shape[0], -1, 32)
    power = torch.floor(torch.log2(blocks.abs().amax(-1).clamp_min(2.0**-100))) - 2
    table = torch.tensor(FP4_VALUES)
    idx = ((blocks / torch.exp2(power)[..., None])[..., None] - table).abs().argmin(-1).to(torch.uint8)
    codes = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return codes.reshape(w.shape[0], -1), (power + 127).to(torch.uint8)


def mxfp8_quantize(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' mxfp8 quantization of one weight: e4m3 and `weight_scale_inv` (float8_e8m0fnu) per [1, 32]."""
    config = FineGrainedFP8Config(weight_block_size=(1, 32), scale_fmt="ue8m0")
    return _finegrained_fp8().Fp8Quantize(SimpleNamespace(quantization_config=config))._quantize_one(name, w)


def random_weights(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("method", ["MXFP4", "MXFP8"])
def test_row_kernels_equal_a_matmul_over_transformers_weights(method):
    """Decode rows (T = 1, 2: dotted from the stored bytes; T = 4: each row decoded once) and the prefill path
    (dequantize + torch.matmul, fp32) on K = 160 (padded to 192) equal x @ W^T in float64 over transformers'
    dequantized W within fp32 rounding."""
    n, k = 40, 160
    w = random_weights(n, k, 1)
    if method == "MXFP4":
        codes, scales = fp4_quantize(w)
        ref = transformers_fp8_path(codes.view(torch.int8), scales.view(torch.float8_e8m0fnu))
    else:
        parts = mxfp8_quantize("w.weight", w)
        codes, scales = parts["w.weight"].view(torch.uint8), parts["w.weight_scale_inv"].view(torch.uint8)
        ref = transformers_fp8_path(parts["w.weight"], parts["w.weight_scale_inv"])
    qw = stored(method, codes.numpy(), scales.numpy(), k)
    q, s = qw.qweight[None], qw.scales[None]  # a stack of one matrix
    for t in (1, 2, 4):
        x = torch.randn(t, 1, k, generator=torch.Generator().manual_seed(t))
        out = np.empty((t, 1, n), np.float32)
        linear_rows(x.numpy(), q, s, qw.group_shift, qw.kp, False, THREADS, out)
        want = x[:, 0].double() @ ref.double().T
        bound = 1e-6 * (x[:, 0].abs().double() @ ref.abs().double().T) + 1e-30
        assert ((torch.from_numpy(out[:, 0]).double() - want).abs() <= bound).all(), t
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(9))
    res = torch.empty(7, n)
    stored_matmul(x, qw.qweight, qw.scales, qw.group_shift, qw.kp, k, np.empty((THREADS, 2, qw.kp), np.float32),
                  torch.empty(n * k), res)
    bound = 1e-6 * (x.abs().double() @ ref.abs().double().T)
    assert ((res.double() - x.double() @ ref.double().T).abs() <= bound).all()


def _per_expert_fp4(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """DeepSeek-V4's FP4 expert tensors (`weight` int8 [N, K/2], `scale` float8_e8m0fnu [N, K/32]) and
    transformers' dequantization of them; down weights as torch's float4_e2m1fn_x2 (safetensors F4, whose header
    counts codes, not bytes), the other dtype transformers reads them in."""
    codes, scales = fp4_quantize(w)
    codes = codes.view(torch.float4_e2m1fn_x2 if ".down_proj." in name else torch.int8)
    packed = {name: codes, name.removesuffix("weight") + "scale": scales.view(torch.float8_e8m0fnu)}
    return packed, transformers_fp8_path(codes, scales.view(torch.float8_e8m0fnu))


def _per_expert_mxfp8(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    packed = mxfp8_quantize(name, w)
    return packed, transformers_fp8_path(packed[name], packed[name + "_scale_inv"])


def _gpt_oss_blocks(cfg, reader: CheckpointReader) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """gpt-oss's MXFP4 layout of every MoE layer's experts (`*_proj_blocks` / `*_proj_scales`, gate and up rows
    interleaved) and transformers' dequantization of it back into per-expert weights."""
    packed, plain = {}, {}
    for layer in cfg.moe_layers:
        prefix = cfg.expert_weight_name(layer, 0, "gate").split(".experts.")[0] + ".experts"
        for fused, projs in (("gate_up", ("gate", "up")), ("down", ("down",))):
            mats = [torch.stack([reader.get_raw(cfg.expert_weight_name(layer, e, p)) for p in projs], 1)
                    .reshape(-1, reader.get_raw(cfg.expert_weight_name(layer, e, projs[0])).shape[1])
                    for e in range(cfg.n_routed_experts)]  # [2I, H] rows gate_0, up_0, gate_1, ...
            quantized = [fp4_quantize(m) for m in mats]
            blocks = torch.stack([c.reshape(c.shape[0], -1, 16) for c, _ in quantized])
            scales = torch.stack([s for _, s in quantized])
            packed[f"{prefix}.{fused}_proj_blocks"], packed[f"{prefix}.{fused}_proj_scales"] = blocks, scales
            dense = transformers_blocks(blocks, scales)
            for i, p in enumerate(projs):
                for e in range(cfg.n_routed_experts):
                    plain[cfg.expert_weight_name(layer, e, p)] = dense[e, i::len(projs)].contiguous()
    return packed, plain


LAYOUT_BUILDERS = {"FP4": _per_expert_fp4, "MXFP8": _per_expert_mxfp8}


def write_mx_twins(checkpoint: Path, root: Path, layouts: tuple[str, ...]) -> dict[str, tuple[Path, Path]]:
    """{layout: (MX checkpoint, its dequantized twin for transformers)} of a checkpoint with one tensor per expert,
    written back under its stored names (a wrapper's too: the reader knows them by the model's); MXFP4 (gpt-oss
    blocks) from DeepSeek-V3's names."""
    reader = CheckpointReader(checkpoint)
    cfg = load_config(checkpoint)
    experts = {cfg.expert_weight_name(l, e, p) for l in cfg.moe_layers for e in range(cfg.n_routed_experts)
               for p in ("gate", "up", "down")}
    dense = {name: reader.get_raw(name) for name in reader.names() if name not in experts}
    config = json.loads((checkpoint / "config.json").read_text())
    out = {}
    for layout in layouts:
        if layout == "MXFP4":
            packed, plain = _gpt_oss_blocks(cfg, reader)
            extra = {"quantization_config": {"quant_method": "mxfp4"}}  # gpt-oss's: experts only
        else:
            packed, plain, extra = {}, {}, {}
            for name in experts:
                packed_one, plain[name] = LAYOUT_BUILDERS[layout](name, reader.get_raw(name))
                packed.update(packed_one)
        for kind, tensors, more in (("packed", packed, extra), ("plain", plain, {})):
            folder = root / f"{layout}-{kind}"
            folder.mkdir()
            save_file({stored_name(cfg.weight_renames, k): v for k, v in {**dense, **tensors}.items()},
                      str(folder / "model.safetensors"))
            (folder / "config.json").write_text(json.dumps({**config, **more}))
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(checkpoint / f, folder / f)
        out[layout] = (root / f"{layout}-packed", root / f"{layout}-plain")
    return out


@pytest.fixture(scope="module")
def mx_checkpoints(tiny_v3, tmp_path_factory):
    """{layout: (MX checkpoint, its dequantized twin for transformers)} from the tiny DeepSeek-V3 checkpoint."""
    return write_mx_twins(tiny_v3, tmp_path_factory.mktemp("mx"), ("MXFP4", "FP4", "MXFP8"))


@pytest.mark.parametrize("layout,method,flags", [
    ("MXFP4", "MXFP4", {"kt_num_gpu_experts": 0}),  # gpt-oss blocks
    ("FP4", "FP4", {"kt_num_gpu_experts": 3}),  # DeepSeek-V4 per-expert FP4, 3 experts a layer in GPU MX stacks
    # experts move between the GPU stacks and the CPU store mid-run; long chunks run layerwise on the device
    ("MXFP8", "MXFP8", {"kt_num_gpu_experts": 3, "kt_enable_dynamic_expert_update": True,
                        "kt_expert_update_interval": 3, "kt_gpu_prefill_token_threshold": 16}),
], ids=["mxfp4-blocks-cpu", "fp4-gpu3", "mxfp8-dynamic+layerwise"])
def test_mx_model_equals_transformers_on_its_dequantized_weights(mx_checkpoints, layout, method, flags):
    """Served with the MX experts kept as stored (decode rows and, for the 30-token prompt, the prefill path; on the
    device side the fused MoE's MX stacks), the model's logits and greedy tokens equal transformers' on the
    checkpoint transformers dequantized."""
    packed, plain = mx_checkpoints[layout]
    ref = hf_model(plain)
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(4, ref.config.vocab_size, (n,), generator=g).tolist() for n in (5, 30)]
    with Engine(str(packed), **EXACT, kt_method=method, **flags) as eng:
        layer = next(iter(eng.runtime.cpu_moe.layers.values()))
        assert (layer.gate_up.method, layer.down.method) == (normalize_kt_method(method),) * 2
        before = eng.runtime.placement()
        got = logits_of(eng, batch)
        tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        if flags["kt_num_gpu_experts"]:
            check_gpu_mx_stacks(eng, packed, method)
        if flags.get("kt_enable_dynamic_expert_update"):
            assert eng.runtime.placement() != before  # experts really moved mid-run
    want, expected = hf_last_logits_and_greedy(ref, batch, GREEDY["max_tokens"])
    assert (got - want).abs().max().item() <= 1e-4
    assert tokens == expected


def check_gpu_mx_stacks(eng: Engine, packed, method: str) -> None:
    """Each MoE layer's GPU stacks hold the checkpoint's MX codes and e8m0 scales, and the plan counted them at
    4.25 / 8.25 bits a weight, as allocated."""
    cfg = load_config(packed)
    source = MXSource(cfg, packed, normalize_kt_method(method))
    bits = 4 if normalize_kt_method(method) == "MXFP4" else 8
    for l, moe in eng.runtime.moe_layers.items():
        assert (moe.w13.bits, moe.w13.group_size, moe.w13.mx, moe.w2.bits) == (bits, 32, True, bits)
        w13, w2 = source.gpu_weights(l, moe.gpu_experts)
        assert torch.equal(moe.w13.qweight, w13.qweight) and torch.equal(moe.w2.scales, w2.scales)
    plan = eng.runtime.plan
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * (bits + 0.25) / 8
    assert plan.bytes("gpu_experts") == plan.gpu_experts_total * len(cfg.moe_layers) * per_expert
    assert plan.allocated()["gpu_experts"] == plan.bytes("gpu_experts")


@pytest.mark.parametrize("method,layout,bits", [("MXFP4", "MXFP4", 4.25), ("FP4", "FP4", 4.25),
                                                ("MXFP8", "MXFP8", 8.25)])
def test_cpu_store_is_allocated_as_planned_at_its_bits(mx_checkpoints, method, layout, bits):
    """A matrix whose K is a multiple of 64 is planned at 4.25 (e2m1) / 8.25 (e4m3) bits a weight, and the CPU store
    filled from the checkpoint takes exactly the planned bytes (the tiny model's down rows, K = 32, are padded to 64
    in both)."""
    fmt = normalize_kt_method(method)
    assert matrix_bytes(fmt, 32, 64, 192) * 8 == bits * 64 * 192
    packed = mx_checkpoints[layout][0]
    cfg = load_config(packed)
    with CPUMoE(fmt) as cpu:
        source = open_source(EngineConfig(model_path=str(packed), kt_method=method), cfg)
        assert isinstance(source, MXSource)
        source.fill(cpu, {}, progress=False)
        planned = cpu_expert_bytes(cfg, method, None) * cfg.n_routed_experts * len(cfg.moe_layers)
        assert cpu.nbytes() == planned


def test_formats_that_do_not_fit_the_checkpoint_are_refused(mx_checkpoints, tiny_v3):
    """Each MX checkpoint is served only by its own method (no silent re-quantization); an MX method on a checkpoint
    without MX experts, or with another group size, names what fits."""
    def source(folder, method, **kw):
        return open_source(EngineConfig(model_path=str(folder), kt_method=method, **kw), load_config(folder))

    fp4, mxfp8, blocks = (mx_checkpoints[k][0] for k in ("FP4", "MXFP8", "MXFP4"))
    with pytest.raises(ConfigError, match="has MXFP4 experts.*use --kt-method MXFP4"):
        source(fp4, "MXFP8")
    with pytest.raises(ConfigError, match="has MXFP8 experts.*use --kt-method MXFP8"):
        source(mxfp8, "FP4")
    for folder, method in ((mxfp8, "FP8"), (blocks, "BF16"), (fp4, "INT4")):
        with pytest.raises(ConfigError, match=f"as {'MXFP8' if folder == mxfp8 else 'MXFP4'} .*--kt-method MX"):
            source(folder, method)
    with pytest.raises(ConfigError, match="no MX experts"):
        source(tiny_v3, "MXFP4")
    with pytest.raises(ConfigError, match="one scale per 32"):
        cpu_expert_bytes(load_config(fp4), "FP4", 64)


@pytest.mark.parametrize("layout,method", [("FP4", "MXFP4"), ("MXFP8", "MXFP8")])
def test_without_kt_method_the_stored_mx_format_is_served(mx_checkpoints, tiny_v3, layout, method):
    """No --kt-method: the auto knobs read the experts' format from the tensors' headers and serve MX codes as stored
    (the default INT4 has no path from them: it would be refused); bf16 experts keep the default INT4."""
    with Engine(str(mx_checkpoints[layout][0]), **EXACT) as eng:
        layer = next(iter(eng.runtime.cpu_moe.layers.values()))
        assert (layer.gate_up.method, layer.down.method) == (method, method)
    with Engine(str(tiny_v3), **EXACT) as eng:
        assert next(iter(eng.runtime.cpu_moe.layers.values())).gate_up.method == "INT4"


@pytest.mark.parametrize("layout", ["MXFP4", "MXFP8"])
def test_cpu_moe_paths_equal_a_torch_moe_over_transformers_weights(mx_checkpoints, layout):
    """CPUMoE.forward on the stored MX experts, every expert through the fused row kernels and then through
    dequantize + torch.matmul (fp32), equals the MoE in float64 over transformers' dequantized experts."""
    packed, plain = mx_checkpoints[layout]
    cfg = load_config(packed)
    layer = cfg.moe_layers[0]
    reader = CheckpointReader(plain)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:4] for _ in range(6)])
    weights = torch.rand(6, 4, generator=g)
    want = torch.zeros(6, cfg.hidden_size, dtype=torch.float64)
    for t in range(6):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            gate, up, down = (reader.get_raw(cfg.expert_weight_name(layer, e, p)).double() for p in PROJS)
            want[t] += w * (down @ (torch.nn.functional.silu(gate @ x[t].double()) * (up @ x[t].double())))
    for threshold in (1 << 30, 0):  # the fused row kernels; dequantize + torch.matmul
        with CPUMoE(layout, prefill_threshold=threshold, prefill_dtype=torch.float32) as cpu:
            MXSource(cfg, packed, layout).fill(cpu, {}, progress=False)
            got = cpu.forward(layer, x, ids, weights).double()
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), threshold
