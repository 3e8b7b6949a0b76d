"""Shared fixtures: tiny random checkpoints, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from ktlite.runtime.tiny_model import write_tiny_model

DATA = Path(__file__).parent / "data"
# how long a test waits for something that should happen (a request aborted, KV freed, a reply) before it calls
# it a hang: waits end as soon as the event happens, so this is sized for the slowest loaded CI machine, not a speed
HANG_GUARD_S = 120.0
# how long a server subprocess may take to start listening: on a fresh clone its start includes numba's first
# compile of the kernels it warms up, minutes on a busy 2-core machine
STARTUP_GUARD_S = 900.0


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module's tiny models (hf_checkpoints.one_torch_thread)."""
    from hf_checkpoints import one_torch_thread

    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "v3", "deepseek_v3", seed=1)


@pytest.fixture(scope="session")
def tiny_v2(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "v2", "deepseek_v2", seed=2)


@pytest.fixture(scope="session")
def tiny_v3_fp8(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "v3fp8", "deepseek_v3", fp8=True, seed=3)


@pytest.fixture(scope="session", params=["deepseek_v3", "deepseek_v2"])
def tiny_model(request, tiny_v3, tiny_v2) -> Path:
    """Each architecture in turn."""
    return tiny_v3 if request.param == "deepseek_v3" else tiny_v2


GQA_FAMILIES = ("qwen3_moe", "minimax_m2", "glm4_moe")
HF_FAMILIES = GQA_FAMILIES + ("deepseek_v32", "glm_moe_dsa", "qwen3_next")


@pytest.fixture(scope="session")
def hf_gqa_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints of the newer families written by transformers (see tests/hf_checkpoints.py)."""
    from hf_checkpoints import write_hf_checkpoint

    root = tmp_path_factory.mktemp("hf_gqa")
    return {family: write_hf_checkpoint(root / family, family, seed=i) for i, family in enumerate(HF_FAMILIES)}


@pytest.fixture(scope="session", params=GQA_FAMILIES)
def tiny_gqa(request, hf_gqa_checkpoints) -> Path:
    """Each GQA family in turn."""
    return hf_gqa_checkpoints[request.param]


@pytest.fixture(scope="session")
def tiny_v32(hf_gqa_checkpoints) -> Path:
    """DeepSeek-V3.2 (sparse attention, index_topk 6) written by transformers."""
    return hf_gqa_checkpoints["deepseek_v32"]


@pytest.fixture(scope="session", params=["deepseek_v32", "glm_moe_dsa"])
def tiny_dsa(request, hf_gqa_checkpoints) -> Path:
    """Each sparse-attention family in turn: DeepSeek-V3.2 and GLM-5 (whose layer 2 reuses layer 1's
    selection), written by transformers."""
    return hf_gqa_checkpoints[request.param]


@pytest.fixture(scope="session")
def tiny_qwen3_next(hf_gqa_checkpoints) -> Path:
    """Qwen3-Next (3 Gated DeltaNet layers + 1 gated attention layer), written by transformers."""
    return hf_gqa_checkpoints["qwen3_next"]


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> Path:
    """gpt-oss written by transformers: sliding window 4 on layers 0 and 2, full attention on layer 1, sinks, 8
    experts top-2 with biases and a clamp limit of 1 (tests/hf_checkpoints.py)."""
    from hf_checkpoints import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_gpt_oss") / "gpt_oss", "gpt_oss", seed=11)


@pytest.fixture(scope="session")
def tiny_minimax_m3(tmp_path_factory) -> Path:
    """MiniMax-M3 written by transformers as the hub ships it (the VL model: text_config, language_model.* beside a
    tiny vision tower): sparse / full / sparse attention (blocks of 4 keys, 2 kept), dense / MoE / MoE MLPs, 8 experts
    top-2 with a shared expert, clamp limit 1 (tests/hf_checkpoints.py)."""
    from hf_checkpoints import write_hf_vl_checkpoint

    return write_hf_vl_checkpoint(tmp_path_factory.mktemp("hf_minimax_m3") / "minimax_m3", "minimax_m3", seed=13)


@pytest.fixture(scope="session")
def tiny_glm5_next(tmp_path_factory) -> Path:
    """GLM-5.3-Flash written by transformers as the hub ships it (the VL model: text_config, `model.language_model.*`
    beside a tiny vision tower): KDA / indexed MLA / indexed MLA reusing the previous selection / KDA, a dense then MoE
    layers, pools of 4 tokens with 2 kept, mHC over 4 streams, clamp limit 1 (tests/hf_checkpoints.py)."""
    from hf_checkpoints import write_hf_vl_checkpoint

    return write_hf_vl_checkpoint(tmp_path_factory.mktemp("hf_glm5_next") / "glm5_next", "glm5_next", seed=17)


@pytest.fixture(scope="session")
def tiny_deepseek_v4(tmp_path_factory) -> Path:
    """DeepSeek-V4 written by transformers: HCA, CSA and sliding-only layers (window 8, rates 8 and 4, indexer top-3),
    hash-MoE then routed MoE layers, mHC over 4 streams, a clamp limit of 1 (tests/hf_checkpoints.py)."""
    from hf_checkpoints import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("hf_deepseek_v4") / "deepseek_v4", "deepseek_v4", seed=13)
