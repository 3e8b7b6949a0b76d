"""Kimi-K2.5 / K2.6 (a vision-language wrapper around DeepSeek-V3) on tiny checkpoints written by transformers'
own Kimi_K25ForConditionalGeneration (tiny text and vision configs): its text path is the reference (transformers
runs the wrapper text-only when no pixel values are given), in every weight dialect, with RAWINT4 experts, through
the Engine and over two tensor-parallel ranks; `ktlite plan` on the published config."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from hf_checkpoints import hf_last_logits_and_greedy, hf_model, prefill_and_decode_errors, write_hf_kimi_k25
from safetensors.torch import load_file, save_file
from test_gqa_engine import EXACT, GREEDY, prompts
from test_rawint4 import write_int4_twins
from test_tensor_parallel import logits_of

from ktlite import Engine
from ktlite.cli import main
from ktlite.errors import ConfigError
from ktlite.runtime import models
from ktlite.runtime.memory import make_plan
from ktlite.runtime.models import load_config, parse_config
from ktlite.runtime.plan_components import allocated_by_component
from ktlite.runtime.plan_inputs import PlanInputs

TOL = 1e-4
DATA = Path(__file__).parent / "data"
K25 = transformers.Kimi_K25ForConditionalGeneration


@pytest.fixture(scope="module")
def k25(tmp_path_factory) -> Path:
    """As the hub's: the lm_head stored apart (tie_word_embeddings false at the wrapper)."""
    return write_hf_kimi_k25(tmp_path_factory.mktemp("k25") / "k25", seed=5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def reference(k25) -> torch.nn.Module:
    return hf_model(k25, K25)


@pytest.fixture(scope="module")
def expected(k25, reference):
    """Prompts, transformers' last-token logits and greedy tokens."""
    batch = prompts(load_config(k25).vocab_size)
    return (batch, *hf_last_logits_and_greedy(reference, batch, GREEDY["max_tokens"]))


def test_prefill_and_decode_logits_and_greedy_32_match_transformers(k25, reference):
    ours = models.load(k25)
    cfg = ours.config
    assert (cfg.architecture, cfg.n_routed_experts, cfg.vision_skipped) == ("DeepseekV3ForCausalLM", 16, True)
    ids = torch.randint(0, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    assert max(prefill_and_decode_errors(ours, reference, ids)) <= TOL
    prompt = ids[:, :9]
    with torch.no_grad():
        greedy = reference.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[:, prompt.shape[1]:]
    assert torch.equal(ours.generate_greedy(prompt, 32), greedy)


def _renamed(src: Path, dst: Path, rename) -> Path:
    tensors = load_file(src / "model.safetensors")
    dst.mkdir()
    save_file({rename(n): t for n, t in tensors.items()}, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def test_hub_and_transformers_weight_names_load_alike(k25, tmp_path):
    """transformers 5.24 writes the decoder layers as `language_model.model.blocks.N` (its vision `blocks` ->
    `layers` rename, reversed); the hub has `language_model.model.layers.N`; transformers' in-memory names are
    `model.language_model.*` / `lm_head.weight`. All three load the same weights."""
    written = load_file(k25 / "model.safetensors")
    assert "language_model.model.blocks.1.mlp.experts.3.up_proj.weight" in written
    assert "language_model.lm_head.weight" in written and any(n.startswith("vision_tower.") for n in written)
    hub = _renamed(k25, tmp_path / "hub", lambda n: n.replace("language_model.model.blocks.", "language_model.model.layers."))
    memory = _renamed(k25, tmp_path / "memory", lambda n: n.replace("language_model.model.blocks.", "model.language_model.layers.")
                      .replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.", "lm_head."))
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    want = models.load(k25)(ids)
    for folder in (hub, memory):
        assert torch.equal(models.load(folder)(ids), want), folder.name


def test_the_wrapper_ties_the_lm_head_by_default_as_transformers(tmp_path):
    """transformers ties by the wrapper's tie_word_embeddings (its default true): no lm_head is stored."""
    path = write_hf_kimi_k25(tmp_path / "tied", seed=6)
    assert json.loads((path / "config.json").read_text())["text_config"]["tie_word_embeddings"] is False
    assert not any("lm_head" in n for n in load_file(path / "model.safetensors"))
    ours = models.load(path)
    assert ours.config.tie_word_embeddings
    ids = torch.randint(0, ours.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf_model(path, K25)(ids).logits
    assert (ours(ids) - want).abs().max().item() <= TOL


def test_published_config_parses_and_plans_on_one_24gib_gpu():
    """The hub's config: text_config (DeepSeek-V3, 61 layers, 384 experts) and the INT4 quantization_config
    at the wrapper. Per-token KV: 61 layers x (512 latent + 64 rope) x 2 B = 70,272 B, as Kimi-K2's."""
    raw = json.loads((DATA / "kimi-k2.5" / "config.json").read_text())
    cfg = parse_config(raw)
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.moe_intermediate_size, len(cfg.moe_layers)) == (61, 384, 2048, 60)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.rope.factor, cfg.vision_skipped) == (512, 64, 64.0, True)
    assert not cfg.tie_word_embeddings and cfg.fp8_block_size is None
    # the hub names the text model kimi_k2; quantization_config inside text_config reads the same
    text = {k: v for k, v in raw["text_config"].items() if k != "quantization_config"}
    inner = {**raw, "quantization_config": None, "text_config": {**text, "model_type": "kimi_k2",
                                                                  "quantization_config": raw["quantization_config"]}}
    assert parse_config(inner) == cfg
    with pytest.raises(ConfigError, match="text_config.model_type"):
        parse_config({**raw, "text_config": {**text, "model_type": "llama"}})
    plan = make_plan(cfg, PlanInputs(gpu_memory="200GiB", dtype="bfloat16", gpu_expert_format="int4_g32"))
    assert plan.kv_bytes_per_token == 61 * 576 * 2
    # one 24 GiB GPU: the bf16 attention (11.5 GiB), embeddings, lm_head and shared experts pass 0.80 of it; at
    # 0.95 with an FP8 KV pool (61 x (512 fp8 + 4 fp32 scales + 64 bf16 rope) = 40,016 B a token) and a 1k chunk
    # they fit; the INT4 experts (60 x 384 x 27,525,120 B = 590.6 GiB) live in the CPU's RAM
    args = ["plan", "--model", str(DATA / "kimi-k2.5"), "--gpu-memory", "24GiB", "--kt-method", "RAWINT4",
            "--cpu-memory", "768GiB"]
    over = CliRunner().invoke(main, args)
    assert over.exit_code == 1 and "--tensor-parallel-size 2" in over.output, over.output
    fits = CliRunner().invoke(main, args + ["--mem-fraction-static", "0.95", "--kv-cache-dtype", "fp8_e4m3",
                                            "--chunked-prefill-size", "1024", "--context-length", "32768",
                                            "--max-running-requests", "4"])
    assert fits.exit_code == 0 and "verdict: fits" in fits.output and "40,016 B" in fits.output, fits.output


@pytest.fixture(scope="module")
def int4(k25, tmp_path_factory):
    return write_int4_twins(k25, tmp_path_factory.mktemp("k25int4"))


def test_rawint4_experts_equal_transformers_on_the_decompressed_weights(int4):
    packed, plain = int4
    batch = prompts(load_config(packed).vocab_size, lengths=(5, 17))
    with Engine(str(packed), **{**EXACT, "kt_method": "RAWINT4"}, kt_num_gpu_experts=4) as eng:
        layer = next(iter(eng.runtime.cpu_moe.layers.values()))
        assert (layer.gate_up.method, layer.gate_up.group_size) == ("INT4", 32)
        got = logits_of(eng, batch)
        tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        plan = eng.runtime.plan  # the GPU experts held as the checkpoint's INT4 codes, planned at that size
        assert plan.allocated()["gpu_experts"] == plan.bytes("gpu_experts") > 0
    want, greedy = hf_last_logits_and_greedy(hf_model(plain, K25), batch, GREEDY["max_tokens"])
    assert (got - want).abs().max().item() <= TOL
    assert tokens == greedy


def test_engine_chunk_5_preemption_half_gpu_experts(k25, expected, caplog):
    batch, _, want = expected
    flags = {**EXACT, "kt_num_gpu_experts": 8, "chunked_prefill_size": 5, "max_total_tokens": 48}
    with caplog.at_level(logging.INFO, logger="ktlite.runtime.assembly"), Engine(str(k25), **flags) as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        assert eng.scheduler.preemptions > 0
        assert all(len(v) == 8 for v in eng.runtime.placement().values())
        assert eng.runtime.runner.kv_pool.used_tokens == 0
        plan, allocated = eng.runtime.plan, allocated_by_component(eng.runtime.runner.model)
        allocated.update(plan.allocated())
    assert plan.mismatches(allocated) == {} and allocated["gpu_experts"] > 0  # planned == allocated
    assert got == want
    assert "vision tower and projector are not loaded" in caplog.text


def test_tp2_equals_transformers_and_each_rank_allocates_its_plan(k25, expected):
    batch, want_logits, want = expected
    with Engine(str(k25), **EXACT, kt_num_gpu_experts=3, tensor_parallel_size=2) as eng:
        tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        logits = logits_of(eng, batch)
        plan, allocated = eng.runtime.plan, eng.runtime.allocated_per_rank
    assert tokens == want
    assert (logits - want_logits).abs().max().item() <= TOL
    assert sorted(allocated) == [0, 1]
    for rank, got in allocated.items():
        assert plan.mismatches(got, rank) == {}, rank
        assert got["attention"] == plan.bytes("attention", rank) > 0


def test_tiny_model_cli_writes_the_hub_layout(tmp_path):
    result = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "k25"), "--arch", "kimi_k25"])
    assert result.exit_code == 0, result.output
    raw = json.loads((tmp_path / "k25" / "config.json").read_text())
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"] and raw["text_config"]["model_type"] == "kimi_k2"
    names = load_file(tmp_path / "k25" / "model.safetensors")
    assert "language_model.lm_head.weight" in names and "language_model.model.layers.1.mlp.experts.0.down_proj.weight" in names
    model = models.load(tmp_path / "k25")  # every tensor the model has, read under its hub name
    assert model.config.vision_skipped and len(model.state_dict()) == len(names)
