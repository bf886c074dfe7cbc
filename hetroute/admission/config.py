"""The ``admission:`` config section: typed, validated at load through :mod:`hetroute.fields`, errors name
the field.

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
from typing import Annotated, Any, Literal

from hetroute.errors import ConfigError
from hetroute.fields import (
    FRACTION,
    POSITIVE,
    NonNegativeInt,
    PositiveFloat,
    Range,
    as_mapping,
    as_number,
    boolean,
    check_keys,
    number,
    opt_string,
    read_dataclass,
    string,
)

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
    max_queue_len: NonNegativeInt = 1024
    max_queue_wait_s: PositiveFloat = 60.0
    ageing_s: PositiveFloat = 5.0
    retry_after_s: NonNegativeInt | None = None
    fill_frac: Annotated[float, FRACTION] = 1.0
    placement: Literal["policy", "first_token"] = "policy"

    @property
    def retry_after(self) -> int:
        if self.retry_after_s is not None:
            return self.retry_after_s
        return max(1, math.ceil(self.max_queue_wait_s))


@dataclass(frozen=True, slots=True)
class FullConfig:
    """When a backend is "full" for a request (admission/full.py).

    ``kv_high_water_frac``: full when the ledger's KV estimate (Σ I + generated + ``kv_output_frac`` ·
    remaining Õ of in-flight requests) plus this request's I + ``kv_output_frac`` · Õ exceeds this
    fraction of the KV capacity. ``kv_output_frac``: the share of each request's predicted (remaining)
    output reserved: 1 reserves the peak (no request can be preempted if the predictions hold), 0.5
    the mean occupancy of a batch whose requests are spread over their lifetimes.
    ``seqs_high_water_frac``: full when in-flight requests reach this fraction of ``max_num_seqs``
    (when known). ``engine_waiting_max``: also full while the engine's last scrape reports more than
    this many waiting requests (None: 0, on the backends whose ``max_num_seqs`` is unknown only).
    ``max_drain_s``: also full when the policy's load ``L_s`` reaches it. ``spill_margin``: see
    ``Placer.place``. ``arrival_window_s``: the time constant over which the tail test measures
    the arrival rate that refills the backlog (admission/arrivals.py). A backend with nothing in
    flight is never full.
    """

    kv_high_water_frac: PositiveFloat = 1.0
    kv_output_frac: Annotated[float, Range(minimum=0, maximum=1)] = 1.0
    seqs_high_water_frac: PositiveFloat = 1.0
    max_drain_s: PositiveFloat | None = None
    spill_margin: PositiveFloat = 3.0
    engine_waiting_max: NonNegativeInt | None = None
    arrival_window_s: PositiveFloat = 5.0


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
_DEFAULT = AdmissionConfig()


def _class(raw: Any, path: str, first: bool) -> ClassConfig:
    d = as_mapping(raw, path)
    if "name" not in d:
        raise ConfigError(f"{path}.name", "every class needs a name")
    return read_dataclass(ClassConfig, d, path, base=ClassConfig(fill_frac=1.0 if first else 0.9))


def _classes(raw: Any) -> tuple[ClassConfig, ...]:
    if raw is None:
        return (ClassConfig(),)
    if not isinstance(raw, list) or not raw:
        raise ConfigError("admission.classes", "expected a non-empty list of classes, highest priority first")
    classes = tuple(_class(c, f"admission.classes[{i}]", i == 0) for i, c in enumerate(raw))
    names = [c.name for c in classes]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise ConfigError(f"admission.classes[{i}].name", f"duplicate class name {n!r}")
    return classes


def _api_keys(raw: Any, classes: tuple[str, ...]) -> dict[str, ApiKeyConfig]:
    out: dict[str, ApiKeyConfig] = {}
    for key, value in as_mapping(raw, "admission.api_keys").items():
        path = f"admission.api_keys.{key[:4]}…"  # never echo a whole key
        d = as_mapping(value, path)
        check_keys(d, ("class", "tenant"), path)
        cls = opt_string(d, "class", path)
        if cls is not None and cls not in classes:
            raise ConfigError(f"{path}.class", f"unknown class {cls!r} (classes: {', '.join(classes)})")
        out[key] = ApiKeyConfig(cls, opt_string(d, "tenant", path))
    return out


def parse_admission(raw: Any) -> AdmissionConfig:
    """Validate the decoded ``admission:`` mapping (None: the defaults)."""
    d = as_mapping(raw, "admission")
    check_keys(d, _KEYS, "admission")
    # Off unless configured: through the gateway the queue cost rate-∞ throughput (docs/admission.md).
    # A present ``admission:`` section turns it on unless it says ``enabled: false``.
    enabled = boolean(d, "enabled", "admission", raw is not None)
    classes = _classes(d.get("classes"))
    names = tuple(c.name for c in classes)
    default_class = opt_string(d, "default_class", "admission") or names[-1]
    if default_class not in names:
        raise ConfigError("admission.default_class", f"unknown class {default_class!r} (classes: {names})")
    tenants = as_mapping(d.get("tenants"), "admission.tenants")
    return AdmissionConfig(
        enabled=enabled,
        classes=classes,
        default_class=default_class,
        class_header=string(d, "class_header", "admission", _DEFAULT.class_header),
        tenant_header=string(d, "tenant_header", "admission", _DEFAULT.tenant_header),
        tenant_weights={t: as_number(w, f"admission.tenants.{t}", POSITIVE) for t, w in tenants.items()},
        default_tenant_weight=number(d, "default_tenant_weight", "admission", 1.0, POSITIVE),
        api_keys=_api_keys(d.get("api_keys"), names),
        full=read_dataclass(FullConfig, d.get("full"), "admission.full"),
        recheck_s=number(d, "recheck_s", "admission", 1.0, POSITIVE),
    )
