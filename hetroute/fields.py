"""The one validation layer: typed readers for decoded YAML, one YAML loader, one file-error wrapper.

Every configuration-like input of hetroute (the router config, policy and predictor params, the GPU and model
catalogs, latency profiles, the simulator's and ``tune-deploy``'s cluster files) is read through this module.

Contract:

- every reader raises :class:`~hetroute.errors.ConfigError` whose ``path`` names the field
  (``backends[2].url``, ``policy.params.theta``, ``gpus[3].mem_bw_gbps``) and whose message says what was
  expected and what was found; nothing raises a bare ``KeyError``/``TypeError`` on bad input;
- a reader returns a value of the declared type within the declared bounds, or raises;
- :func:`read_dataclass` reads a whole frozen dataclass from a mapping: the dataclass's fields are the
  allowed keys (any other is an error), its defaults are the defaults and its annotations, with an optional
  :class:`Range` or :class:`Reader` in ``Annotated[...]``, are the types and bounds. One definition per field;
- :func:`load_yaml` is the only place that reads a YAML file, and :func:`file_errors` the only place that
  turns a field error into an error naming the file (``gpus.yaml: gpus[3].name: ...``).

Why a small stdlib module and not pydantic v2: the project already had one error type and one message shape
(``<field path>: <what was wrong>``) that its tests, docs and operators rely on; pydantic would add a
dependency to the router's import path, report locations as tuples and word every message its own way, so
each caller would need a translation layer as long as this module. The dataclasses stay plain frozen,
slotted dataclasses, so nothing that builds them in code (tests, the simulator) changes.

Layering: imports only :mod:`hetroute.errors`, the standard library and ``yaml``, so the catalog and every
other layer may use it.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

import yaml

from hetroute.errors import ConfigError, FileConfigError

T = TypeVar("T")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()
"""The default of a required field: absent, the reader raises ``<path>: missing``."""


def at(path: str, key: object) -> str:
    """The path of ``key`` inside ``path`` (``at("server", "port") == "server.port"``; ``at("", k) == k``)."""
    return f"{path}.{key}" if path else str(key)


def _fmt(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
    """Bounds of a number: ``minimum <= x``, ``above < x``, ``x <= maximum``, ``x < below`` (None: none)."""

    minimum: float | None = None
    above: float | None = None
    maximum: float | None = None
    below: float | None = None

    def violation(self, value: float) -> str | None:
        """``must be >= 0``-style text of the first bound ``value`` breaks, or None."""
        if self.minimum is not None and not value >= self.minimum:
            return f"must be >= {_fmt(self.minimum)}"
        if self.above is not None and not value > self.above:
            return f"must be > {_fmt(self.above)}"
        if self.maximum is not None and not value <= self.maximum:
            return f"must be <= {_fmt(self.maximum)}"
        if self.below is not None and not value < self.below:
            return f"must be < {_fmt(self.below)}"
        return None


ANY: Final = Range()
POSITIVE: Final = Range(above=0)
NON_NEGATIVE: Final = Range(minimum=0)
AT_LEAST_ONE: Final = Range(minimum=1)
FRACTION: Final = Range(above=0, maximum=1)
"""A share in (0, 1]."""
UNIT: Final = Range(minimum=0, maximum=1)
"""A share in [0, 1]."""

PositiveFloat = Annotated[float, POSITIVE]
NonNegativeFloat = Annotated[float, NON_NEGATIVE]
PositiveInt = Annotated[int, AT_LEAST_ONE]
NonNegativeInt = Annotated[int, NON_NEGATIVE]


@dataclasses.dataclass(frozen=True, slots=True)
class Reader:
    """``Annotated[X, Reader(fn)]``: :func:`read_dataclass` reads the field with ``fn(value, path)``."""

    read: Callable[[Any, str], Any]


# ---------------------------------------------------------------- values


def as_mapping(value: Any, path: str, *, none_ok: bool = True) -> Mapping[str, Any]:
    """A mapping with string keys; ``None`` reads as ``{}`` unless ``none_ok`` is false."""
    if value is None and none_ok:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {key!r}")
    return value


def check_keys(data: Mapping[str, Any], allowed: Collection[str], path: str, *, what: str = "field") -> None:
    """Reject the first key of ``data`` not in ``allowed``, naming it and listing the valid ones."""
    for key in data:
        if key not in allowed:
            valid = ", ".join(allowed) if allowed else "none"
            raise ConfigError(at(path, key), f"unknown {what} (valid: {valid})")


def as_list(value: Any, path: str, what: str = "items") -> list[Any]:
    """A non-empty list."""
    if not isinstance(value, list) or not value:
        raise ConfigError(path, f"expected a non-empty list of {what}, got {value!r}")
    return value


def as_number(value: Any, path: str, bounds: Range = ANY) -> float:
    """A finite number (an int reads as a float) within ``bounds``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise ConfigError(path, f"expected a finite number, got {value!r}")
    problem = bounds.violation(float(value))
    if problem is not None:
        raise ConfigError(path, f"{problem}, got {value!r}")
    return float(value)


