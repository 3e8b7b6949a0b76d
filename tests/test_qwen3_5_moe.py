"""Qwen3.5-MoE (Qwen3-Next's hybrid with split Gated DeltaNet projections and a MoE in every layer) against
transformers on tiny checkpoints transformers wrote in both layouts: the text model (`Qwen3_5MoeForCausalLM`,
flat config, `model.*`) and the hub's vision-language model (`Qwen3_5MoeForConditionalGeneration`: `text_config`,
`model.language_model.*`, a vision tower, plus `mtp.*` tensors as the hub folders carry them); through the Engine,
under tensor parallelism, and the plan of a published config."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from hf_checkpoints import hf_generate, hf_greedy_each, hf_step_logits, write_hf_checkpoint, write_hf_vl_checkpoint
from safetensors.torch import load_file, save_file
from test_gqa_engine import EXACT, GREEDY
from test_qwen3_next import CHUNKED_TOL, TOL, ids_of, step_logits
from test_tensor_parallel import logits_of

from ktlite import Engine
from ktlite.cli import main
from ktlite.errors import ConfigError
from ktlite.runtime import models
from ktlite.runtime.loader import CheckpointReader
from ktlite.runtime.memory import make_plan
from ktlite.runtime.models import load_config, parse_config
from ktlite.runtime.models.rope import inv_frequencies
from ktlite.runtime.plan_components import allocated_by_component
from ktlite.runtime.plan_inputs import PlanInputs

DATA = Path(__file__).parent / "data"
LAYOUTS = ("text", "vl")
# what the hub folders carry beside the text model: ktlite reads neither (the text path only)
SKIPPED = ("model.visual.", "mtp.")


def _add_mtp_tensors(folder: Path) -> None:
    """The multi-token-prediction layer's tensors the hub checkpoints store (`mtp.*`; transformers ignores them)."""
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    tensors.update({"mtp.fc.weight": torch.randn(64, 128, generator=gen).bfloat16(),
                    "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(32, 64, generator=gen).bfloat16(),
                    "mtp.norm.weight": torch.zeros(64).bfloat16()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen35")
    vl = write_hf_vl_checkpoint(root / "vl", "qwen3_5_moe", seed=12)
    _add_mtp_tensors(vl)
    return {"text": write_hf_checkpoint(root / "text", "qwen3_5_moe", seed=11), "vl": vl}


def reference(path: Path) -> torch.nn.Module:
    """transformers' model of the folder's own class (the VL one for the hub layout)."""
    vl = "text_config" in json.loads((path / "config.json").read_text())
    cls = transformers.Qwen3_5MoeForConditionalGeneration if vl else transformers.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reads_the_text_model_and_nothing_else(qwen35, layout):
    """Every tensor of the text model and lm_head is read under the name transformers wrote; the vision tower
    and the mtp layer are the only ones left (the VL layout); every layer is a MoE, layer_types places the
    full-attention layer."""
    ours = models.load(qwen35[layout])
    cfg = ours.config
    read = {ours.checkpoint_name(n) for n in ours.state_dict()}
    stored = set(CheckpointReader(qwen35[layout]).names())
    assert read <= stored
    left = stored - read
    assert left and all(n.startswith(SKIPPED) for n in left) if layout == "vl" else not left
    assert cfg.architecture == ("Qwen3_5MoeForConditionalGeneration" if layout == "vl" else "Qwen3_5MoeForCausalLM")
    assert cfg.moe_layers == [0, 1, 2, 3] and cfg.full_attention_layers == (2,)


# both layouts below one 64-token chunk; past it, decode and generate on the hub's layout (the model is the same)
@pytest.mark.parametrize("layout, length", [("text", 21), ("vl", 21), ("vl", 70)])
def test_prefill_logits_match_transformers(qwen35, layout, length):
    ours, ref = models.load(qwen35[layout]), reference(qwen35[layout])
    ids = ids_of(ours.config.vocab_size, 2, length)
    with torch.no_grad():
        expected = ref(ids).logits
    # one 64-token chunk and beyond: the compiled delta rule sums in another fp32 order (test_qwen3_next.py)
    assert (ours(ids) - expected).abs().max().item() <= (TOL if length < 64 else CHUNKED_TOL)


def test_step_by_step_decode_matches_transformers_decode(qwen35):
    ours, ref = models.load(qwen35["vl"]), reference(qwen35["vl"])
    ids = ids_of(ours.config.vocab_size, 2, 16, seed=1)
    assert (step_logits(ours, ids, 5) - hf_step_logits(ref, ids, 5)).abs().max().item() <= TOL


def test_greedy_32_tokens_equal_generate(qwen35):
    ours, ref = models.load(qwen35["vl"]), reference(qwen35["vl"])
    ids = ids_of(ours.config.vocab_size, 2, 9, seed=3)
    assert torch.equal(ours.generate_greedy(ids, 32), hf_generate(ref, ids, 32))


@pytest.fixture(scope="module")
def eight(qwen35):
    """8 prompts of different lengths and transformers' greedy continuations (the VL checkpoint)."""
    g = torch.Generator().manual_seed(12)
    vocab = load_config(qwen35["vl"]).vocab_size
    batch = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in range(3, 39, 5)]
    return batch, hf_greedy_each(reference(qwen35["vl"]), batch, 6)


def test_engine_chunk_5_mixed_preemption_half_gpu_experts_planned_as_allocated(qwen35, eight):
    batch, want = eight
    flags = {**EXACT, "kt_num_gpu_experts": 8, "chunked_prefill_size": 5, "enable_mixed_chunk": True,
             "max_total_tokens": 48}
    with Engine(str(qwen35["vl"]), **flags) as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params={**GREEDY, "max_tokens": 6})]
        assert eng.scheduler.preemptions > 0
        assert eng.runtime.runner.kv_pool.used_tokens == 0
        plan = eng.runtime.plan
        allocated = allocated_by_component(eng.runtime.runner.model)
        allocated.update(plan.allocated())
        assert plan.mismatches(allocated) == {} and plan.bytes("state_pool") > 0
    assert got == want


