"""Where the routed experts come from: `--kt-method` and `--kt-weight-path` choose one source.

| --kt-method            | --kt-weight-path                     | CPU store                                  |
|------------------------|--------------------------------------|--------------------------------------------|
| INT4, INT8 (AMX*, MOE_*) | omitted / an HF folder             | quantized at load (numba, group-wise)      |
| any of INT4/INT8/BF16  | a `ktlite convert` folder            | read as converted                          |
| BF16                   | omitted / an HF folder               | BF16 experts as they are                   |
| FP8, FP8_PERCHANNEL    | omitted / an HF folder with FP8      | e4m3 + scales as they are (kernels/cpu/fp8.py) |
| RAWINT4                | omitted / a compressed-tensors folder | INT4 group 32, the same codes and scales  |
| LLAMAFILE              | a GGUF file or folder (split too)    | Q4_K/Q5_K/Q6_K/Q8_0/BF16 blocks as they are |
| MXFP4 (FP4), MXFP8     | omitted / an HF folder with MX experts | e2m1 / e4m3 + e8m0 scales as they are (mx.py) |

"Omitted" means the `--model` folder; where MX checkpoints keep their experts: ktlite/runtime/mx_layouts.py.
Nothing that loses precision happens silently: FP8 of a non-FP8 checkpoint is refused with the methods that fit,
BF16 of FP8 or FP32 experts warns that it rounds, INT4/INT8 of FP8 weights say that they quantize again, MX
experts are served only by their own method, and GGUF types without a kernel are converted
to the nearest ktlite format with one warning per type naming a tensor.

Besides filling the CPU store, a source gives the device side its experts (`dense`: fp32 weights, the
same values the CPU kernels use where the source has its own encoding) and, for kept encodings,
refills a CPU slot when dynamic placement moves an expert back (CPUMoE.native_fill).

HF folders are read through memory maps of their safetensors files (`_Safetensors`): an expert's bytes
are copied once, from the page cache into the CPU store, and the maps are dropped after loading, so
RAM holds the experts once in their stored size.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ktlite.config import EngineConfig
from ktlite.errors import CheckpointError, ConfigError
from ktlite.kernels.cpu import gguf_quants
from ktlite.kernels.cpu.compressed_int4 import fill_int4_rows, gpu_int4, unpack_codes
from ktlite.kernels.cpu.fp8 import fill_fp8_rows, fp8_group_size
from ktlite.kernels.cpu.mx import MX_GROUP, MX_METHODS, codes_per_byte, fill_mx_rows
from ktlite.kernels.cpu.moe import CPUMoE, Format
from ktlite.kernels.cpu.quant import (
    QUANTIZED_METHODS,
    RAWINT4_GROUP,
    QuantizedWeight,
    dequantize,
    empty_quantized,
    normalize_kt_method,
    quantize_into,
)
from ktlite.kernels.triton.quant import QuantizedWeight as GPUQuantizedWeight
from ktlite.runtime.convert import MANIFEST, load_converted
from ktlite.runtime.models.config import ModelConfig
from ktlite.runtime.models.wrapper import our_name
from ktlite.runtime.mx_layouts import LAYOUTS, MXTensors

logger = logging.getLogger(__name__)

PROJS = ("gate", "up", "down")
Placement = Mapping[int, Sequence[int]]  # MoE layer -> its experts on the device (the rest are CPU experts)


# ---- HF safetensors, memory-mapped ------------------------------------------------------------


_ST_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F8_E4M3": np.uint8, "I32": np.int32,
              "I64": np.int64, "U8": np.uint8, "I8": np.int8, "F8_E8M0": np.uint8, "F4": np.uint8}


class _Safetensors:
    """The tensors of an HF folder's safetensors files as numpy views of memory maps (BF16 as its uint16
    bits, F8_E4M3 / F8_E8M0 as bytes, F4 as its bytes of two e2m1 codes: the last dim halved), by the model's
    names (`renames`: a wrapper checkpoint's, ModelConfig.weight_renames). Maps open on first use; `release()`
    drops them (views taken stay valid)."""

    def __init__(self, folder: Path, renames: tuple[tuple[str, str], ...] = ()):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
            sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {folder}")
        self._entries: dict[str, tuple[str, str, tuple[int, ...], int]] = {}  # name -> (file, dtype, shape, offset)
        for f in files:
            with open(folder / f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    self._entries[our_name(renames, name)] = (f, info["dtype"], tuple(info["shape"]), 8 + size + info["data_offsets"][0])
        self._maps: dict[str, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        return self._entry(name)[1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def _entry(self, name: str) -> tuple[str, str, tuple[int, ...], int]:
        if name not in self._entries:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.folder}")
        return self._entries[name]

    def array(self, name: str) -> np.ndarray:
        f, dtype, shape, offset = self._entry(name)
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {dtype}, which ktlite does not read")
        if f not in self._maps:  # copy-on-write: writable views for torch, the file is never changed
            self._maps[f] = np.memmap(self.folder / f, np.uint8, mode="c")
        if dtype == "F4":  # the header counts 4-bit codes, two a byte
            shape = (*shape[:-1], shape[-1] // 2)
        count = int(np.prod(shape))
        item = np.dtype(_ST_DTYPES[dtype]).itemsize
        return self._maps[f][offset:offset + count * item].view(_ST_DTYPES[dtype]).reshape(shape)

    def float32(self, name: str) -> np.ndarray:
        """A (scale) tensor as fp32, exactly (BF16/F16/F32 only)."""
        a, dtype = self.array(name), self.dtype(name)
        if dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        if dtype not in ("F16", "F32"):
            raise CheckpointError(f"tensor {name!r}: expected a float tensor, found {dtype}")
        return a.astype(np.float32)

    def release(self) -> None:
        self._maps.clear()


# ---- the sources ------------------------------------------------------------------------------


class Source:
    """One place the experts come from. Sources that keep a checkpoint's encoding (`formats` not None)
    fill CPU slots in place (`fill_native`) and refill them on dynamic placement; the others hand
    weights to CPUMoE.set_expert, which quantizes them into the method's format. GPU experts are
    `dense` weights, or (where gpu_expert_format says so) the source's own codes from `gpu_weights`."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def formats(self, layer: int) -> tuple[Format, Format] | None:
        return None

    def weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) for CPUMoE.set_expert (sources whose formats() is None)."""
        raise NotImplementedError

    def fill_native(self, layer: int, expert: int, gate_up: QuantizedWeight, down: QuantizedWeight) -> None:
        """Write an expert in its stored encoding into a slot's views (sources with formats())."""
        raise NotImplementedError

    def dense(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, H], up [I, H], down [H, I]) fp32 for the device side."""
        raise NotImplementedError

    def gpu_weights(self, layer: int, experts: Sequence[int]) -> tuple[GPUQuantizedWeight, GPUQuantizedWeight]:
        """(w13 [E, 2I, H], w2 [E, H, I]) of `experts` in the GPU INT4 format (RAWINT4's source)."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop what loading held (memory maps); later calls reopen it."""

    def fill(self, cpu: CPUMoE, placement: Placement, progress: bool = True) -> None:
        """Every MoE layer's CPU experts (those `placement` does not put on the device)."""
        cfg = self.cfg
        todo = []
        for layer in cfg.moe_layers:
            on_device = set(placement.get(layer, ()))
            cpu_ids = [e for e in range(cfg.n_routed_experts) if e not in on_device]
            cpu.reserve_layer(layer, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cpu_ids,
                              self.formats(layer))
            todo += [(layer, e) for e in cpu_ids]
        native = bool(cfg.moe_layers) and self.formats(cfg.moe_layers[0]) is not None
        for layer, e in tqdm(todo, desc=f"CPU experts ({cpu.method})", unit="expert", disable=not progress or not todo):
            if native:
                self.fill_native(layer, e, *cpu.slot_views(layer, e))
            else:
                cpu.set_expert(layer, e, *self.weights(layer, e))
        cpu.native_fill = self.fill_native if native else None
        self.release()


class HFSource(Source):
    """Experts of an HF folder by their checkpoint names: BF16/FP32 as stored, FP8 with its scales.
    `method` None: only the device side reads it (dense)."""

    def __init__(self, cfg: ModelConfig, folder: Path, method: str | None):
        super().__init__(cfg)
        self.tensors = _Safetensors(folder, cfg.weight_renames)
        self.method = method
        self.fp8_block = cfg.fp8_block_size or (128, 128)
        if method is None:  # the device side of converted experts: tensors are looked up when asked for
            return
        mx = stored_mx(cfg, self.tensors)
        if mx is not None:  # ktlite has no MX -> INT4/INT8/BF16/FP8 path: nothing re-quantizes them silently
            raise ConfigError(f"{folder} stores its routed experts as {mx} (codes with an e8m0 scale per {MX_GROUP}): "
                              f"serve them as they are with --kt-method {mx}")
        first = cfg.expert_weight_name(cfg.moe_layers[0], 0, "gate") if cfg.moe_layers else None
        if first is not None and first not in self.tensors:
            raise CheckpointError(f"{folder} has no routed expert tensors (looked for {first!r}); point "
                                  "--kt-weight-path at the checkpoint that holds them")
        self.stored = self.tensors.dtype(first) if first else "BF16"  # BF16 / F32 / F16 / F8_E4M3
        self._check_method()

    def _check_method(self) -> None:
        fp8 = self.stored == "F8_E4M3"
        if self.method == "FP8" and not fp8:
            raise ConfigError(f"--kt-method FP8 needs FP8 experts; {self.tensors.folder} stores them as {self.stored}: "
                              "use --kt-method BF16 (lossless for BF16 weights) or INT8/INT4")
        if self.method == "BF16" and self.stored != "BF16":
            logger.warning("--kt-method BF16: the %s experts of %s are rounded to bf16, which loses precision%s",
                           self.stored, self.tensors.folder, " (--kt-method FP8 keeps them as they are)" if fp8 else "")
        if self.method in ("INT4", "INT8") and fp8:
            logger.info("--kt-method %s: the FP8 experts are dequantized and quantized again to %s "
                        "(--kt-method FP8 keeps them as they are)", self.method, self.method)

    def formats(self, layer: int) -> tuple[Format, Format] | None:
        if self.method != "FP8":
            return None
        g = fp8_group_size(self._scale(self.cfg.expert_weight_name(layer, 0, "gate"))[1])
        return ("FP8", g), ("FP8", g)

    def _scale(self, name: str) -> tuple[str, tuple[int, int] | None]:
        """(scale tensor name, block; None for per-channel) of an FP8 weight."""
        if name + "_scale_inv" in self.tensors:  # block scales (weight_scale_inv)
            return name + "_scale_inv", self.fp8_block
        other = name + "_scale"  # compressed-tensors style weight_scale: per channel or per block
        if other not in self.tensors:
            raise CheckpointError(f"FP8 tensor {name!r} has neither {name}_scale_inv nor {other}")
        n = self.tensors.shape(name)[0]
        return other, None if self.tensors.shape(other) in ((n,), (n, 1)) else self.fp8_block

    def _fp8(self, name: str) -> tuple[np.ndarray, np.ndarray, tuple[int, int] | None]:
        scale, block = self._scale(name)
        return self.tensors.array(name), self.tensors.float32(scale), block

    def _dequantized(self, name: str) -> torch.Tensor:
        """An FP8 weight in fp32 through the CPU kernels' decoder (e4m3 * scale, one rounding)."""
        weight, scale, block = self._fp8(name)
        qw = empty_quantized("FP8", fp8_group_size(block), (), *weight.shape)
        fill_fp8_rows(qw.qweight, qw.scales, weight, scale, block)
        return dequantize(qw)

    def _tensor(self, name: str) -> torch.Tensor:
        """As stored (BF16 stays BF16, no copy), FP8 dequantized to fp32."""
        dtype = self.tensors.dtype(name)
        if dtype == "F8_E4M3":
            return self._dequantized(name)
        t = torch.from_numpy(self.tensors.array(name))
        return t.view(torch.bfloat16) if dtype == "BF16" else t

    def weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self._matrix(layer, expert, p) for p in PROJS)

    def _matrix(self, layer: int, expert: int, proj: str) -> torch.Tensor:
        """One expert's [out, in] matrix: its own tensor, or its columns of a stacked one (cfg.stacked_expert)."""
        stacked = self.cfg.stacked_expert(layer, expert, proj)
        if stacked is None:
            return self._tensor(self.cfg.expert_weight_name(layer, expert, proj))
        if self.tensors.dtype(stacked.name) not in ("BF16", "F16", "F32"):
            raise CheckpointError(f"tensor {stacked.name!r} is {self.tensors.dtype(stacked.name)}: stacked experts are "
                                  "read from bf16/fp16/fp32 checkpoints")
        t = torch.from_numpy(np.ascontiguousarray(stacked.take(self.tensors.array(stacked.name), expert)))
        return t.view(torch.bfloat16) if self.tensors.dtype(stacked.name) == "BF16" else t

    def fill_native(self, layer: int, expert: int, gate_up: QuantizedWeight, down: QuantizedWeight) -> None:
        inter = self.cfg.moe_intermediate_size
        gate, up, dn = (self.cfg.expert_weight_name(layer, expert, p) for p in PROJS)
        fill_fp8_rows(gate_up.qweight[:inter], gate_up.scales[:inter], *self._fp8(gate))
        fill_fp8_rows(gate_up.qweight[inter:], gate_up.scales[inter:], *self._fp8(up))
        fill_fp8_rows(down.qweight, down.scales, *self._fp8(dn))

    def dense(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.float() for t in self.weights(layer, expert))

    def release(self) -> None:
        self.tensors.release()


