"""The whole Engine through the real Triton kernels (interpreted on CPU) equals the torch twins.

TRITON_INTERPRET is read when Triton kernels are first imported, so the Triton run happens in a
fresh interpreter; the twin run is the same script without the variable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, sys, torch
from ktlite import Engine
from ktlite.kernels.triton import use_triton
prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [300]]
flags = dict(kt_method="BF16", dtype="float32", max_total_tokens=2048, kt_gpu_experts_ratio=0.5,
             chunked_prefill_size=5, enable_mixed_chunk=True)
with Engine(sys.argv[1], **flags) as engine:
    out = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_tokens": 5, "ignore_eos": True})
print(json.dumps({"triton": use_triton(torch.zeros(1)), "tokens": [r.token_ids for r in out]}))
"""


def run(model, interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_engine_on_triton_kernels_matches_torch_twins(tiny_v3):
    triton, twin = run(tiny_v3, True), run(tiny_v3, False)
    assert triton["triton"] and not twin["triton"]  # each run really took its path
    assert triton["tokens"] == twin["tokens"]


def test_gqa_and_sparse_mla_engines_on_triton_kernels_match_torch_twins(hf_gqa_checkpoints):
    """GQA decode/extend (MiniMax-M2: per-layer q/k norm, partial rotary) and DeepSeek-V3.2's sparse MLA
    through the interpreted kernels."""
    for family in ("minimax_m2", "deepseek_v32"):
        model = hf_gqa_checkpoints[family]
        triton, twin = run(model, True), run(model, False)
        assert triton["triton"] and not twin["triton"]
        assert triton["tokens"] == twin["tokens"], family


def test_glm5_next_engine_on_triton_kernels_matches_torch_twins(tiny_glm5_next):
    """GLM-5.3-Flash: Kimi Delta Attention's per-channel decay in the recurrent kernel (prompts too), the sparse MLA
    kernel with no rope part (a masked zero-width rope tile) over the pooled indexer's slots, the clamped fused MoE."""
    triton, twin = run(tiny_glm5_next, True), run(tiny_glm5_next, False)
    assert triton["triton"] and not twin["triton"]
    assert triton["tokens"] == twin["tokens"]
