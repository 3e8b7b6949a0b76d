"""GPU-side kernels and their dispatch: Triton on CUDA tensors, the plain-torch twin elsewhere.

The runtime calls mla_decode / mla_extend / gqa_decode / gqa_extend / fused_moe / fp8_linear and
never picks an implementation itself:
- tensors on CUDA -> Triton kernel;
- TRITON_INTERPRET=1 -> Triton kernel run by the interpreter on CPU tensors (tests);
- otherwise (CPU, no interpreter) -> torch twin, chosen without touching Triton: a launch there
  would raise "0 active drivers"; MLA decode in fp32 has a compiled CPU kernel instead
  (ktlite/kernels/cpu/attention.py: one call where the twin makes ~10 small torch ops per layer);
- KTLITE_FORCE_TORCH_KERNELS=1 -> always the twin (debugging), and a CPU device's decode runs its modules one by
  one instead of the compiled blocks (kernels/cpu/mla_block.py, dense_linear.swiglu_rows).
Kernel modules are imported on first Triton use, so importing this package never needs a GPU.
Note triton.jit decides "interpreted or compiled" when a kernel module is first imported: set
TRITON_INTERPRET before the first Triton call in a process, not in between.
"""

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from ktlite.kernels.cpu import attention as cpu_attention
from ktlite.kernels.triton.quant import QuantizedWeight, dequantize_expert, quantize_weight
from ktlite.kernels.triton.reference import (
    fp8_dequantize,
    fp8_linear_torch,
    causal_conv1d_batch_torch,
    fused_moe_torch,
    gated_delta_rule_batch_torch,
    gqa_decode_torch,
    gqa_extend_torch,
    mla_decode_torch,
    sparse_mla_torch,
    mla_extend_torch,
)

logger = logging.getLogger(__name__)

__all__ = [
    "QuantizedWeight",
    "dequantize_expert",
    "fp8_dequantize",
    "fp8_linear",
    "causal_conv1d",
    "fused_moe",
    "gated_delta_rule",
    "gqa_decode",
    "gqa_extend",
    "interpreted",
    "mla_decode",
    "mla_extend",
    "quantize_weight",
    "sparse_mla",
    "use_triton",
]


def forced_torch() -> bool:
    return os.environ.get("KTLITE_FORCE_TORCH_KERNELS", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether a call on tensor t goes to the Triton kernel (rules in the module docstring)."""
    if forced_torch():
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels(name: str) -> ModuleType:
    return importlib.import_module(f"ktlite.kernels.triton.{name}")


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Set TRITON_INTERPRET=1 inside the block, then restore it. Tests import the kernel modules
    and run them inside it (triton reads the variable both at decoration and at launch), so other
    CPU calls in the same process, e.g. other tests' models, keep using the fast twins."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def mla_decode(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Absorbed-MLA decode. q [B, H, kv_lora_rank + rope], kv_buffer [slots, kv_lora_rank + rope] or packed
    FP8 rows [slots, bytes] uint8 (kv_fp8.latent_rows, read in place; the same for mla_extend and sparse_mla),
    req_to_token [max_reqs, max_context] int32, req_pool_indices [B], seq_lens [B] (incl. the
    current token, already in the pool) -> [B, H, kv_lora_rank] in q's dtype."""
    if use_triton(q):
        return _kernels("decode_attn").mla_decode_triton(
            q, kv_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale, kv_lora_rank
        )
    if not forced_torch() and cpu_attention.handles(q, kv_buffer):
        return cpu_attention.mla_decode(q, kv_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale, kv_lora_rank)
    return mla_decode_torch(q, kv_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale, kv_lora_rank)


def mla_extend(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    kv_lora_rank: int,
    extend_start_loc: torch.Tensor | None = None,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Absorbed-MLA causal extend. q [N, H, kv_lora_rank + rope] (N = sum(extend_lens), requests in
    order), prefix_lens/extend_lens [B] -> [N, H, kv_lora_rank]. The optional extend_start_loc
    (exclusive cumsum of extend_lens) and max_extend_len only spare the Triton path recomputing them."""
    if use_triton(q):
        return _kernels("extend_attn").mla_extend_triton(
            q, kv_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale, kv_lora_rank,
            extend_start_loc=extend_start_loc, max_extend_len=max_extend_len,
        )
    return mla_extend_torch(
        q, kv_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale, kv_lora_rank
    )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts on this device. hidden [T, H], w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I] (dense bf16/fp16 or QuantizedWeight INT8/INT4), topk_ids/topk_weights [T, k],
    expert_mask [E] bool (True = computed here) -> [T, H] in hidden's dtype. Ids outside [0, E)
    (e.g. -1) are skipped like masked ones, so a compact stack of just this device's experts with
    remapped ids works without a mask."""
    if use_triton(hidden):
        return _kernels("moe").fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, expert_mask)
    return fused_moe_torch(hidden, w13, w2, topk_ids, topk_weights, expert_mask)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] float8_e4m3fn * 128x128 block scale_inv [ceil(N/128), ceil(K/128)])^T
    + bias -> [M, N] in x's dtype. On CUDA, w8a8 on GPUs with FP8 MMA (sm89+), else weight-only."""
    if use_triton(x):
        return _kernels("fp8").fp8_linear_triton(x, weight, weight_scale_inv, bias)
    return fp8_linear_torch(x, weight, weight_scale_inv, bias)


