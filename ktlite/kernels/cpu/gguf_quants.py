"""GGUF (llama.cpp) quantized blocks kept as they are in CPU RAM: Q4_K, Q5_K, Q6_K and Q8_0.

Storage (a QuantizedWeight whose method is the GGML type name): `qweight` [..., N, K / QK] of the
block's record dtype below (the bytes of the GGUF file, block by block; a record per type so numba
dispatches on it), `scales` empty [..., N, 0] (the scales live inside the blocks), group_size = QK.
The record fields follow ggml's block structs; the kernels (rowdots.py) decode them as ggml does:

- Q8_0 (32 weights, 34 B): w = d * qs[j].
- Q4_K (256 weights, 144 B): 8 sub-blocks of 32 with 6-bit scale sc and min m packed in `scales`;
  w = (d * sc) * q - (dmin * m), q a 4-bit code (64-weight runs: low nibbles, then high nibbles).
- Q5_K (256, 176 B): Q4_K plus a fifth bit per weight in `qh` (bit i of qh[l] for sub-block i).
- Q6_K (256, 210 B): 16 sub-blocks of 16 with int8 scales; w = (d * sc) * (q - 32), q 6 bits from
  `ql` nibbles and 2 bits of `qh`.
d and dmin are float16 bit patterns. `gguf.quants.dequantize` is the reference in the tests.
Other GGML types are not kept: the expert source dequantizes them into the nearest ktlite format.
"""

from __future__ import annotations

import re
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from ktlite.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from gguf import ReaderTensor

QK_K = 256
BLOCKS: dict[str, tuple[np.dtype, int]] = {  # GGML type name -> (block record dtype, weights per block)
    "Q8_0": (np.dtype([("d", "<u2"), ("qs", "i1", (32,))]), 32),
    "Q4_K": (np.dtype([("d", "<u2"), ("dmin", "<u2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))]), QK_K),
    "Q5_K": (np.dtype([("d", "<u2"), ("dmin", "<u2"), ("scales", "u1", (12,)), ("qh", "u1", (32,)),
                       ("qs", "u1", (128,))]), QK_K),
    "Q6_K": (np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<u2")]), QK_K),
}
Q8_0, Q4_K, Q5_K, Q6_K = (BLOCKS[t][0] for t in ("Q8_0", "Q4_K", "Q5_K", "Q6_K"))


def block_weights(method: str) -> int:
    return BLOCKS[method][1]


def is_gguf_format(method: str) -> bool:
    return method in BLOCKS


# ---- reading GGUF files (the `gguf` package maps them; tensors stay in the page cache) ----------


def _gguf():
    """The `gguf` package, imported when GGUF weights are read (it is not needed otherwise)."""
    try:
        import gguf
    except ImportError as exc:
        raise ConfigError("--kt-method LLAMAFILE reads GGUF files with the `gguf` package: pip install gguf") from exc
    return gguf

KEPT = tuple(BLOCKS) + ("BF16",)  # types stored as they are (BF16 is a ktlite format too)
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$")


def gguf_files(path: Path) -> list[Path]:
    """The GGUF files of `path`: a folder's *.gguf, all parts of a split file (`x-00001-of-00003.gguf`),
    or the one file."""
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
    else:
        m = _SPLIT.match(path.name)
        files = [path] if m is None else [path.with_name(f"{m['stem']}-{i:05d}-of-{m['total']}.gguf")
                                          for i in range(1, int(m["total"]) + 1)]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise CheckpointError(f"GGUF weights at {path}: missing {missing or 'every *.gguf file'}")
    return files


def read_tensors(path: Path) -> dict[str, ReaderTensor]:
    """name -> tensor (numpy views of memory maps) over every file of `gguf_files(path)`."""
    tensors: dict[str, ReaderTensor] = {}
    for f in gguf_files(path):
        for t in _gguf().GGUFReader(f, "r").tensors:
            tensors[t.name] = t
    return tensors


def type_name(t: ReaderTensor) -> str:
    return _gguf().GGMLQuantizationType(t.tensor_type).name


def nearest_format(t: ReaderTensor) -> tuple[str, int]:
    """(ktlite format, group) closest to a GGML type ktlite has no kernel for: 16/32-bit floats -> BF16,
    up to 4.5 bits per weight -> INT4 (group 32), more -> INT8 (group 32)."""
    name = type_name(t)
    if name in ("F16", "F32", "F64"):
        return "BF16", 64
    gguf = _gguf()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.tensor_type)]
    return ("INT4", 32) if 8 * size / block <= 4.5 else ("INT8", 32)


def expert_stack(t: ReaderTensor) -> np.ndarray:
    """A kept expert tensor's data [E, N, K / QK] as records (Q*), or [E, N, K] bf16 bits (BF16)."""
    name = type_name(t)
    dtype = np.dtype(np.uint16) if name == "BF16" else BLOCKS[name][0]
    data = np.asarray(t.data)
    return data.view(dtype).reshape(*data.shape[:-1], -1)


def dequantize_expert(t: ReaderTensor, expert: int) -> np.ndarray:
    """Expert `expert` of a stacked GGUF tensor as fp32 [N, K] (gguf's own dequantization)."""
    gguf = _gguf()
    return gguf.quants.dequantize(np.asarray(t.data[expert]), gguf.GGMLQuantizationType(t.tensor_type)).astype(np.float32)
