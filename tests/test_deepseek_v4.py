"""DeepSeek-V4 against transformers on a tiny checkpoint transformers wrote (tests/hf_checkpoints.py): an HCA layer
(one entry per 8 tokens), two CSA layers (rate 4, overlapping windows, the indexer keeps 3 entries) and a
sliding-only layer, all with a window of 8 and sinks; hash-MoE then routed MoE layers with the clamp at 1; mHC over 4
streams. Prompts of ~30 tokens drop window keys and compressed entries alike. The reference model's logits (one
prefill, and a prefill then one-token steps through the pool and the per-request compressor state) and greedy
tokens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_checkpoints import chunked_error, hf_greedy_with_logits, hf_model, stepwise_logits
from test_gqa_families import random_ids

from ktlite.runtime import models
from ktlite.runtime.models.deepseek_v4 import CSA, HCA, SLIDING

TOL = 1e-4
LENGTH = 30


@pytest.fixture(scope="module")
def pair(tiny_deepseek_v4):
    return models.load(tiny_deepseek_v4), hf_model(tiny_deepseek_v4)


@pytest.fixture(scope="module")
def ids(pair):
    return random_ids(2, LENGTH, pair[0].config.vocab_size, seed=1)


@pytest.fixture(scope="module")
def expected(pair, ids):
    with torch.no_grad():
        return pair[1](ids).logits


def test_config_reads_every_layer_kind(tiny_deepseek_v4):
    cfg = models.load_config(tiny_deepseek_v4)
    assert cfg.layer_kinds == (HCA, CSA, SLIDING, CSA) and cfg.hash_layers == (0, 1)
    assert (cfg.csa_rate, cfg.hca_rate, cfg.window, cfg.index_topk) == (4, 8, 8, 3)
    # the prompts really drop: keys out of the window, closed CSA entries past the indexer's top-k
    assert LENGTH > cfg.window and LENGTH // cfg.csa_rate > cfg.index_topk
    assert cfg.router.scoring == "sqrtsoftplus" and cfg.router.correction_bias and cfg.activation.limit == 1.0
    assert (cfg.rope.theta, cfg.rope.kind, cfg.compress_rope.theta, cfg.compress_rope.kind) == (
        10000.0, "default", 160000.0, "yarn")
    assert cfg.compress_rope.cos_sin_scale == 1.0 and cfg.rope.head_dim == 8 and cfg.rope.interleave


def test_prefill_logits_match_transformers(pair, ids, expected):
    got = pair[0](ids)
    assert (got - expected).abs().max().item() <= TOL


def test_chunked_prefill_matches_transformers_chunked(pair, ids):
    """Chunks of 7 through both caches: windows close mid-chunk from the ring the previous chunk left (transformers'
    own chunked forward is the reference, as its indexer ties break per forward)."""
    ours, ref = pair
    assert chunked_error(ours, ref, ids, 7, ref.config) <= TOL


@pytest.fixture(scope="module")
def generated(pair):
    """transformers' greedy 32 tokens after 7-token prompts, with the logits of each step of its cached decode."""
    prompt = random_ids(2, 7, pair[0].config.vocab_size, seed=3)
    return prompt, *hf_greedy_with_logits(pair[1], prompt, 32)


def test_decode_step_by_step_matches_transformers(pair, generated):
    """The prompt at once (no window closed yet), then transformers' tokens one at a time: the compressors close
    their windows from the per-request ring. Compared with transformers' own cached decode, not its one-shot prefill:
    the indexer's scores tie (relu zeros) and transformers breaks those ties differently in the two."""
    prompt, tokens, logits = generated
    assert (stepwise_logits(pair[0], prompt, tokens) - logits).abs().max().item() <= TOL


def test_greedy_32_equals_generate(pair, generated):
    prompt, tokens, _ = generated
    assert pair[0].generate_greedy(prompt, 32).tolist() == tokens.tolist()


def test_tiny_model_is_what_transformers_reads(tmp_path):
    """`ktlite tiny-model --arch deepseek_v4` writes a folder transformers loads as written (its config states
    `intermediate_size`, which transformers reads as the experts' width) and whose logits ktlite's model equals."""
    from ktlite.runtime.tiny_model import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny", "deepseek_v4")
    ref, ours = hf_model(path), models.load(path)
    assert ours.config.moe_intermediate_size == ref.config.moe_intermediate_size == 32
    ids = random_ids(2, LENGTH, ours.config.vocab_size, seed=5)
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= TOL


