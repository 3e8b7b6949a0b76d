"""DeepSeek-V3.2 and GLM-5 (DSA: lightning indexer + sparse MLA) against transformers on tiny checkpoints
transformers wrote, with index_topk (6) below the prompt lengths so the sparsity is exercised."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_checkpoints import hf_model, prefill_and_decode_errors
from test_gqa_engine import EXACT, GREEDY, hf_greedy, prompts

from ktlite import Engine
from ktlite.cli import main
from ktlite.runtime import models
from ktlite.runtime.memory import PlanDoesNotFit, make_plan
from ktlite.runtime.plan_inputs import PlanInputs
from ktlite.runtime.models import load_config

TOL = 1e-4
DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("score_bytes", [None, 1], ids=["whole", "one-key-tiles"])
def test_prefill_and_decode_logits_match_transformers(tiny_dsa, score_bytes, monkeypatch):
    """Also with the indexer's scores computed one key at a time (the tiles that bound a long context's memory)."""
    from ktlite.runtime.models import deepseek_v32

    if score_bytes is not None:
        monkeypatch.setattr(deepseek_v32, "INDEX_SCORE_BYTES", score_bytes)
    ours, ref = models.load(tiny_dsa), hf_model(tiny_dsa)
    assert ours.config.index_topk == 6
    ids = torch.randint(0, ours.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    assert max(prefill_and_decode_errors(ours, ref, ids)) <= TOL


def test_greedy_tokens_equal_generate(tiny_dsa):
    ours, ref = models.load(tiny_dsa), hf_model(tiny_dsa)
    ids = torch.randint(0, ours.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[:, ids.shape[1]:]
    assert torch.equal(ours.generate_greedy(ids, 32), expected)


def test_sparse_attention_equals_dense_mla_when_topk_covers_every_token(tiny_v32):
    from ktlite.kernels.attention import mla_extend, sparse_mla

    cfg = load_config(tiny_v32)
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(40, cfg.kv_latent_dim, generator=g)
    table = torch.randperm(40, generator=g).view(2, 20).int()
    prefix, extend = torch.tensor([3, 0]), torch.tensor([5, 9])
    q = torch.randn(int(extend.sum()), 4, cfg.kv_latent_dim, generator=g)
    # every causally visible slot of each query, padded with -1 to a common width
    slots = torch.full((q.shape[0], 12), -1, dtype=torch.int64)
    row_of = [0] * 5 + [1] * 9
    pos_of = [3 + i for i in range(5)] + list(range(9))
    for n, (row, pos) in enumerate(zip(row_of, pos_of)):
        slots[n, : pos + 1] = table[row, : pos + 1].long()
    sparse = sparse_mla(q, kv, slots, 0.1, cfg.kv_lora_rank)
    dense = mla_extend(q, kv, table, torch.tensor([0, 1]), prefix, extend, 0.1, cfg.kv_lora_rank)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def expected(tiny_dsa):
    """Prompts and transformers' greedy tokens for each sparse-attention family (V3.2, GLM-5)."""
    batch = prompts(load_config(tiny_dsa).vocab_size)
    return batch, hf_greedy(tiny_dsa, batch, GREEDY["max_tokens"])


def test_engine_chunk_5_preemption_half_gpu_experts(tiny_dsa, expected):
    batch, want = expected
    half = load_config(tiny_dsa).n_routed_experts // 2
    flags = {**EXACT, "kt_num_gpu_experts": half, "chunked_prefill_size": 5, "max_total_tokens": 48}
    with Engine(str(tiny_dsa), **flags) as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        assert eng.scheduler.preemptions > 0
        assert eng.runtime.runner.kv_pool.used_tokens == 0
    assert got == want


def test_engine_tp2_equals_transformers(tiny_dsa, expected):
    batch, want = expected
    with Engine(str(tiny_dsa), **EXACT, kt_num_gpu_experts=3, tensor_parallel_size=2) as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        plan, allocated = eng.runtime.plan, eng.runtime.allocated_per_rank
    assert got == want
    for rank, used in allocated.items():
        assert plan.mismatches(used, rank) == {}, rank


def test_plan_counts_indexer_weights_and_index_keys():
    cfg = load_config(DATA / "deepseek-v3.2")
    v3 = load_config(DATA / "deepseek-v3")
    plan = make_plan(cfg, PlanInputs(gpu_memory="200GiB", dtype="bfloat16"))
    base = make_plan(v3, PlanInputs(gpu_memory="200GiB", dtype="bfloat16"))
    assert plan.kv_bytes_per_token == 61 * (576 + 128) * 2 == 85_888
    # per layer: wq_b 1536 x 64*128, wk 7168 x 128, k_norm weight + bias 2 x 128, weights_proj 7168 x 64
    indexer = 61 * (1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64) * 2
    assert plan.bytes("attention") - base.bytes("attention") == indexer


