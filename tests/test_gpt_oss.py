"""gpt-oss against transformers on a tiny checkpoint transformers wrote (sliding window 4 and full attention layers,
sinks, q/k/v/o biases, router bias, interleaved gate/up experts with biases and a clamp limit of 1): the reference
model's logits and greedy tokens, then the Engine with CPU and GPU experts, chunked prefill, preemption and tensor
parallelism."""

from __future__ import annotations

import pytest
import torch
from hf_checkpoints import engine_expectations, hf_last_logits_and_greedy, hf_model, served_as_transformers
from test_gqa_families import random_ids

from ktlite.runtime import models

TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tiny_gpt_oss):
    return models.load(tiny_gpt_oss), hf_model(tiny_gpt_oss)


def test_config_windows_sinks_and_activation(tiny_gpt_oss):
    cfg = models.load_config(tiny_gpt_oss)
    assert cfg.windows == (4, 0, 4)
    assert cfg.attention.sinks and cfg.attention.o_bias and cfg.attention.bias
    assert (cfg.activation.kind, cfg.activation.limit, cfg.activation.alpha) == ("swiglu_oai", 1.0, 1.702)
    assert cfg.router.logit_bias and cfg.router.normalize and cfg.moe_layers == [0, 1, 2]


def test_prefill_logits_match_transformers(pair):
    ours, ref = pair
    ids = random_ids(3, 23, ours.config.vocab_size)  # 23 tokens: the window of 4 drops most keys
    with torch.no_grad():
        expected = ref(ids).logits
    got = ours(ids)
    assert (got - expected).abs().max().item() <= TOL


def test_decode_step_by_step_matches_transformers(pair):
    ours, ref = pair
    ids = random_ids(2, 21, ours.config.vocab_size, seed=2)
    with torch.no_grad():
        expected = ref(ids).logits
    cache = ours.new_cache(2, 21)
    got = [ours(ids[:, :6], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(6, 21)]
    assert (torch.cat(got, dim=1) - expected).abs().max().item() <= TOL


def test_greedy_32_equals_generate(pair):
    ours, ref = pair
    ids = random_ids(2, 7, ours.config.vocab_size, seed=3)
    _, expected = hf_last_logits_and_greedy(ref, ids.tolist(), 32)
    assert ours.generate_greedy(ids, 32).tolist() == expected


# ---- the Engine -------------------------------------------------------------------------------------------------

GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
EXACT = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 256,
         "gpu_memory": "1GiB", "max_running_requests": 8}
N_EXPERTS = 8


@pytest.fixture(scope="module")
def expected(tiny_gpt_oss, pair):
    """Prompts of 5..30 tokens (the window of 4 drops keys in all but the first) and transformers' greedy tokens and
    last-token logits."""
    return engine_expectations(pair[1], pair[0].config.vocab_size, GREEDY["max_tokens"])


def test_engine_cpu_experts_equal_transformers(tiny_gpt_oss, expected):
    served_as_transformers(tiny_gpt_oss, EXACT, expected, GREEDY, TOL)


