"""Router configuration: YAML → frozen, validated dataclasses (house style §5).

Owns the whole ``hetroute serve`` configuration schema and is the only module that reads
environment variables (``HETROUTE_ADMIN_TOKEN``). Invariants:

- every value is checked at load; a bad value raises :class:`ConfigError` whose ``path``
  names the field (``backends[2].url``), and unknown keys are errors, not ignored;
- the result is immutable; a backend's ``engine``/``models`` may be ``None`` only until
  :mod:`hetroute.backends.discovery` fills them from the running backend;
- relative profile paths resolve against the config file's directory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import yaml

from hetroute.admission.config import AdmissionConfig, parse_admission
from hetroute.dns_settings import DNS_DISCOVERY, DnsConfig
from hetroute.errors import ConfigError
from hetroute.latency import LatencyProfile, ProfileError, load_profile
from hetroute.learning.settings import LearningConfig
from hetroute.policy_names import policy_names
from hetroute.prefix.settings import PrefixConfig
from hetroute.routing.foreign import DEFAULT_FOREIGN_MODE, FOREIGN_MODES, ForeignMode
from hetroute.types import ENGINE_KINDS, BackendSpec, EngineKind

ADMIN_TOKEN_ENV = "HETROUTE_ADMIN_TOKEN"
DEFAULT_POLICY_TYPE = "default"
SHARED_PORT_ZERO = "must be a fixed port, not 0, when server.workers > 1 (the workers share it)"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_grace_s: float = 30.0
    access_log: bool = True
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    keepalive_idle_s: float = 75.0
    max_connections: int = 2048
    workers: int = 1
    """Processes serving the port (``hetroute serve --workers``, :mod:`hetroute.commands.serve_workers`);
    more than 1 needs Linux and a fixed ``port``."""


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    """Upstream timeouts; none is unbounded. ``idle_s`` bounds the gap between chunks.

    ``first_byte_s`` bounds a stream's first byte; ``request_s`` bounds a whole non-streaming
    request (its engine answers nothing before the end).
    """

    connect_s: float = 5.0
    first_byte_s: float = 120.0
    idle_s: float = 60.0
    discovery_s: float = 10.0
    request_s: float = 600.0


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """``max_attempts`` counts the first try: 3 means up to two fail-overs before the first byte."""

    max_attempts: int = 3
    retry_request_timeouts: bool = False


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Active probing and Envoy-style passive outlier ejection."""

    probe_path: str = "/health"
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 2.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    consecutive_failures: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 50.0


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    enabled: bool = True
    interval_s: float = 1.0
    timeout_s: float = 1.0
    stale_after_s: float = 5.0
    foreign_load: ForeignMode = DEFAULT_FOREIGN_MODE
    """How the router counts requests the engines hold that it did not send (other router replicas,
    direct clients): ``hetroute.routing.foreign``."""


@dataclass(frozen=True, slots=True)
class TokensConfig:
    """Tokenizer-free prompt-length estimate: chars per token, learned online per model."""

    initial_chars_per_token: float = 4.0
    learn_rate: float = 0.1