def test_seed_users_plan_on_two_16gib_gpus():
    """The flags of the user's launch line on two 16 GiB GPUs: one GPU cannot hold the weights, and
    the fixes offered keep the user's two GPUs (TP=2 plus one flag) rather than asking for eight; on
    two, the 0.98 static fraction leaves too little headroom for a 2048-token chunk, and each
    suggested change (a smaller chunk, or 0.96) makes the plan fit on the same two GPUs."""
    flags = ["--kt-num-gpu-experts", "0", "--chunked-prefill-size", "2048", "--max-running-requests", "16",
             "--max-total-tokens", "20000", "--gpu-memory", "16GiB"]

    def plan(*extra: str, gpus: str = "2"):
        return CliRunner().invoke(main, ["plan", "--model", str(DATA / "deepseek-v3.2"), "--gpus", gpus, *flags, *extra])

    one = plan("--mem-fraction-static", "0.98", "--tensor-parallel-size", "1")
    assert one.exit_code == 1, one.output
    fixes = one.output.split("To fit, change one of: ")[1].split(".\n")[0].split("; ")
    assert "--tensor-parallel-size 2 with --chunked-prefill-size <= 1280" in fixes
    assert "--tensor-parallel-size 2 with --mem-fraction-static <= 0.96" in fixes
    assert not any("--tensor-parallel-size 8" in fix for fix in fixes), fixes
    lone = plan("--mem-fraction-static", "0.98", "--tensor-parallel-size", "1", gpus="1")
    assert "--tensor-parallel-size 8 (8 GPUs like this one)" in lone.output, lone.output  # nothing smaller fits
    two = plan("--mem-fraction-static", "0.98", "--tensor-parallel-size", "2")
    assert two.exit_code == 1, two.output
    assert "--mem-fraction-static <= 0.96" in two.output and "--chunked-prefill-size <= 1280" in two.output
    for fix in (["--mem-fraction-static", "0.96"], ["--mem-fraction-static", "0.98", "--chunked-prefill-size", "1280"]):
        fixed = plan(*fix, "--tensor-parallel-size", "2")
        assert fixed.exit_code == 0 and "verdict: fits" in fixed.output, fixed.output


def test_tensor_parallel_suggestions_replan_to_fit():
    """Each "--tensor-parallel-size N with ..." suggestion carries every change it names, and the
    plan with those changes fits on the machine's GPUs; the split alone does not."""
    cfg = load_config(DATA / "deepseek-v3.2")
    inputs = PlanInputs(gpu_memory="16GiB", kt_num_gpu_experts=0, mem_fraction_static=0.98, chunked_prefill_size=2048,
                        max_running_requests=16, max_total_tokens=20_000)
    with pytest.raises(PlanDoesNotFit) as err:
        make_plan(cfg, inputs, machine_gpus=2)
    combos = [s for s in err.value.suggestions if s.field == "tensor_parallel_size"]
    assert combos and all(s.with_ and s.value == 2 for s in combos)
    with pytest.raises(PlanDoesNotFit):
        make_plan(cfg, dataclasses.replace(inputs, tensor_parallel_size=2))
    for s in combos:
        assert make_plan(cfg, dataclasses.replace(inputs, **s.changes)).fits, s.text


def test_glm5_shared_layers_have_no_indexer_and_no_index_keys(hf_gqa_checkpoints):
    cfg = load_config(hf_gqa_checkpoints["glm_moe_dsa"])
    assert cfg.shared_index_layers == (2,) and cfg.index_rope_interleave
    model = models.build(cfg, "meta")
    assert model.model.layers[2].self_attn.indexer is None and model.model.layers[1].self_attn.indexer is not None
    index_spec = next(s for s in cfg.token_cache_specs() if s.name == "index_key")
    assert index_spec.layers == (0, 1)
    # an FP8 pool packs them: 32 e4m3 values and one fp32 scale per token
    packed = next(s for s in cfg.token_cache_specs(1, torch.float8_e4m3fn) if s.name == "index_key")
    assert (packed.layers, packed.shape, packed.dtype) == ((0, 1), (36,), torch.uint8)


# The launch line of the user ktlite was started for, verbatim but for the command name and paths
SEED = ("--host 0.0.0.0 --port 30000 --model {M} --kt-weight-path {W} --kt-cpuinfer 36 --kt-threadpool-count 1 "
        "--kt-num-gpu-experts 0 --attention-backend triton --trust-remote-code --mem-fraction-static 0.98 "
        "--chunked-prefill-size 2048 --max-running-requests 16 --max-total-tokens 20000 "
        "--served-model-name DeepSeek-V3.2 --enable-mixed-chunk --tensor-parallel-size 1 --enable-p2p-check "
        "--disable-shared-experts-fusion --kt-method AMXINT4")


def test_seed_launch_command_serves_a_v32_checkpoint(tmp_path):
    import openai
    from test_cli import Server

    from ktlite.runtime.convert import convert_checkpoint
    from ktlite.runtime.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "M", "deepseek_v32", seed=7)
    convert_checkpoint(model, tmp_path / "W", "AMXINT4", progress=False)
    server = Server(SEED.format(M=model, W=tmp_path / "W").split(), tmp_path)
    try:
        client = openai.OpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["DeepSeek-V3.2"]
        chunks = list(client.chat.completions.create(model="DeepSeek-V3.2", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert "".join(c.choices[0].delta.content or "" for c in chunks)
    finally:
        assert server.stop() == 0


def test_fp8_checkpoint_keeps_indexer_projections_fp8(tmp_path):
    """As in the hub's FP8 V3.2 checkpoints: the indexer's wq_b and wk are FP8, its weights_proj is not;
    kept FP8 on the device they give the logits of the dequantized reference."""
    from ktlite.runtime.models.fp8 import FP8Linear
    from ktlite.runtime.tiny_model import write_tiny_model
    from test_tensor_parallel import logits_of

    path = write_tiny_model(tmp_path / "v32fp8", "deepseek_v32", fp8=True, seed=8)
    ref = models.load(path)
    batch = prompts(ref.config.vocab_size, lengths=(6, 11))
    with Engine(str(path), **EXACT, weight_dtype="fp8", kt_num_gpu_experts=16) as eng:
        indexer = eng.runtime.runner.model.model.layers[0].self_attn.indexer
        assert isinstance(indexer.wq_b, FP8Linear) and isinstance(indexer.wk, FP8Linear)
        assert not isinstance(indexer.weights_proj, FP8Linear)
        got = logits_of(eng, batch)
    want = torch.cat([ref(torch.tensor([ids]))[0, -1:] for ids in batch])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
