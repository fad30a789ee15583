"""Adapter errors: each message names the adapter, the file or field, and what was expected."""


class AdapterError(ValueError):
    """An adapter cannot be used: bad files, unsupported PEFT feature, wrong base model."""


class AdapterPathError(AdapterError):
    """The adapter path resolves outside the allowed adapter root (the server answers 403)."""


class AdapterNotFoundError(AdapterError, KeyError):
    """No adapter registered under that name or id (the server answers 404)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CompositionError(AdapterError):
    """A request's composition of adapters cannot be served: no adapter, one twice, a weight
    that is not finite, more adapters than max_loras, a DoRA adapter (the server answers 400)."""