@dataclass(frozen=True, slots=True)
class ComponentConfig:
    """A pluggable component chosen by registry name; params are validated by its factory."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BackendConfig:
    name: str
    url: str
    engine: EngineKind | None = None
    models: tuple[str, ...] | None = None
    weight: float = 1.0
    labels: Mapping[str, str] = field(default_factory=dict)
    gpu: str | None = None
    tp: int | None = None
    profile: LatencyProfile | None = None
    profile_path: str | None = None
    kv_capacity_tokens: int | None = None
    max_num_seqs: int | None = None
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
        return BackendSpec(
            name=self.name,
            url=self.url,
            engine=self.engine,
            models=self.models,
            weight=self.weight,
            labels=dict(self.labels),
            gpu=self.gpu,
            tp=self.tp,
            profile=self.profile,
            profile_path=self.profile_path,
            kv_capacity_tokens=self.kv_capacity_tokens,
            max_num_seqs=self.max_num_seqs,
        )


@dataclass(frozen=True, slots=True)
class Config:
    backends: tuple[BackendConfig, ...]
    policy: ComponentConfig = field(default_factory=lambda: ComponentConfig(DEFAULT_POLICY_TYPE))
    predictor: ComponentConfig | None = None
    server: ServerConfig = field(default_factory=ServerConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    retries: RetryConfig = field(default_factory=RetryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    learning: LearningConfig = field(default_factory=LearningConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    dns: DnsConfig = field(default_factory=DnsConfig)
    admin_token: str | None = None
    default_model: str | None = None
    seed: int = 0

    def specs(self) -> tuple[BackendSpec, ...]:
        """The fixed backends (entries with DNS discovery are not backends themselves)."""
        return tuple(b.to_spec(i) for i, b in enumerate(self.backends) if b.discovery is None)

    def dns_entries(self) -> tuple[BackendConfig, ...]:
        """The entries whose URL's host is re-resolved into backends (``discovery: dns``)."""
        return tuple(b for b in self.backends if b.discovery == DNS_DISCOVERY)

    def with_backends(self, backends: Sequence[BackendConfig]) -> Config:
        return replace(self, backends=tuple(backends))


# ---------------------------------------------------------------- value readers

_T = TypeVar("_T")


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"expected a mapping, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {key!r}")
    return value


def _check_keys(data: Mapping[str, Any], allowed: Sequence[str], path: str) -> None:
    for key in data:
        if key not in allowed:
            prefix = f"{path}." if path else ""
            raise ConfigError(f"{prefix}{key}", f"unknown field (valid: {', '.join(allowed)})")


def _num(data: Mapping[str, Any], key: str, path: str, default: float, *, positive: bool = True) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise ConfigError(f"{path}.{key}", f"expected a finite number, got {value!r}")
    if positive and float(value) <= 0:
        raise ConfigError(f"{path}.{key}", f"must be > 0, got {value!r}")
    return float(value)


def _int(data: Mapping[str, Any], key: str, path: str, default: _T, *, minimum: int = 1) -> int | _T:
    value = data.get(key, default)
    if value is None or value is default:
        return cast(int | _T, value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}.{key}", f"expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path}.{key}", f"must be >= {minimum}, got {value}")
    return value


def _str(data: Mapping[str, Any], key: str, path: str, default: _T) -> str | _T:
    value = data.get(key, default)
    if value is None or value is default:
        return cast(str | _T, value)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}.{key}", f"expected a non-empty string, got {value!r}")
    return value


