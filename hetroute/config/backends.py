"""One ``backends:`` entry of the router config: :class:`BackendConfig` and :func:`backend_from_dict`.

:func:`backend_from_dict` is the one parser of a backend entry: the config file's ``backends:`` items go
through it, and so must any other source of a backend in the same shape (an admin API). Errors name the
field under the path given (``backends[2].url``). ``BackendConfig`` shares every field with the routing view
:class:`hetroute.types.BackendSpec` (both extend :class:`hetroute.types.BackendFields`); only ``engine`` and
``models`` differ: here they may be None until :mod:`hetroute.backends.discovery` fills them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from hetroute.dns_settings import DNS_DISCOVERY
from hetroute.errors import ConfigError
from hetroute.fields import (
    AT_LEAST_ONE,
    POSITIVE,
    as_choice,
    as_list,
    as_mapping,
    as_str,
    as_url,
    at,
    check_keys,
    field_value,
    number,
    opt_integer,
    opt_string,
    optional,
)
from hetroute.latency import LatencyProfile, ProfileError, load_profile
from hetroute.types import ENGINE_KINDS, BackendFields, BackendSpec, EngineKind

BACKEND_KEYS = (
    "name", "url", "engine", "models", "weight", "labels", "gpu", "tp",
    "profile", "kv_capacity_tokens", "max_num_seqs", "max_model_len", "discovery",
)  # fmt: skip
DEFAULTS_KEYS = (
    "engine", "weight", "labels", "profile", "kv_capacity_tokens", "max_num_seqs", "max_model_len",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class BackendConfig(BackendFields):
    """A configured backend; ``engine``/``models`` None until discovery resolves them."""

    engine: EngineKind | None = None
    models: tuple[str, ...] | None = None
    discovery: str | None = None
    """``dns``: the URL's host names a set of servers, re-resolved (:mod:`hetroute.backends.dns`)."""

    @property
    def resolved(self) -> bool:
        return self.engine is not None and self.models is not None

    def to_spec(self, index: int) -> BackendSpec:
        """The routing view; ConfigError if discovery has not filled engine and models."""
        if self.engine is None:
            raise ConfigError(f"backends[{index}].engine", "unknown (discovery did not run or failed)")
        if not self.models:
            raise ConfigError(f"backends[{index}].models", "unknown (discovery did not run or failed)")
        shared = {f.name: getattr(self, f.name) for f in fields(BackendFields)}
        shared["labels"] = dict(self.labels)
        return BackendSpec(**shared, engine=self.engine, models=self.models)


def _models(raw: Any, path: str) -> tuple[str, ...] | None:
    if raw is None:
        return None
    items = as_list([raw] if isinstance(raw, str) else raw, path, "model names")
    return tuple(as_str(m, f"{path}[{j}]") for j, m in enumerate(items))


def _labels(raw: Any, path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in as_mapping(raw, path).items():
        if isinstance(value, Mapping | list) or value is None:
            raise ConfigError(at(path, key), f"expected a scalar label value, got {value!r}")
        out[key] = str(value)
    return out


def _tp(merged: Mapping[str, Any], labels: Mapping[str, str], path: str) -> int | None:
    tp = opt_integer(merged, "tp", path, AT_LEAST_ONE)
    if tp is None and "tp" in labels:
        if not labels["tp"].isdigit() or int(labels["tp"]) < 1:
            raise ConfigError(f"{path}.labels.tp", f"expected a positive integer, got {labels['tp']!r}")
        tp = int(labels["tp"])
    return tp


def _profile(
    ref: Any, path: str, profiles: Mapping[str, str], base_dir: Path
) -> tuple[LatencyProfile | None, str | None]:
    if ref is None:
        return None, None
    if not isinstance(ref, str) or not ref:
        raise ConfigError(path, f"expected a file path or a key of `profiles`, got {ref!r}")
    file = profiles.get(ref, ref)
    full = Path(file) if Path(file).is_absolute() else base_dir / file
    try:
        return load_profile(full), str(full)
    except ProfileError as exc:
        raise ConfigError(path, str(exc)) from exc


def backend_from_dict(
    raw: Any,
    path: str = "backend",
    *,
    defaults: Mapping[str, Any] | None = None,
    profiles: Mapping[str, str] | None = None,
    base_dir: Path | None = None,
) -> BackendConfig:
    """Validate one decoded backend entry into a :class:`BackendConfig`; errors name ``<path>.<field>``.
    The config's ``backends:`` items and the body of ``POST /admin/backends`` both go through it.

    ``defaults`` (the config's ``defaults:`` section) fill absent fields; ``profile`` is a key of
    ``profiles`` or a file path, relative paths resolving against ``base_dir`` (default: the working
    directory). ``name`` defaults to the URL's ``host:port``. Names are not checked for uniqueness here.
    """
    d = as_mapping(raw, path, none_ok=False)
    check_keys(d, BACKEND_KEYS, path)
    merged = {**(defaults or {}), **d}
    url = as_url(field_value(merged, "url", path), f"{path}.url")
    engine = merged.get("engine")
    if engine is not None:
        as_choice(engine, f"{path}.engine", ENGINE_KINDS)
    labels = _labels(merged.get("labels"), f"{path}.labels")
    profile, profile_path = _profile(
        merged.get("profile"), f"{path}.profile", profiles or {}, base_dir or Path.cwd()
    )
    return BackendConfig(
        name=opt_string(merged, "name", path) or (urlsplit(url).netloc or url),
        url=url,
        engine=cast(EngineKind | None, engine),
        models=_models(merged.get("models"), f"{path}.models"),
        weight=number(merged, "weight", path, 1.0, POSITIVE),
        labels=labels,
        gpu=opt_string(merged, "gpu", path) or labels.get("gpu"),
        tp=_tp(merged, labels, path),
        profile=profile,
        profile_path=profile_path,
        kv_capacity_tokens=opt_integer(merged, "kv_capacity_tokens", path, AT_LEAST_ONE),
        max_num_seqs=opt_integer(merged, "max_num_seqs", path, AT_LEAST_ONE),
        max_model_len=opt_integer(merged, "max_model_len", path, AT_LEAST_ONE),
        discovery=optional(merged, "discovery", path, lambda v, p: as_choice(v, p, (DNS_DISCOVERY,))),
    )


def parse_profiles(raw: Any) -> dict[str, str]:
    """The ``profiles:`` section: a name for each profile file a backend may refer to."""
    out: dict[str, str] = {}
    for key, file in as_mapping(raw, "profiles").items():
        if not isinstance(file, str) or not file:
            raise ConfigError(f"profiles.{key}", f"expected a file path, got {file!r}")
        out[key] = file
    return out


def parse_backends(
    raw: Any, defaults_raw: Any, profiles: Mapping[str, str], base_dir: Path
) -> tuple[BackendConfig, ...]:
    """The ``backends:`` list (non-empty, unique names) with the ``defaults:`` section applied."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError("backends", "expected a non-empty list of backends")
    defaults = as_mapping(defaults_raw, "defaults")
    check_keys(defaults, DEFAULTS_KEYS, "defaults")
    backends = tuple(
        backend_from_dict(b, f"backends[{i}]", defaults=defaults, profiles=profiles, base_dir=base_dir)
        for i, b in enumerate(raw)
    )
    seen: dict[str, int] = {}
    for i, b in enumerate(backends):
        if b.name in seen:
            raise ConfigError(
                f"backends[{i}].name", f"duplicate of backends[{seen[b.name]}].name ({b.name!r})"
            )
        seen[b.name] = i
    return backends
