"""Attention backends: one interface per attention kind, its implementations chosen by the tensors' device.

Kinds (each a Protocol below: the signature and shapes, written once), called by the models as
`attention.gqa_extend(q, ...)` and so on:
  mla_decode, mla_extend, sparse_mla, gqa_decode, gqa_extend, gated_delta_rule, causal_conv1d.

Implementations of a kind, by name:
  "triton"  the Triton kernel (GPU; or interpreted on CPU tensors under TRITON_INTERPRET=1, in tests);
  "cpu"     a compiled (numba) kernel for CPU tensors, registered where one exists;
  "torch"   the plain-torch twin in kernels/triton/reference.py: the spec tests compare against, and what a
            CPU call runs when no compiled kernel takes its inputs.
Every kind has a "torch" and a "triton" implementation (tests/test_attention_backends.py checks).

Selection, per call, from the call's arguments (select()):
  1. KTLITE_FORCE_TORCH_KERNELS=1                         -> "torch" (debugging);
  2. the first tensor argument on CUDA, or TRITON_INTERPRET=1 -> "triton";
  3. a CPU tensor: "cpu" where registered and its `accepts` says yes to these arguments (dtype, layout),
     else "torch".

Registering a compiled CPU implementation is one line in REGISTERED below, in its kind's group:

    Impl("gqa_extend", "cpu", "ktlite.kernels.cpu.gqa_attention:gqa_extend", "ktlite.kernels.cpu.gqa_attention:accepts"),

- target "module:function": the kernel. It takes the kind's parameters, same names, same order (it may add
  optional ones after them); it is imported on the first call that selects it, so importing this module loads
  neither Triton nor numba kernel modules.
- accepts "module:function" (optional; None = every CPU input): called with the same arguments as the kernel,
  returns whether the kernel takes them (e.g. fp32/bf16 buffers yes, packed FP8 rows no) — no means the twin runs.
tests/test_attention_backends.py imports every registered target and accepts and checks the kernel's parameters
against its kind's Protocol, so a misspelt path or signature fails there, not in a model.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ktlite.kernels.triton import forced_torch, use_triton

IMPLEMENTATIONS = ("triton", "cpu", "torch")


class MlaDecode(Protocol):
    def __call__(self, q: torch.Tensor, kv_buffer: torch.Tensor, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                 kv_lora_rank: int) -> torch.Tensor:
        """Absorbed-MLA decode. q [B, H, kv_lora_rank + rope], kv_buffer [slots, kv_lora_rank + rope] or packed FP8
        rows [slots, bytes] uint8 (kv_fp8.latent_rows, read in place; the same for mla_extend and sparse_mla),
        req_to_token [max_reqs, max_context] int32, req_pool_indices [B], seq_lens [B] (incl. the current token,
        already in the pool) -> [B, H, kv_lora_rank] in q's dtype."""
        ...


class MlaExtend(Protocol):
    def __call__(self, q: torch.Tensor, kv_buffer: torch.Tensor, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                 sm_scale: float, kv_lora_rank: int) -> torch.Tensor:
        """Absorbed-MLA causal extend. q [N, H, kv_lora_rank + rope] (N = sum(extend_lens), requests in order),
        prefix_lens/extend_lens [B] -> [N, H, kv_lora_rank]; the new tokens' latents are already in the pool."""
        ...


class SparseMla(Protocol):
    def __call__(self, q: torch.Tensor, kv_buffer: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
                 kv_lora_rank: int) -> torch.Tensor:
        """Absorbed MLA over each query's selected pool slots (DSA sparse attention, decode and extend alike).
        q [N, H, kv_lora_rank + rope], kv_buffer as mla_decode's, topk_slots [N, K] int64 (-1 = none; causality
        already applied) -> [N, H, kv_lora_rank] in q's dtype."""
        ...


