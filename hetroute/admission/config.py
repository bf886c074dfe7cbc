"""The ``admission:`` config section: typed, validated at load, errors name the field.

Owns the schema of the router-side queue (docs/configuration.md, "admission"). Invariants:

- ``classes`` is in strict priority order, highest first, with unique names; ``default_class``
  names one of them;
- every bound is finite and positive; tenant weights are > 0;
- the section is optional: without it the queue is off (``AdmissionConfig()``); a present section
  turns it on (one class ``default`` unless it lists classes), and it then holds requests only while
  every candidate backend is full, so a fleet that is never full never sees it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hetroute.errors import ConfigError

DEFAULT_CLASS = "default"


@dataclass(frozen=True, slots=True)
class ClassConfig:
    """One priority class.

    ``max_queue_len``: requests of this class that may wait at once (beyond: 429 ``queue_full``).
    ``max_queue_wait_s``: longest wait before the request is shed (429 ``wait_timeout``).
    ``ageing_s``: starvation bound: when this class has waited ``ageing_s`` without any of its
    requests being dispatched, its head goes before every higher class (once).
    ``retry_after_s``: the ``Retry-After`` sent with a 429 (default: ``max_queue_wait_s`` rounded up).
    ``fill_frac``: the share of each backend's high-water marks (KV, sequences, drain) this class may
    fill; below 1 it leaves headroom that only higher classes use, so their requests start at once
    instead of queueing inside a saturated engine (default 1 for the first class, 0.9 below it).
    ``placement``: ``policy`` (the routing policy's choice, late-bound; the default) or
    ``first_token`` (the free backend with the smallest predicted time to first token: for
    interactive classes on fleets whose slow backends have long steps under load).
    """

    name: str = DEFAULT_CLASS
    max_queue_len: int = 1024
    max_queue_wait_s: float = 60.0
    ageing_s: float = 5.0
    retry_after_s: int | None = None
    fill_frac: float = 1.0
    placement: Literal["policy", "first_token"] = "policy"

    @property
    def retry_after(self) -> int:
        if self.retry_after_s is not None:
            return self.retry_after_s
        return max(1, math.ceil(self.max_queue_wait_s))


@dataclass(frozen=True, slots=True)
class FullConfig:
    """When a backend is "full" for a request (admission/full.py).

    ``kv_high_water_frac``: full when the ledger's KV estimate (Σ I + generated + remaining Õ of
    in-flight requests) plus this request's I + Õ exceeds this fraction of the KV capacity.
    ``seqs_high_water_frac``: full when in-flight requests reach this fraction of ``max_num_seqs``
    (when known). ``engine_waiting_max``: also full while the engine's last scrape reports more than
    this many waiting requests (None: 0, on the backends whose ``max_num_seqs`` is unknown only).
    ``max_drain_s``: also full when the policy's load ``L_s`` reaches it. ``spill_margin``: see
    ``Placer.place``. A backend with nothing in flight is never full.
    """

    kv_high_water_frac: float = 1.0
    seqs_high_water_frac: float = 1.0
    max_drain_s: float | None = None
    spill_margin: float = 2.0
    engine_waiting_max: int | None = None


@dataclass(frozen=True, slots=True)
class ApiKeyConfig:
    """What one API key (``Authorization: Bearer <key>``) maps to; None keeps the header/default."""

    priority_class: str | None = None
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The router-side queue. ``enabled: false`` dispatches every request at once, as before."""

    enabled: bool = False
    classes: tuple[ClassConfig, ...] = (ClassConfig(),)
    default_class: str = DEFAULT_CLASS
    class_header: str = "x-hetroute-priority"
    tenant_header: str = "x-hetroute-tenant"
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    default_tenant_weight: float = 1.0
    api_keys: Mapping[str, ApiKeyConfig] = field(default_factory=dict)
    full: FullConfig = field(default_factory=FullConfig)
    recheck_s: float = 1.0

    def class_index(self, name: str) -> int:
        for i, c in enumerate(self.classes):
            if c.name == name:
                return i
        raise KeyError(name)

    def weight_of(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, self.default_tenant_weight)


# ---------------------------------------------------------------- parsing

_KEYS = (
    "enabled", "classes", "default_class", "class_header", "tenant_header", "tenants",
    "default_tenant_weight", "api_keys", "full", "recheck_s",
)  # fmt: skip
_CLASS_KEYS = (
    "name",
    "max_queue_len",
    "max_queue_wait_s",
    "ageing_s",
    "retry_after_s",
    "fill_frac",
    "placement",
)
_DEFAULT = AdmissionConfig()
_FULL_KEYS = (
    "kv_high_water_frac", "seqs_high_water_frac", "max_drain_s", "spill_margin", "engine_waiting_max",
)  # fmt: skip


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(path, f"expected a mapping with string keys, got {value!r}")
    return value


def _only(data: Mapping[str, Any], allowed: tuple[str, ...], path: str) -> None:
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}", f"unknown field (valid: {', '.join(allowed)})")


