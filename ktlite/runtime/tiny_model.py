"""Write small random checkpoints of every family in HF format (the demo model and test fixtures).

The shapes are tiny but exercise every feature a family has (each family module's TINY_CONFIGS:
e.g. MLA with and without q_lora_rank, dense layers before MoE layers, expert groups, shared
experts, YaRN rope with mscale, GQA with per-head or per-layer q/k norms, attention bias, partial
rotary, sigmoid routers with a correction bias). Weights are drawn with a
larger spread than real initialisations so router choices and argmaxes are decisive (no near-ties
that rounding could flip when comparing implementations).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ktlite.kernels.cpu.mx import E2M1_VALUES, MX_GROUP
from ktlite.runtime.models import build
from ktlite.runtime.models.config import ModelConfig, parse_config
from ktlite.runtime.models.wrapper import stored_name
from ktlite.runtime.models.fp8 import FP8Linear
from ktlite.runtime.models.registry import tiny_configs

logger = logging.getLogger(__name__)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
# A chat template in the style of the MLA models' template, reduced to system/user/assistant turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}" + EOS + ""
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)
VOCAB_SIZE = 1024
CONTEXT = 512

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": CONTEXT,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}
# each family module's TINY_CONFIGS: {--arch name: config.json fields beyond _COMMON}
ARCH_CONFIGS = tiny_configs()


def _corpus() -> list[str]:
    """Offline training text: the docstrings of Python's builtins and a few stdlib modules."""
    import builtins
    import collections
    import json as json_mod
    import os
    import string

    texts = [string.__doc__ or ""]
    for module in (builtins, collections, json_mod, os, string):
        for name in sorted(dir(module)):
            doc = getattr(getattr(module, name), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    texts.append("Hello! How are you today? Tell me about Mixture-of-Experts models. 你好，世界。Ünïcödé ✓")
    return texts


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, USER, ASSISTANT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def _random_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():  # a table of expert ids (DeepSeek-V4's hash-MoE tid2eid): k distinct each
            experts = model.config.n_routed_experts
            state[name] = torch.stack([torch.randperm(experts, generator=gen)[: tensor.shape[1]]
                                       for _ in range(tensor.shape[0])])
            continue
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(tensor.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            value = 0.05 * torch.randn(tensor.shape, generator=gen)
        elif name.endswith("gate.weight"):  # router: spread scores so top-k choices are not near-ties
            value = 0.5 * torch.randn(tensor.shape, generator=gen)
        else:
            fan_in = tensor.shape[-1]
            value = torch.randn(tensor.shape, generator=gen) * (1.5 / fan_in**0.5)
        state[name] = value.float()
    return state


def _fp8_quantize(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [N, K] -> (float8_e4m3fn [N, K], scale_inv [ceil(N/b), ceil(K/b)]) (block-FP8 checkpoints)."""
    n, k = weight.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block)
    padded[:n, :k] = weight
    tiles = padded.view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale_inv[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale_inv.float()


def _fp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [N, K] -> (int8 [N, K/2] e2m1 codes, two a byte, the low nibble the even k; float8_e8m0fnu
    [N, K/32] scales), as DeepSeek-V4's hub stores its routed experts. OCP MX v1.0's conversion: a block's scale is
    2^(floor(log2 amax) - 2), which puts its largest value in e2m1's top binade [4, 8), and each value takes the
    nearest e2m1 magnitude (E2M1_VALUES' first eight; bit 3 the sign)."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // MX_GROUP, MX_GROUP)
    exponent = torch.floor(torch.log2(blocks.abs().amax(-1).clamp_min(2.0**-126))) - 2
    scaled = blocks / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) | ((scaled < 0).long() << 3)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(n, k // 2).to(torch.uint8)
    return packed.view(torch.int8), (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _routed_expert_weights(cfg: ModelConfig) -> set[str]:
    """Checkpoint names of every routed expert's gate/up/down matrix (per-expert tensors)."""
    return {cfg.expert_weight_name(layer, e, proj) for layer in cfg.moe_layers for e in range(cfg.n_routed_experts)
            for proj in ("gate", "up", "down")}


def tiny_config(arch: str, **text: Any) -> dict[str, Any]:
    """config.json of `arch`'s tiny model, `text` adding language-model fields (vocabulary, bos/eos): a wrapper
    family (Kimi-K2.5) nests them and the shared tiny fields in its `text_config`."""
    fields = dict(ARCH_CONFIGS[arch])
    nested = fields.pop("text_config", None)
    lm = {**_COMMON, **(fields if nested is None else nested), **text}
    return lm if nested is None else {**fields, "text_config": lm}


def write_tiny_model(
    path: str | Path, arch: str = "deepseek_v3", fp8: bool = False, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
    overrides: dict | None = None, fp8_skip: list[str] | None = None, fp4: bool = False,
) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json into `path`;
    `overrides` replaces config.json fields (e.g. wider experts for formats with 256-wide blocks);
    `fp4` stores the routed experts as FP4 (`_fp4_quantize`; `<weight>` codes and `<base>.scale`, DeepSeek-V4's hub
    layout, served with --kt-method FP4), whatever `fp8` does to the other linear layers;
    `fp8_skip` becomes the FP8 quantization_config's `modules_to_not_convert` (transformers' key), and
    the linear layers it names are written in `dtype`."""
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"--arch must be one of {sorted(ARCH_CONFIGS)}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    raw = {**tiny_config(arch, vocab_size=tokenizer.get_vocab_size(), bos_token_id=tokenizer.token_to_id(BOS),
                         eos_token_id=tokenizer.token_to_id(EOS)), **(overrides or {})}
    if fp8:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        if fp8_skip is not None:
            raw["quantization_config"]["modules_to_not_convert"] = list(fp8_skip)
    cfg = parse_config(raw)
    model = build(cfg, "cpu", torch.float32)
    # the linear layers the config's checkpoint stores in FP8 (embeddings, lm_head, norms, routers and
    # modules_to_not_convert stay high precision)
    fp8_names = {f"{n}.weight" for n, m in build(cfg, "meta", fp8_weights=True).named_modules() if isinstance(m, FP8Linear)}
    fp4_names = _routed_expert_weights(cfg) if fp4 else set()
    tensors: dict[str, torch.Tensor] = {}
    for name, value in _random_state(model, seed).items():
        stored = stored_name(cfg.weight_renames, model.checkpoint_name(name))
        if model.checkpoint_name(name) in fp4_names:
            if value.dim() != 2:  # every expert of a layer in one tensor (gpt-oss: MX blocks on the hub)
                raise ValueError(f"--fp4 writes per-expert FP4 tensors; {arch} stores its routed experts stacked")
            fp4_names.discard(model.checkpoint_name(name))
            tensors[stored], tensors[stored.removesuffix("weight") + "scale"] = _fp4_quantize(value)
        elif fp8 and name in fp8_names:  # the scales under the family's name for them (DeepSeek-V4: `.scale`)
            scale = stored_name(cfg.weight_renames, model.checkpoint_name(name + "_scale_inv"))
            tensors[stored], tensors[scale] = _fp8_quantize(value)
        elif not value.is_floating_point():
            tensors[stored] = value
        elif name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            tensors[stored] = value  # routers stay float32, as in the published checkpoints
        else:
            tensors[stored] = value.to(dtype)
    if fp4_names:
        raise ValueError(f"--fp4: {arch}'s checkpoint has no tensor {min(fp4_names)!r} to store as FP4")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    write_tokenizer_files(path, tokenizer)
    logger.info("wrote tiny %s checkpoint to %s", arch, path)
    return path


def write_tokenizer_files(path: Path, tokenizer: Tokenizer) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and generation_config.json."""
    tokenizer.save(str(path / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": CONTEXT,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2))