class GqaDecode(Protocol):
    def __call__(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                 sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """GQA decode over the token pool. q [B, Hq, D], k_buffer [slots, Hkv, D], v_buffer [slots, Hkv, Dv], or
        both packed FP8 rows [slots, Hkv, D + 4] uint8 (kv_fp8.head_rows, read in place; the same for gqa_extend),
        seq_lens [B] (incl. the current token, already in the pool) -> [B, Hq, Dv] in q's dtype. Query head h
        reads kv head h // (Hq // Hkv).
        sinks [Hq] fp32 (optional, gpt-oss / DeepSeek-V4): one extra logit per head that joins the softmax's
        denominator and adds nothing to the output. window > 0: the query at position p sees only the keys at
        positions p - window + 1 .. p (a sliding window of `window` keys, itself included); 0 = all."""
        ...


class GqaExtend(Protocol):
    def __call__(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                 sm_scale: float, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """GQA causal extend. q [N, Hq, D] (N = sum(extend_lens), requests in order) -> [N, Hq, Dv]; the new
        tokens' K/V are already in the pool; token i of request b sees positions 0..prefix_lens[b] + i (only the
        last `window` of them when window > 0). sinks and window as in gqa_decode."""
        ...


class GatedDeltaRule(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 states: torch.Tensor, rows: torch.Tensor, extend_lens: torch.Tensor,
                 reset: torch.Tensor) -> torch.Tensor:
        """Gated delta rule (Gated DeltaNet) over a packed batch; see reference.gated_delta_rule_batch_torch.
        q, k [N, H, dk], v [N, H, dv], g [N, H] (a log decay per head) or [N, H, dk] (per key channel: Kimi Delta
        Attention), beta [N, H]; states [R, H, dk, dv] fp32 updated in place at rows [B]
        (zeroed first where reset [B]); extend_lens [B] -> [N, H, dv]."""
        ...


class CausalConv1d(Protocol):
    def __call__(self, x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                 extend_lens: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv1d + SiLU over a packed batch, continuing each sequence's rolling state
        conv_states [R, C, W-1] (updated in place at rows [B], zeroed first where reset). x [N, C], weight [C, W]."""
        ...


KINDS: dict[str, type] = {
    "mla_decode": MlaDecode, "mla_extend": MlaExtend, "sparse_mla": SparseMla, "gqa_decode": GqaDecode,
    "gqa_extend": GqaExtend, "gated_delta_rule": GatedDeltaRule, "causal_conv1d": CausalConv1d,
}


@dataclass(frozen=True)
class Impl:
    """One implementation of a kind; target and accepts are "module:function" (see the module docstring)."""

    kind: str
    name: str
    target: str
    accepts: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.name not in IMPLEMENTATIONS:
            raise ValueError(f"{self}: kind must be one of {sorted(KINDS)}, name one of {IMPLEMENTATIONS}")


_T = "ktlite.kernels.triton."
_REF = _T + "reference:"
_CPU_LINEAR = "ktlite.kernels.cpu.linear_attention:"
REGISTERED: tuple[Impl, ...] = (  # one group per kind: add a kind's "cpu" line to its own group
    # MLA decode
    Impl("mla_decode", "torch", _REF + "mla_decode_torch"),
    Impl("mla_decode", "triton", _T + "decode_attn:mla_decode_triton"),
    Impl("mla_decode", "cpu", "ktlite.kernels.cpu.attention:mla_decode", "ktlite.kernels.cpu.attention:accepts"),

    # MLA extend
    Impl("mla_extend", "torch", _REF + "mla_extend_torch"),
    Impl("mla_extend", "triton", _T + "extend_attn:mla_extend_triton"),
    Impl("mla_extend", "cpu", "ktlite.kernels.cpu.attention:mla_extend", "ktlite.kernels.cpu.attention:accepts"),

    # sparse MLA
    Impl("sparse_mla", "torch", _REF + "sparse_mla_torch"),
    Impl("sparse_mla", "triton", _T + "sparse_mla_attn:sparse_mla_triton"),
    Impl("sparse_mla", "cpu", "ktlite.kernels.cpu.attention:sparse_mla", "ktlite.kernels.cpu.attention:accepts"),

    # GQA decode
    Impl("gqa_decode", "torch", _REF + "gqa_decode_torch"),
    Impl("gqa_decode", "triton", _T + "gqa_decode_attn:gqa_decode_triton"),
    Impl("gqa_decode", "cpu", "ktlite.kernels.cpu.gqa_attention:gqa_decode", "ktlite.kernels.cpu.gqa_attention:accepts"),

    # GQA extend
    Impl("gqa_extend", "torch", _REF + "gqa_extend_torch"),
    Impl("gqa_extend", "triton", _T + "gqa_extend_attn:gqa_extend_triton"),
    Impl("gqa_extend", "cpu", "ktlite.kernels.cpu.gqa_attention:gqa_extend", "ktlite.kernels.cpu.gqa_attention:accepts"),

    # gated delta rule
    Impl("gated_delta_rule", "torch", _REF + "gated_delta_rule_batch_torch"),
    Impl("gated_delta_rule", "triton", _T + "gated_delta_attn:gated_delta_rule_triton"),
    Impl("gated_delta_rule", "cpu", _CPU_LINEAR + "gated_delta_rule", _CPU_LINEAR + "accepts_gated_delta_rule"),

    # causal conv1d
    Impl("causal_conv1d", "torch", _REF + "causal_conv1d_batch_torch"),
    Impl("causal_conv1d", "triton", _T + "causal_conv_attn:causal_conv1d_triton"),
    Impl("causal_conv1d", "cpu", _CPU_LINEAR + "causal_conv1d", _CPU_LINEAR + "accepts_causal_conv1d"),
)


def _registry(impls: tuple[Impl, ...]) -> dict[str, dict[str, Impl]]:
    out: dict[str, dict[str, Impl]] = {kind: {} for kind in KINDS}
    for impl in impls:
        if impl.name in out[impl.kind]:
            raise ValueError(f"{impl.kind} has two {impl.name!r} implementations")
        out[impl.kind][impl.name] = impl
    return out


_REGISTRY = _registry(REGISTERED)


def implementations(kind: str) -> dict[str, Impl]:
    """The registered implementations of a kind, by name."""
    return dict(_REGISTRY[kind])


def resolve(path: str) -> Callable[..., Any]:
    """The function a "module:function" path names, imported on first use and looked up on each (so a test's
    monkeypatch of the module attribute is what runs)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))


def select(kind: str, *args: Any, **kwargs: Any) -> str:
    """The implementation name a call of `kind` with these arguments runs (rules in the module docstring)."""
    if forced_torch():
        return "torch"
    if use_triton(_first_tensor(args, kwargs)):
        return "triton"
    cpu = _REGISTRY[kind].get("cpu")
    if cpu is not None and (cpu.accepts is None or resolve(cpu.accepts)(*args, **kwargs)):
        return "cpu"
    return "torch"


class Kind:
    """A callable attention kind: picks the implementation for each call's arguments and runs it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__doc__ = KINDS[name].__call__.__doc__
        spec = inspect.signature(KINDS[name].__call__)
        self.__signature__ = spec.replace(parameters=list(spec.parameters.values())[1:])  # without self

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        impl = _REGISTRY[self.name][select(self.name, *args, **kwargs)]
        return resolve(impl.target)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"attention.{self.name}"


mla_decode: MlaDecode = Kind("mla_decode")
mla_extend: MlaExtend = Kind("mla_extend")
sparse_mla: SparseMla = Kind("sparse_mla")
gqa_decode: GqaDecode = Kind("gqa_decode")
gqa_extend: GqaExtend = Kind("gqa_extend")
gated_delta_rule: GatedDeltaRule = Kind("gated_delta_rule")
causal_conv1d: CausalConv1d = Kind("causal_conv1d")