# ---- the hub's dialect: config fields and tensor names ----------------------------------------------------------

RATIOS = {SLIDING: 0, CSA: 4, HCA: 128}  # the hub's compress_ratios values


def hub_config(resaved: dict) -> dict:
    """A transformers-written config.json dict as the hub's files state it: per-layer `compress_ratios` (the tiny
    HCA rate through the legacy `compress_rate_hca`), `num_hash_layers`, `qk_rope_head_dim`, and the compressed
    branches' YaRN in a flat `rope_scaling` under `type` beside `rope_theta` / `compress_rope_theta`."""
    hub = {k: v for k, v in resaved.items() if k not in (
        "layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor")}
    compress = dict(resaved["rope_parameters"]["compress"])
    hub.update(compress_ratios=[RATIOS[k] for k in resaved["layer_types"]],
               compress_rate_hca=resaved["compress_rates"][HCA],
               num_hash_layers=resaved["mlp_layer_types"].count("hash_moe"),
               rope_theta=resaved["rope_parameters"]["main"]["rope_theta"], compress_rope_theta=compress["rope_theta"],
               rope_scaling={"type": compress["rope_type"], **{k: compress[k] for k in (
                   "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")}})
    return hub


def hub_name(stored: str) -> str:
    """transformers' save_pretrained keeps the hub's names under `model.` but for the main kv norm (`attn.norm`,
    `attn.kv_norm` on the hub: tests/data/deepseek-v4-flash/README.md): the hub's own."""
    renames = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    if stored in renames:
        return renames[stored]
    if stored.startswith("model.hc_head.hc_"):
        return "hc_head_" + stored.removeprefix("model.hc_head.hc_")
    return re.sub(r"\.attn\.norm\.", ".attn.kv_norm.", stored.removeprefix("model."))


@pytest.fixture(scope="module")
def hub_twin(tiny_deepseek_v4, tmp_path_factory):
    """The tiny checkpoint with the hub's config fields and tensor names."""
    import json

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("dsv4_hub")
    for f in tiny_deepseek_v4.iterdir():
        if f.suffix == ".safetensors":
            save_file({hub_name(k): v for k, v in load_file(f).items()}, out / f.name)
        elif f.name == "config.json":
            (out / f.name).write_text(json.dumps(hub_config(json.loads(f.read_text()))))
        else:
            (out / f.name).symlink_to(f)
    return out


def test_hub_dialect_parses_as_transformers_reads_it(tiny_deepseek_v4, hub_twin):
    """Both dialects parse to one config; each rope table is the one transformers derives from the hub file."""
    import json

    from transformers import DeepseekV4Config as HFConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from ktlite.runtime.models.rope import RotaryEmbedding

    ours = models.load_config(hub_twin)
    assert ours == models.load_config(tiny_deepseek_v4)
    hf = HFConfig(**json.loads((hub_twin / "config.json").read_text()))
    rotary = DeepseekV4RotaryEmbedding(hf)
    positions = torch.arange(0, 400, 7)
    for kind, rope in (("main", ours.rope), ("compress", ours.compress_rope)):
        cos, sin = rotary(torch.zeros(1), positions[None], layer_type=kind)
        got = RotaryEmbedding(rope).cos_sin(positions)
        assert (got[0] - cos[0]).abs().max() <= 1e-5 and (got[1] - sin[0]).abs().max() <= 1e-5, kind


def test_hub_names_load_to_the_same_logits(pair, hub_twin, ids, expected):
    """The hub's tensor names (`embed`, `layers.N.attn.wq_a`, `hc_head_fn`, ...) serve the same model."""
    assert (models.load(hub_twin)(ids) - expected).abs().max().item() <= TOL


# ---- the Engine -------------------------------------------------------------------------------------------------

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
EXACT = {"kt_method": "BF16", "dtype": "float32", "max_total_tokens": 2048, "chunked_prefill_size": 256,
         "gpu_memory": "1GiB", "max_running_requests": 4}


@pytest.fixture(scope="module")
def engine_expected(pair):
    """Prompts of 5..30 tokens and transformers' greedy tokens and last-token logits for each, one at a time."""
    from hf_checkpoints import engine_expectations

    return engine_expectations(pair[1], pair[0].config.vocab_size, GREEDY["max_tokens"])