def test_half_gpu_experts_chunk_5_preemption_layerwise_prefill_and_dynamic_placement(tiny_gpt_oss, expected):
    """Chunks of 5 tokens run every expert on the device (threshold 4: the layerwise path, biases by expert id), decode
    steps split them between GPU (biases by GPU slot) and CPU experts, and the placement moves every 2 steps (the
    biases follow the experts); 48 KV slots force preemption."""
    from ktlite import Engine

    batch, tokens, _ = expected
    flags = {**EXACT, "kt_num_gpu_experts": N_EXPERTS // 2, "chunked_prefill_size": 5, "max_total_tokens": 48,
             "kt_gpu_prefill_token_threshold": 4, "kt_enable_dynamic_expert_update": True,
             "kt_expert_update_interval": 2}
    with Engine(str(tiny_gpt_oss), **flags) as eng:
        initial = eng.runtime.placement()
        assert [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)] == tokens
        assert eng.scheduler.preemptions > 0
        assert eng.runtime.placement() != initial
        assert all(len(v) == N_EXPERTS // 2 for v in eng.runtime.placement().values())


def test_quantized_cpu_experts_close_to_transformers_and_convert(tiny_gpt_oss, expected, tmp_path):
    """ktlite quantizes the bf16 experts (each expert's de-interleaved columns of gate_up_proj) at load: INT8 and INT4
    logits stay close to transformers'; `ktlite convert` reads the same columns: serving its INT8 experts with
    --kt-weight-path equals quantizing them at load."""
    from test_tensor_parallel import logits_of

    from ktlite import Engine
    from ktlite.runtime.convert import convert_checkpoint

    batch, _, logits = expected
    got = {}
    for method in ("INT8", "INT4"):
        with Engine(str(tiny_gpt_oss), **{**EXACT, "kt_method": method}) as eng:
            got[method] = logits_of(eng, batch)
    for method, bound in (("INT8", 0.02), ("INT4", 0.2)):
        rel = (torch.linalg.norm(got[method] - logits) / torch.linalg.norm(logits)).item()
        assert 0 < rel < bound, (method, rel)
    convert_checkpoint(tiny_gpt_oss, tmp_path / "int8", "INT8", progress=False)
    with Engine(str(tiny_gpt_oss), **{**EXACT, "kt_method": "INT8"}, kt_weight_path=str(tmp_path / "int8")) as eng:
        assert torch.equal(logits_of(eng, batch), got["INT8"])


def test_tp2_equals_tp1_and_each_rank_allocates_its_plan(tiny_gpt_oss, expected):
    """Heads and their sinks split over 2 ranks, the o bias added once, GPU experts split (expert parallel); the KV
    pool keeps every token of the sliding layers too (as planned: K and V per kv head, 3 layers)."""
    from test_tensor_parallel import logits_of

    from ktlite import Engine

    batch, tokens, logits = expected
    flags = {**EXACT, "kt_num_gpu_experts": 3}
    results = {}
    for tp in (1, 2):
        with Engine(str(tiny_gpt_oss), **flags, tensor_parallel_size=tp) as eng:
            got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
            results[tp] = (got, logits_of(eng, batch), eng.runtime.plan, getattr(eng.runtime, "allocated_per_rank", {}))
    assert results[1][0] == results[2][0] == tokens
    torch.testing.assert_close(results[2][1], logits, atol=TOL, rtol=TOL)
    plan, allocated = results[2][2], results[2][3]
    assert sorted(allocated) == [0, 1]
    for rank, got in allocated.items():
        assert plan.mismatches(got, rank) == {}, rank
        for component in ("embeddings", "lm_head", "attention", "kv_pool", "norms_router"):
            assert got[component] == plan.bytes(component, rank) > 0, (rank, component)
    assert plan.kv_bytes_per_token == 3 * 2 * 1 * 16 * 4  # each rank: 1 of the 2 kv heads, fp32


def test_tiny_model_cli_writes_what_transformers_reads(tmp_path):
    """`ktlite tiny-model --arch gpt_oss` writes the checkpoint names and config fields transformers reads: its
    GptOssForCausalLM gives ktlite's logits on it."""
    from click.testing import CliRunner

    from ktlite.cli import main

    result = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "g"), "--arch", "gpt_oss"])
    assert result.exit_code == 0, result.output
    ours, ref = models.load(tmp_path / "g"), hf_model(tmp_path / "g")
    assert ours.config.windows == (4, 0, 4) and ref.config.layer_types[0] == "sliding_attention"
    ids = random_ids(1, 12, ours.config.vocab_size, seed=5)
    with torch.no_grad():
        expected = ref(ids).logits
    assert (ours(ids) - expected).abs().max().item() <= TOL


def test_mxfp4_checkpoint_served_as_stored_equals_transformers_on_its_dequantization(tiny_gpt_oss, tmp_path):
    """gpt-oss as the hub ships it: experts as MXFP4 `*_proj_blocks` / `*_proj_scales` (gate/up rows interleaved) and
    `quantization_config: mxfp4`. Served with --kt-method MXFP4, half the experts in the GPU's MX stacks (biases and
    the clamp in the fused MoE's epilogue) and half in the CPU's MX rows, chunks of 5: logits and greedy tokens equal
    transformers' on the checkpoint transformers' `convert_moe_packed_tensors` dequantized."""
    import json
    import shutil

    from safetensors.torch import save_file
    from test_mx_experts import fp4_quantize, transformers_blocks
    from test_tensor_parallel import logits_of

    from ktlite import Engine
    from ktlite.runtime.loader import CheckpointReader

    reader = CheckpointReader(tiny_gpt_oss)
    tensors = {name: reader.get_raw(name) for name in reader.names()}
    packed, plain = {}, {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stack = tensors.pop(name)  # [E, in, out]
        quantized = [fp4_quantize(w.T) for w in stack]  # each expert's [out, in]: gate_up's rows alternate gate, up
        blocks = torch.stack([c.reshape(c.shape[0], -1, 16) for c, _ in quantized])
        scales = torch.stack([s for _, s in quantized])
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        plain[name] = transformers_blocks(blocks, scales).transpose(1, 2).to(stack.dtype).contiguous()
    config = json.loads((tiny_gpt_oss / "config.json").read_text())
    folders = {}
    for kind, experts, extra in (("packed", packed, {"quantization_config": {"quant_method": "mxfp4"}}),
                                 ("plain", plain, {})):
        folder = folders[kind] = tmp_path / kind
        folder.mkdir()
        save_file({**tensors, **experts}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_gpt_oss / f, folder / f)
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(4, config["vocab_size"], (n,), generator=g).tolist() for n in (5, 23)]
    logits, tokens = hf_last_logits_and_greedy(hf_model(folders["plain"]), batch, GREEDY["max_tokens"])
    flags = {**EXACT, "kt_method": "MXFP4", "kt_num_gpu_experts": N_EXPERTS // 2, "chunked_prefill_size": 5}
    with Engine(str(folders["packed"]), **flags) as eng:
        moe = next(iter(eng.runtime.moe_layers.values()))
        assert moe.w13.mx and moe.w13.bits == 4 and moe.biases is not None
        assert [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)] == tokens
        assert (logits_of(eng, batch) - logits).abs().max().item() <= TOL
