"""Every family's rope fields with non-default values, in both config dialects, against transformers.

End to end: each checkpoint is written by transformers (`rope_parameters`, what save_pretrained writes);
its hub twin is the same folder with config.json stating rope as the family's hub folders do
(`rope_theta` and `partial_rotary_factor` at top level, MiniMax-M2's `rotary_dim` beside them, the
scaling in `rope_scaling`: under the legacy `type` as DeepSeek's files, under `rope_type` as Qwen's).
Config only (no weights, quick): where each value may be written (top level, `rope_parameters`,
`rope_scaling`, both with different values, nowhere) parses to the frequencies and scale transformers
derives from the same dict."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import FAMILIES, hf_model, write_hf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ktlite.runtime import models
from ktlite.runtime.models.config import parse_config
from ktlite.runtime.models.rope import inv_frequencies

TOL = 1e-4
# no family's default theta, and a yarn whose every field differs from its default
ROPE = {"rope_type": "yarn", "rope_theta": 30000.0, "factor": 3.0, "original_max_position_embeddings": 16,
        "beta_fast": 8.0, "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.9}
# the families with partial rotary, each off its default (Qwen3-Next and Qwen3.5 0.25, GLM-4.5 0.5, MiniMax-M2 its
# rotary_dim)
PARTIAL = {"qwen3_next": 0.5, "qwen3_5_moe": 0.5, "glm4_moe": 0.25, "minimax_m2": 0.75}
HEAD_DIM = 16  # the GQA families' tiny head
# families with one rope for every layer (DeepSeek-V4 has two, nested per rope kind: tests/test_deepseek_v4.py reads
# both of its dialects; GLM-5.3-Flash has none)
ONE_ROPE = tuple(f for f in FAMILIES if f not in ("deepseek_v4", "glm5_next"))
# MiniMax-M3 ships as the VL model (tests/test_minimax_m3.py loads that against transformers): transformers' text-only
# class (MiniMaxM3VLForCausalLM) saves its in-memory names (fused dense gate_up, `indexer.*`), no checkpoint a user has;
# its config placements are read here under the VL class's name, which the hub's files state
VL_ONLY = {"minimax_m3": "MiniMaxM3SparseForConditionalGeneration"}
MLA = ("deepseek_v32", "glm_moe_dsa", "deepseek_v3", "deepseek_v2")  # hub rope_scaling spells `type`


def hub_config(config: dict[str, Any], family: str) -> dict[str, Any]:
    """A re-saved config.json dict with its rope moved from `rope_parameters` to where hub folders keep it."""
    config = copy.deepcopy(config)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {"type" if family in MLA else "rope_type": kind, **rope}
    return config


def write_hub_twin(folder: Path, out: Path, family: str) -> Path:
    """`folder` with its config.json in the hub dialect (the weights and tokenizer linked)."""
    out.mkdir()
    for f in folder.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = hub_config(json.loads((folder / "config.json").read_text()), family)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _rope(family: str, base: dict[str, Any] = ROPE) -> dict[str, Any]:
    return {**base, "partial_rotary_factor": PARTIAL[family]} if family in PARTIAL else dict(base)


def _rotary_dim(family: str) -> dict[str, Any]:
    """MiniMax-M2's files also state the rotated width as `rotary_dim`."""
    return {"rotary_dim": int(HEAD_DIM * PARTIAL[family])} if family == "minimax_m2" else {}


@pytest.fixture(scope="module", params=[f for f in ONE_ROPE if f not in VL_ONLY])
def dialects(request, tmp_path_factory) -> dict[str, Any]:
    """{"resaved": the transformers-written folder, "hub": its hub twin, "rope": the values} of one family."""
    family, root = request.param, tmp_path_factory.mktemp(f"rope_{request.param}")
    rope = _rope(family)
    resaved = write_hf_checkpoint(root / "resaved", family, rope_parameters=rope, **_rotary_dim(family))
    return {"resaved": resaved, "hub": write_hub_twin(resaved, root / "hub", family), "rope": rope}