def test_engine_cpu_experts_equal_transformers_and_the_caches_are_planned_exactly(tiny_deepseek_v4, engine_expected):
    """Every routed expert on the CPU (the clamp in its kernel); the KV pool (compressed entries, index keys) and the
    state pool (the window rows' and the compressors' rings, per running request: no prefix-cache snapshots) are
    allocated as planned, and the plan's arithmetic is the config's."""
    from hf_checkpoints import served_as_transformers

    plan, states, allocated = served_as_transformers(tiny_deepseek_v4, EXACT, engine_expected, GREEDY, TOL)
    requests = EXACT["max_running_requests"]
    assert not states.snapshot_rows
    assert plan.mismatches(allocated) == {} and allocated["kv_pool"] > 0 and allocated["state_pool"] > 0
    # per token, fp32: its stripe of the entries and index keys (32 / 4 and 16 / 4 on the 2 CSA layers, 32 / 8 on the
    # HCA one)
    assert plan.kv_bytes_per_token == (2 * (8 + 4) + 4) * 4
    # per request, fp32: the window's 8 rows x 32 on 4 layers; kv + gate rings: HCA 8 positions x 32; CSA 2 x 4
    # positions x 2 x 32, its indexer x 2 x 16
    assert plan.bytes("state_pool") == requests * (4 * 8 * 32 + 2 * (1 * 8 * 32 + 2 * 8 * 64 + 2 * 8 * 32)) * 4


def test_half_gpu_experts_chunk_5_and_preemption(tiny_deepseek_v4, engine_expected):
    """Chunks of 5 tokens (mixed with other requests' decode tokens) close windows mid-chunk from the ring the
    previous chunk left; 48 KV slots force
    preemption, and a preempted request recomputes its prompt (its rings are rewritten before they are read);
    decode steps run half the experts on the device (the clamp in the fused MoE), half on the CPU, prefill chunks
    all of them on the device (layerwise), and the placement moves every 2 steps."""
    from ktlite import Engine

    batch, tokens, _ = engine_expected
    flags = {**EXACT, "kt_num_gpu_experts": 4, "chunked_prefill_size": 5, "max_total_tokens": 48,
             "enable_mixed_chunk": True,  # decode tokens ride along with the prefill chunks
             "kt_gpu_prefill_token_threshold": 4,  # chunks of 5 run every expert on the device (layerwise)
             "kt_enable_dynamic_expert_update": True, "kt_expert_update_interval": 2}  # experts move mid-run
    with Engine(str(tiny_deepseek_v4), **flags) as eng:
        initial = eng.runtime.placement()
        assert [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)] == tokens
        assert eng.scheduler.preemptions > 0 and eng.runtime.placement() != initial
        assert eng.runtime.runner.kv_pool.used_tokens == 0


def test_engine_tp2_equals_transformers(tiny_deepseek_v4, engine_expected):
    """Two ranks: query heads and output groups split, the shared KV head, compressors and indexer replicated (their
    caches too); every rank's plan equals what it allocated."""
    from ktlite import Engine

    batch, tokens, _ = engine_expected
    with Engine(str(tiny_deepseek_v4), **EXACT, kt_num_gpu_experts=3, tensor_parallel_size=2) as eng:
        got = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        plan, allocated = eng.runtime.plan, eng.runtime.allocated_per_rank
    assert got == tokens
    assert len(allocated) == 2 and all(plan.mismatches(used, rank) == {} for rank, used in allocated.items())


def test_speculative_decoding_is_refused(tiny_deepseek_v4):
    """A verify forward would advance the compressors' rings over drafts that may be rejected: refused before
    allocating (the recurrent families rewind theirs)."""
    from ktlite import Engine
    from ktlite.errors import ConfigError

    with pytest.raises(ConfigError, match="speculative decoding does not roll that state back"):
        Engine(str(tiny_deepseek_v4), **EXACT, speculative_algorithm="NGRAM", speculative_num_steps=3)


