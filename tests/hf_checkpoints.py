"""Tiny checkpoints of the newer families written by transformers itself (not by ktlite).

The model is built from its transformers config class, its random weights are replaced by ones with
a larger spread (so router choices and argmaxes are decisive, as in ktlite's tiny models) rounded to
bf16, and `save_pretrained` writes it in bf16 with the hub's tensor names. The tokenizer files are
the tiny BPE tokenizer ktlite's demo model uses.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

from ktlite.runtime.models import glm5_next, minimax_m3
from ktlite.runtime.tiny_model import BOS, CONTEXT, EOS, train_tokenizer, write_tokenizer_files

# the tiny BPE tokenizer, trained once per session (~4 s a time; every checkpoint here reads it only)
_tokenizer = functools.cache(train_tokenizer)

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, tie_word_embeddings=False)
# the MLA families' shapes and router (DeepSeek-V2/V3, V3.2, GLM-5)
_MLA = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=CONTEXT,
            tie_word_embeddings=False)
_DSA = dict(index_n_heads=16, index_head_dim=32, index_topk=6)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# family -> (transformers config class, its keyword arguments); write_hf_checkpoint's overrides replace keys
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        **_COMMON, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        mlp_only_layers=[0], decoder_sparse_step=1, rope_theta=10000.0)),
    "minimax_m2": (transformers.MiniMaxM2Config, dict(
        **{**_COMMON, "intermediate_size": 32}, num_local_experts=16, num_experts_per_tok=4, rotary_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "glm4_moe": (transformers.Glm4MoeConfig, dict(
        **_COMMON, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
        attention_bias=True, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "deepseek_v32": (transformers.DeepseekV32Config, dict(**_MLA, **_DSA, rope_parameters=_YARN)),
    "glm_moe_dsa": (transformers.GlmMoeDsaConfig, dict(
        **_MLA, **_DSA, index_topk_pattern="FFS", rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen3_next": (transformers.Qwen3NextConfig, dict(
        **{**_COMMON, "num_hidden_layers": 4}, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
        shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    # every layer MoE; mRoPE fields as the hub's text_config states them (for text all position axes are equal)
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, dict(
        **{**_COMMON, "num_hidden_layers": 4}, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
        shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True})),
    # a window of 4 drops keys from 5-token prompts on; a clamp limit of 1 clamps many gate/up values
    "gpt_oss": (transformers.GptOssConfig, dict(
        **{**_COMMON, "intermediate_size": 32, "rms_norm_eps": 1e-5}, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False})),
    "deepseek_v3": (transformers.DeepseekV3Config, dict(**_MLA, rope_parameters=_YARN)),
    # every layer kind, blocks of 4 keys with 2 kept, clamp limit 1 (ktlite's tiny-model fields: minimax_m3.TINY_TEXT)
    "minimax_m3": (transformers.MiniMaxM3VLTextConfig, {**_COMMON, **minimax_m3.TINY_TEXT}),
    # every layer kind: HCA (one entry per 8 tokens), CSA (rate 4, top-3 of the indexer) and sliding-only layers, a
    # window of 8, hash-MoE then routed MoE; ~30-token prompts drop window keys and compressed entries alike; a clamp
    # limit of 1 clamps many gate/up values; the compressed branches' rope is YaRN
    "deepseek_v4": (transformers.DeepseekV4Config, dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        partial_rotary_factor=0.25, q_lora_rank=48, o_groups=2, o_lora_rank=16, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.5,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, index_n_heads=4, index_head_dim=16, index_topk=3, hc_mult=4, hc_sinkhorn_iters=20,
        swiglu_limit=1.0, rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=CONTEXT,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32, "beta_slow": 1}, tie_word_embeddings=False)),
    # KDA, indexed MLA (own indexer, then reusing it), dense then MoE layers; pools of 4 with 2 kept, clamp limit 1
    # (ktlite's tiny-model fields: glm5_next.TINY_TEXT)
    "glm5_next": (transformers.Glm5NextTextConfig, {**_COMMON, **glm5_next.TINY_TEXT}),
    # V2's router (transformers): softmax, best groups by their top expert, always times routed_scaling_factor
    "deepseek_v2": (transformers.DeepseekV2Config, dict(
        **{**_MLA, "q_lora_rank": None, "n_shared_experts": 2, "norm_topk_prob": False, "routed_scaling_factor": 1.5},
        topk_method="group_limited_greedy", rope_parameters=_YARN)),
}


# families whose checkpoints store their (1 + w) norms' w: centred at 0 so every norm scales by about 1
UNIT_OFFSET_NORMS = ("qwen3_next", "qwen3_5_moe", "minimax_m3")


def _spread(model: torch.nn.Module, seed: int, norm_center: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # (1 + w) indexer norms (MiniMax-M3) spread like the others; DSA's LayerNorm indexer keeps its init
            if name.endswith("norm.weight") and ("indexer" not in name or norm_center == 0.0):
                value = norm_center + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("sinks"):  # attention sinks (gpt-oss): logits of the scores' size
                value = torch.randn(p.shape, generator=gen)
            elif name.endswith(("gate.weight", "router.weight")):  # routers
                value = 0.5 * torch.randn(p.shape, generator=gen)
            elif p.dim() == 1:  # biases
                value = 0.05 * torch.randn(p.shape, generator=gen)
            else:
                value = torch.randn(p.shape, generator=gen) * (1.5 / p.shape[-1] ** 0.5)
            p.copy_(value.bfloat16().float())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((0.05 * torch.randn(b.shape, generator=gen)).bfloat16().float())
            elif name.endswith("tid2eid"):  # hash-MoE (DeepSeek-V4): k distinct experts per token id
                experts = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(experts, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]))


def _text_config(family: str, tokenizer, overrides: dict[str, Any]) -> transformers.PreTrainedConfig:
    config_class, kwargs = FAMILIES[family]
    config = config_class(**copy.deepcopy({**kwargs, **overrides}))  # transformers fills rope dicts in place
    config.vocab_size = tokenizer.get_vocab_size()
    config.bos_token_id, config.eos_token_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    return config


def _save(model: torch.nn.Module, path: Path, tokenizer, seed: int, norm_center: float = 1.0) -> Path:
    _spread(model, seed, norm_center)
    model.to(torch.bfloat16).save_pretrained(path)
    write_tokenizer_files(path, tokenizer)
    return path


def _norm_center(family: str) -> float:
    return 0.0 if family in UNIT_OFFSET_NORMS else 1.0


def write_hf_checkpoint(path: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """`family`'s tiny checkpoint; `overrides` replace its config's keyword arguments (e.g. rope_parameters)."""
    tokenizer = _tokenizer()
    config = _text_config(family, tokenizer, overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _save(model, path, tokenizer, seed, _norm_center(family))


# a tiny vision tower: transformers builds and saves the whole vision-language model, ktlite reads its text part
_TINY_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, patch_size=4,
                         temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
# family -> its vision-language wrapper's config class (the hub checkpoints' layout) and the wrapper's fields beside
# text_config (a tiny vision tower) given the text config
VL_CONFIGS: dict[str, tuple[type, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "qwen3_5_moe": (transformers.Qwen3_5MoeConfig,
                    lambda text: dict(vision_config={**_TINY_QWEN_VISION, "out_hidden_size": text["hidden_size"]})),
    "minimax_m3": (transformers.MiniMaxM3VLConfig, lambda text: dict(
        vision_config=minimax_m3.TINY_VISION,
        projector_hidden_size=minimax_m3.TINY_CONFIGS["minimax_m3"]["projector_hidden_size"])),
    "glm5_next": (transformers.Glm5NextConfig, lambda text: dict(vision_config=glm5_next.TINY_VISION)),
}


def write_hf_vl_checkpoint(path: Path, family: str, seed: int = 0) -> Path:
    """`family`'s tiny text model inside its vision-language model (the hub layout: `text_config`, the language
    model's and the vision tower's weights), written by transformers' ConditionalGeneration class."""
    tokenizer = _tokenizer()
    text = _text_config(family, tokenizer, {}).to_dict()
    config_class, wrapper = VL_CONFIGS[family]
    config = config_class(text_config=text, tie_word_embeddings=False, **wrapper(text))
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return _save(model, path, tokenizer, seed, _norm_center(family))


