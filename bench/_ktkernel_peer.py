"""kt-kernel's CPU experts on bench/cpu_moe.py's inputs, for its optional peer column.

kt-kernel pins its own torch, so this runs under the python of a side venv that has it, as a subprocess
of bench/cpu_moe.py (`--ktkernel-python PATH`), and imports nothing of ktlite. The underscore keeps it
out of `ktlite bench`'s list: it is not a benchmark of its own.

    SIDE/bin/python bench/_ktkernel_peer.py --probe          # JSON: kt-kernel version, variant, methods
    SIDE/bin/python bench/_ktkernel_peer.py DIR/request.json  # writes DIR/result.json, DIR/outputs.safetensors

The request names a safetensors file per shape holding the float experts the parent benches (`gate`,
`up` [D, inter, hidden], `down` [D, hidden, inter]; expert e of the layer is e % D, as in the parent's
slots) and, per T, the input `x{T}` (bf16 [T, hidden]: kt-kernel takes bf16 hidden states) with the
routings `ids{T}` (int64 [R, T, topk]) and `w{T}` (fp32 [R, T, topk]). Per method and T the result has
the fastest seconds per forward (routing i % R at call i) and the output of routing 0 (in
outputs.safetensors); the parent scores both engines' outputs against one float64 reference.

Methods (kt-kernel's names for them, but for Q8_0): AMXINT4 / AMXINT8 quantize the bf16 experts at load
(kt-kernel's own online quantizer; AMX and AVX-512 builds only); RAWINT4 (group 32, encoded here as
compressed-tensors does) and BF16 take pre-encoded experts (any build); Q8_0 is its LLAMAFILE method on GGUF
Q8_0 blocks (gguf-py's quantizer; LLAMAFILE needs moe_intermediate % 256 == 0).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import kt_kernel
import torch
from kt_kernel import kt_kernel_ext as ext
from kt_kernel.utils.amx import _select_rawint4_backend  # kt-kernel's own AMX / AVX-VNNI / AVX2 pick
from safetensors.torch import load_file, save_file

AMX_METHODS = ("AMXINT4", "AMXINT8")
OTHER_METHODS = ("RAWINT4", "Q8_0", "BF16")
RAWINT4_GROUP = 32


def default_methods() -> list[str]:
    """The AMX INT4/INT8 methods where this build has them, else the INT4 and INT8 peers it runs here."""
    return list(AMX_METHODS) if hasattr(ext.moe, "AMXInt4_MOE") else ["RAWINT4", "Q8_0"]


def probe() -> dict:
    return {"version": kt_kernel.__version__, "variant": kt_kernel.__cpu_variant__, "torch": torch.__version__,
            "methods": [m for m in AMX_METHODS if hasattr(ext.moe, "AMXInt4_MOE")] + list(OTHER_METHODS),
            "default": default_methods()}


def rawint4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric INT4: scale = absmax / 7.5 per group, codes + 8 two to a byte (the
    lower k in the low nibble), bf16 scales [N, K / group]: the bytes kt-kernel's RAWINT4 loader passes on."""
    n, k = w.shape
    groups = w.reshape(n, k // RAWINT4_GROUP, RAWINT4_GROUP)
    scale = (groups.abs().amax(-1, keepdim=True) / 7.5).clamp_min(1e-12).bfloat16()
    codes = ((groups / scale.float()).round().clamp(-8, 7) + 8).to(torch.uint8).reshape(n, k)
    return (codes[:, 0::2] | codes[:, 1::2] << 4).contiguous(), scale.reshape(n, -1).contiguous()


class Peer:
    """One kt-kernel worker pool for every MoE this process builds (kt-kernel keeps one per process too)."""

    def __init__(self, threads: int, max_len: int, workdir: str):
        cfg = ext.WorkerPoolConfig()
        cfg.subpool_count, cfg.subpool_numa_map, cfg.subpool_thread_count = 1, [0], [threads]
        self.cpu = ext.CPUInfer(cfg)
        self.max_len, self.workdir = max_len, workdir

    def build(self, method: str, shape: dict, experts: dict[str, torch.Tensor]) -> tuple[object, list]:
        """kt-kernel's MoE for `method` over the shape's experts; the tensors it reads must outlive it."""
        e_num, inter = shape["experts"], shape["inter"]
        mask = torch.zeros(e_num, dtype=torch.bool)
        cfg = ext.moe.MOEConfig(e_num, shape["topk"], shape["hidden"], inter, mask.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len = 0, self.cpu.backend_, self.max_len
        mats = [experts[k] for k in ("gate", "up", "down")]
        distinct = mats[0].shape[0]
        keep: list = [mask]
        if method in AMX_METHODS or method == "Q8_0":  # one [E, N, K] array per projection
            reps = e_num // distinct
            if method == "Q8_0":
                if inter % 256:
                    raise ValueError(f"LLAMAFILE needs moe_intermediate % 256 == 0 (QK_K), not {inter}")
                stacks = [torch.from_numpy(gguf.quants.quantize(m.float().numpy(), gguf.GGMLQuantizationType.Q8_0))
                          .repeat(reps, 1, 1).contiguous() for m in mats]
                q8 = ext.kvcache.ggml_type.Q8_0
                cfg.gate_type = cfg.up_type = cfg.down_type = q8
                cfg.hidden_type = ext.kvcache.ggml_type.BF16
                cfg.m_block, cfg.group_min_len, cfg.group_max_len = 32, 10, self.max_len  # LlamafileMoEWrapper's
                cls = ext.moe.MOE
            else:
                stacks = [m.bfloat16().repeat(reps, 1, 1).contiguous() for m in mats]
                cfg.save, cfg.load, cfg.path = True, False, self.workdir  # quantize at load, as cpu_save does
                cls = ext.moe.AMXInt4_MOE if method == "AMXINT4" else ext.moe.AMXInt8_MOE
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (s.data_ptr() for s in stacks)
            keep += stacks
        else:  # per-expert pointers to the distinct experts' encodings; kt-kernel copies them at load
            if method == "BF16":
                enc = [[(m[d].bfloat16().contiguous(), None) for d in range(distinct)] for m in mats]
                cls = getattr(ext.moe, "AMXBF16_MOE", None) or ext.moe.AVX2BF16_MOE
            elif method == "RAWINT4":
                enc = [[rawint4(m[d]) for d in range(distinct)] for m in mats]
                qc = cfg.quant_config
                qc.bits, qc.group_size, qc.zero_point = 4, RAWINT4_GROUP, False
                cls = _select_rawint4_backend(RAWINT4_GROUP)
            else:
                raise ValueError(f"unknown kt-kernel method {method!r} (have {AMX_METHODS + OTHER_METHODS})")
            for name, per in zip(("gate", "up", "down"), enc):
                slots = [per[e % distinct] for e in range(e_num)]
                setattr(cfg, f"{name}_projs", [[q.data_ptr() for q, _ in slots]])
                setattr(cfg, f"{name}_scales", [[0 if s is None else s.data_ptr() for _, s in slots]])
            keep.append(enc)
        moe = cls(cfg)
        identity = torch.arange(e_num, dtype=torch.int64)  # physical -> logical expert (read as uint64)
        self.cpu.submit(moe.load_weights_task(identity.data_ptr()))
        self.cpu.sync()
        return moe, keep

    def forward(self, moe: object, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                qlen: torch.Tensor) -> None:
        self.cpu.submit(moe.forward_task(qlen.data_ptr(), ids.shape[1], ids.data_ptr(), w.data_ptr(), x.data_ptr(),
                                         out.data_ptr(), False))
        self.cpu.sync()


def fastest(call: Callable[[int], None], budget_s: float, max_calls: int) -> float:
    """Seconds of the fastest call(i), i >= 1, after a warm-up call(0): bench/cpu_moe.py's rule (at least 3
    calls, or 1 that alone takes longer than the budget; the minimum, since other load only adds time)."""
    call(0)
    best, spent, n = float("inf"), 0.0, 0
    while n < 3 or (spent < budget_s and n < max_calls):
        t0 = time.perf_counter()
        call(n + 1)
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
        if dt > budget_s:
            break
    return best


def run(request: Path) -> None:
    req = json.loads(request.read_text())
    methods = req["methods"] or default_methods()
    results: list[dict] = []
    outputs: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(dir=request.parent) as workdir:
        peer = Peer(req["threads"], req["max_len"], workdir)
        for shape in req["shapes"]:
            data = load_file(shape["file"])
            for method in methods:
                try:
                    moe, keep = peer.build(method, shape, data)
                except (ValueError, RuntimeError, AttributeError) as e:  # not built here: say why, go on
                    results.append({"shape": shape["name"], "method": method, "error": str(e)})
                    continue
                for t in shape["tokens"]:
                    x, ids, w = data[f"x{t}"], data[f"ids{t}"], data[f"w{t}"]
                    out = torch.empty(t, shape["hidden"], dtype=torch.bfloat16)
                    qlen = torch.tensor([t], dtype=torch.int32)
                    key = f"{shape['name']}/{method}/{t}"

                    def fwd(i: int) -> None:
                        peer.forward(moe, x, ids[i % len(ids)], w[i % len(w)], out, qlen)
                        if i == 0:  # the warm-up call: routing 0's output, for the error
                            outputs[key] = out.clone()

                    budget = req["budget_s"] * (req["long_factor"] if t >= req["long_from"] else 1)
                    seconds = fastest(fwd, budget, req["max_calls"])
                    results.append({"shape": shape["name"], "method": method, "T": t, "seconds": seconds,
                                    "kernel": type(moe).__name__})
                del moe, keep
        save_file(outputs, str(request.parent / "outputs.safetensors"))
    (request.parent / "result.json").write_text(json.dumps({**probe(), "methods": methods, "results": results}))


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        print(json.dumps(probe()))
    else:
        run(Path(sys.argv[1]))