_MX_CODES = {"MXFP4": ("U8", "I8", "F4"), "MXFP8": ("F8_E4M3",)}  # safetensors dtypes of each format's codes
_E8M0 = ("U8", "F8_E8M0")


def _mx_found(cfg: ModelConfig, tensors: _Safetensors) -> tuple[str, MXTensors] | None:
    """(layout name, tensors of layer 0's first gate) of the first LAYOUTS entry whose codes and e8m0 scales the
    checkpoint holds, else None."""
    if not cfg.moe_layers:
        return None
    for name, where in LAYOUTS.items():
        t = where(cfg, cfg.moe_layers[0], 0, "gate")
        scales = [s for s in t.scales if s in tensors]
        if t.codes in tensors and scales and tensors.dtype(scales[0]) in _E8M0:
            return name, t
    return None


def stored_mx(cfg: ModelConfig, tensors: _Safetensors) -> str | None:
    """MXFP4 or MXFP8 where the checkpoint's routed experts are MX codes with e8m0 scales, else None."""
    found = _mx_found(cfg, tensors)
    if found is None:
        return None
    return next((m for m, dtypes in _MX_CODES.items() if tensors.dtype(found[1].codes) in dtypes), None)


# quantization_config.quant_method -> the MX format of the routed experts, for a folder without tensors
_MX_QUANT_METHODS = {"mxfp4": "MXFP4", "mxfp8": "MXFP8"}