def gqa_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """GQA decode over the token pool. q [B, Hq, D], k_buffer [slots, Hkv, D], v_buffer [slots, Hkv, Dv], or both
    packed FP8 rows [slots, Hkv, D + 4] uint8 (kv_fp8.head_rows, read in place; the same for gqa_extend),
    seq_lens [B] (incl. the current token, already in the pool) -> [B, Hq, Dv] in q's dtype. Query head
    h reads kv head h // (Hq // Hkv)."""
    if use_triton(q):
        return _kernels("gqa_decode_attn").gqa_decode_triton(
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale
        )
    return gqa_decode_torch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale)


def gqa_extend(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    extend_start_loc: torch.Tensor | None = None,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """GQA causal extend. q [N, Hq, D] (N = sum(extend_lens), requests in order) -> [N, Hq, Dv]; the new
    tokens' K/V are already in the pool. The optional extend_start_loc (exclusive cumsum of extend_lens)
    and max_extend_len only spare the Triton path recomputing them."""
    if use_triton(q):
        return _kernels("gqa_extend_attn").gqa_extend_triton(
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, sm_scale,
            extend_start_loc=extend_start_loc, max_extend_len=max_extend_len,
        )
    return gqa_extend_torch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                            sm_scale)


def sparse_mla(q: torch.Tensor, kv_buffer: torch.Tensor, topk_slots: torch.Tensor, sm_scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA over each query's selected pool slots (DSA sparse attention, decode and extend
    alike). q [N, H, kv_lora_rank + rope], kv_buffer [slots, kv_lora_rank + rope], topk_slots [N, K] int64
    (-1 = none; causality already applied) -> [N, H, kv_lora_rank] in q's dtype."""
    if use_triton(q):
        return _kernels("sparse_mla_attn").sparse_mla_triton(q, kv_buffer, topk_slots, sm_scale, kv_lora_rank)
    return sparse_mla_torch(q, kv_buffer, topk_slots, sm_scale, kv_lora_rank)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, rows: torch.Tensor, extend_lens: torch.Tensor, reset: torch.Tensor,
                     chunk: int = 64) -> torch.Tensor:
    """Gated delta rule (Gated DeltaNet) over a packed batch; see reference.gated_delta_rule_batch_torch.
    q, k [N, H, dk], v [N, H, dv], g, beta [N, H]; states [R, H, dk, dv] fp32 updated in place at rows [B]
    (zeroed first where reset [B]); extend_lens [B] -> [N, H, dv]. Chunked form (chunks of `chunk`) for
    any length; one token is the recurrent step. `chunk` steers the twin only (the result does not depend on
    it); the Triton path runs token by token for decode batches, else in chunks of 64."""
    if use_triton(q):
        return _kernels("gated_delta_attn").gated_delta_rule_triton(q, k, v, g, beta, states, rows, extend_lens, reset)
    return gated_delta_rule_batch_torch(q, k, v, g, beta, states, rows, extend_lens, reset, chunk)


def causal_conv1d(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                  extend_lens: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over a packed batch, continuing each sequence's rolling state
    conv_states [R, C, W-1] (updated in place at rows [B], zeroed first where reset). x [N, C], weight [C, W]."""
    if use_triton(x):
        return _kernels("causal_conv_attn").causal_conv1d_triton(x, conv_states, weight, rows, extend_lens, reset)
    return causal_conv1d_batch_torch(x, conv_states, weight, rows, extend_lens, reset)
