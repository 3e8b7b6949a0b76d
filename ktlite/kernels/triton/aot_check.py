"""Compile every Triton kernel for real CUDA targets on a machine without a GPU.

The interpreter runs kernels as numpy and accepts things a GPU compile rejects (e4m3 pointers on
sm80, tl.dot shapes, shared memory beyond the SM's limit). Triton ships ptxas, so the full
ttir -> ptx -> cubin pipeline runs on a CPU box; this is what the tests call in a subprocess
(TRITON_INTERPRET must be unset there, or triton.jit hands out interpreted functions).

    python -m ktlite.kernels.triton.aot_check [--only mla|sparse_mla|gqa|moe|fp8|linear] [--arch 80 90]

Configurations mirror the wrappers' GPU defaults at the largest MLA model's sizes (hidden 7168, 128 heads)
with plain and packed-FP8 latent pools, and at the tiny test models' latent widths; GQA at head_dim 128 with groups of 8 to 16 query heads per kv head,
bf16 and packed-FP8 pools.
"""

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ktlite.kernels.triton import decode_attn, extend_attn, fp8, gqa_decode_attn, gqa_extend_attn, moe, sparse_mla_attn
from ktlite.kernels.triton import causal_conv_attn, gated_delta_attn
from ktlite.kernels.triton.common import dot_width, shared_bytes

logger = logging.getLogger(__name__)



@dataclass
class KernelConfig:
    family: str
    label: str
    fn: object  # triton JITFunction
    pointers: dict[str, str]  # arg -> pointer type, e.g. "*bf16"; other non-constexpr args are i32
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 2
    min_arch: int = 80
    floats: tuple[str, ...] = field(default=())  # fp32 scalar args
    min_shared: int = 0  # launched only on GPUs with this much shared memory per block (skipped for the others)

    def signature(self) -> dict[str, str]:
        sig = {}
        for name in self.fn.arg_names:
            if name in self.constexprs:
                sig[name] = "constexpr"
            elif name in self.pointers:
                sig[name] = self.pointers[name]
            else:
                sig[name] = "fp32" if name in self.floats else "i32"
        return sig


