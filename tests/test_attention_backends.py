"""The attention interface (ktlite/kernels/attention.py): what is registered, that it matches each kind's
signature, that importing the interface loads no kernel module, and that the selection rule picks by device."""

import inspect
import subprocess
import sys

import pytest
import torch

import ktlite.kernels.triton as kt
from ktlite.kernels import attention


def test_every_kind_has_a_torch_reference_and_a_triton_kernel() -> None:
    for kind in attention.KINDS:
        assert {"torch", "triton"} <= set(attention.implementations(kind)), kind


@pytest.mark.parametrize("impl", attention.REGISTERED, ids=lambda i: f"{i.kind}-{i.name}")
def test_registered_implementation_takes_its_kinds_parameters(impl: attention.Impl) -> None:
    """The kernel takes the kind's parameters, same names and order; any it adds after them are optional."""
    with kt.interpreted():  # a Triton kernel module decides "interpreted" when first imported
        kernel = attention.resolve(impl.target)
        accepts = attention.resolve(impl.accepts) if impl.accepts else None
    spec = list(inspect.signature(attention.KINDS[impl.kind].__call__).parameters)[1:]
    params = list(inspect.signature(kernel).parameters.values())
    assert [p.name for p in params[: len(spec)]] == spec
    assert all(p.default is not inspect.Parameter.empty for p in params[len(spec):])
    assert accepts is None or callable(accepts)


def test_a_misspelt_registration_fails_when_made() -> None:
    with pytest.raises(ValueError):
        attention.Impl("gqa_extnd", "cpu", "ktlite.kernels.cpu.x:y")
    with pytest.raises(ValueError):
        attention.Impl("gqa_extend", "numba", "ktlite.kernels.cpu.x:y")
    with pytest.raises(ValueError):
        attention._registry((attention.Impl("gqa_extend", "cpu", "a:b"), attention.Impl("gqa_extend", "cpu", "c:d")))


def test_importing_the_interface_loads_no_kernel_module() -> None:
    code = ("import sys, ktlite.kernels.attention; "
            "print(sorted(m for m in sys.modules if m.endswith(('_attn', 'kernels.cpu.attention'))"
            " or m == 'triton'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def _mla_decode_args(dtype: torch.dtype) -> tuple:
    kv = torch.randn(8, 20, dtype=dtype)
    return (torch.randn(1, 2, 20, dtype=dtype), kv, torch.arange(8, dtype=torch.int32)[None], torch.tensor([0]),
            torch.tensor([5]), 0.3, 16)


def test_selection_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KTLITE_FORCE_TORCH_KERNELS", raising=False)
    fp32, fp16 = _mla_decode_args(torch.float32), _mla_decode_args(torch.float16)
    assert attention.select("mla_decode", *fp32) == "cpu"  # CPU fp32, a compiled kernel registered
    assert attention.select("mla_decode", *fp16) == "torch"  # its accepts says no (an fp16 pool)
    assert attention.select("mla_extend", *fp32[:4], torch.tensor([4]), torch.tensor([1]), 0.3, 16) == "cpu"
    assert attention.select("gqa_decode", fp32[0], fp32[1], fp32[1], *fp32[2:6]) == "cpu"
    assert attention.select("gqa_decode", fp16[0], fp16[1], fp16[1], *fp16[2:6]) == "torch"  # an fp16 pool
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention.select("mla_decode", *fp32) == "triton"
    monkeypatch.setenv("KTLITE_FORCE_TORCH_KERNELS", "1")
    assert attention.select("mla_decode", *fp32) == "torch"


def test_a_kind_runs_what_select_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    from ktlite.kernels.cpu import attention as cpu_attention
    from ktlite.kernels.triton.reference import mla_decode_torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KTLITE_FORCE_TORCH_KERNELS", raising=False)
    fp32, fp16 = _mla_decode_args(torch.float32), _mla_decode_args(torch.float16)
    assert torch.equal(attention.mla_decode(*fp32), cpu_attention.mla_decode(*fp32))
    assert torch.equal(attention.mla_decode(*fp16), mla_decode_torch(*fp16))
    assert list(inspect.signature(attention.mla_decode).parameters)[:2] == ["q", "kv_buffer"]  # help() shows it