def test_bf16_cpu_device_close_to_transformers(tiny_deepseek_v4, engine_expected):
    """The serving dtype on a CPU device: bf16 activations, the dense layers INT8 (wo_a stored per group), the
    mHC weights, sinks and position biases fp32 as the hub keeps them; close to transformers' fp32 logits, and
    allocated as planned."""
    from test_tensor_parallel import logits_of

    from ktlite import Engine
    from ktlite.runtime.plan_components import allocated_by_component

    batch, _, logits = engine_expected
    with Engine(str(tiny_deepseek_v4), **{**EXACT, "dtype": "bfloat16"}, kt_num_gpu_experts=3) as eng:
        model, plan = eng.runtime.runner.model, eng.runtime.plan
        attn = model.model.layers[0].self_attn
        assert attn.wo_a is None and attn.wo_a_groups is not None  # quantized per group
        assert {model.model.layers[0].attn_hc.fn.dtype, attn.attn_sink.dtype, attn.compressor.ape.dtype} == {
            torch.float32}
        rel = (torch.linalg.norm(logits_of(eng, batch) - logits) / torch.linalg.norm(logits)).item()
        allocated = {**allocated_by_component(model), **plan.allocated()}
    # bf16 activations and INT8 dense layers over a random tiny model (large weights, 4 streams): ~5-10 % measured;
    # a wrong layout (wo_a's groups, the fp32 parameters) is ~100 %
    assert 0 < rel < 0.2, rel
    assert plan.mismatches(allocated) == {}


def test_no_prefix_cache_a_next_turn_recomputes(tiny_deepseek_v4, pair):
    """A request resuming from another's prefix would close the window straddling the prefix's end into the
    prefix's shared slots: the prefix cache is off (no state snapshots planned or kept), the next turn of a
    conversation recomputes its whole prompt, and its tokens equal transformers'."""
    from hf_checkpoints import hf_greedy_each

    from ktlite import Engine

    g = torch.Generator().manual_seed(9)
    first, added = (torch.randint(4, pair[0].config.vocab_size, (n,), generator=g).tolist() for n in (21, 6))
    with Engine(str(tiny_deepseek_v4), **EXACT) as eng:
        assert eng.scheduler.cache is None and not eng.runtime.runner.state_pool.snapshot_rows
        r1 = eng.generate(input_ids=first, sampling_params=GREEDY)
        second = first + r1.token_ids + added
        r2 = eng.generate(input_ids=second, sampling_params=GREEDY)
    assert r1.cached_tokens == r2.cached_tokens == 0
    assert [r1.token_ids, r2.token_ids] == hf_greedy_each(pair[1], [first, second], GREEDY["max_tokens"])


# ---- the published config's plan ------------------------------------------------------------------------------

FLASH = Path(__file__).parent / "data" / "deepseek-v4-flash"
FLASH_KV = (21 * (128 + 32) + 20 * 4) * 2  # bf16 (tests/data/deepseek-v4-flash/README.md)
FLASH_STATE = (43 * 128 * 512 + 20 * 2 * 128 * 512 + 21 * 2 * 8 * 1024 + 21 * 2 * 8 * 256) * 4  # fp32 rings


def test_flash_config_reads_as_published():
    cfg = models.load_config(FLASH)
    assert cfg.layer_kinds[:4] == (SLIDING, SLIDING, CSA, HCA) and cfg.layer_kinds[-1] == CSA
    assert (cfg.layer_kinds.count(CSA), cfg.layer_kinds.count(HCA), cfg.hash_layers) == (21, 20, (0, 1, 2))
    assert (cfg.window, cfg.index_topk, cfg.csa_rate, cfg.hca_rate, cfg.fp8_block_size) == (128, 512, 4, 128, (128, 128))
    assert (cfg.rope.head_dim, cfg.compress_rope.factor, cfg.compress_rope.original_max_position_embeddings) == (
        64, 16.0, 65536)


