"""Typed readers for the cluster file: each raises :class:`ClusterError` naming ``file: field.path``.

Owns: :class:`ClusterError`, :class:`FieldReader`. Invariant: no reader returns a value of the wrong type or
out of range; every failure names the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hetroute.errors import ConfigError


class ClusterError(ConfigError):
    """An invalid cluster file; names the file and the field."""

    def __init__(self, source: str, field_path: str, message: str) -> None:
        super().__init__(f"{source}: {field_path}", message)
        self.source = source
        self.field_path = field_path


class FieldReader:
    """Typed field readers that raise :class:`ClusterError` naming ``source: path``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, message: str) -> ClusterError:
        return ClusterError(self.source, path, message)

    def mapping(self, value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(path, f"expected a mapping, got {type(value).__name__}")
        return value

    def unknown_keys(self, item: Mapping[str, Any], allowed: set[str], path: str) -> None:
        extra = sorted(str(k) for k in item if k not in allowed)
        if extra:
            raise self.fail(
                f"{path}.{extra[0]}", f"unknown field; expected one of {', '.join(sorted(allowed))}"
            )

    def string(self, item: Mapping[str, Any], key: str, path: str, default: str | None = None) -> str:
        value = item.get(key, default)
        if not isinstance(value, str) or not value.strip():
            raise self.fail(
                f"{path}.{key}", "missing" if key not in item else f"expected a string, got {value!r}"
            )
        return value.strip()

    def number(
        self,
        item: Mapping[str, Any],
        key: str,
        path: str,
        *,
        lo: float = 0.0,
        hi: float = math.inf,
        lo_open: bool = True,
        default: float | None = None,
    ) -> float:
        if key not in item or item[key] is None:
            if default is not None:
                return default
            raise self.fail(f"{path}.{key}", "missing")
        value = item[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.fail(f"{path}.{key}", f"expected a number, got {value!r}")
        if value < lo or (lo_open and value == lo) or value > hi:
            bound = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi != math.inf else "")
            raise self.fail(f"{path}.{key}", f"expected a number {bound}, got {value!r}")
        return float(value)

    def integer(self, item: Mapping[str, Any], key: str, path: str, default: int | None = None) -> int:
        if key not in item or item[key] is None:
            if default is not None:
                return default
            raise self.fail(f"{path}.{key}", "missing")
        value = item[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(f"{path}.{key}", f"expected a positive integer, got {value!r}")
        return value

    def opt_integer(self, item: Mapping[str, Any], key: str, path: str) -> int | None:
        return None if item.get(key) is None else self.integer(item, key, path)