def test_engine_tp2_equals_tp1(qwen35, eight):
    batch, want = eight[0][:4], eight[1][:4]
    results = {}
    for tp in (1, 2):
        with Engine(str(qwen35["vl"]), **EXACT, kt_num_gpu_experts=3, tensor_parallel_size=tp) as eng:
            results[tp] = ([r.token_ids for r in eng.generate(input_ids=batch, sampling_params={**GREEDY, "max_tokens": 6})],
                           logits_of(eng, batch), getattr(eng.runtime, "allocated_per_rank", {}), eng.runtime.plan)
    assert results[1][0] == results[2][0] == want
    torch.testing.assert_close(results[2][1], results[1][1], atol=1e-4, rtol=1e-4)
    assert results[2][2]  # both ranks reported what they allocated
    for rank, used in results[2][2].items():
        assert results[2][3].mismatches(used, rank) == {}, rank


# ---- config only: the VL config's rope in each place a file may write it ------------------------------------

def _vl_config(text_rope: dict) -> dict:
    """The published VL config with its text_config's rope fields replaced by `text_rope` (theta 30000 and
    partial rotary 0.5, both off the defaults)."""
    raw = json.loads((DATA / "qwen3.5-35b-a3b" / "config.json").read_text())
    text = {k: v for k, v in raw["text_config"].items() if k not in ("rope_parameters", "partial_rotary_factor")}
    return {**raw, "text_config": {**text, **copy.deepcopy(text_rope)}}


MROPE = {"mrope_section": [11, 11, 10], "mrope_interleaved": True}
ROPE_PLACES = {
    "rope_parameters with mrope": {"rope_parameters": {"rope_type": "default", "rope_theta": 30000.0,
                                                       "partial_rotary_factor": 0.5, **MROPE}},
    "top level + rope_scaling with mrope": {"rope_theta": 30000.0, "partial_rotary_factor": 0.5,
                                            "rope_scaling": {"rope_type": "default", **MROPE}},
    "top level only": {"rope_theta": 30000.0, "partial_rotary_factor": 0.5},
}


@pytest.mark.parametrize("place", list(ROPE_PLACES))
def test_vl_config_rope_parses_as_transformers_reads_it(place):
    raw = _vl_config(ROPE_PLACES[place])
    text = transformers.Qwen3_5MoeConfig.from_dict(copy.deepcopy(raw)).text_config
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    expected = Qwen3_5MoeTextRotaryEmbedding(text).inv_freq
    rope = parse_config(raw).rope
    assert rope.theta == 30000.0 and rope.head_dim == 128  # 256 x 0.5
    torch.testing.assert_close(inv_frequencies(rope), expected, rtol=1e-6, atol=0)


def test_mrope_rope_type_is_refused_as_transformers_cannot_run_it():
    """Old Qwen-VL files say `"type": "mrope"`; transformers' Qwen3.5 rotary has no such rope type, nor does ktlite."""
    raw = _vl_config({"rope_theta": 30000.0, "rope_scaling": {"type": "mrope", **MROPE}})
    text = transformers.Qwen3_5MoeConfig.from_dict(copy.deepcopy(raw)).text_config
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    with pytest.raises(KeyError):
        Qwen3_5MoeTextRotaryEmbedding(text)
    with pytest.raises(ConfigError, match="mrope"):
        parse_config(raw)