@pytest.mark.parametrize(("gpu", "tp"), [("24GiB", 1), ("16GiB", 2)])
def test_plan_of_flash_one_24gib_and_two_16gib_gpus(gpu, tp):
    """The KV and state arithmetic of the published config, and `ktlite plan` on 1 x 24 GiB and 2 x 16 GiB."""
    from click.testing import CliRunner

    from ktlite.cli import main
    from ktlite.runtime.memory import make_plan
    from ktlite.runtime.plan_inputs import PlanInputs

    plan = make_plan(models.load_config(FLASH), PlanInputs(gpu_memory=gpu, tensor_parallel_size=tp,
                                                           max_running_requests=8, state_snapshots=0))
    assert plan.kv_bytes_per_token == FLASH_KV == 6_880
    assert plan.bytes("kv_pool") == plan.kv_pool_tokens * FLASH_KV
    assert plan.bytes("state_pool") == 8 * FLASH_STATE and FLASH_STATE == 23_478_272
    attention = (43 * (4_195_328 + 2_097_664 + 3 * 33_562_624 + 256)  # wq_a, wkv, wq_b / wo_a / wo_b, fp32 sinks
                 + 21 * (16_777_216 + 16_384 + 8_390_656 + 524_288 + 4_194_304 + 4_096) + 20 * (8_388_608 + 262_144))
    if tp == 1:  # fp8 projections, bf16 compressors, fp32 sinks and position biases (README): as the hub stores them
        assert plan.bytes("attention") == attention == 5_401_249_024
    else:  # query heads and output groups split; the shared KV head, compressors and indexer replicated
        split = 43 * (3 * 33_562_624 + 256) // 2
        assert plan.bytes("attention") == attention - split
    result = CliRunner().invoke(main, ["plan", "--model", str(FLASH), "--gpu-memory", gpu,
                                       "--tensor-parallel-size", str(tp)])
    assert result.exit_code == 0, result.output
    assert "verdict: fits" in result.stdout and f"x {FLASH_KV:,} B" in result.stdout
    assert f"GPU {tp - 1} of {tp}" in result.stdout and f"{64 // tp} of 64 heads" in result.stdout


# ---- the hub's FP4 experts --------------------------------------------------------------------------------------


def twin_folders(root: Path, hub_twin: Path, tiny: Path) -> tuple[Path, Path]:
    """Two folders with every file but the weights: `packed` the hub twin's, `plain` the transformers-written one's."""
    import shutil

    packed_dir, plain_dir = root / "packed", root / "plain"
    for folder, source in ((packed_dir, hub_twin), (plain_dir, tiny)):
        folder.mkdir()
        for f in source.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, folder / f.name)
    return packed_dir, plain_dir


@pytest.fixture(scope="module")
def fp4_pair(tiny_deepseek_v4, hub_twin, tmp_path_factory):
    """(the hub twin with its routed experts in the hub's FP4: `w1.weight` int8 [out, in / 2] e2m1 pairs and
    `w1.scale` e8m0 per 32 inputs; the transformers-written folder with those experts as transformers dequantizes
    them)."""
    from safetensors.torch import load_file, save_file
    from test_mx_experts import fp4_quantize, transformers_fp8_path

    packed_dir, plain_dir = twin_folders(tmp_path_factory.mktemp("dsv4_fp4"), hub_twin, tiny_deepseek_v4)
    expert = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
    packed, plain = {}, {}
    for name, w in load_file(tiny_deepseek_v4 / "model.safetensors").items():
        if expert.search(name):
            codes, scales = fp4_quantize(w.float())
            packed[hub_name(name)] = codes.view(torch.int8)
            packed[hub_name(name).removesuffix("weight") + "scale"] = scales.view(torch.float8_e8m0fnu)
            plain[name] = transformers_fp8_path(codes.view(torch.int8), scales.view(torch.float8_e8m0fnu))
        else:
            packed[hub_name(name)], plain[name] = w, w
    save_file(packed, packed_dir / "model.safetensors")
    save_file(plain, plain_dir / "model.safetensors")
    return packed_dir, plain_dir


def test_fp4_experts_equal_transformers_on_their_dequantized_weights(fp4_pair):
    """`--kt-method FP4` serves the hub's routed experts as stored (CPU rows, 3 a layer in the device's MX stacks,
    the clamp in both): logits and greedy tokens equal transformers' on the dequantized folder."""
    packed, plain = fp4_pair
    assert_fp4_engine_equals(packed, hf_model(plain), (5, 30), seed=3)


