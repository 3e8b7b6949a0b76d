"""The memory plan: per-component bytes vs built models and checkpoints, knob suggestions, CLI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ktlite.cli import main
from ktlite.errors import ConfigError, PlanError
from ktlite.runtime.memory import PlanDoesNotFit, expert_bytes, make_plan
from ktlite.runtime.plan_components import WEIGHT_COMPONENTS, allocated_by_component, components_of
from ktlite.runtime.plan_inputs import PlanInputs, parse_size
from ktlite.runtime.models import build, load_config
from ktlite.runtime.models.deepseek import DeepseekForCausalLM

DATA = Path(__file__).parent / "data"
V3 = load_config(DATA / "deepseek-v3")
GIB = 2**30


def _model_bytes(model: torch.nn.Module) -> dict[str, int]:
    return allocated_by_component(model)


def _assert_planned(plan, built: dict[str, int]) -> None:
    """Exact per component, except norms_router within 1 %: build() casts the rope frequencies to
    the model dtype, the plan keeps them float32 (a few bytes)."""
    exact = {c: b for c, b in built.items() if c != "norms_router"}
    assert {c: plan.bytes(c) for c in exact} == exact
    assert plan.mismatches(built) == {}


def test_deepseek_v3_latent_kv_bytes_per_token():
    plan = make_plan(V3, PlanInputs(gpu_memory="80GiB", dtype="bfloat16"))
    assert plan.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert plan.bytes("kv_pool") == plan.kv_pool_tokens * 70_272
    v2 = make_plan(load_config(DATA / "deepseek-v2-lite"), PlanInputs(gpu_memory="24GiB"))
    assert v2.kv_bytes_per_token == 27 * 576 * 2
    # packed FP8 rows: 512 e4m3 values + 4 fp32 scales (one per 128) + 64 bf16 rope values
    fp8_kv = make_plan(V3, PlanInputs(gpu_memory="80GiB", kv_cache_dtype="fp8_e4m3"))
    assert fp8_kv.kv_bytes_per_token == 61 * (512 + 4 * 4 + 64 * 2) == 61 * 656


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_planned_weights_equal_built_tiny_model(tiny_model, dtype):
    cfg = load_config(tiny_model)
    # all routed experts on the GPU, so the built model's experts are the planned GPU experts
    plan = make_plan(cfg, PlanInputs(gpu_memory="1GiB", dtype=str(dtype).removeprefix("torch."),
                                     kt_num_gpu_experts=cfg.n_routed_experts))
    built = _model_bytes(build(cfg, "cpu", dtype))
    absent = {"mtp"} | ({"shared_experts"} if not cfg.n_shared_experts else set())  # MTP layer: test_mtp.py
    assert set(built) == (set(WEIGHT_COMPONENTS) | {"gpu_experts"}) - absent
    _assert_planned(plan, built)


def test_planned_fp8_weights_equal_checkpoint(tiny_v3_fp8):
    """FP8 projections: 1 byte per value + one fp32 scale per 128x128 block; the rest bf16/fp32."""
    cfg = load_config(tiny_v3_fp8)
    plan = make_plan(cfg, PlanInputs(gpu_memory="1GiB", kt_num_gpu_experts=cfg.n_routed_experts))
    assert plan.weight_dtype == "fp8"
    tensors = load_file(str(tiny_v3_fp8 / "model.safetensors"))
    assert any(t.dtype == torch.float8_e4m3fn for t in tensors.values())
    owner = components_of(build(cfg, "meta", torch.bfloat16, fp8_weights=True))
    stored: dict[str, int] = {}
    for name, t in tensors.items():
        stored[owner[name]] = stored.get(owner[name], 0) + t.numel() * t.element_size()
    stored["norms_router"] += (cfg.qk_rope_head_dim // 2) * 4  # rope frequencies: derived, not stored
    # the fused MoE has no FP8 path: GPU experts are held dense in bf16, twice their stored FP8 bytes
    experts = stored.pop("gpu_experts")
    assert plan.bytes("gpu_experts") == 2 * cfg.n_routed_experts * len(cfg.moe_layers) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert plan.bytes("gpu_experts") > 2 * experts * 0.99  # the FP8 bytes minus their block scales
    assert {c: plan.bytes(c) for c in stored} == stored


def test_planned_weights_equal_deepseek_v3_on_meta():
    """Real DeepSeek-V3 shapes on the meta device (no memory). 256 experts x 58 layers take ~7 s to
    construct even on meta, so the model is built with 16 routed experts (2 per group): attention,
    dense, shared, embedding and lm_head shapes do not depend on the expert count."""
    cfg = dataclasses.replace(V3, n_routed_experts=16)
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg).to(torch.bfloat16)
    for layer in cfg.moe_layers:
        model.model.layers[layer].mlp.gate.float()
    built = _model_bytes(model)
    plan = make_plan(cfg, PlanInputs(gpu_memory="200GiB", dtype="bfloat16", kt_num_gpu_experts=16))
    _assert_planned(plan, built)
    assert built["attention"] == 61 * 187_105_280 * 2  # q_a, q_b, kv_a, kv_b, o_proj per layer


def test_tensor_parallel_splits_heads_vocab_and_experts():
    one = make_plan(V3, PlanInputs(gpu_memory="200GiB", dtype="bfloat16"))
    two = make_plan(V3, PlanInputs(gpu_memory="100GiB", dtype="bfloat16", tensor_parallel_size=2, kt_num_gpu_experts=3))
    h = V3.hidden_size
    replicated = 61 * (V3.q_lora_rank * h + V3.kv_latent_dim * h) * 2  # q_a_proj, kv_a_proj_with_mqa
    assert two.bytes("attention", 1) == replicated + (one.bytes("attention") - replicated) // 2
    for c in ("embeddings", "lm_head", "dense_mlp", "shared_experts"):
        assert two.bytes(c, 0) == two.bytes(c, 1) == one.bytes(c) // 2
    assert two.bytes("norms_router", 1) == one.bytes("norms_router")
    assert two.kv_bytes_per_token == one.kv_bytes_per_token  # each rank holds the whole latent pool
    assert two.gpu_experts_per_layer == (2, 1)
    assert two.bytes("gpu_experts", 0) == 2 * 58 * expert_bytes(V3, "bfloat16") == 2 * two.bytes("gpu_experts", 1)


def test_ratio_wins_over_count_and_layerwise_buffer(tiny_v3):
    cfg = load_config(tiny_v3)
    plan = make_plan(cfg, PlanInputs(gpu_memory="1GiB", kt_num_gpu_experts=10, kt_gpu_experts_ratio=0.5))
    assert plan.gpu_experts_total == 8
    assert plan.bytes("layerwise_buffer") == 0
    lw = make_plan(cfg, PlanInputs(gpu_memory="1GiB", kt_gpu_prefill_token_threshold=128, tensor_parallel_size=2))
    assert lw.bytes("layerwise_buffer", 1) == 8 * expert_bytes(cfg, "bfloat16")


def test_alloc_ledger_equals_planned_kv_pool(tiny_v3):
    cfg = load_config(tiny_v3)
    plan = make_plan(cfg, PlanInputs(gpu_memory="1GiB", max_total_tokens=1000, chunked_prefill_size=512))
    kv = plan.alloc("kv_pool", (cfg.num_hidden_layers, plan.kv_pool_tokens, cfg.kv_latent_dim), torch.bfloat16, "cpu")
    assert kv.shape == (3, 1000, cfg.kv_latent_dim)
    assert plan.allocated() == {"kv_pool": plan.bytes("kv_pool")}
    assert plan.mismatches(plan.allocated()) == {}
    planned = plan.bytes("kv_pool")
    assert plan.mismatches({"kv_pool": 2 * planned}) == {"kv_pool": (planned, 2 * planned)}


def _refit(inputs: PlanInputs, field: str, value: object) -> bool:
    try:
        make_plan(V3, dataclasses.replace(inputs, **{field: value}))
    except PlanError:
        return False
    return True


@pytest.mark.parametrize(
    "inputs, field, step",
    [
        (PlanInputs(gpu_memory="48GiB", kt_num_gpu_experts=40), "kt_num_gpu_experts", 1),
        (PlanInputs(gpu_memory="24GiB", max_total_tokens=41_000), "max_total_tokens", 1),
        (PlanInputs(gpu_memory="24GiB", chunked_prefill_size=16_384), "chunked_prefill_size", 1),
        (PlanInputs(gpu_memory="24GiB", mem_fraction_static=0.6), "mem_fraction_static", -0.01),
        (PlanInputs(gpu_memory="24GiB", mem_fraction_static=0.95), "mem_fraction_static", 0.01),
        (PlanInputs(gpu_memory="48GiB", kt_gpu_experts_ratio=0.2), "kt_gpu_experts_ratio", 1 / 256),
        (PlanInputs(gpu_memory="16GiB"), "tensor_parallel_size", None),
        (PlanInputs(gpu_memory="16GiB"), "gpu_memory", -(2**20)),
    ],
)
def test_impossible_plan_names_knob_with_largest_value_that_fits(monkeypatch, inputs, field, step):
    real_empty = torch.empty

    def no_alloc(*args, **kwargs):  # shapes on the meta device (the plan's model shard) allocate nothing
        if torch.device(kwargs.get("device") or torch.get_default_device()).type == "meta":
            return real_empty(*args, **kwargs)
        raise AssertionError("the plan must fail before allocating")

    monkeypatch.setattr(torch, "empty", no_alloc)
    with pytest.raises(PlanDoesNotFit) as info:
        make_plan(V3, inputs)
    monkeypatch.undo()
    message = str(info.value)
    assert "static total" in message and "attention" in message and "To fit, change one of:" in message
    suggestion = next(s for s in info.value.suggestions if s.field == field)
    assert suggestion.text in message
    assert _refit(inputs, field, suggestion.value)
    if step is not None:  # one step past the suggested bound no longer fits
        assert not _refit(inputs, field, round(suggestion.value + step, 10))


def test_no_gpu_size_is_a_config_error_when_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the plan reads the device's memory")
    with pytest.raises(ConfigError, match="--gpu-memory"):
        make_plan(V3, PlanInputs())


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"mem_fraction_static": 0.0}, "--mem-fraction-static"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
        ({"kt_gpu_experts_ratio": 1.5}, "--kt-gpu-experts-ratio"),
        ({"kt_num_gpu_experts": 257}, "--kt-num-gpu-experts"),
        ({"chunked_prefill_size": 0}, "--chunked-prefill-size"),
        ({"tensor_parallel_size": 3}, "--tensor-parallel-size"),
        ({"context_length": 10**6}, "--context-length"),
        ({"dtype": "int4"}, "--dtype"),
        ({"gpu_memory": "16 parsecs"}, "--gpu-memory"),
    ],
)
def test_invalid_flags_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        make_plan(V3, PlanInputs(**{"gpu_memory": "16GiB", **kwargs}))


def test_fp8_dtype_needs_an_fp8_checkpoint():
    with pytest.raises(ConfigError, match="--dtype fp8"):
        make_plan(load_config(DATA / "deepseek-v2-lite"), PlanInputs(gpu_memory="16GiB", dtype="fp8"))


def test_parse_size():
    assert parse_size("16GiB") == 16 * GIB == parse_size("16g") == parse_size(str(16 * GIB))
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("800MiB") == 800 * 2**20
    assert parse_size("1.5GiB") == 3 * GIB // 2


def test_components_of_tags_every_tensor_and_rejects_untagged_ones():
    cfg = dataclasses.replace(V3, n_routed_experts=16)  # 256 experts x 58 layers take seconds even on meta
    owner = components_of(build(cfg, "meta", torch.bfloat16, fp8_weights=True))
    assert owner["model.layers.5.mlp.experts.7.down_proj.weight_scale_inv"] == "gpu_experts"
    assert owner["model.layers.5.mlp.gate.e_score_correction_bias"] == "norms_router"
    assert owner["model.layers.0.mlp.gate_proj.weight"] == "dense_mlp"
    assert owner["model.layers.5.mlp.shared_experts.up_proj.weight"] == "shared_experts"
    assert owner["model.layers.5.self_attn.kv_a_layernorm.weight"] == "norms_router"
    assert owner["model.layers.5.self_attn.kv_b_proj.weight"] == "attention"
    with pytest.raises(ValueError, match="plan_component"):
        components_of(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_cli_plan_deepseek_v3_one_24gib_gpu():
    result = CliRunner().invoke(main, ["plan", "--model", str(DATA / "deepseek-v3"), "--gpu-memory", "24GiB"])
    print(result.output)
    assert result.exit_code == 0, result.output
    assert "GPU 0 of 1" in result.stdout and "verdict: fits" in result.stdout and "x 70,272 B" in result.stdout


def test_cli_plan_deepseek_v3_two_16gib_gpus():
    args = ["plan", "--model", str(DATA / "deepseek-v3"), "--gpu-memory", "16GiB", "--tensor-parallel-size", "2"]
    result = CliRunner().invoke(main, args)
    print(result.output)
    assert result.exit_code == 0, result.output
    assert "GPU 0 of 2" in result.stdout and "GPU 1 of 2" in result.stdout and "64 of 128 heads" in result.stdout


def test_cli_plan_that_does_not_fit_exits_1():
    result = CliRunner().invoke(main, ["plan", "--model", str(DATA / "deepseek-v3"), "--gpu-memory", "16GiB"])
    assert result.exit_code == 1
    assert "does not fit" in result.stderr and "--tensor-parallel-size 2" in result.stderr
    bad = CliRunner().invoke(main, ["plan", "--model", str(DATA / "deepseek-v3"), "--gpu-memory", "16GiB",
                                    "--mem-fraction-static", "2"])
    assert bad.exit_code == 2 and "--mem-fraction-static" in bad.stderr
