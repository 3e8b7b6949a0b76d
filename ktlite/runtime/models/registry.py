"""Which family serves a checkpoint: `architectures[0]` (or `model_type`) -> the family's module.

A family module defines ARCHITECTURES, MODEL_TYPES, `parse_config(raw) -> config` and `Model`
(`Model(config, routed_experts: bool)`, a `base.CausalLM`). Adding a family is adding its module
here. A wrapper family (Kimi-K2.5) parses the whole file into another family's config (its
`architecture` names the family whose `Model` runs it) and defines no Model of its own; a multimodal
wrapper no family claims is served by the family of the language model in its `text_config`."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ktlite.errors import ConfigError
from ktlite.runtime.models.wrapper import text_config

FAMILY_MODULES = ("deepseek", "kimi_k25", "deepseek_v32", "glm_moe_dsa", "qwen3_moe", "qwen3_next", "qwen3_5_moe",
                  "minimax_m2", "glm4_moe", "gpt_oss", "minimax_m3",
                  "deepseek_v4", "glm5_next")


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"ktlite.runtime.models.{name}")


def supported() -> list[str]:
    return [arch for name in FAMILY_MODULES for arch in _module(name).ARCHITECTURES]


def _match(raw: dict[str, Any]) -> ModuleType | None:
    archs = raw.get("architectures") or []
    for name in FAMILY_MODULES:
        module = _module(name)
        # a nested text_config (e.g. Kimi-K2.5's on the hub) names its family by model_type only
        if any(a in module.ARCHITECTURES for a in archs) or (not archs and raw.get("model_type") in module.MODEL_TYPES):
            return module
    return None


def _resolve(raw: dict[str, Any]) -> tuple[ModuleType, dict[str, Any]]:
    """(family, the config dict it parses): a wrapper family that parses the whole file (Kimi-K2.5), else
    the family of the language model a multimodal wrapper nests in `text_config`, or of a plain file."""
    for candidate in (raw, text_config(raw)):
        module = _match(candidate)
        if module is not None:
            return module, candidate
    archs, model_type = raw.get("architectures") or [], raw.get("model_type")
    raise ConfigError(f"config.json: architectures={archs!r} (model_type {model_type!r}) is not supported; "
                      f"ktlite serves {', '.join(supported())}")


def family_of(raw: dict[str, Any]) -> ModuleType:
    return _resolve(raw)[0]


def parse(raw: dict[str, Any]):
    module, fields = _resolve(raw)
    return module.parse_config(fields)


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