def assert_fp4_engine_equals(packed: Path, ref: torch.nn.Module, lengths: tuple[int, ...], seed: int) -> None:
    """`--kt-method FP4` on `packed` (3 GPU experts a layer, the rest CPU rows): logits and greedy tokens of prompts
    of `lengths` equal transformers' (`ref`, on the dequantized folder)."""
    from hf_checkpoints import hf_last_logits_and_greedy
    from test_tensor_parallel import logits_of

    from ktlite import Engine

    g = torch.Generator().manual_seed(seed)
    batch = [torch.randint(4, ref.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    with Engine(str(packed), **{**EXACT, "kt_method": "FP4", "kt_num_gpu_experts": 3}) as eng:
        got = logits_of(eng, batch)
        tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
    want, expected = hf_last_logits_and_greedy(ref, batch, GREEDY["max_tokens"])
    assert (got - want).abs().max().item() <= TOL and tokens == expected


def test_tiny_model_fp4_serves_as_transformers_dequantizes_it(tmp_path):
    """`ktlite tiny-model --arch deepseek_v4 --fp4` stores the routed experts as the hub does (int8 e2m1 pairs, an
    F8_E8M0 `.scale` per 32 inputs; all 16 codes in use); `--kt-method FP4` serves that folder == transformers on the
    folder with those experts as transformers dequantizes them."""
    import shutil

    from click.testing import CliRunner
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from test_mx_experts import transformers_fp8_path

    from ktlite.cli import main

    packed, plain = tmp_path / "fp4", tmp_path / "plain"
    result = CliRunner().invoke(main, ["tiny-model", str(packed), "--arch", "deepseek_v4", "--fp4"])
    assert result.exit_code == 0, result.output
    tensors = load_file(packed / "model.safetensors")
    scales = [n for n in tensors if n.endswith(".scale")]
    with safe_open(packed / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(n).get_dtype() for n in scales} | {f.get_slice(n.removesuffix("scale") + "weight").get_dtype()
                                                                 for n in scales}
    assert dtypes == {"F8_E8M0", "I8"} and all(".experts." in n for n in scales)
    codes = torch.cat([tensors[n.removesuffix("scale") + "weight"].view(torch.uint8).flatten() for n in scales])
    assert set(torch.cat((codes & 15, codes >> 4)).tolist()) == set(range(16))
    shutil.copytree(packed, plain, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: (transformers_fp8_path(t, tensors[n.removesuffix("weight") + "scale"])
                   if n.removesuffix("weight") + "scale" in tensors else t) for n, t in tensors.items()
               if not n.endswith(".scale")}, plain / "model.safetensors")
    assert_fp4_engine_equals(packed, hf_model(plain), (6, 25), seed=4)


def test_tiny_model_fp4_refuses_stacked_experts(tmp_path):
    """gpt-oss keeps every expert of a layer in one tensor (MX blocks on the hub): --fp4 says it cannot write that."""
    from click.testing import CliRunner

    from ktlite.cli import main

    result = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "x"), "--arch", "gpt_oss", "--fp4"])
    assert result.exit_code == 2 and "per-expert FP4" in result.output


# KTransformers' DeepSeek-V4-Flash tutorial (kvcache-ai/ktransformers doc/en/DeepSeek-V4-Flash.md, "Launch Command (8x
# RTX 5090 Example)"), verbatim but for the command name, the paths and --tensor-parallel-size: 8 there, 1 here (8
# ranks need 8 GPUs, or 8 CPU processes on this 2-core machine, and a model with 8 query heads)
KT_V4 = ("--host 127.0.0.1 --port 30000 --model {M} --kt-weight-path {M} --kt-method MXFP4 --kt-num-gpu-experts 144 "
         "--kt-cpuinfer 8 --kt-threadpool-count 2 --kt-gpu-prefill-token-threshold 4096 "
         "--kt-enable-dynamic-expert-update --tensor-parallel-size 1 --attention-backend flashinfer "
         "--mem-fraction-static 0.80 --chunked-prefill-size 2048 --max-running-requests 4 --max-total-tokens 32768 "
         "--watchdog-timeout 3000 --disable-shared-experts-fusion --cuda-graph-bs 1 2 4 --cuda-graph-max-bs 4 "
         "--trust-remote-code")
# its "Optional: Enable MTP" flags, appended
KT_V4_MTP = (" --speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 "
             "--speculative-num-draft-tokens 4 --speculative-moe-runner-backend auto")


def test_ktransformers_v4_launch_line_serves_an_fp4_checkpoint(tmp_path):
    """The tutorial's line (SGLang's several-valued --cuda-graph-bs included) serves `tiny-model --fp4` over the
    OpenAI API; with its MTP flags appended the server refuses to start and names the flag, suggesting no other
    algorithm (V4's compressor state has no rewind: no speculative decoding yet)."""
    import subprocess
    import sys

    import openai
    from test_cli import Server

    from ktlite.runtime.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "M", "deepseek_v4", fp4=True, seed=6)
    server = Server(KT_V4.format(M=model).split(), tmp_path)
    try:
        client = openai.OpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none", max_retries=0, timeout=120)
        chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8,
                                                     temperature=0, messages=[{"role": "user", "content": "hi"}],
                                                     stream=True))
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    finally:
        assert server.stop() == 0
    assert "--cuda-graph-bs 1,2,4: accepted, no effect" in server.stderr_path.read_text()
    refused = subprocess.run([sys.executable, "-m", "ktlite.launch_server", *(KT_V4 + KT_V4_MTP).format(M=model).split()],
                             capture_output=True, text=True, timeout=600)
    error = refused.stderr.splitlines()[-1]
    assert refused.returncode != 0 and "--speculative-algorithm" in error and "NGRAM" not in error, refused.stderr[-2000:]