@pytest.mark.parametrize("dialect", ["resaved", "hub"])
def test_non_default_rope_matches_transformers(dialects, dialect):
    path, rope = dialects[dialect], dialects["rope"]
    ref = hf_model(path)
    assert {k: ref.config.rope_parameters.get(k) for k in rope} == rope  # transformers reads every value stated
    ours = models.load(path)
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
    err = (ours(ids) - expected).abs().max().item()
    assert err <= TOL, f"max |logit difference| {err:.3g}"


# ---- config only: every place a value can be written -------------------------------------------------


def _resaved_dict(family: str, rope: dict[str, Any]) -> dict[str, Any]:
    config_class, kwargs = FAMILIES[family]
    config = config_class(**copy.deepcopy({**kwargs, "rope_parameters": rope, **_rotary_dim(family)})).to_dict()
    config["architectures"] = [VL_ONLY.get(family) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    return json.loads(json.dumps(config))


def _placements(family: str) -> dict[str, dict[str, Any]]:
    """config.json dicts of `family` stating non-default rope values in each place a file may write them."""
    yarn, plain = _rope(family), _rope(family, {"rope_type": "default", "rope_theta": 30000.0})
    resaved = _resaved_dict(family, yarn)
    hub = hub_config(resaved, family)
    cases = {
        "resaved": resaved,
        "hub": hub,
        "hub, rope_scaling under the other key": hub_config(resaved, "qwen3_moe" if family in MLA else "deepseek_v3"),
        "hub, no scaling (rope_scaling null)": hub_config(_resaved_dict(family, plain), family),
        "resaved, no scaling": _resaved_dict(family, plain),
        # a re-save that kept stale top-level values: the rope dict's win (transformers' order)
        "resaved + stale top level": {**resaved, "rope_theta": 1234.0,
                                      **({"partial_rotary_factor": 1.0} if family in PARTIAL else {})},
    }
    # yarn without its pretraining length: transformers takes max_position_embeddings
    cases["hub, yarn without original_max_position_embeddings"] = {
        **hub, "rope_scaling": {k: v for k, v in hub["rope_scaling"].items() if k != "original_max_position_embeddings"}}
    if family == "minimax_m2":
        legacy = {k: v for k, v in hub.items() if k != "partial_rotary_factor"}
        cases["hub, rotary_dim only"] = legacy  # only the legacy field states the rotated width
        cases["hub, rotary_dim 4 only"] = {**legacy, "rotary_dim": 4}
        cases["resaved + stale rotary_dim"] = {**resaved, "rotary_dim": 4}  # rope_parameters' factor wins
    return cases


CASES = [(family, name) for family in ONE_ROPE for name in _placements(family)]


def _transformers_rope(raw: dict[str, Any], family: str) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and cos/sin scale for a config.json dict."""
    config = FAMILIES[family][0].from_dict(copy.deepcopy(raw))
    params = config.rope_parameters
    if params["rope_type"] != "default":
        return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0


@pytest.mark.parametrize(("family", "case"), CASES, ids=[f"{f}: {c}" for f, c in CASES])
def test_rope_placements_parse_as_transformers_reads_them(family, case):
    raw = _placements(family)[case]
    expected_freq, expected_scale = _transformers_rope(raw, family)
    rope = parse_config(raw).rope
    freq = inv_frequencies(rope)
    assert freq.shape == expected_freq.shape, f"rotated width {2 * len(freq)}, transformers {2 * len(expected_freq)}"
    err = ((freq - expected_freq) / expected_freq).abs().max().item()
    assert err <= 1e-5, f"frequencies off by up to {err:.3g} (relative)"
    assert math.isclose(rope.cos_sin_scale, expected_scale, rel_tol=1e-6), f"cos/sin scale {rope.cos_sin_scale}, transformers {expected_scale}"
    assert rope.theta == 30000.0  # the stated theta, never a default
