"""ktlite: a small inference engine for DeepSeek-class Mixture-of-Experts models."""

__version__ = "0.1.0"