# the smallest MoonViT transformers' Kimi-K2.5 class builds (its vision tower is written, never served)
_TINY_MOONVIT = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                     num_hidden_layers=1, hidden_size=16, intermediate_size=32)


def write_hf_kimi_k25(path: Path, seed: int = 0, **wrapper: Any) -> Path:
    """Kimi-K2.5 written by transformers' own class: the deepseek_v3 family's tiny text_config and a tiny
    vision tower; `wrapper` sets the wrapper config's fields (e.g. tie_word_embeddings)."""
    tokenizer = _tokenizer()
    text = _text_config("deepseek_v3", tokenizer, {})
    config = transformers.Kimi_K25Config(text_config=text.to_dict(), vision_config=_TINY_MOONVIT,
                                         projection_hidden_size=_TINY_MOONVIT["hidden_size"], **wrapper)
    torch.manual_seed(seed)
    return _save(transformers.Kimi_K25ForConditionalGeneration(config), path, tokenizer, seed)


def hf_model(path, auto: type = transformers.AutoModelForCausalLM) -> torch.nn.Module:
    return auto.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_generate(ref: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' n greedy tokens after each row of ids [B, T] (no EOS stop) -> [B, n]."""
    return ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[:, ids.shape[1]:]


def hf_greedy_each(ref: torch.nn.Module, batch: list[list[int]], n: int) -> list[list[int]]:
    """transformers' n greedy tokens for prompts of different lengths, one at a time."""
    return [hf_generate(ref, torch.tensor([ids]), n)[0].tolist() for ids in batch]


@torch.no_grad()
def hf_step_logits(ref: torch.nn.Module, ids: torch.Tensor, first: int) -> torch.Tensor:
    """transformers' cached decode: the first `first` tokens at once, then one at a time -> logits [B, T, vocab]."""
    out = ref(ids[:, :first], use_cache=True)
    steps, cache = [out.logits], out.past_key_values
    for i in range(first, ids.shape[1]):
        out = ref(ids[:, i : i + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
        cache = out.past_key_values
    return torch.cat(steps, dim=1)


@torch.no_grad()
def engine_expectations(ref: torch.nn.Module, vocab: int, n: int, lengths: tuple[int, ...] = (5, 17, 9, 30),
                        seed: int = 7) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """Random prompts of `lengths` tokens, transformers' n greedy tokens and last-token logits for each: what the
    families' Engine tests compare against."""
    g = torch.Generator().manual_seed(seed)
    batch = [torch.randint(4, vocab, (m,), generator=g).tolist() for m in lengths]
    logits, tokens = hf_last_logits_and_greedy(ref, batch, n)
    return batch, tokens, logits


def served_as_transformers(checkpoint: Path, flags: dict[str, Any], expected: tuple, sampling: dict[str, Any],
                           tol: float) -> tuple[Any, Any, dict[str, int]]:
    """Serve `expected`'s prompts (engine_expectations) through the Engine with `flags`: its greedy tokens equal
    transformers' and its last-token logits are within `tol`. Returns (plan, state pool, bytes allocated per plan
    component) for the families' plan checks."""
    from test_tensor_parallel import logits_of

    from ktlite import Engine
    from ktlite.runtime.plan_components import allocated_by_component

    batch, tokens, logits = expected
    with Engine(str(checkpoint), **flags) as eng:
        assert [r.token_ids for r in eng.generate(input_ids=batch, sampling_params=sampling)] == tokens
        assert (logits_of(eng, batch) - logits).abs().max().item() <= tol
        plan = eng.runtime.plan
        return plan, eng.runtime.runner.state_pool, {**allocated_by_component(eng.runtime.runner.model),
                                                      **plan.allocated()}


def hf_last_logits_and_greedy(ref: torch.nn.Module, batch: list[list[int]], n: int) -> tuple[torch.Tensor, list[list[int]]]:
    """transformers' reference for prompts one at a time: last-token logits [B, vocab] and n greedy tokens each
    (no EOS stop)."""
    logits = torch.cat([ref(torch.tensor([ids])).logits[0, -1:] for ids in batch])
    return logits, hf_greedy_each(ref, batch, n)


@torch.no_grad()
def prefill_and_decode_errors(ours: torch.nn.Module, ref: torch.nn.Module, ids: torch.Tensor,
                              prefill: int = 5) -> tuple[float, float]:
    """Max |ours - transformers| over every position's logits: one prefill of `ids` [B, T], and a prefill of the
    first `prefill` tokens followed by one-token decode steps through ours's cache."""
    want = ref(ids).logits
    cache = ours.new_cache(*ids.shape)
    steps = [ours(ids[:, :prefill], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(prefill, ids.shape[1])]
    return (ours(ids) - want).abs().max().item(), (torch.cat(steps, dim=1) - want).abs().max().item()


@torch.no_grad()
def chunked_error(ours: torch.nn.Module, ref: torch.nn.Module, ids: torch.Tensor, chunk: int,
                  hf_config: transformers.PreTrainedConfig) -> float:
    """Max |ours - transformers| over ids [B, T] fed in chunks of `chunk` through each side's cache (transformers'
    own chunked forward is the reference: an indexer breaks its score ties per forward)."""
    from transformers import DynamicCache

    cache, hf_cache, errors = ours.new_cache(*ids.shape), DynamicCache(config=hf_config), []
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        want = ref(piece, cache=hf_cache, use_cache=True).logits
        errors.append((ours(piece, cache) - want).abs().max().item())
    return max(errors)


@torch.no_grad()
def hf_greedy_with_logits(ref: torch.nn.Module, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' n greedy tokens after prompt [B, T] (no EOS stop) and the logits of each step of its cached
    decode -> ([B, n], [B, n, vocab])."""
    out = ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, prompt.shape[1]:], torch.stack(out.logits, dim=1)


@torch.no_grad()
def stepwise_logits(ours: torch.nn.Module, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Ours: the prompt at once, then `tokens` [B, n] one at a time through its cache -> each step's logits
    [B, n, vocab] (step i predicts tokens[:, i])."""
    cache = ours.new_cache(prompt.shape[0], prompt.shape[1] + tokens.shape[1])
    got = [ours(prompt, cache)[:, -1:]] + [ours(tokens[:, i : i + 1], cache) for i in range(tokens.shape[1] - 1)]
    return torch.cat(got, dim=1)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls on one torch thread: OpenMP's wake-ups cost milliseconds a call on a loaded 2-core machine (one
    thread ran tiny models ~10-50x faster than two there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
