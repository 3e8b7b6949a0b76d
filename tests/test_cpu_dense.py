"""CPU-only device path (--cpu-dense-method): the device-side Linear layers quantized at load and run by
the CPU kernels (ktlite/kernels/cpu/dense_linear.py, ktlite/runtime/cpu_dense.py).

Exactness is checked against the dequantized weights, not the original ones: quantization changes the
logits of a random tiny model enough to flip greedy tokens, but an engine whose quantized layers are
swapped back for nn.Linear layers holding their dequantized values computes the same function, so its
logits must match to fp32 rounding and its greedy tokens exactly.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_tensor_parallel import logits_of
from torch import nn

from ktlite import Engine
from ktlite.cli import main
from ktlite.config import EngineConfig
from ktlite.errors import ConfigError
from ktlite.kernels.cpu import dense_linear, device_blocks, mla_block
from ktlite.kernels.cpu.dense_linear import QuantizedHeads, QuantizedLinear
from ktlite.kernels.cpu.quant import dequantize, int8_activation_values, quantize, relative_error
from ktlite.runtime.cpu_dense import (apply_cpu_dense, eligible_linears, fused_groups, head_matrix_owners,
                                      planned_weight_bytes, quantize_dense)
from ktlite.runtime.forward_batch import ForwardBatch
from ktlite.runtime.plan_components import WEIGHT_COMPONENTS, allocated_by_component
from ktlite.runtime.models import build, load_config
from ktlite.runtime.models import layers as model_layers
from ktlite.runtime.models.base import Embedding
from ktlite.runtime.models.config import RouterSpec
from ktlite.runtime.models.layers import MLP, RMSNorm, Router
from ktlite.runtime.models.rope import apply_rope
from ktlite.runtime.models.router import route_args, select_experts
from ktlite.runtime.models.tp_layers import TPContext, VocabParallelEmbedding
from ktlite.runtime.tiny_model import write_tiny_model

# no prefix cache: the second generate of a test must recompute its prompts, not reuse the first one's KV
FLAGS = {"device": "cpu", "kt_method": "BF16", "dtype": "float32", "cpu_dense_method": "INT8",
         "max_total_tokens": 512, "chunked_prefill_size": 128, "gpu_memory": "1GiB", "max_running_requests": 4, "disable_radix_cache": True}
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


# ---- QuantizedLinear against float64 math on its dequantized weight ----------------------------------

@pytest.mark.parametrize("method", ["INT8", "INT4"])
@pytest.mark.parametrize("tokens", [1, 3, 37])  # row dots from the stored bytes, rows decoded once, matmul
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_equals_dequantized_matmul(method, tokens, bias):
    g = torch.Generator().manual_seed(tokens)
    layer = nn.Linear(100, 72, bias=bias)  # K = 100: rows zero padded to the stored length
    with torch.no_grad():
        layer.weight.copy_(torch.randn(72, 100, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(72, generator=g))
    q = QuantizedLinear.from_linear(layer, method, None)
    x = torch.randn(tokens, 100, generator=g)
    want = x.double() @ q.dequantized().double().T + (layer.bias.double() if bias else 0.0)
    got = q(x)
    assert got.dtype == torch.float32 and got.shape == (tokens, 72)
    # fp32 sums of 100 products of O(1) values: rounding ~1e-6 relative to the terms
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the output is in the input's dtype. In bf16 (8-bit mantissa, relative rounding 2^-9) the matmul path
    # also rounds the weights, each product then off by <= 2^-8 of |x w|, and the result by 2^-9 of itself
    x16 = x.bfloat16()
    got16 = q(x16)
    assert got16.dtype == torch.bfloat16
    w = q.dequantized().double()
    want16 = x16.double() @ w.T + (layer.bias.bfloat16().double() if bias else 0.0)
    bound = 2**-8 * (x16.double().abs() @ w.abs().T + want16.abs()) + 1e-6
    assert bool(((got16.double() - want16).abs() <= bound).all())


@pytest.mark.parametrize("method", ["INT8", "INT4"])
@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("tile", [None, 2 * 40 * 100, 3 * 100])  # whole matrices, 2 per tile, 3 rows per tile
def test_quantized_heads_equal_per_head_dequantized_matmuls(method, tokens, tile, monkeypatch):
    """QuantizedHeads (MLA's W_UK / W_UV on a CPU device): head g of x [..., G, K] times its own W_g [N, K]."""
    if tile is not None:
        monkeypatch.setattr(dense_linear, "TILE_WEIGHTS", tile)
    g = torch.Generator().manual_seed(tokens)
    heads = QuantizedHeads.from_matrices(torch.randn(5, 40, 100, generator=g), method, None)
    x = torch.randn(2, tokens, 5, 100, generator=g)
    want = torch.einsum("btgk,gnk->btgn", x.double(), heads.dequantized().double())
    got = heads(x)
    assert got.dtype == torch.float32 and got.shape == (2, tokens, 5, 40)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert heads(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("method", ["INT8", "INT4"])
def test_quantized_heads_int8_activations(method):
    """Per-head matrices dotting int8 activations (with AVX512-VNNI: 4 x 4 tiles, each head's rows against its own
    rows of x), against float64 math on the same quantized activations."""
    g = torch.Generator().manual_seed(3)
    heads = QuantizedHeads.from_matrices(torch.randn(5, 40, 100, generator=g), method, None, int8_activations=True)
    x = torch.randn(6, 5, 100, generator=g)
    want = torch.einsum("tgk,gnk->tgn", int8_activation_values(x), heads.dequantized().double())
    assert relative_error(heads(x), want) < 1e-6


def test_quantized_linear_tiles_and_leading_dims(monkeypatch):
    """The matmul path in several dequantized tiles, for x [B, S, K]."""
    monkeypatch.setattr(dense_linear, "TILE_WEIGHTS", 3 * 64)  # 3 rows per tile: 7 tiles, the last partial
    layer = nn.Linear(64, 20, bias=True)
    q = QuantizedLinear.from_linear(layer, "INT8", None)
    x = torch.randn(2, 5, 64)
    want = x.double() @ q.dequantized().double().T + layer.bias.double()
    torch.testing.assert_close(q(x).double(), want, rtol=1e-5, atol=1e-5)


# ---- the engine on a CPU device ----------------------------------------------------------------------

ARCHS = ("deepseek_v3", "deepseek_v2", "deepseek_v32", "glm_moe_dsa", "qwen3_moe", "qwen3_next", "minimax_m2",
         "glm4_moe")


@pytest.fixture(scope="module")
def tiny_arch(tmp_path_factory, tiny_v3):
    """arch -> a tiny random checkpoint of that family, written on first use."""
    paths = {"deepseek_v3": tiny_v3}

    def get(arch: str) -> Path:
        if arch not in paths:
            paths[arch] = write_tiny_model(tmp_path_factory.mktemp("tiny") / arch, arch, seed=4)
        return paths[arch]

    return get


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (9, 14)]


class DenseHeads(nn.Module):
    """Per-head matrices w [G, N, K] in torch: x [..., G, K] -> [..., G, N]."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.register_buffer("w", w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...gk,gnk->...gn", x, self.w.to(x.dtype))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrices, as QuantizedHeads offers its own (MLA's decompressed form reads them)."""
        return self.w.to(dtype)


def dequantized_back(model: nn.Module) -> None:
    """Swap every QuantizedLinear for an nn.Linear holding its dequantized weight (and bias), and every
    QuantizedHeads for DenseHeads of its dequantized matrices."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is QuantizedHeads:
                setattr(parent, name, DenseHeads(child.dequantized()))
            elif isinstance(child, QuantizedLinear):
                layer = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    layer.weight.copy_(child.dequantized())
                    if child.bias is not None:
                        layer.bias.copy_(child.bias)
                setattr(parent, name, layer)


@pytest.mark.parametrize("case", [f"{arch}-INT8" for arch in ARCHS] + ["deepseek_v3-INT4", "qwen3_moe-INT4"])
def test_engine_quantizes_the_device_side_and_equals_its_dequantized_weights(case, tiny_arch):
    arch, method = case.split("-")
    path = tiny_arch(arch)
    flags = {**FLAGS, "cpu_dense_method": method.lower()}  # any case
    with Engine(str(path), **flags) as eng:
        model = eng.runtime.runner.model
        assert {m.stack.method for m in model.modules() if isinstance(m, QuantizedHeads)} == {method}
        # no torch Linear stays: MLA's kv_b_proj (its keep_linears) became the per-head W_UK / W_UV
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        mla = [m for m in model.modules() if hasattr(m, "head_matrices")]
        mla_family = arch.startswith("deepseek") or arch == "glm_moe_dsa"
        assert len(mla) == (len(model.model.layers) if mla_family else 0) and (not mla_family or mla)
        for attn in mla:
            c = attn.cfg
            assert attn.kv_b_proj is None
            # the query's first projection and the latent's, one matrix (fused_linears)
            assert isinstance(attn.q_kv_a_proj, QuantizedLinear) and attn.kv_a_proj_with_mqa is None
            assert (attn.uk_heads.heads, attn.uk_heads.out_features, attn.uk_heads.in_features) == (
                c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim)
            assert (attn.uv_heads.heads, attn.uv_heads.out_features, attn.uv_heads.in_features) == (
                c.num_attention_heads, c.v_head_dim, c.kv_lora_rank)
        assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.plan_component == "lm_head"
        assert type(model.model.embed_tokens) is Embedding
        assert all(m.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, Router))
        for layer in model.model.layers:  # attention (or linear attention) projections, dense MLP, shared experts
            assert any(isinstance(m, QuantizedLinear) for m in layer.self_attn.modules())
            shared = getattr(layer.mlp, "shared_experts", layer.mlp)
            if shared is not None:
                assert not any(isinstance(m, nn.Linear) for m in shared.modules())
                assert any(isinstance(m, QuantizedLinear) for m in shared.modules())
                if isinstance(shared, MLP):
                    assert isinstance(shared.gate_up_proj, QuantizedLinear) and shared.gate_proj is None
        # the bytes the memory plan would count for this method, from the meta-built model
        meta = build(load_config(path), "meta", torch.float32, routed_experts=False)
        planned = planned_weight_bytes(meta, method)
        allocated = allocated_by_component(model)
        assert {c: allocated.get(c, 0) for c in WEIGHT_COMPONENTS} == {c: planned.get(c, 0) for c in WEIGHT_COMPONENTS}
        assert eng.runtime.plan.mismatches({c: allocated.get(c, 0) for c in WEIGHT_COMPONENTS}) == {}  # the plan used

        batch = prompts(eng.runtime.vocab_size)
        got_tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        got = logits_of(eng, batch)  # prefill: matmul path (lm_head: one row per prompt, row dots)
        got_one = logits_of(eng, [[5]])  # one token: the row-dot kernel everywhere
        dequantized_back(model)
        assert not any(isinstance(m, QuantizedHeads) for m in model.modules())
        want_tokens = [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=GREEDY)]
        want, want_one = logits_of(eng, batch), logits_of(eng, [[5]])
    assert_same_function(got, want)
    assert_same_function(got_one, want_one)
    assert got_tokens == want_tokens


@pytest.mark.parametrize("interleave", [True, False], ids=["rope-pairs", "rope-halves"])
def test_compiled_block_rope_and_norm_equal_the_modules(interleave):
    """The compiled block's RoPE (both layouts: the DeepSeek tests' checkpoints cover only one) and RMSNorm against
    rope.py's and RMSNorm's."""
    g = torch.Generator().manual_seed(0)
    x, angles = torch.randn(64, generator=g), torch.randn(32, generator=g)
    rotated = np.empty(64, np.float32)
    device_blocks.rope_rotated(x.numpy(), angles.cos().numpy(), angles.sin().numpy(), interleave, rotated)
    torch.testing.assert_close(torch.from_numpy(rotated), apply_rope(x, angles.cos(), angles.sin(), interleave))
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    normed = np.empty(64, np.float32)
    device_blocks.rms_scaled(x.numpy(), norm.weight.detach().numpy(), np.float32(norm.eps), normed)
    torch.testing.assert_close(torch.from_numpy(normed), norm(x).detach())


@pytest.mark.parametrize("case", ["deepseek_v2-INT4", "deepseek_v3-INT8", "deepseek_v3-INT4", "qwen3_moe-INT8",
                                  "deepseek_v3-INT8-bfloat16"])
def test_compiled_decode_blocks_equal_the_modules(case, tiny_arch, monkeypatch):
    """A decode step on a CPU device runs as compiled blocks (runtime/compiled_decode.py) where every layer has them
    (MLA families): MLA's attention with the layer's input norm and residual add, each MoE layer's norm, router,
    routed and shared experts and residual add, each dense MLP with its norm and add, one call each; otherwise each
    quantized SwiGLU MLP is still one call (swiglu_rows). The logits and stored latents equal the torch modules'
    (KTLITE_FORCE_TORCH_KERNELS sends all back to them) on the same weights, with and without a query LoRA and the
    V3 router's sigmoid, correction bias and group limit (V2 / V3), and GQA attention with no shared experts (Qwen3:
    no plan). A module swapped after a step is seen: the kept plan is not run (here no plan is left: the swapped
    o_proj has no compiled form; the other layers' attention is still one compiled call from the normalised input),
    and the result is the same function. Over a bf16 KV pool (the last case) the block reads and writes the pool's
    bf16 rows; its stored latents are the modules' within one bf16 rounding (2^-8 relative: the same fp32 value up to
    its summation order, rounded once)."""
    arch, method, *kv_dtype = case.split("-")
    calls = {"attention": 0, "moe": 0, "dense_mlp": 0, "mlp": 0, "attention_block": 0}

    def counted(name, fn):
        def run(*args):
            out = fn(*args)
            calls[name] += out is not None  # dense_linear.swiglu_rows' None: the modules run
            return out
        return run

    for name, kernel in {"attention": "mla_attention_residual", "moe": "moe_block_rows",
                         "dense_mlp": "swiglu_residual"}.items():  # called from Python only: safe to wrap
        monkeypatch.setattr(device_blocks, kernel, counted(name, getattr(device_blocks, kernel)))
    monkeypatch.setattr(model_layers, "swiglu_rows", counted("mlp", model_layers.swiglu_rows))  # MLP.forward's
    # MLAttention.forward_batch's own compiled call, where no plan runs
    monkeypatch.setattr(mla_block, "mla_decode_block", counted("attention_block", mla_block.mla_decode_block))
    flags = {**FLAGS, "cpu_dense_method": method, "kv_cache_dtype": kv_dtype[0] if kv_dtype else "auto"}
    with Engine(str(tiny_arch(arch)), **flags) as eng:
        runner, model = eng.runtime.runner, eng.runtime.runner.model
        ids = prompts(eng.runtime.vocab_size)
        pool = runner.kv_pool
        rows = [pool.alloc_request() for _ in ids]
        slots = [pool.alloc_tokens(r, len(p)) for r, p in zip(rows, ids)]
        runner.forward(ForwardBatch.build(ids, [0] * len(rows), rows, slots, [True] * len(rows), runner.device))
        new = [pool.alloc_tokens(r, 1) for r in rows]
        decode = ForwardBatch.build([[7], [11]], [len(p) for p in ids], rows, new, [True] * len(rows), runner.device)
        mla = "latent" in pool.buffers
        stored = (lambda: pool.buffer("latent", 1)[torch.cat(new)].clone()) if mla else (lambda: None)
        before = dict(calls)
        got, got_latents = runner.forward(decode), stored()
        ran = {name: calls[name] - before[name] for name in calls}
        again = runner.forward(decode)  # the kept plan
        with monkeypatch.context() as forced:
            forced.setenv("KTLITE_FORCE_TORCH_KERNELS", "1")
            counts = dict(calls)
            want, want_latents = runner.forward(decode), stored()  # the same slots, rewritten by the modules
            assert calls == counts  # the modules ran: no compiled call
        if mla:  # a module swapped after a step: the kept plan is not used (no plan now: o_proj has no compiled form)
            attn = model.model.layers[1].self_attn
            linear = nn.Linear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False)
            with torch.no_grad():
                linear.weight.copy_(attn.o_proj.dequantized())
            attn.o_proj = linear
            counts = dict(calls)
            swapped = runner.forward(decode)
            assert [calls[k] - counts[k] for k in ("attention", "moe", "dense_mlp")] == [0, 0, 0]
            # the other layers' attention still one compiled call each, from the normalised input
            assert calls["attention_block"] - counts["attention_block"] == len(model.model.layers) - 1
    layers = len(model.model.layers)
    moe_layers = len(runner.moe_layers)
    dense = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MLP)]
    assert moe_layers > 0
    if mla:
        assert ran == {"attention": layers, "moe": moe_layers, "dense_mlp": len(dense), "mlp": 0, "attention_block": 0}
        assert_same_function(swapped, want)
    else:
        assert ran == {"attention": 0, "moe": 0, "dense_mlp": 0, "attention_block": 0,
                       "mlp": sum(isinstance(m, MLP) and m.gate_up_proj is not None for m in model.modules())}
        assert ran["mlp"] > 0
    assert_same_function(got, want)
    torch.testing.assert_close(again, got)
    if mla:
        torch.testing.assert_close(got_latents.float(), want_latents.float(), rtol=2.0**-8 if kv_dtype else 1e-5,
                                   atol=1e-5)


ROUTERS = {  # (scoring, method, n_group, topk_group, normalize, scaling, correction bias): the families' routers
    "v2-lite": ("softmax", "greedy", 1, 1, False, 1.0, False),
    "v2": ("softmax", "group_limited_greedy", 8, 3, False, 16.0, False),
    "v3": ("sigmoid", "noaux_tc", 8, 4, True, 2.5, True),
    "qwen3": ("softmax", "greedy", 1, 1, True, 1.0, False),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_compiled_router_equals_select_experts(name):
    """device_blocks.route_rows (the MoE block's router) picks the experts select_experts picks, with the same
    weights."""
    scoring, method, n_group, topk_group, normalize, scaling, biased = ROUTERS[name]
    spec = RouterSpec(64, 6, scoring, method, n_group, topk_group, normalize, scaling, correction_bias=biased)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(33, 64, generator=g) * 3
    bias = torch.randn(64, generator=g) * 0.1 if biased else None
    want_ids, want_w = select_experts(logits, spec, bias)
    ids, weights = device_blocks.route_rows(logits.numpy(),
                                            np.zeros(0, np.float32) if bias is None else bias.numpy(), route_args(spec))
    want_order, order = want_ids.argsort(dim=1), torch.from_numpy(ids).argsort(dim=1)
    assert torch.equal(torch.from_numpy(ids).gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(torch.from_numpy(weights).gather(1, order), want_w.gather(1, want_order))


def assert_same_function(got: torch.Tensor, want: torch.Tensor) -> None:
    """Logits of the same weights in fp32, summed in other orders (row kernel, oneDNN, all-reduce): equal to
    1e-4 of the logits' scale through 3-4 layers (seen: up to 1.3e-5, Qwen3-Next's recurrent layers the
    most). Quantizing the weights at all moves them by ~5e-2 of it."""
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def as_rank_shards_dequantized(model: nn.Module, shards: list[dict], method: str) -> None:
    """Give each eligible Linear of a TP=1 model the dequantized values the TP ranks compute with: a
    row-parallel weight (split along K) quantized per rank's column range, every other one whole (groups
    run along K, so a split into rows or heads changes nothing, and head matrices are quantized whole)."""
    for _, module, matrices in list(head_matrix_owners(model)):
        for name, w in matrices.items():
            setattr(module, name, DenseHeads(dequantize(quantize(w, method, None))))
    for name, _, _, layer in eligible_linears(model):
        w = layer.weight.detach()
        cuts = sorted({rank[name + ".weight"][1:] for rank in shards
                       if rank.get(name + ".weight", (0,))[0] == 1})
        parts = [w[:, lo:hi] for lo, hi in cuts] or [w]
        with torch.no_grad():
            layer.weight.copy_(torch.cat([dequantize(quantize(p, method, None)) for p in parts], dim=1))


def test_tensor_parallel_ranks_quantize_their_shards(tiny_v3):
    """TP=2 on CPU: each rank quantizes its own shard after loading it. Its weight bytes are those of its
    quantized meta shard, and the logits are those of one process holding the ranks' dequantized values
    (not TP=1's quantization: o_proj's K = 64 splits into 32 columns per rank, zero padded to a group
    of its own, where TP=1's groups span 64 columns)."""
    cfg = load_config(tiny_v3)
    batch = prompts(cfg.vocab_size)
    with Engine(str(tiny_v3), **FLAGS, tensor_parallel_size=2) as eng:
        got = logits_of(eng, batch)
        allocated = eng.runtime.allocated_per_rank
    shards = []
    for rank in (0, 1):
        meta = build(cfg, "meta", torch.float32, routed_experts=False, tp=TPContext(rank, 2))
        assert isinstance(meta.lm_head, nn.Linear) and isinstance(meta.model.embed_tokens, VocabParallelEmbedding)
        planned = planned_weight_bytes(meta, "INT8")
        assert all(allocated[rank].get(c, 0) == planned.get(c, 0) for c in WEIGHT_COMPONENTS), rank
        shards.append(meta.tp_shards)
    with Engine(str(tiny_v3), **{**FLAGS, "cpu_dense_method": "none"}) as eng:
        model = eng.runtime.runner.model
        assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
        as_rank_shards_dequantized(model, shards, "INT8")
        want = logits_of(eng, batch)
    assert_same_function(got, want)


def test_quantize_dense_frees_each_weight_as_it_goes(tiny_v3, monkeypatch):
    """Peak RAM while quantizing: the full-precision model plus one layer's (or fused group's) quantized copy,
    not two models; kv_b_proj, stored as per-head W_UK / W_UV, is freed too."""
    model = build(load_config(tiny_v3), "cpu", torch.float32, routed_experts=False)
    old = [weakref.ref(layer.weight) for _, _, _, layer in eligible_linears(model)]
    head_sources = [weakref.ref(m.kv_b_proj.weight) for _, m, _ in head_matrix_owners(model)]
    groups = [len(names) for _, _, names in fused_groups(model)]
    alive = []
    init = QuantizedLinear.__init__

    def counting(self, *args, **kwargs):
        alive.append(sum(ref() is not None for ref in old))
        init(self, *args, **kwargs)

    monkeypatch.setattr(QuantizedLinear, "__init__", counting)
    assert quantize_dense(model, "INT8") == len(old) + 2 * len(head_sources)  # W_UK and W_UV per MLA layer
    # a fused group's parts are dropped once stacked, before quantizing; a single Linear is freed once replaced
    fused = [len(old) - sum(groups[: i + 1]) for i in range(len(groups))]
    singles = list(range(fused[-1], 0, -1))
    assert alive == fused + singles
    assert all(ref() is None for ref in old + head_sources) and len(head_sources) == 3
    # MLA's query and latent projections in 3 layers; gate and up of layer 0's dense MLP and 2 layers' shared experts
    assert groups == [2] * 6


# ---- switching it off, and the flag ------------------------------------------------------------------

def test_none_fp32_and_cuda_keep_torch_layers(tiny_v3):
    cfg = load_config(tiny_v3)
    for flags in ({"device": "cpu", "cpu_dense_method": "none"}, {"device": "cpu", "dtype": "float32"},
                  {"device": "cuda"}):
        model = build(cfg, "cpu", torch.float32, routed_experts=False)
        before = [name for name, _, _, _ in eligible_linears(model)]
        apply_cpu_dense(model, EngineConfig.from_kwargs(str(tiny_v3), **flags))
        assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
        assert [name for name, _, _, _ in eligible_linears(model)] == before


def test_auto_is_int8_on_a_cpu_device_unless_fp32_is_asked_for(tiny_v3):
    quantization = {(dtype, method): EngineConfig.from_kwargs(str(tiny_v3), device="cpu", dtype=dtype,
                                                             cpu_dense_method=method).cpu_dense_quantization
                    for dtype in ("auto", "bfloat16", "float32") for method in ("auto", "INT4", "none")}
    assert quantization == {("auto", "auto"): "INT8", ("bfloat16", "auto"): "INT8", ("float32", "auto"): None,
                            ("auto", "INT4"): "INT4", ("bfloat16", "INT4"): "INT4", ("float32", "INT4"): "INT4",
                            ("auto", "none"): None, ("bfloat16", "none"): None, ("float32", "none"): None}


@pytest.mark.parametrize("amx_bf16", [True, False], ids=["bf16_attention_cpu", "no_bf16_products"])
def test_auto_kv_pool_is_bf16_on_a_bf16_cpu_unless_fp32_is_asked_for(tiny_v3, amx_bf16, monkeypatch):
    """--kv-cache-dtype auto on a CPU device: bf16 where the CPU multiplies bf16 in hardware (AMX-BF16 or
    AVX512-BF16: prefill attention in bf16 products) and --dtype is auto; an explicit --dtype keeps its own
    (float32: the exact reference setting); CUDA keeps the activation dtype. Both CPUs are stood in for
    (target.bf16_attention_cpu), whichever this one is."""
    from ktlite import config

    monkeypatch.setattr(config, "bf16_attention_cpu", lambda: amx_bf16)
    kv = {(device, dtype): EngineConfig.from_kwargs(str(tiny_v3), device=device, dtype=dtype).torch_kv_dtype
          for device in ("cpu", "cuda") for dtype in ("auto", "float32", "bfloat16")}
    assert kv == {("cpu", "auto"): torch.bfloat16 if amx_bf16 else torch.float32, ("cpu", "float32"): torch.float32,
                  ("cpu", "bfloat16"): torch.bfloat16, ("cuda", "auto"): torch.bfloat16,
                  ("cuda", "float32"): torch.float32, ("cuda", "bfloat16"): torch.bfloat16}


@pytest.mark.parametrize("bad", ["INT3", "fp8", "BF16", ""])
def test_bad_method_names_the_flag(tiny_v3, bad):
    with pytest.raises(ConfigError, match="--cpu-dense-method"):
        EngineConfig.from_kwargs(str(tiny_v3), cpu_dense_method=bad)


def test_cli_flag_reaches_the_config(tiny_v3):
    result = CliRunner().invoke(main, ["generate", "Hi", "--model-path", str(tiny_v3), "--cpu-dense-method", "INT3"])
    assert result.exit_code == 1 and "--cpu-dense-method" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["generate", "--help"])
    assert "--cpu-dense-method" in result.output