# ---- the hub's block-FP8 dense weights ----------------------------------------------------------------------------

HUB_FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.ffn\.shared_experts\.w[123]\.weight$")
HUB_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
             "weight_block_size": [128, 128]}  # tests/data/deepseek-v4-flash/config.json


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn codes, float8_e8m0fnu scales [ceil(N/128), ceil(K/128)]): a power-of-two scale per
    128 x 128 block, the block's largest value within e4m3's 448."""
    n, k = w.shape
    blocks = F.pad(w.float(), (0, -k % 128, 0, -n % 128)).view(-(-n // 128), 128, -(-k // 128), 128)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)).clamp_min(2.0**-60) / 448)))
    codes = (blocks / scale[:, None, :, None]).view(blocks.shape[0] * 128, -1)[:n, :k].to(torch.float8_e4m3fn)
    return codes, scale.to(torch.float8_e8m0fnu)


def fp8_dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return codes.float() * full[: codes.shape[0], : codes.shape[1]]


@pytest.fixture(scope="module")
def fp8_pair(tiny_deepseek_v4, hub_twin, tmp_path_factory):
    """(the hub twin with the hub's block-FP8 projections: e4m3 `weight` + e8m0 `scale` per 128 x 128 block, and its
    quantization_config; the transformers-written folder with those weights dequantized)."""
    import json

    from safetensors.torch import load_file, save_file

    packed_dir, plain_dir = twin_folders(tmp_path_factory.mktemp("dsv4_fp8"), hub_twin, tiny_deepseek_v4)
    config = json.loads((packed_dir / "config.json").read_text())
    (packed_dir / "config.json").write_text(json.dumps({**config, "quantization_config": HUB_QUANT}))
    packed, plain = {}, {}
    for name, w in load_file(tiny_deepseek_v4 / "model.safetensors").items():
        hub = hub_name(name)
        if HUB_FP8.search(hub):
            codes, scale = fp8_blocks(w)
            packed[hub], packed[hub.removesuffix("weight") + "scale"] = codes, scale
            plain[name] = fp8_dequantized(codes, scale)
        else:
            packed[hub], plain[name] = w, w
    save_file(packed, packed_dir / "model.safetensors")
    save_file(plain, plain_dir / "model.safetensors")
    return packed_dir, plain_dir


def test_fp8_projections_equal_transformers_on_their_dequantized_weights(fp8_pair, ids):
    """The hub's FP8 projections with `.scale` e8m0 blocks: dequantized at load (the reference model) and kept FP8
    on the device (`--weight-dtype fp8`: FP8Linear layers where the hub has FP8, bf16 compressors), both equal to
    transformers on the dequantized folder."""
    from test_tensor_parallel import logits_of

    from ktlite import Engine
    from ktlite.runtime.models.fp8 import FP8Linear

    packed, plain = fp8_pair
    ref = hf_model(plain)
    with torch.no_grad():
        want = ref(ids).logits
    assert (models.load(packed)(ids) - want).abs().max().item() <= TOL
    batch = ids.tolist()
    with Engine(str(packed), **EXACT, weight_dtype="fp8") as eng:
        attn = eng.runtime.runner.model.model.layers[1].self_attn  # a CSA layer
        assert all(isinstance(getattr(attn, n), FP8Linear) for n in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"))
        assert isinstance(attn.indexer.wq_b, FP8Linear) and not isinstance(attn.compressor.wkv, FP8Linear)
        got = logits_of(eng, batch)
    assert (got - want[:, -1]).abs().max().item() <= TOL


def test_fp8_kv_cache_is_refused_before_allocating():
    from ktlite.errors import ConfigError
    from ktlite.runtime.memory import make_plan
    from ktlite.runtime.plan_inputs import PlanInputs

    with pytest.raises(ConfigError, match="FP8 KV cache is not supported yet"):
        make_plan(models.load_config(FLASH), PlanInputs(gpu_memory="24GiB", kv_cache_dtype="fp8_e4m3"))