def as_int(value: Any, path: str, bounds: Range = ANY) -> int:
    """An integer (not a bool, not a float) within ``bounds``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"expected an integer, got {value!r}")
    problem = bounds.violation(value)
    if problem is not None:
        raise ConfigError(path, f"{problem}, got {value!r}")
    return value


def as_str(value: Any, path: str) -> str:
    """A string with something besides white space in it."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(path, f"expected a non-empty string, got {value!r}")
    return value


def as_bool(value: Any, path: str) -> bool:
    """``true`` or ``false`` (not 0/1, not "yes")."""
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {value!r}")
    return value


def as_choice(value: Any, path: str, choices: Collection[str]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(path, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def as_url(value: Any, path: str) -> str:
    """An ``http(s)://host[:port][/path]`` URL without query or fragment, trailing ``/`` removed."""
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected an http(s) URL, got {value!r}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(path, f"expected an http(s) URL with a host, got {value!r}")
    if parts.query or parts.fragment:
        raise ConfigError(path, f"must not have a query or fragment, got {value!r}")
    try:
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as exc:
        raise ConfigError(path, f"bad port in {value!r}") from exc
    return value.rstrip("/")


# ---------------------------------------------------------------- keys of a mapping


def field_value(data: Mapping[str, Any], key: str, path: str, default: Any = MISSING) -> Any:
    """``data[key]``, ``default`` when absent; ``<path>.<key>: missing`` when absent and required."""
    if key in data:
        return data[key]
    if default is MISSING:
        raise ConfigError(at(path, key), "missing")
    return default


def keyed(
    data: Mapping[str, Any], key: str, path: str, read: Callable[[Any, str], T], default: Any = MISSING
) -> T:
    """``read(data[key], "<path>.<key>")``; ``default`` (unchecked) when absent, ``missing`` when required."""
    if key not in data and default is not MISSING:
        return cast(T, default)
    return read(field_value(data, key, path), at(path, key))


def optional(data: Mapping[str, Any], key: str, path: str, read: Callable[[Any, str], T]) -> T | None:
    """``read(data[key], "<path>.<key>")``, None when the key is absent or null."""
    value = data.get(key)
    return None if value is None else read(value, at(path, key))


def number(
    data: Mapping[str, Any], key: str, path: str, default: Any = MISSING, bounds: Range = ANY
) -> float:
    """:func:`as_number` of ``data[key]`` (``default`` when absent, unchecked)."""
    return float(keyed(data, key, path, lambda v, p: as_number(v, p, bounds), default))


def opt_number(data: Mapping[str, Any], key: str, path: str, bounds: Range = ANY) -> float | None:
    """:func:`number`, None when absent or null."""
    return optional(data, key, path, lambda v, p: as_number(v, p, bounds))


def integer(data: Mapping[str, Any], key: str, path: str, default: Any = MISSING, bounds: Range = ANY) -> int:
    """:func:`as_int` of ``data[key]`` (``default`` when absent, unchecked)."""
    return int(keyed(data, key, path, lambda v, p: as_int(v, p, bounds), default))


def opt_integer(data: Mapping[str, Any], key: str, path: str, bounds: Range = ANY) -> int | None:
    """:func:`integer`, None when absent or null."""
    return optional(data, key, path, lambda v, p: as_int(v, p, bounds))


def string(data: Mapping[str, Any], key: str, path: str, default: Any = MISSING) -> str:
    """:func:`as_str` of ``data[key]`` (``default`` when absent, unchecked)."""
    return str(keyed(data, key, path, as_str, default))


def opt_string(data: Mapping[str, Any], key: str, path: str) -> str | None:
    """:func:`string`, None when absent or null."""
    return optional(data, key, path, as_str)


def boolean(data: Mapping[str, Any], key: str, path: str, default: Any = MISSING) -> bool:
    """:func:`as_bool` of ``data[key]`` (``default`` when absent)."""
    return bool(keyed(data, key, path, as_bool, default))


def choice(
    data: Mapping[str, Any], key: str, path: str, choices: Collection[str], default: Any = MISSING
) -> str:
    """:func:`as_choice` of ``data[key]`` (``default`` when absent)."""
    return str(keyed(data, key, path, lambda v, p: as_choice(v, p, choices), default))


# ---------------------------------------------------------------- whole dataclasses


def read_value(hint: Any, value: Any, path: str, bounds: Range = ANY) -> Any:
    """``value`` read as the type ``hint`` (bool, int, float, str, a Literal, a dataclass, ``X | None``,
    ``object``, or ``Annotated`` with a :class:`Range` or :class:`Reader`)."""
    origin = get_origin(hint)
    if origin is Annotated:
        base, *extras = get_args(hint)
        for extra in extras:
            if isinstance(extra, Reader):
                return extra.read(value, path)
        ranges = [e for e in extras if isinstance(e, Range)]
        return read_value(base, value, path, ranges[0] if ranges else bounds)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        if value is None and len(options) < len(get_args(hint)):
            return None
        if len(options) == 1:
            return read_value(options[0], value, path, bounds)
    if origin is Literal:
        return as_choice(value, path, [str(a) for a in get_args(hint)])
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return read_dataclass(hint, value, path)
    readers: dict[Any, Callable[[Any, str], Any]] = {
        bool: as_bool,
        int: lambda v, p: as_int(v, p, bounds),
        float: lambda v, p: as_number(v, p, bounds),
        str: as_str,
        object: lambda v, p: v,
        Any: lambda v, p: v,
    }
    reader = readers.get(hint)
    if reader is None:
        raise TypeError(f"{path}: no reader for the type {hint!r}; annotate it with a Reader")
    return reader(value, path)


def read_dataclass(
    cls: type[T],
    raw: Any,
    path: str,
    *,
    base: T | None = None,
    what: str = "field",
    exclude: Collection[str] = (),
) -> T:
    """The frozen dataclass ``cls`` read from the mapping ``raw`` (None: all defaults).

    The allowed keys are ``cls``'s init fields less ``exclude``; an absent field takes ``base``'s value
    when a ``base`` instance is given, else the dataclass default; a field with neither is ``missing``.
    ``what`` names a key in the unknown-key error (``unknown parameter for policy 'x' (valid: ...)``).
    """
    data = as_mapping(raw, path)
    fields = [f for f in dataclasses.fields(cls) if f.init and f.name not in exclude]  # type: ignore[arg-type]
    check_keys(data, [f.name for f in fields], path, what=what)
    hints = get_type_hints(cls, include_extras=True)  # read at load time only: no cache, no global state
    values: dict[str, Any] = {}
    for f in fields:
        if f.name in data:
            values[f.name] = read_value(hints[f.name], data[f.name], at(path, f.name))
        elif base is None and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(at(path, f.name), "missing")
    if base is not None:
        return dataclasses.replace(base, **values)  # type: ignore[type-var]
    return cls(**values)


# ---------------------------------------------------------------- files


def load_yaml(file: str | Path, *, path: str = "<file>") -> Any:
    """The decoded YAML of ``file``; ConfigError at ``path`` when it cannot be read or parsed."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        where = "" if path == str(file) else f" {file}"  # the full path, unless the error's path is it
        raise ConfigError(path, f"cannot read{where}: {exc.strerror or exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(path, f"not valid YAML: {exc}") from exc


FileErrorFactory = Callable[[str, str, str], Exception]
"""``(source, field_path, message) -> error``: :class:`FileConfigError` or a subclass, or ``ProfileError``."""


@contextmanager
def file_errors(source: str, error: FileErrorFactory = FileConfigError) -> Iterator[None]:
    """Inside the block, a field error becomes ``error(source, field_path, message)``, whose text reads
    ``<source>: <field path>: <message>``. An error that already names its file passes unchanged."""
    try:
        yield
    except FileConfigError:
        raise
    except ConfigError as exc:
        raise error(source, exc.path, exc.message) from exc
