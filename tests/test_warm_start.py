"""No compilation in a user's first request: once the Engine is constructed (its start-up forwards, verify.py), the
requests a user sends compile no numba kernel and load none from numba's cache: every numba dispatcher of ktlite
keeps the specialisations it had. Counted, not timed, so it holds on a loaded machine and whichever kernels the
model's forward picks (the MoE / dense paths of a DeepSeek-V3, a Qwen3-Next's Gated DeltaNet and gated attention).
"""

from __future__ import annotations

import sys

import pytest
from numba.core.dispatcher import Dispatcher

from ktlite import Engine
from ktlite.runtime.verify import reach_sizes

FLAGS = {"device": "cpu", "max_running_requests": 64, "chunked_prefill_size": 512}  # the demo's (`make demo`)


def specialisations() -> dict[str, int]:
    """Compiled (or cache-loaded) specialisations of every numba dispatcher a ktlite module holds."""
    counts = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("ktlite"):
            for obj in list(vars(module).values()):
                if isinstance(obj, Dispatcher):
                    counts[f"{obj.py_func.__module__}.{obj.py_func.__qualname__}"] = len(obj.signatures)
    return counts


def test_reach_sizes():
    assert reach_sizes(1) == []
    assert reach_sizes(4) == [1, 2, 3]
    assert reach_sizes(64) == [1, 2, 3, 4, 8, 16, 32]


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
def test_first_requests_compile_nothing(arch, tiny_v3, tiny_qwen3_next):
    """A short prompt, the same prompt again (a prefix-cache hit), then three requests at once; each decoding."""
    path = tiny_v3 if arch == "deepseek_v3" else tiny_qwen3_next
    with Engine(str(path), **FLAGS) as eng:
        before = specialisations()
        assert before, "no numba kernel was loaded at start-up"
        params = {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True}
        prompt = list(range(5, 25))
        eng.generate(input_ids=prompt, sampling_params=params)
        eng.generate(input_ids=prompt + [3], sampling_params=params)
        eng.generate(input_ids=[prompt[:7], prompt[:3] * 3, prompt[2:]], sampling_params=params)
        after = specialisations()
    grown = {name: (before.get(name, 0), n) for name, n in after.items() if n != before.get(name, 0)}
    assert grown == {}, f"compiled or loaded during the requests: {grown}"
