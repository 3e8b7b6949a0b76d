"""ktlite: a small inference engine for very large Mixture-of-Experts models (CPU experts, GPU attention)."""

from typing import Any

__version__ = "0.1.0"

__all__ = ["Engine", "GenerationResult", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the CLI and light tools need not load torch/numba/triton to start.
    if name in ("Engine", "GenerationResult"):
        from ktlite.runtime import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from ktlite.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'ktlite' has no attribute {name!r}")