def _pos(data: Mapping[str, Any], key: str, path: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{path}.{key}", f"expected a finite number, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{path}.{key}", f"must be > 0, got {value!r}")
    return float(value)


def _count(data: Mapping[str, Any], key: str, path: str, default: int | None, minimum: int) -> int | None:
    value = data.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{path}.{key}", f"expected an integer >= {minimum}, got {value!r}")
    return value


def _name(data: Mapping[str, Any], key: str, path: str, default: str | None) -> str | None:
    value = data.get(key, default)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{path}.{key}", f"expected a non-empty string, got {value!r}")
    return value


def _class(raw: Any, path: str, first: bool) -> ClassConfig:
    d = _mapping(raw, path)
    _only(d, _CLASS_KEYS, path)
    name = _name(d, "name", path, None)
    if name is None:
        raise ConfigError(f"{path}.name", "every class needs a name")
    dflt = ClassConfig()
    return ClassConfig(
        name=name,
        max_queue_len=_count(d, "max_queue_len", path, dflt.max_queue_len, 0) or 0,
        max_queue_wait_s=_pos(d, "max_queue_wait_s", path, dflt.max_queue_wait_s),
        ageing_s=_pos(d, "ageing_s", path, dflt.ageing_s),
        retry_after_s=_count(d, "retry_after_s", path, None, 0),
        fill_frac=_pos(d, "fill_frac", path, 1.0 if first else 0.9),
        placement=_placement(d.get("placement", "policy"), f"{path}.placement"),
    )


def _placement(value: Any, path: str) -> Literal["policy", "first_token"]:
    if value == "policy":
        return "policy"
    if value == "first_token":
        return "first_token"
    raise ConfigError(path, f"expected policy or first_token, got {value!r}")


def _full(raw: Any) -> FullConfig:
    d = _mapping(raw, "admission.full")
    _only(d, _FULL_KEYS, "admission.full")
    dflt = FullConfig()
    return FullConfig(
        kv_high_water_frac=_pos(d, "kv_high_water_frac", "admission.full", dflt.kv_high_water_frac),
        seqs_high_water_frac=_pos(d, "seqs_high_water_frac", "admission.full", dflt.seqs_high_water_frac),
        max_drain_s=_pos(d, "max_drain_s", "admission.full", 1.0) if "max_drain_s" in d else None,
        spill_margin=_pos(d, "spill_margin", "admission.full", dflt.spill_margin),
        engine_waiting_max=_count(d, "engine_waiting_max", "admission.full", None, 0),
    )


def _api_keys(raw: Any, classes: tuple[str, ...]) -> dict[str, ApiKeyConfig]:
    out: dict[str, ApiKeyConfig] = {}
    for key, value in _mapping(raw, "admission.api_keys").items():
        path = f"admission.api_keys.{key[:4]}…"  # never echo a whole key
        d = _mapping(value, path)
        _only(d, ("class", "tenant"), path)
        cls = _name(d, "class", path, None)
        if cls is not None and cls not in classes:
            raise ConfigError(f"{path}.class", f"unknown class {cls!r} (classes: {', '.join(classes)})")
        out[key] = ApiKeyConfig(cls, _name(d, "tenant", path, None))
    return out


def parse_admission(raw: Any) -> AdmissionConfig:
    """Validate the decoded ``admission:`` mapping (None: the defaults)."""
    d = _mapping(raw, "admission")
    _only(d, _KEYS, "admission")
    # Off unless configured: through the gateway the queue cost rate-∞ throughput (docs/admission.md).
    # A present ``admission:`` section turns it on unless it says ``enabled: false``.
    enabled = d.get("enabled", raw is not None)
    if not isinstance(enabled, bool):
        raise ConfigError("admission.enabled", f"expected true or false, got {enabled!r}")
    classes_raw = d.get("classes")
    if classes_raw is None:
        classes: tuple[ClassConfig, ...] = (ClassConfig(),)
    elif isinstance(classes_raw, list) and classes_raw:
        classes = tuple(_class(c, f"admission.classes[{i}]", i == 0) for i, c in enumerate(classes_raw))
    else:
        raise ConfigError("admission.classes", "expected a non-empty list of classes, highest priority first")
    names = tuple(c.name for c in classes)
    for i, c in enumerate(classes):
        if c.fill_frac > 1:
            raise ConfigError(f"admission.classes[{i}].fill_frac", f"must be <= 1, got {c.fill_frac}")
    for i, n in enumerate(names):
        if n in names[:i]:
            raise ConfigError(f"admission.classes[{i}].name", f"duplicate class name {n!r}")
    default_class = _name(d, "default_class", "admission", None) or names[-1]
    if default_class not in names:
        raise ConfigError("admission.default_class", f"unknown class {default_class!r} (classes: {names})")
    weights = {
        t: _pos({t: w}, t, "admission.tenants", 1.0)
        for t, w in _mapping(d.get("tenants"), "admission.tenants").items()
    }
    return AdmissionConfig(
        enabled=enabled,
        classes=classes,
        default_class=default_class,
        class_header=_name(d, "class_header", "admission", _DEFAULT.class_header) or "",
        tenant_header=_name(d, "tenant_header", "admission", _DEFAULT.tenant_header) or "",
        tenant_weights=weights,
        default_tenant_weight=_pos(d, "default_tenant_weight", "admission", 1.0),
        api_keys=_api_keys(d.get("api_keys"), names),
        full=_full(d.get("full")),
        recheck_s=_pos(d, "recheck_s", "admission", 1.0),
    )