def configs(dt: str = "bf16") -> list[KernelConfig]:
    """Kernel variants the wrappers launch on a GPU, with activations in dt."""
    mla = {"Q": f"*{dt}", "KV": f"*{dt}", "ReqToToken": "*i32", "ReqPoolIdx": "*i32", "SeqLens": "*i32",
           "MidO": "*fp32", "MidLse": "*fp32", "Out": f"*{dt}", "PrefixLens": "*i32", "ExtendLens": "*i32",
           "ExtendStart": "*i64"}
    out = [KernelConfig("mla", "decode stage2", decode_attn._decode_stage2, mla,
                        dict(KV_LORA=512, BLOCK_C=512, BLOCK_S=8))]
    # latent pools (latent_tile): plain dt, packed FP8 (sm89+), packed FP8 decoded with integer ops
    pools = ((dt, {"KV": f"*{dt}", "KVScale": f"*{dt}", "KVRope": f"*{dt}"}, dict(GROUP=1, PACKED=False), False, 80),
             ("fp8", {"KV": "*fp8e4nv", "KVScale": "*fp32", "KVRope": "*bf16"}, dict(GROUP=128, PACKED=True), False, 89),
             ("fp8 bytes", {"KV": "*u8", "KVScale": "*fp32", "KVRope": "*bf16"}, dict(GROUP=128, PACKED=True), True, 80))
    # V3's widths, and the tiny test models' (kv_lora 32, rope 8: tiles widened by dot_width) on a plain pool
    shapes = [(pool, 512, 64) for pool in pools] + [(pools[0], 32, 8)]
    for (pool, latent, layout, bits, min_arch), kv_lora, rope in shapes:
        ptrs = {**mla, **latent}
        dims = dict(KV_LORA=kv_lora, ROPE=rope, BLOCK_C=dot_width(kv_lora), BLOCK_R=dot_width(rope), **layout,
                    E4M3_BITS=bits)
        pool = pool if kv_lora == 512 else f"{pool} (tiny: kv_lora {kv_lora}, rope {rope})"
        (nh, nn, nw), (wh, wn, ww) = decode_attn.NARROW_TILES, decode_attn.WIDE_TILES
        out += [
            KernelConfig("mla", f"decode stage1 {pool} pool", decode_attn._decode_stage1, ptrs,
                         dict(dims, BLOCK_H=nh, BLOCK_N=nn), num_warps=nw, min_arch=min_arch, floats=("qk_scale",)),
            KernelConfig("mla", f"decode stage1 {pool} pool, wide tiles", decode_attn._decode_stage1, ptrs,
                         dict(dims, BLOCK_H=wh, BLOCK_N=wn), num_warps=ww, min_arch=min_arch, floats=("qk_scale",),
                         min_shared=decode_attn.WIDE_SHARED_BYTES),
            KernelConfig("mla", f"extend {pool} pool", extend_attn._extend_kernel, ptrs,
                         dict(dims, BLOCK_T=2, BLOCK_H=16, BLOCK_N=32), num_warps=8, num_stages=1, min_arch=min_arch,
                         floats=("qk_scale",)),
        ]
        for split in (False, True):  # direct output (prefill) or partials for decode_attn's stage 2
            dst = "*fp32" if split else f"*{dt}"
            out.append(KernelConfig("sparse_mla", f"sparse mla {'split' if split else 'direct'} {pool} pool",
                                    sparse_mla_attn._sparse_mla_kernel, dict(ptrs, TopK="*i64", O=dst, Lse=dst),
                                    dict(dims, BLOCK_H=16, BLOCK_N=32, SPLIT=split), min_arch=min_arch,
                                    floats=("qk_scale",)))
    out += gqa_configs(dt)
    out += linear_attn_configs(dt)
    # (bits, weight and scale types, MX codes): dense, INT8 / INT4 with fp16 scales, MXFP8 / MXFP4 with e8m0 bytes
    for bits, w_ty, s_ty, mx in ((16, dt, dt, False), (8, "i8", "fp16", False), (4, "u8", "fp16", False),
                                 (8, "u8", "u8", True), (4, "u8", "u8", True)):
        for gated in (True, False):
            for block_m, bias in ((16, False), (64, False), (16, True)):  # biased experts: gpt-oss
                ptrs = {"A": f"*{dt}", "W": f"*{w_ty}", "Scales": f"*{s_ty}", "Out": f"*{dt}", "SortedIds": "*i32",
                        "ExpertIds": "*i32", "NumPadded": "*i32", "TopkWeights": "*fp32", "Bias": f"*{dt}"}
                consts = dict(A_ROW_DIV=8 if gated else 1, GATED=gated, HAS_BIAS=bias, WEIGHTED=not gated, BITS=bits,
                              MX=mx, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64 if bits == 16 else 32 if mx else 128)
                label = (f"moe {'gate_up' if gated else 'down'} bits={bits}{' mx' if mx else ''} BM={block_m}"
                         f"{' bias' if bias else ''}")
                out.append(KernelConfig("moe", label, moe._moe_gemm_kernel, ptrs, consts, num_stages=3,
                                        floats=("alpha", "limit", "up_offset")))
    for mode, min_arch in (("weight-only", 89), ("e4m3-bits", 80), ("w8a8", 89)):
        for block_m in (16, 64):
            ptrs = {"X": "*fp8e4nv" if mode == "w8a8" else f"*{dt}", "XScale": "*fp32",
                    "W": "*u8" if mode == "e4m3-bits" else "*fp8e4nv", "WScale": "*fp32", "Bias": f"*{dt}",
                    "Out": f"*{dt}"}
            consts = dict(W8A8=mode == "w8a8", E4M3_BITS=mode == "e4m3-bits", HAS_BIAS=True, SCALE_BLOCK=128,
                          BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)
            out.append(KernelConfig("fp8", f"fp8 {mode} BM={block_m}", fp8._fp8_gemm_kernel, ptrs, consts,
                                    num_stages=3, min_arch=min_arch))
    return out


def gqa_configs(dt: str) -> list[KernelConfig]:
    """GQA decode/extend with a dt pool, a packed FP8 pool (head_tile: e4m3 codes, sm89+) and its codes as
    bytes decoded by integer ops (before sm89); index tensors are int64, as ForwardBatch builds them."""
    ints = {name: "*i64" for name in ("ReqPoolIdx", "SeqLens", "PrefixLens", "ExtendLens", "ExtendStart")}
    dims = dict(HEAD_D=128, HEAD_DV=128, BLOCK_D=128, BLOCK_DV=128)
    floats = ("qk_scale",)
    stage2 = {"MidO": "*fp32", "MidLse": "*fp32", "Out": f"*{dt}"}
    out = [KernelConfig("gqa", "gqa decode stage2", decode_attn._decode_stage2, stage2,
                        dict(KV_LORA=128, BLOCK_C=128, BLOCK_S=8))]
    pools = ((dt, dt, dt, False, 80), ("fp8", "fp8e4nv", "fp32", True, 89), ("fp8 bytes", "u8", "fp32", True, 80))
    for pool, kv_ty, scale_ty, packed, min_arch in pools:
        ptrs = {"Q": f"*{dt}", "K": f"*{kv_ty}", "V": f"*{kv_ty}", "KScale": f"*{scale_ty}", "VScale": f"*{scale_ty}",
                "ReqToToken": "*i32", "MidO": "*fp32", "MidLse": "*fp32", "Out": f"*{dt}", "Sinks": "*fp32", **ints}
        # sinks (gpt-oss) on the plain pool only: the pool kind and the sinks touch different lines
        for sinks in (False, True) if pool == dt else (False,):
            kinds = dict(PACKED=packed, E4M3_BITS=kv_ty == "u8", HAS_SINKS=sinks)
            label = f"{pool} pool{', sinks' if sinks else ''}"
            out += [
                KernelConfig("gqa", f"gqa decode stage1 {label}", gqa_decode_attn._gqa_decode_stage1, ptrs,
                             dict(dims, BLOCK_H=16, BLOCK_N=64, **kinds), min_arch=min_arch, floats=floats),
                KernelConfig("gqa", f"gqa extend {label}", gqa_extend_attn._gqa_extend_kernel, ptrs,
                             dict(dims, BLOCK_T=8, BLOCK_H=8, BLOCK_N=64, **kinds), min_arch=min_arch,
                             floats=floats),
            ]
    return out


