"""HybridMoE: one MoE layer split across device experts and CPU experts equals the reference."""

from __future__ import annotations

import pytest
import torch

from ktlite.kernels.cpu.moe import CPUMoE
from ktlite.runtime.hybrid_moe import HybridMoE
from ktlite.runtime.models import build
from ktlite.runtime.models.config import parse_config
from ktlite.runtime.tiny_model import ARCH_CONFIGS, _COMMON

LAYER = 1


@pytest.fixture(scope="module")
def reference():
    raw = {**_COMMON, **ARCH_CONFIGS["deepseek_v3"], "vocab_size": 64}
    model = build(parse_config(raw), "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model.model.layers[LAYER].mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(16, generator=g))
    return model.model.layers[LAYER].mlp


def make_hybrid(moe, gpu_experts: list[int]) -> tuple[HybridMoE, CPUMoE]:
    e, (i, h) = len(moe.experts), moe.experts[0].gate_proj.weight.shape

    def source(layer, expert):
        m = moe.experts[expert]
        return m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight

    cpu = CPUMoE("BF16", num_threads=1, prefill_dtype=torch.float32)
    cpu_ids = [x for x in range(e) if x not in gpu_experts]
    cpu.reserve_layer(LAYER, e, h, i, cpu_ids)
    for x in cpu_ids:
        cpu.set_expert(LAYER, x, *[w.to(torch.bfloat16).float() for w in source(LAYER, x)])
    n = len(gpu_experts)
    hybrid = HybridMoE(LAYER, moe.gate, moe.shared_experts, gpu_experts, torch.empty(n, 2 * i, h), torch.empty(n, h, i),
                       cpu, lambda l, x: tuple(w.to(torch.bfloat16).float() for w in source(l, x)))
    return hybrid, cpu


def bf16_reference(moe, x):
    """The reference MoE with bf16-rounded expert weights (what the BF16 CPU store holds)."""
    saved = [p.detach().clone() for p in moe.experts.parameters()]
    with torch.no_grad():
        for p in moe.experts.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        out = moe(x)
        for p, s in zip(moe.experts.parameters(), saved):
            p.copy_(s)
    return out


@pytest.mark.parametrize("gpu_experts", [[], [1, 3, 8, 12], list(range(16))])
@pytest.mark.parametrize("tokens", [1, 40])
def test_hybrid_equals_reference(reference, gpu_experts, tokens):
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    hybrid, cpu = make_hybrid(reference, gpu_experts)
    out, deferred = hybrid(x)
    assert deferred is None
    torch.testing.assert_close(out, bf16_reference(reference, x), rtol=1e-4, atol=1e-4)
    cpu.close()


def test_deferred_experts_are_an_exact_split(reference):
    """Deferring D CPU experts per token moves their share to the handle; nothing is lost."""
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))
    hybrid, cpu = make_hybrid(reference, [0, 5])
    full, _ = hybrid(x)
    now, deferred = hybrid(x, defer=2)
    assert deferred is not None
    later = deferred.wait()
    assert (now - full).abs().max() > 1e-3  # something really was deferred
    torch.testing.assert_close(now + later, full, rtol=1e-4, atol=1e-4)
    cpu.close()


def test_cpu_experts_protocol_is_what_hybrid_moe_calls_and_cpumoe_has():
    """CPUExperts lists every method HybridMoE calls on its CPU experts, and CPUMoE has each with the same
    parameters: the protocol is the contract between the two, not a partial copy of it."""
    import inspect
    import re

    from ktlite.kernels.cpu.moe import CPUMoE
    from ktlite.runtime import hybrid_moe

    declared = {n for n, v in vars(hybrid_moe.CPUExperts).items() if inspect.isfunction(v) and not n.startswith("_")}
    called = set(re.findall(r"self\.cpu\.(\w+)\(", inspect.getsource(hybrid_moe.HybridMoE)))
    assert called <= declared, called - declared
    for name in declared:
        want = list(inspect.signature(getattr(hybrid_moe.CPUExperts, name)).parameters)
        assert list(inspect.signature(getattr(CPUMoE, name)).parameters) == want, name
