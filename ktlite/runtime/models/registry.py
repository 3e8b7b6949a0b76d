"""Which family serves a checkpoint: `architectures[0]` (or `model_type`) -> the family's module.

A family module defines ARCHITECTURES, MODEL_TYPES, `parse_config(raw) -> config` and `Model`
(`Model(config, routed_experts: bool)`, a `base.CausalLM`). Adding a family is adding its module
here."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ktlite.errors import ConfigError

FAMILY_MODULES = ("deepseek", "deepseek_v32", "glm_moe_dsa", "qwen3_moe", "qwen3_next", "minimax_m2", "glm4_moe",
                 "gpt_oss")


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"ktlite.runtime.models.{name}")


def supported() -> list[str]:
    return [arch for name in FAMILY_MODULES for arch in _module(name).ARCHITECTURES]


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers (e.g. Kimi-K2.5) nest the language model's config in `text_config`."""
    text = raw.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text and "num_hidden_layers" not in raw:
        return {**text, "quantization_config": text.get("quantization_config") or raw.get("quantization_config")}
    return raw


def family_of(raw: dict[str, Any]) -> ModuleType:
    raw = _text_config(raw)
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    for name in FAMILY_MODULES:
        module = _module(name)
        # a nested text_config (e.g. Kimi-K2.5's) names its family by model_type only
        if any(a in module.ARCHITECTURES for a in archs) or (not archs and model_type in module.MODEL_TYPES):
            return module
    raise ConfigError(f"config.json: architectures={archs!r} (model_type {model_type!r}) is not supported; "
                      f"ktlite serves {', '.join(supported())}")


def parse(raw: dict[str, Any]):
    return family_of(raw).parse_config(_text_config(raw))


def model_class(cfg) -> type:
    """The model class of a parsed config (its family module's `Model`)."""
    for name in FAMILY_MODULES:
        module = _module(name)
        if cfg.architecture in module.ARCHITECTURES:
            return module.Model
    raise ConfigError(f"no model family for architecture {cfg.architecture!r}")


def tiny_configs() -> dict[str, dict[str, Any]]:
    """{`ktlite tiny-model --arch` name: config fields} over every family (their TINY_CONFIGS)."""
    return {name: fields for module in map(_module, FAMILY_MODULES) for name, fields in module.TINY_CONFIGS.items()}