def stored_mx_method(folder: Path, cfg: ModelConfig) -> str | None:
    """MXFP4 or MXFP8 where a checkpoint stores its routed experts as MX codes, which only that --kt-method serves
    (nothing re-quantizes them): from the tensors' headers, or from quantization_config where the folder holds no
    tensors (`ktlite plan` of a config.json alone: DeepSeek-V4's FP4 experts cannot be told from its config, whose
    quantization_config describes the FP8 dense weights). None: experts the default INT4 quantizes."""
    try:
        tensors = _Safetensors(folder, cfg.weight_renames)
    except (CheckpointError, OSError):
        raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
        quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
        return _MX_QUANT_METHODS.get(quant.get("quant_method"))
    return stored_mx(cfg, tensors)


class MXSource(Source):
    """MXFP4 / FP4 (e2m1) and MXFP8 (e4m3) experts with their e8m0 scales per 32, kept as stored
    (kernels/cpu/mx.py), found by the first mx_layouts.LAYOUTS entry the checkpoint matches."""

    def __init__(self, cfg: ModelConfig, folder: Path, method: str):
        super().__init__(cfg)
        self.tensors = _Safetensors(folder, cfg.weight_renames)  # a wrapper's names too (MiniMax-M3)
        self.method = method
        found = _mx_found(cfg, self.tensors)
        stored = stored_mx(cfg, self.tensors)
        if found is None or stored != method:
            what = f"{stored} experts" if stored else "no MX experts (codes with e8m0 scales per 32)"
            looked = ", ".join(where(cfg, cfg.moe_layers[0], 0, "gate").codes for where in LAYOUTS.values()) \
                if cfg.moe_layers else "nothing: the model has no MoE layers"
            hint = f"use --kt-method {stored}" if stored else "FP8 and BF16 experts have their own --kt-method"
            raise ConfigError(f"--kt-method {method} reads {method} experts; {folder} has {what} (looked for "
                              f"{looked}): {hint}")
        self.layout = LAYOUTS[found[0]]

    def formats(self, layer: int) -> tuple[Format, Format]:
        return (self.method, MX_GROUP), (self.method, MX_GROUP)

    def matrix(self, layer: int, expert: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
        """(code bytes [N, K / codes a byte], e8m0 scales [N, K / 32]) of one expert matrix, as stored."""
        t = self.layout(self.cfg, layer, expert, proj)
        codes = self.tensors.array(t.codes)
        scales = self.tensors.array(next(s for s in t.scales if s in self.tensors))
        if t.expert is not None:
            codes, scales = codes[t.expert], scales[t.expert]
        codes = codes.reshape(codes.shape[0], -1)[t.rows]  # gpt-oss blocks [out, in / 32, 16] -> [out, in / 2]
        scales = scales[t.rows]
        n, k = _dims(self.cfg, proj)
        want = ((n, k // codes_per_byte(self.method)), (n, -(-k // MX_GROUP)))
        if (codes.shape, scales.shape) != want:
            raise CheckpointError(f"{t.codes}: {self.method} codes {codes.shape} / scales {scales.shape} of expert "
                                  f"{expert} do not match config.json's [{n}, {k}] (want {want[0]} / {want[1]})")
        return codes, scales

    def fill_native(self, layer: int, expert: int, gate_up: QuantizedWeight, down: QuantizedWeight) -> None:
        inter = self.cfg.moe_intermediate_size
        for proj, dst, rows in (("gate", gate_up, slice(0, inter)), ("up", gate_up, slice(inter, None)),
                                ("down", down, slice(None))):
            fill_mx_rows(dst.qweight[rows], dst.scales[rows], *self.matrix(layer, expert, proj), self.method)

    def stored(self, layer: int, expert: int, proj: str) -> QuantizedWeight:
        """One expert matrix in ktlite's storage of its format (the codes and scales as stored, padded)."""
        qw = empty_quantized(self.method, MX_GROUP, (), *_dims(self.cfg, proj))
        fill_mx_rows(qw.qweight, qw.scales, *self.matrix(layer, expert, proj), self.method)
        return qw

    def dense(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The CPU decoder's fp32 values (code * 2^(scale - 127), one rounding) for the device side."""
        return tuple(dequantize(self.stored(layer, expert, p)) for p in PROJS)

    def gpu_weights(self, layer: int, experts: Sequence[int]) -> tuple[GPUQuantizedWeight, GPUQuantizedWeight]:
        """(w13 [E, 2I, H], w2 [E, H, I]) of `experts` as GPU MX stacks (the fused MoE's MX path), same bytes."""
        bits = 4 if self.method == "MXFP4" else 8

        def stack(projs: tuple[str, ...]) -> GPUQuantizedWeight:
            parts = [[self.matrix(layer, e, p) for p in projs] for e in experts]
            codes = np.stack([np.concatenate([np.asarray(c).view(np.uint8) for c, _ in m]) for m in parts])
            scales = np.stack([np.concatenate([np.asarray(s).view(np.uint8) for _, s in m]) for m in parts])
            return GPUQuantizedWeight(torch.from_numpy(codes), torch.from_numpy(scales), bits, MX_GROUP, mx=True)

        return stack(("gate", "up")), stack(("down",))

    def release(self) -> None:
        self.tensors.release()


class ConvertedSource(Source):
    """`ktlite convert` output for the CPU; the device side reads the HF checkpoint."""

    def __init__(self, cfg: ModelConfig, folder: Path, model: Path):
        super().__init__(cfg)
        self.folder, self.model = folder, model
        self.hf = HFSource(cfg, model, None)

    def fill(self, cpu: CPUMoE, placement: Placement, progress: bool = True) -> None:
        cpu_ids = {l: [e for e in range(self.cfg.n_routed_experts) if e not in set(placement.get(l, ()))]
                   for l in self.cfg.moe_layers}
        load_converted(self.folder, cpu, json.loads((self.model / "config.json").read_text()), cpu_ids)

    def dense(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hf.dense(layer, expert)


class CompressedInt4Source(Source):
    """compressed-tensors pack-quantized INT4 experts into INT4 group 32 as they
    are (kernels/cpu/compressed_int4.py), on the CPU and the GPU."""

    def __init__(self, cfg: ModelConfig, folder: Path):
        super().__init__(cfg)
        self.tensors = _Safetensors(folder, cfg.weight_renames)
        _check_pack_quantized(folder)
        first = self._base(cfg.moe_layers[0], 0, "gate") + ".weight_packed" if cfg.moe_layers else None
        if first is not None and first not in self.tensors:
            raise CheckpointError(f"--kt-method RAWINT4: {folder} has no {first!r} (compressed-tensors INT4 experts)")

    def _base(self, layer: int, expert: int, proj: str) -> str:
        return self.cfg.expert_weight_name(layer, expert, proj).removesuffix(".weight")

    def formats(self, layer: int) -> tuple[Format, Format]:
        return ("INT4", RAWINT4_GROUP), ("INT4", RAWINT4_GROUP)

    def codes(self, layer: int, expert: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
        """(nibbles uint8 [N, K] = code + 8, fp32 scales [N, K / 32]) of one matrix, checked against config.json."""
        base = self._base(layer, expert, proj)
        h, i = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        n, k = (h, i) if proj == "down" else (i, h)
        shape = tuple(int(v) for v in self.tensors.array(base + ".weight_shape"))
        if shape != (n, k):
            raise CheckpointError(f"{base}.weight_shape is {shape}, config.json says ({n}, {k})")
        return unpack_codes(self.tensors.array(base + ".weight_packed"), k), self.tensors.float32(base + ".weight_scale")

    def fill_native(self, layer: int, expert: int, gate_up: QuantizedWeight, down: QuantizedWeight) -> None:
        inter = self.cfg.moe_intermediate_size
        fill_int4_rows(gate_up.qweight[:inter], gate_up.scales[:inter], *self.codes(layer, expert, "gate"))
        fill_int4_rows(gate_up.qweight[inter:], gate_up.scales[inter:], *self.codes(layer, expert, "up"))
        fill_int4_rows(down.qweight, down.scales, *self.codes(layer, expert, "down"))

    def dense(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = []
        for p in PROJS:  # (code - 8) * scale: exact in fp32
            nib, scale = self.codes(layer, expert, p)
            q = nib.astype(np.float32) - 8.0
            out.append(torch.from_numpy((q.reshape(q.shape[0], -1, RAWINT4_GROUP) * scale[..., None]).reshape(q.shape)))
        return tuple(out)

    def gpu_weights(self, layer: int, experts: Sequence[int]) -> tuple[GPUQuantizedWeight, GPUQuantizedWeight]:
        """(w13 [E, 2I, H], w2 [E, H, I]) of `experts` in the GPU INT4 format (fused_moe), same codes."""
        gu = [self.codes(layer, e, p) for e in experts for p in ("gate", "up")]
        dn = [self.codes(layer, e, "down") for e in experts]
        w13 = gpu_int4([np.concatenate([g[0], u[0]]) for g, u in zip(gu[0::2], gu[1::2])],
                       [np.concatenate([g[1], u[1]]) for g, u in zip(gu[0::2], gu[1::2])])
        return w13, gpu_int4([d[0] for d in dn], [d[1] for d in dn])

    def release(self) -> None:
        self.tensors.release()


def _check_pack_quantized(folder: Path) -> None:
    """config.json must describe symmetric INT4 in groups of 32, pack-quantized (what RAWINT4 reads)."""
    raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    groups = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    ok = (quant.get("quant_method") == "compressed-tensors" and quant.get("format") == "pack-quantized"
          and any(w.get("num_bits") == 4 and w.get("type") == "int" and w.get("symmetric") and
                  w.get("strategy") == "group" and w.get("group_size") == RAWINT4_GROUP for w in groups))
    if not ok:
        raise ConfigError(f"--kt-method RAWINT4 reads compressed-tensors pack-quantized INT4 (symmetric, group "
                          f"{RAWINT4_GROUP}); {folder}/config.json describes {quant or 'no quantization'}")


class GGUFSource(Source):
    """LLAMAFILE: `blk.N.ffn_{gate,up,down}_exps.weight` of a GGUF file or folder, kept in their GGML types
    (Q4_K, Q5_K, Q6_K, Q8_0, BF16); other types are dequantized into the nearest ktlite format with one
    warning per type."""

    NAME = "blk.{layer}.ffn_{proj}_exps.weight"

    def __init__(self, cfg: ModelConfig, path: Path):
        super().__init__(cfg)
        self.path = path
        self.tensors = gguf_quants.read_tensors(path)
        self._formats: dict[int, tuple[Format, Format]] = {}
        warned: set[str] = set()
        for layer in cfg.moe_layers:
            t = {p: self._tensor(layer, p) for p in PROJS}
            self._formats[layer] = (self._format([t["gate"], t["up"]], warned), self._format([t["down"]], warned))

    def _tensor(self, layer: int, proj: str):
        name = self.NAME.format(layer=layer, proj=proj)
        if name not in self.tensors:
            raise CheckpointError(f"GGUF at {self.path} has no {name!r}, which config.json's MoE layer {layer} needs "
                                  f"(is it this model's GGUF?)")
        t = self.tensors[name]
        h, i, e = self.cfg.hidden_size, self.cfg.moe_intermediate_size, self.cfg.n_routed_experts
        want = (h, i, e) if proj == "down" else (i, h, e)  # GGUF dims: fastest first (K, N, experts)
        got = tuple(int(d) for d in t.shape)
        if got != (want[1], want[0], want[2]):
            raise CheckpointError(f"GGUF tensor {name} has dims {got} (K, N, experts); config.json needs "
                                  f"{(want[1], want[0], want[2])}")
        return t

    def _format(self, tensors: list, warned: set[str]) -> Format:
        types = {gguf_quants.type_name(t) for t in tensors}
        kind = types.pop() if len(types) == 1 else None
        if kind in gguf_quants.KEPT:
            return (kind, gguf_quants.block_weights(kind)) if kind != "BF16" else ("BF16", 64)
        formats = [gguf_quants.nearest_format(t) for t in tensors]
        fmt = max(formats, key=lambda f: ("INT4", "INT8", "BF16").index(f[0]))
        for t in tensors:
            kind = gguf_quants.type_name(t)
            if kind not in warned:
                warned.add(kind)
                why = "ktlite has no kernel for it" if kind not in gguf_quants.KEPT else "gate and up differ in type"
                logger.warning("GGUF tensor %s is %s (%s): its experts are dequantized and quantized again as %s, "
                               "which may lose precision", t.name, kind, why, fmt[0])
        return fmt

    def formats(self, layer: int) -> tuple[Format, Format]:
        return self._formats[layer]

    def fill_native(self, layer: int, expert: int, gate_up: QuantizedWeight, down: QuantizedWeight) -> None:
        inter = self.cfg.moe_intermediate_size
        for t, dst, rows in ((self._tensor(layer, "gate"), gate_up, slice(0, inter)),
                             (self._tensor(layer, "up"), gate_up, slice(inter, 2 * inter)),
                             (self._tensor(layer, "down"), down, slice(None))):
            if gguf_quants.type_name(t) == dst.method:  # kept: the file's bytes
                dst.qweight[rows] = gguf_quants.expert_stack(t)[expert]
            else:
                quantize_into(dst, (rows,), torch.from_numpy(gguf_quants.dequantize_expert(t, expert)))

    def dense(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = []
        for p in PROJS:
            t = self._tensor(layer, p)
            kind = gguf_quants.type_name(t)
            if kind in gguf_quants.BLOCKS:  # the CPU kernels' decoder: the values CPU experts compute with
                qw = empty_quantized(kind, gguf_quants.block_weights(kind), (), *_dims(self.cfg, p))
                qw.qweight[:] = gguf_quants.expert_stack(t)[expert]
                out.append(dequantize(qw))
            else:
                out.append(torch.from_numpy(gguf_quants.dequantize_expert(t, expert)))
        return tuple(out)


def _dims(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return (h, i) if proj == "down" else (i, h)


# ---- choosing ---------------------------------------------------------------------------------


def _is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf")))


def gpu_expert_format(config: EngineConfig) -> str:
    """How the GPU experts are held (plan_inputs.GPU_EXPERT_FORMATS): INT4 (RAWINT4) or MX (MXFP4 / FP4, MXFP8)
    stacks filled by the source's `gpu_weights` with the checkpoint's codes, else dense; the memory plan records
    it before any source is opened."""
    method = normalize_kt_method(config.kt_method)
    return {"RAWINT4": "int4_g32", "MXFP4": "mxfp4", "MXFP8": "mxfp8"}.get(method, "dense")


def open_source(config: EngineConfig, cfg: ModelConfig) -> Source:
    """The expert source `--kt-method` and `--kt-weight-path` name (see the module docstring)."""
    method = normalize_kt_method(config.kt_method)
    model = Path(config.model_path)
    path = Path(config.kt_weight_path) if config.kt_weight_path else model
    if not path.exists():
        raise ConfigError(f"--kt-weight-path {path}: no such file or folder")
    if method == "LLAMAFILE":
        if not _is_gguf(path):
            raise ConfigError(f"--kt-method LLAMAFILE reads GGUF experts: --kt-weight-path {path} is not a .gguf file "
                              "or a folder of them")
        return GGUFSource(cfg, path)
    if _is_gguf(path):
        raise ConfigError(f"--kt-weight-path {path} holds GGUF weights: use --kt-method LLAMAFILE")
    if (path / MANIFEST).is_file():
        if method not in QUANTIZED_METHODS:
            raise ConfigError(f"--kt-weight-path {path} holds `ktlite convert` output; serve it with the --kt-method "
                              f"it was converted with (INT4, INT8 or BF16), not {method}")
        return ConvertedSource(cfg, path, model)
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"--kt-weight-path {path} is neither an HF checkpoint folder, a `ktlite convert` folder nor "
                          "GGUF (KTransformers' own converted AMX weights are not readable: run `ktlite convert` or "
                          "point --kt-weight-path at the HF folder)")
    if method == "RAWINT4":
        return CompressedInt4Source(cfg, path)
    if method in MX_METHODS:
        return MXSource(cfg, path, method)
    return HFSource(cfg, path, method)
