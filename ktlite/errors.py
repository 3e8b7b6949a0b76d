"""Errors ktlite raises on purpose. Each message says what was wrong and what to change."""


class KtliteError(Exception):
    """Base class: anything ktlite raises deliberately."""


class ConfigError(KtliteError, ValueError):
    """A model config.json or a flag has a value ktlite cannot serve."""


class EngineFailure(KtliteError):
    """The engine stopped serving (a forward step raised, or a tensor-parallel rank died): every request ends."""


class CheckpointError(KtliteError):
    """A checkpoint folder is missing a file or tensor, or a tensor has the wrong shape."""


class PlanError(KtliteError):
    """The memory plan does not fit the device; the message names the knob and what fits."""


class RequestError(KtliteError, ValueError):
    """A request's parameters are invalid (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