def linear_attn_configs(dt: str) -> list[KernelConfig]:
    """Gated DeltaNet / Kimi Delta Attention layers (dk = dv = 128, conv width 4 over 8192 channels): the gated delta
    rule's recurrent (decay per head or per key channel) and chunked kernels and the causal conv1d, with int64 index
    tensors."""
    ints = {name: "*i64" for name in ("Rows", "Starts", "Lens")}
    ptrs = {"Q": f"*{dt}", "K": f"*{dt}", "V": f"*{dt}", "Gate": "*fp32", "Beta": f"*{dt}", "States": "*fp32",
            "Reset": "*i32", "Out": f"*{dt}", "ChunkStart": "*i64", "ChunkLen": "*i32", "W": f"*{dt}", "U": f"*{dt}",
            "Gcum": "*fp32", **ints}
    dims = dict(DK=128, DV=128, BLOCK_K=128)
    conv = {"X": f"*{dt}", "States": f"*{dt}", "Weight": f"*{dt}", "Reset": "*i32", "Out": f"*{dt}", **ints}
    return [
        KernelConfig("linear", "gated delta recurrent", gated_delta_attn._recurrent_kernel, ptrs,
                     dict(dims, BLOCK_V=64, PER_CHANNEL=False), floats=("scale",)),
        # Kimi Delta Attention (GLM-5.3-Flash): a decay per key channel
        KernelConfig("linear", "gated delta recurrent per-channel decay", gated_delta_attn._recurrent_kernel, ptrs,
                     dict(dims, BLOCK_V=64, PER_CHANNEL=True), floats=("scale",)),
        KernelConfig("linear", "gated delta chunk prep", gated_delta_attn._chunk_prep_kernel, ptrs,
                     dict(dims, BLOCK_DV=128)),
        KernelConfig("linear", "gated delta chunk state", gated_delta_attn._chunk_state_kernel, ptrs,
                     dict(dims, BLOCK_V=64, BLOCK_C=gated_delta_attn.CHUNK), num_warps=8, floats=("scale",)),
        KernelConfig("linear", "causal conv1d", causal_conv_attn._conv_kernel, conv,
                     dict(C=8192, WIDTH=4, BLOCK_T=16, BLOCK_C=128, BLOCK_S=4)),
    ]


def compile_config(cfg: KernelConfig, arch: int) -> int:
    """Compile cfg for sm{arch}; returns shared memory bytes, raises if it does not fit."""
    if not isinstance(cfg.fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("kernels were imported under TRITON_INTERPRET; run aot_check without it")
    src = ASTSource(cfg.fn, cfg.signature(), cfg.constexprs)
    kernel = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    )
    shared = kernel.metadata.shared
    limit = shared_bytes(arch)
    if shared > limit:
        raise RuntimeError(f"needs {shared} B shared memory, sm{arch} allows {limit}")
    return shared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("mla", "sparse_mla", "gqa", "moe", "fp8", "linear"))
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = parser.parse_args(argv)
    failures = 0
    for cfg in configs(args.dtype):
        if args.only and cfg.family != args.only:
            continue
        for arch in args.arch:
            if arch < cfg.min_arch or shared_bytes(arch) < cfg.min_shared:
                continue
            start = time.perf_counter()
            try:
                shared = compile_config(cfg, arch)
                print(f"ok   sm{arch} {cfg.label:40s} shared={shared:6d} B  {time.perf_counter() - start:.1f}s")
            except Exception as exc:  # report every failing variant, not just the first
                failures += 1
                print(f"FAIL sm{arch} {cfg.label:40s} {type(exc).__name__}: {str(exc).splitlines()[-1][:300]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