# ---- the published config's plan ---------------------------------------------------------------------------

def test_published_config_plan_counts_kv_of_the_attention_layers_and_state_per_request():
    cfg = load_config(DATA / "qwen3.5-35b-a3b")
    assert (cfg.architecture, cfg.text_prefix, len(cfg.moe_layers)) == ("Qwen3_5MoeForConditionalGeneration",
                                                                         "model.language_model.", 40)
    plan = make_plan(cfg, PlanInputs(gpu_memory="24GiB", max_total_tokens=131072, max_running_requests=4,
                                     chunked_prefill_size=8192, dtype="bfloat16"))
    assert plan.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2 == 20_480  # 10 attention layers x K+V x 2 kv heads
    conv = (2 * 16 * 128 + 32 * 128) * 3 * 4  # q, k, v channels x (width 4 - 1) x fp32 = 96 KiB
    recurrent = 32 * 128 * 128 * 4  # value heads x k_dim x v_dim x fp32 = 2 MiB
    assert plan.bytes("state_pool") == 4 * 30 * (conv + recurrent)
    assert plan.bytes("dense_mlp") == 0  # a MoE in every layer
    shown = CliRunner().invoke(main, ["plan", "--model", str(DATA / "qwen3.5-35b-a3b"), "--gpu-memory", "24GiB"]).output
    assert "x 20,480 B" in shown and "fits" in shown, shown


def test_tiny_model_cli_writes_what_transformers_reads(tmp_path):
    result = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "m"), "--arch", "qwen3_5_moe"])
    assert result.exit_code == 0, result.output
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32,
                                                                  output_loading_info=True)
    assert type(ref).__name__ == "Qwen3_5MoeForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    ours = models.load(tmp_path / "m")
    ids = ids_of(ours.config.vocab_size, 1, 12, seed=5)
    with torch.no_grad():
        assert (ours(ids) - ref.eval()(ids).logits).abs().max().item() <= TOL


def test_next_turn_starts_from_the_last_reply_snapshot(qwen35):
    """The prefix cache of a recurrent model (test_hybrid_prefix_cache.py) on the VL checkpoint: the second turn
    resumes from the recurrent state where the first reply ended, and both equal transformers."""
    from test_hybrid_prefix_cache import FLAGS, NEW, _prompts, _turns

    vocab = load_config(qwen35["vl"]).vocab_size
    first, added = _prompts(vocab, 1, 37, seed=5)[0], _prompts(vocab, 1, 9, seed=6)[0]
    with Engine(str(qwen35["vl"]), **FLAGS) as eng:
        (p1, r1), (p2, r2) = _turns(eng, [first], [(0, []), (0, added)])
    assert r2.cached_tokens == len(p1) + NEW - 1
    assert [r1.token_ids, r2.token_ids] == hf_greedy_each(reference(qwen35["vl"]), [p1, p2], NEW)


def test_serves_chat_with_the_qwen3_coder_tool_and_qwen3_reasoning_parsers(qwen35, tmp_path):
    """Qwen3.5 is served as Qwen3-Next is (ktlite, like SGLang, takes the parsers from the flags, never from the
    model): --tool-call-parser qwen3_coder --reasoning-parser qwen3 on the VL checkpoint with a template that
    renders tools and opens a think block; the prompt is transformers' rendering, and the random reply, inside
    the opened think block, is all reasoning."""
    import openai
    from chat_templates import MAPPING, with_template
    from test_tools_api import ENGINE_FLAGS, HISTORY, PARSERS, TOOLS, reference_prompt

    from ktlite.server import ServerOptions, ServerThread

    model = with_template(qwen35["vl"], tmp_path / "m", MAPPING)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 2048  # rendered tools are long in the tiny vocabulary
    (model / "config.json").write_text(json.dumps(config))
    with Engine(str(model), **ENGINE_FLAGS) as eng, ServerThread(eng, ServerOptions(port=0, **PARSERS)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=4,
                                               temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        prompt = reference_prompt(model, MAPPING, HISTORY, TOOLS, True, enable_thinking=True)
        assert reply.usage.prompt_tokens == len(eng.tokenizer.encode(prompt, add_bos=False))
    message = reply.choices[0].message
    assert message.reasoning_content and not message.content and not message.tool_calls
    assert reply.usage.completion_tokens == 4
