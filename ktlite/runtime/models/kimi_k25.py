"""Kimi-K2.5 / K2.6: a vision-language wrapper around a DeepSeek-V3 language model (Kimi-K2's); ktlite serves
its text, with the DeepSeek family's model (deepseek.py).

config.json: `architectures` KimiK25ForConditionalGeneration (transformers' own class writes
Kimi_K25ForConditionalGeneration), `model_type` kimi_k25, the language model's config in `text_config`
(`model_type` kimi_k2 on the hub, deepseek_v3 once transformers re-saves it), the MoonViT tower's in
`vision_config`; the INT4 experts' `quantization_config` at the wrapper (hub) or inside `text_config`.
transformers ties the lm_head to the embedding by the wrapper's `tie_word_embeddings` (its default: true).

Weights: the hub stores `language_model.model.*` and `language_model.lm_head.weight` next to
`vision_tower.*` and `mm_projector.*`. transformers 5.24's `save_pretrained` writes the decoder layers as
`language_model.model.blocks.{i}.*`: its K2.5 weight mapping renames the vision tower's `blocks` to
`layers` on load, and the reverse runs over the language model's names too (its loader maps them back). In
memory transformers names them `model.language_model.*` and `lm_head.weight`. All three read as the
model's own names (`WEIGHT_RENAMES`); the vision tensors are never read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ktlite.errors import ConfigError
from ktlite.runtime.models import deepseek_config
from ktlite.runtime.models.wrapper import text_config
from ktlite.runtime.models.deepseek_config import DeepseekConfig

ARCHITECTURES = ("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration")
MODEL_TYPES = ("kimi_k25",)

# (stored prefix, our prefix): the hub's names first (what `ktlite tiny-model` writes), then transformers'
WEIGHT_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.blocks.", "model.layers."),
    ("model.language_model.", "model."),
)


def parse_config(raw: dict[str, Any]) -> DeepseekConfig:
    """The wrapper's config.json: its `text_config` parsed as DeepSeek-V3, read through WEIGHT_RENAMES."""
    text = text_config(raw)
    if text is raw:
        raise ConfigError("config.json: a kimi_k25 config needs the language model's fields in `text_config`")
    if text.get("model_type", "kimi_k2") not in deepseek_config.MODEL_TYPES:
        raise ConfigError(f"config.json: text_config.model_type={text['model_type']!r} is not a DeepSeek-V3 model "
                          f"(one of {deepseek_config.MODEL_TYPES})")
    text = {**text, "tie_word_embeddings": raw.get("tie_word_embeddings", True)}
    cfg = deepseek_config.parse_config(text)
    return dataclasses.replace(cfg, weight_renames=WEIGHT_RENAMES, vision_skipped="vision_config" in raw)


# `ktlite tiny-model --arch kimi_k25`: the wrapper around tiny DeepSeek-V3 text fields (the writer nests the
# shared tiny fields in `text_config` too) and a tiny vision config, as the hub's file has one
TINY_CONFIGS = {"kimi_k25": {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "tie_word_embeddings": False,
    "text_config": {**deepseek_config.TINY_CONFIGS["deepseek_v3"], "model_type": "kimi_k2"},
    "vision_config": {"patch_size": 14, "vt_hidden_size": 16, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 2},
}}
