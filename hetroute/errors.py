"""The exception hierarchy. Each carries what a caller needs to answer the client."""

from __future__ import annotations


class HetrouteError(Exception):
    """Base of hetroute's own errors."""


class ConfigError(HetrouteError):
    """Invalid configuration; ``path`` names the field (``backends[2].url``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        """Picklable with its constructor's arguments (a worker process's error reaches its parent)."""
        return (type(self), (self.path, self.message))


class FileConfigError(ConfigError):
    """Invalid content of a file: ``path`` is ``<source>: <field path>`` (``gpus.yaml: gpus[3].name``)."""

    def __init__(self, source: str, field_path: str, message: str) -> None:
        super().__init__(f"{source}: {field_path}", message)
        self.source = source
        self.field_path = field_path

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, str]]:  # type: ignore[override]
        return (type(self), (self.source, self.field_path, self.message))


class UnknownModel(HetrouteError):
    """No configured backend serves this model through this API (404)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model

    def __reduce__(self) -> tuple[type[UnknownModel], tuple[str]]:
        return (type(self), (self.model,))


class NoBackendAvailable(HetrouteError):
    """Backends serve the model but none is available now (503)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no healthy backend for model `{model}`")
        self.model = model

    def __reduce__(self) -> tuple[type[NoBackendAvailable], tuple[str]]:
        return (type(self), (self.model,))