def _bool(data: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{path}.{key}", f"expected true or false, got {value!r}")
    return value


def _url(value: Any, path: str) -> str:
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


# ---------------------------------------------------------------- sections

_SERVER_KEYS = (
    "host", "port", "max_body_bytes", "shutdown_grace_s", "access_log",
    "header_timeout_s", "body_timeout_s", "keepalive_idle_s", "max_connections", "workers",
)  # fmt: skip
_TIMEOUT_KEYS = ("connect_s", "first_byte_s", "idle_s", "discovery_s", "request_s")
_HEALTH_KEYS = tuple(HealthConfig.__dataclass_fields__)
_SCRAPE_KEYS = tuple(ScrapeConfig.__dataclass_fields__)
_TOKENS_KEYS = tuple(TokensConfig.__dataclass_fields__)
_LEARNING_KEYS = tuple(LearningConfig.__dataclass_fields__)
_PREFIX_KEYS = tuple(PrefixConfig.__dataclass_fields__)
_BACKEND_KEYS = (
    "name", "url", "engine", "models", "weight", "labels", "gpu", "tp",
    "profile", "kv_capacity_tokens", "max_num_seqs", "discovery",
)  # fmt: skip
_DEFAULTS_KEYS = ("engine", "weight", "labels", "profile", "kv_capacity_tokens", "max_num_seqs")
_TOP_KEYS = (
    "backends", "defaults", "profiles", "policy", "predictor", "server", "timeouts", "retries",
    "health", "scrape", "tokens", "learning", "admin_token", "default_model", "seed", "admission",
    "prefix", "dns",
)  # fmt: skip


def _server(raw: Any) -> ServerConfig:
    d = _mapping(raw, "server")
    _check_keys(d, _SERVER_KEYS, "server")
    dflt = ServerConfig()
    port = _int(d, "port", "server", dflt.port, minimum=0)
    if port > 65535:
        raise ConfigError("server.port", f"must be <= 65535, got {port}")
    workers = _int(d, "workers", "server", dflt.workers)
    if workers > 1 and port == 0:
        raise ConfigError("server.port", SHARED_PORT_ZERO)
    return ServerConfig(
        host=_str(d, "host", "server", dflt.host),
        port=port,
        max_body_bytes=_int(d, "max_body_bytes", "server", dflt.max_body_bytes),
        shutdown_grace_s=_num(d, "shutdown_grace_s", "server", dflt.shutdown_grace_s),
        access_log=_bool(d, "access_log", "server", dflt.access_log),
        header_timeout_s=_num(d, "header_timeout_s", "server", dflt.header_timeout_s),
        body_timeout_s=_num(d, "body_timeout_s", "server", dflt.body_timeout_s),
        keepalive_idle_s=_num(d, "keepalive_idle_s", "server", dflt.keepalive_idle_s),
        max_connections=_int(d, "max_connections", "server", dflt.max_connections),
        workers=workers,
    )


def _timeouts(raw: Any) -> TimeoutsConfig:
    d = _mapping(raw, "timeouts")
    _check_keys(d, _TIMEOUT_KEYS, "timeouts")
    dflt = TimeoutsConfig()
    return TimeoutsConfig(*(_num(d, k, "timeouts", getattr(dflt, k)) for k in _TIMEOUT_KEYS))


def _health(raw: Any) -> HealthConfig:
    d = _mapping(raw, "health")
    _check_keys(d, _HEALTH_KEYS, "health")
    dflt = HealthConfig()
    path = _str(d, "probe_path", "health", dflt.probe_path)
    if not path.startswith("/"):
        raise ConfigError("health.probe_path", f"must start with '/', got {path!r}")
    cfg = HealthConfig(
        probe_path=path,
        probe_interval_s=_num(d, "probe_interval_s", "health", dflt.probe_interval_s),
        probe_timeout_s=_num(d, "probe_timeout_s", "health", dflt.probe_timeout_s),
        unhealthy_threshold=_int(d, "unhealthy_threshold", "health", dflt.unhealthy_threshold),
        healthy_threshold=_int(d, "healthy_threshold", "health", dflt.healthy_threshold),
        consecutive_failures=_int(d, "consecutive_failures", "health", dflt.consecutive_failures),
        base_ejection_s=_num(d, "base_ejection_s", "health", dflt.base_ejection_s),
        max_ejection_s=_num(d, "max_ejection_s", "health", dflt.max_ejection_s),
        max_ejection_percent=_num(
            d, "max_ejection_percent", "health", dflt.max_ejection_percent, positive=False
        ),
    )
    if not 0 <= cfg.max_ejection_percent <= 100:
        raise ConfigError(
            "health.max_ejection_percent", f"must be in [0, 100], got {cfg.max_ejection_percent}"
        )
    if cfg.max_ejection_s < cfg.base_ejection_s:
        raise ConfigError("health.max_ejection_s", "must be >= health.base_ejection_s")
    return cfg


def _scrape(raw: Any) -> ScrapeConfig:
    d = _mapping(raw, "scrape")
    _check_keys(d, _SCRAPE_KEYS, "scrape")
    dflt = ScrapeConfig()
    return ScrapeConfig(
        enabled=_bool(d, "enabled", "scrape", dflt.enabled),
        interval_s=_num(d, "interval_s", "scrape", dflt.interval_s),
        timeout_s=_num(d, "timeout_s", "scrape", dflt.timeout_s),
        stale_after_s=_num(d, "stale_after_s", "scrape", dflt.stale_after_s),
        foreign_load=_foreign_mode(d),
    )


def _foreign_mode(d: Mapping[str, Any]) -> ForeignMode:
    value = d.get("foreign_load", DEFAULT_FOREIGN_MODE)
    if value is False:  # YAML reads a bare ``off`` as false
        value = "off"
    if value not in FOREIGN_MODES:
        raise ConfigError("scrape.foreign_load", f"expected one of {', '.join(FOREIGN_MODES)}, got {value!r}")
    return cast(ForeignMode, value)


def _tokens(raw: Any) -> TokensConfig:
    d = _mapping(raw, "tokens")
    _check_keys(d, _TOKENS_KEYS, "tokens")
    dflt = TokensConfig()
    rate = _num(d, "learn_rate", "tokens", dflt.learn_rate)
    if rate > 1:
        raise ConfigError("tokens.learn_rate", f"must be in (0, 1], got {rate}")
    return TokensConfig(_num(d, "initial_chars_per_token", "tokens", dflt.initial_chars_per_token), rate)


def _learning(raw: Any) -> LearningConfig:
    d = _mapping(raw, "learning")
    _check_keys(d, _LEARNING_KEYS, "learning")
    dflt = LearningConfig()
    ratio = _num(d, "drift_ratio", "learning", dflt.drift_ratio)
    if ratio <= 1:
        raise ConfigError("learning.drift_ratio", f"must be > 1, got {ratio}")
    return LearningConfig(
        enabled=_bool(d, "enabled", "learning", dflt.enabled),
        refit_interval_s=_num(d, "refit_interval_s", "learning", dflt.refit_interval_s),
        half_life_s=_num(d, "half_life_s", "learning", dflt.half_life_s),
        window=_int(d, "window", "learning", dflt.window, minimum=8),
        prior_strength=_num(d, "prior_strength", "learning", dflt.prior_strength),
        drift_ratio=ratio,
        state_dir=_str(d, "state_dir", "learning", dflt.state_dir),
        save_interval_s=_num(d, "save_interval_s", "learning", dflt.save_interval_s),
    )


def _prefix(raw: Any) -> PrefixConfig:
    d = _mapping(raw, "prefix")
    _check_keys(d, _PREFIX_KEYS, "prefix")
    dflt = PrefixConfig()
    header = _str(d, "session_header", "prefix", dflt.session_header)
    if any(c.isspace() or c == ":" for c in header):
        raise ConfigError("prefix.session_header", f"not a header name: {header!r}")
    return PrefixConfig(
        enabled=_bool(d, "enabled", "prefix", dflt.enabled),
        ttl_s=_num(d, "ttl_s", "prefix", dflt.ttl_s),
        max_chunks=_int(d, "max_chunks", "prefix", dflt.max_chunks),
        session_header=header.lower(),
        session_ttl_s=_num(d, "session_ttl_s", "prefix", dflt.session_ttl_s),
        max_sessions=_int(d, "max_sessions", "prefix", dflt.max_sessions),
    )


def _dns(raw: Any) -> DnsConfig:
    d = _mapping(raw, "dns")
    _check_keys(d, ("interval_s", "timeout_s", "nameservers"), "dns")
    dflt = DnsConfig()
    servers = d.get("nameservers", [])
    if isinstance(servers, str):
        servers = [servers]
    if not isinstance(servers, list) or not all(isinstance(x, str) and x for x in servers):
        raise ConfigError("dns.nameservers", f"expected a list of host or host:port, got {servers!r}")
    for j, server in enumerate(servers):
        host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
        if port and (not port.isdigit() or not 0 < int(port) < 65536):
            raise ConfigError(f"dns.nameservers[{j}]", f"bad port in {server!r}")
    return DnsConfig(
        interval_s=_num(d, "interval_s", "dns", dflt.interval_s),
        timeout_s=_num(d, "timeout_s", "dns", dflt.timeout_s),
        nameservers=tuple(servers),
    )


def _component(raw: Any, path: str, default_type: str | None) -> ComponentConfig | None:
    if raw is None:
        return ComponentConfig(default_type) if default_type is not None else None
    if isinstance(raw, str):
        raw = {"type": raw}
    d = _mapping(raw, path)
    _check_keys(d, ("type", "params"), path)
    kind = _str(d, "type", path, default_type)
    if kind is None:
        raise ConfigError(f"{path}.type", "missing")
    params = dict(_mapping(d.get("params"), f"{path}.params"))
    return ComponentConfig(kind, params)


def _policy(raw: Any) -> ComponentConfig:
    comp = _component(raw, "policy", DEFAULT_POLICY_TYPE)
    assert comp is not None
    valid = policy_names()  # the registry is the source of valid names
    if comp.type not in valid:
        raise ConfigError("policy.type", f"unknown policy {comp.type!r} (valid: {', '.join(valid)})")
    return comp


def _load_profile(
    ref: str, path: str, profiles: Mapping[str, str], base_dir: Path
) -> tuple[LatencyProfile, str]:
    file = profiles.get(ref, ref)
    full = Path(file) if Path(file).is_absolute() else base_dir / file
    try:
        return load_profile(full), str(full)
    except ProfileError as exc:
        raise ConfigError(path, str(exc)) from exc


def _labels(raw: Any, path: str) -> dict[str, str]:
    d = _mapping(raw, path)
    out: dict[str, str] = {}
    for key, value in d.items():
        if isinstance(value, Mapping | list) or value is None:
            raise ConfigError(f"{path}.{key}", f"expected a scalar label value, got {value!r}")
        out[key] = str(value)
    return out


def backend_from_dict(
    raw: Any,
    path: str = "backend",
    *,
    defaults: Mapping[str, Any] | None = None,
    profiles: Mapping[str, str] | None = None,
    base_dir: Path | None = None,
) -> BackendConfig:
    """One backend entry, shaped as an item of the config's ``backends:`` (also the body of
    ``POST /admin/backends``); ConfigError names the field under ``path``."""
    return _backend(raw, path, defaults or {}, profiles or {}, base_dir or Path.cwd())


def _backend(
    raw: Any, path: str, defaults: Mapping[str, Any], profiles: Mapping[str, str], base_dir: Path
) -> BackendConfig:
    d = _mapping(raw, path)
    _check_keys(d, _BACKEND_KEYS, path)
    merged = {**defaults, **d}
    if "url" not in merged:
        raise ConfigError(f"{path}.url", "missing")
    url = _url(merged["url"], f"{path}.url")
    name = _str(merged, "name", path, None) or (urlsplit(url).netloc or url)
    engine = merged.get("engine")
    if engine is not None and engine not in ENGINE_KINDS:
        raise ConfigError(f"{path}.engine", f"expected one of {'|'.join(ENGINE_KINDS)}, got {engine!r}")
    models_raw = merged.get("models")
    models: tuple[str, ...] | None = None
    if models_raw is not None:
        if isinstance(models_raw, str):
            models_raw = [models_raw]
        if not isinstance(models_raw, list) or not models_raw:
            raise ConfigError(
                f"{path}.models", f"expected a non-empty list of model names, got {models_raw!r}"
            )
        for j, m in enumerate(models_raw):
            if not isinstance(m, str) or not m:
                raise ConfigError(f"{path}.models[{j}]", f"expected a non-empty string, got {m!r}")
        models = tuple(models_raw)
    labels = _labels(merged.get("labels"), f"{path}.labels")
    gpu = _str(merged, "gpu", path, None) or labels.get("gpu")
    tp = _int(merged, "tp", path, None)
    if tp is None and "tp" in labels:
        if not labels["tp"].isdigit() or int(labels["tp"]) < 1:
            raise ConfigError(f"{path}.labels.tp", f"expected a positive integer, got {labels['tp']!r}")
        tp = int(labels["tp"])
    discovery = merged.get("discovery")
    if discovery is not None and discovery != DNS_DISCOVERY:
        raise ConfigError(f"{path}.discovery", f"expected {DNS_DISCOVERY!r} or nothing, got {discovery!r}")
    profile: LatencyProfile | None = None
    profile_path: str | None = None
    ref = merged.get("profile")
    if ref is not None:
        if not isinstance(ref, str) or not ref:
            raise ConfigError(f"{path}.profile", f"expected a file path or a key of `profiles`, got {ref!r}")
        profile, profile_path = _load_profile(ref, f"{path}.profile", profiles, base_dir)
    return BackendConfig(
        name=name,
        url=url,
        engine=cast(EngineKind | None, engine),
        models=models,
        weight=_num(merged, "weight", path, 1.0),
        labels=labels,
        gpu=gpu,
        tp=tp,
        profile=profile,
        profile_path=profile_path,
        kv_capacity_tokens=_int(merged, "kv_capacity_tokens", path, None),
        max_num_seqs=_int(merged, "max_num_seqs", path, None),
        discovery=discovery,
    )


def config_from_dict(
    data: Any, *, base_dir: Path | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Validate decoded YAML into a :class:`Config`; ``env`` defaults to ``os.environ``."""
    env = os.environ if env is None else env
    base_dir = base_dir or Path.cwd()
    root = _mapping(data, "<root>")
    _check_keys(root, _TOP_KEYS, "")
    backends_raw = root.get("backends")
    if not isinstance(backends_raw, list) or not backends_raw:
        raise ConfigError("backends", "expected a non-empty list of backends")
    defaults = _mapping(root.get("defaults"), "defaults")
    _check_keys(defaults, _DEFAULTS_KEYS, "defaults")
    profiles = _mapping(root.get("profiles"), "profiles")
    for key, file in profiles.items():
        if not isinstance(file, str) or not file:
            raise ConfigError(f"profiles.{key}", f"expected a file path, got {file!r}")
    backends = tuple(
        _backend(b, f"backends[{i}]", defaults, profiles, base_dir) for i, b in enumerate(backends_raw)
    )
    seen: dict[str, int] = {}
    for i, b in enumerate(backends):
        if b.name in seen:
            raise ConfigError(
                f"backends[{i}].name", f"duplicate of backends[{seen[b.name]}].name ({b.name!r})"
            )
        seen[b.name] = i
    retries = _mapping(root.get("retries"), "retries")
    _check_keys(retries, ("max_attempts", "retry_request_timeouts"), "retries")
    token = _str(root, "admin_token", "<root>", None) or env.get(ADMIN_TOKEN_ENV) or None
    seed = _int(root, "seed", "<root>", 0, minimum=0)
    return Config(
        backends=backends,
        policy=_policy(root.get("policy")),
        predictor=_component(root.get("predictor"), "predictor", None),
        server=_server(root.get("server")),
        timeouts=_timeouts(root.get("timeouts")),
        retries=RetryConfig(
            _int(retries, "max_attempts", "retries", 3),
            _bool(retries, "retry_request_timeouts", "retries", False),
        ),
        health=_health(root.get("health")),
        scrape=_scrape(root.get("scrape")),
        tokens=_tokens(root.get("tokens")),
        learning=_learning(root.get("learning")),
        admission=parse_admission(root.get("admission")),
        prefix=_prefix(root.get("prefix")),
        dns=_dns(root.get("dns")),
        admin_token=token,
        default_model=_str(root, "default_model", "<root>", None),
        seed=seed,
    )


def load_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> Config:
    """Read a YAML config file; ConfigError names the file or the field."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(file), f"cannot read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(file), f"not valid YAML: {exc}") from exc
    return config_from_dict(data, base_dir=file.parent, env=env)


def quick_config(
    urls: Sequence[str], *, policy: str | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """The config of ``hetroute serve --backend URL ...``: engines and models are discovered."""
    data: dict[str, Any] = {"backends": [{"url": u} for u in urls]}
    if policy is not None:
        data["policy"] = {"type": policy}
    return config_from_dict(data, env=env)
