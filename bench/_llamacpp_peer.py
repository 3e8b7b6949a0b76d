"""llama.cpp's side of bench/e2e.py's peer column, on the same random checkpoint converted to GGUF.

Never imports ktlite (the underscore keeps it out of `ktlite bench`: it is a peer, not a benchmark): `bench`
runs under a python with llama-cpp-python (a side venv), as a subprocess
of bench/e2e.py --llamacpp-gguf, and prints one JSON line.

    # the side venv: PyPI has only llama-cpp-python's sdist, built here (5-25 min on 2 cores); its
    # vendor/llama.cpp folder has the converter (pip download --no-deps llama-cpp-python; tar -xzf it)
    python3 -m venv SIDE && CMAKE_ARGS="-DGGML_NATIVE=ON" SIDE/bin/pip install llama-cpp-python==0.3.36 gguf
    # HF checkpoint -> bf16 GGUF, with the user's llama.cpp converter (any python with torch + transformers)
    python bench/_llamacpp_peer.py convert --converter LLAMA_CPP/convert_hf_to_gguf.py CHECKPOINT OUT.bf16.gguf
    # bf16 GGUF -> Q4_0 / Q8_0 (llama.cpp's own type mix for that file type; side venv)
    python bench/_llamacpp_peer.py quantize OUT.bf16.gguf OUT.Q4_0.gguf --type Q4_0
    python bench/_llamacpp_peer.py bench OUT.Q4_0.gguf --threads 2 --prompt-len 64 --prefill-len 512,4096 --gen 24 --flash-attn

On a CPU where llama.cpp built its AMX buffer, `bench` keeps the weights out of it (_without_amx_buffer: on
DeepSeek-V2's MLA it aborts) and says where they went in its JSON ("weights_in").
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import runpy
import sys
import time
from pathlib import Path


def convert(converter: Path, checkpoint: Path, out: Path, outtype: str) -> None:
    """Run the user's convert_hf_to_gguf.py in this process, with two overrides for a random, cut-down checkpoint:
    - the bench tokenizer is trained on the fly, so no pre-tokenizer hash in the converter's table knows it;
      its pre-tokenizer is the standard GPT-2 byte-level regex, which llama.cpp calls "gpt-2";
    - llama.cpp tells DeepSeek-V2-Lite (no q_lora) by its 27 layers and otherwise requires
      `attention.q_lora_rank`, which the converter omits when it is null: write 0, its "no q_lora" value."""
    here = converter.resolve().parent
    sys.path[:0] = [str(here), str(here / "gguf-py")]  # its `conversion` package and the gguf-py it ships with
    from conversion.base import TextModel  # type: ignore[import-not-found]
    from conversion.deepseek import DeepseekV2Model  # type: ignore[import-not-found]

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    set_params = DeepseekV2Model.set_gguf_parameters

    def set_params_q_lora(self) -> None:
        set_params(self)
        if self.hparams.get("q_lora_rank") is None:
            self.gguf_writer.add_q_lora_rank(0)

    DeepseekV2Model.set_gguf_parameters = set_params_q_lora
    sys.argv = [str(converter), str(checkpoint), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(converter), run_name="__main__")


def quantize(src: Path, out: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 0  # all cores
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed for {src} -> {out}")


def gguf_summary(path: Path) -> dict:
    """The file type, bits per weight of the whole file, and the weights and bytes one batch-1 decode token
    reads: every tensor once except the token embedding (a lookup reads one row), routed experts (`*_exps`)
    at top-k of n_experts, as bench/e2e.py's bytes_per_decode_token counts ktlite's."""
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    arch = field("general.architecture")
    active = field(f"{arch}.expert_used_count") / field(f"{arch}.expert_count")
    weights = nbytes = 0.0
    for t in reader.tensors:
        if t.name != "token_embd.weight":
            share = active if "_exps." in t.name else 1.0
            weights += t.n_elements * share
            nbytes += t.n_bytes * share
    return {"file_type": LlamaFileType(field("general.file_type")).name.removeprefix("MOSTLY_"),
            "file_bytes": path.stat().st_size,
            "file_bits_per_weight": 8 * sum(int(t.n_bytes) for t in reader.tensors)
            / sum(int(t.n_elements) for t in reader.tensors),
            "weights_per_token": int(weights), "bytes_per_token": int(nbytes)}


# weights llama.cpp's CPU_REPACK buffer takes (its interleaved layouts for the AVX-512 / AVX2 kernels): every
# matrix but the token embedding (rows are looked up) and MLA's 3-D attn_k_b / attn_v_b (no repacked matmul)
_REPACKED = rb"(_exps|attn_q|attn_kv_a_mqa|attn_output|ffn_gate|ffn_up|ffn_down|_shexp)\.weight"
_KEEP_ALIVE: list = []  # the override arrays llama.cpp's model parameters point to


def _cpu_buffer_types(llama_cpp) -> dict[str, int]:
    """The CPU device's buffer types by name ("CPU", and its extra ones: "CPU_REPACK", "AMX" where built)."""
    import ctypes

    lib = Path(llama_cpp.__file__).parent / "lib"
    ggml, base = ctypes.CDLL(str(lib / "libggml.so")), ctypes.CDLL(str(lib / "libggml-base.so"))
    vp = ctypes.c_void_p
    ggml.ggml_backend_dev_by_name.restype, ggml.ggml_backend_dev_by_name.argtypes = vp, [ctypes.c_char_p]
    for name, res, args in (("ggml_backend_dev_backend_reg", vp, [vp]), ("ggml_backend_dev_buffer_type", vp, [vp]),
                            ("ggml_backend_reg_get_proc_address", vp, [vp, ctypes.c_char_p]),
                            ("ggml_backend_buft_name", ctypes.c_char_p, [vp])):
        getattr(base, name).restype, getattr(base, name).argtypes = res, args
    dev = ggml.ggml_backend_dev_by_name(b"CPU")
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(vp), vp)(base.ggml_backend_reg_get_proc_address(
        base.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts"))
    found = {"CPU": base.ggml_backend_dev_buffer_type(dev)}
    extra = get_extra(dev)
    for i in itertools.takewhile(lambda i: extra[i], itertools.count()):
        found[base.ggml_backend_buft_name(extra[i]).decode()] = extra[i]
    return found


def _without_amx_buffer(llama_cpp, file_type: str) -> str:
    """Where llama.cpp has its AMX buffer (an AMX CPU), load the weights without it: on DeepSeek-V2's MLA it aborts
    (`GGML_ASSERT(*cur_backend_id != -1)`: the AMX buffer takes attn_k_b / attn_v_b but has no op for them, and
    the 3-D experts; 2-D matrices alone in it segfault in this wheel). Q4_0 matrices go to CPU_REPACK (its best
    working path there), the rest to CPU, through the model parameters' tensor_buft_overrides; Q8_0 matrices in
    CPU_REPACK segfault at load in this wheel, so Q8_0 stays in CPU buffers. Returns where the weights went."""
    import ctypes

    llama_cpp.llama_backend_init()
    bufts = _cpu_buffer_types(llama_cpp)
    if "AMX" not in bufts:
        return "its default buffers"

    class Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    repack = file_type == "Q4_0"
    overrides = (Override * 3)(*([Override(_REPACKED, bufts["CPU_REPACK"])] if repack else []),
                               Override(b".", bufts["CPU"]), Override())
    defaults = llama_cpp.llama_cpp.llama_model_default_params  # what Llama() builds its parameters from

    def params():
        p = defaults()
        p.use_extra_bufts = False
        p.tensor_buft_overrides = ctypes.addressof(overrides)
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params
    _KEEP_ALIVE.append(overrides)
    return (f"its {'CPU_REPACK' if repack else 'CPU'} buffers, not its AMX one (which aborts on MLA"
            + ("" if repack else "; Q8_0 in CPU_REPACK segfaults") + ")")


def bench(path: Path, threads: int, prompt_len: int, prefill_lens: list[int], gen: int, flash_attn: bool) -> dict:
    """Prefill tok/s of each of `prefill_lens` tokens into an empty KV cache, and batch-1 greedy decode tok/s of
    `gen` tokens after a `prompt_len` prompt (the prompt not counted), each after a warm-up pass."""
    import llama_cpp
    import numpy as np

    buffers = _without_amx_buffer(llama_cpp, gguf_summary(path)["file_type"])
    longest = max(prefill_lens)
    # n_batch: tokens per llama_decode call (its default 2048 for long prompts; the whole prompt when shorter)
    llm = llama_cpp.Llama(str(path), n_ctx=max(longest, prompt_len + gen) + 16, n_batch=min(max(longest, 512), 2048),
                          n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn, verbose=False)
    vocab = llm.n_vocab()
    rng = random.Random(7)
    ids = lambda n: [rng.randrange(1000) for _ in range(n)]  # noqa: E731 - the ids bench/e2e.py draws from

    def prefill(tokens: list[int]) -> float:
        llm.reset()  # eval() drops the KV cache past n_tokens: an empty cache
        t = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - t

    def decode(prompt: list[int]) -> tuple[float, list[int]]:
        llm.reset()
        llm.eval(prompt)
        out: list[int] = []
        t = time.perf_counter()
        for _ in range(gen):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            out.append(int(logits.argmax()))
            llm.eval(out[-1:])
        return time.perf_counter() - t, out

    rates = {}
    for n in prefill_lens:
        prefill(ids(n))
        rates[n] = n / prefill(ids(n))
    decode(ids(prompt_len))
    decode_s, tokens = decode(ids(prompt_len))
    return {"gguf": str(path), **gguf_summary(path), "prefill_tok_s": rates,
            "decode_tok_s": gen / decode_s, "weights_in": buffers, "threads": threads, "flash_attn": flash_attn,
            "greedy_tokens": tokens, "llama_cpp": llama_cpp.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="HF checkpoint -> GGUF with llama.cpp's convert_hf_to_gguf.py")
    c.add_argument("checkpoint", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--converter", type=Path, required=True, help="path to llama.cpp's convert_hf_to_gguf.py")
    c.add_argument("--outtype", default="bf16", help="bf16 keeps the checkpoint's weights exactly; or q8_0")
    q = sub.add_parser("quantize", help="GGUF -> a llama.cpp file type (llama_model_quantize)")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("--type", default="Q4_0", help="Q4_0, Q8_0, Q4_K_M, ... (LLAMA_FTYPE_MOSTLY_<type>)")
    b = sub.add_parser("bench", help="prefill and batch-1 decode tok/s; one JSON line")
    b.add_argument("gguf", type=Path)
    b.add_argument("--threads", type=int, required=True)
    b.add_argument("--prompt-len", type=int, default=64)
    b.add_argument("--prefill-len", default="512", help="prompt lengths of the prefill rows, comma-separated")
    b.add_argument("--gen", type=int, default=24)
    b.add_argument("--flash-attn", action="store_true")
    args = ap.parse_args()
    if args.cmd == "convert":
        convert(args.converter, args.checkpoint, args.out, args.outtype)
    elif args.cmd == "quantize":
        quantize(args.src, args.out, args.type)
    else:
        lens = [int(n) for n in args.prefill_len.split(",")]
        print(json.dumps(bench(args.gguf, args.threads, args.prompt_len, lens, args.gen, args.flash_attn)))


if __name__ == "__main__":
    main()
