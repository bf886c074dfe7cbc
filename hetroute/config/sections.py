"""The scalar sections of the router config (``server``, ``timeouts``, ``retries``, ``health``, ``scrape``,
``tokens``, ``learning``, ``prefix``) and their parsers.

Each section is a frozen dataclass whose annotations carry the bounds (``hetroute.fields``): the dataclass
is the schema, :func:`hetroute.fields.read_dataclass` reads it, and a parser here adds only the checks that
tie two fields together. Every error names the field (``server.port``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from hetroute.errors import ConfigError
from hetroute.fields import (
    FRACTION,
    PositiveFloat,
    PositiveInt,
    Range,
    Reader,
    as_mapping,
    as_str,
    read_dataclass,
)
from hetroute.learning.settings import LearningConfig
from hetroute.prefix.settings import PrefixConfig
from hetroute.routing.foreign import DEFAULT_FOREIGN_MODE, ForeignMode

SHARED_PORT_ZERO = "must be a fixed port, not 0, when server.workers > 1 (the workers share it)"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: Annotated[int, Range(minimum=0, maximum=65535)] = 8000
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    shutdown_grace_s: PositiveFloat = 30.0
    access_log: bool = True
    header_timeout_s: PositiveFloat = 15.0
    body_timeout_s: PositiveFloat = 60.0
    keepalive_idle_s: PositiveFloat = 75.0
    max_connections: PositiveInt = 2048
    workers: PositiveInt = 1
    """Processes serving the port (``hetroute serve --workers``, :mod:`hetroute.commands.serve_workers`);
    more than 1 needs Linux and a fixed ``port``."""
    worker_restarts: Annotated[int, Range(minimum=0)] = 5
    """With ``workers`` > 1: how many times in any 60 s a worker that died unasked is started again;
    one death more stops the group (exit 1). 0: any death stops the group."""
    replicas: PositiveInt = 1
    """Router replicas sharing the engines (a Deployment's ``replicas``), this one included. A hint:
    until a scrape has seen this router's own requests, each of the ``replicas × workers`` routers
    assumes the others sent as many as it did (:class:`hetroute.routing.foreign.ForeignLoad`)."""


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    """Upstream timeouts; none is unbounded. ``idle_s`` bounds the gap between chunks.

    ``first_byte_s`` bounds a stream's first byte; ``request_s`` bounds a whole non-streaming
    request (its engine answers nothing before the end).
    """

    connect_s: PositiveFloat = 5.0
    first_byte_s: PositiveFloat = 120.0
    idle_s: PositiveFloat = 60.0
    discovery_s: PositiveFloat = 10.0
    request_s: PositiveFloat = 600.0


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """``max_attempts`` counts the first try: 3 means up to two fail-overs before the first byte."""

    max_attempts: PositiveInt = 3
    retry_request_timeouts: bool = False


def _probe_path(value: Any, path: str) -> str:
    text = as_str(value, path)
    if not text.startswith("/"):
        raise ConfigError(path, f"must start with '/', got {text!r}")
    return text


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Active probing and Envoy-style passive outlier ejection."""

    probe_path: Annotated[str, Reader(_probe_path)] = "/health"
    probe_interval_s: PositiveFloat = 5.0
    probe_timeout_s: PositiveFloat = 2.0
    unhealthy_threshold: PositiveInt = 2
    healthy_threshold: PositiveInt = 1
    consecutive_failures: PositiveInt = 5
    base_ejection_s: PositiveFloat = 30.0
    max_ejection_s: PositiveFloat = 300.0
    max_ejection_percent: Annotated[float, Range(minimum=0, maximum=100)] = 50.0


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    enabled: bool = True
    interval_s: PositiveFloat = 1.0
    timeout_s: PositiveFloat = 1.0
    stale_after_s: PositiveFloat = 5.0
    foreign_load: ForeignMode = DEFAULT_FOREIGN_MODE
    """How the router counts requests the engines hold that it did not send (other router replicas,
    direct clients): ``hetroute.routing.foreign``."""


@dataclass(frozen=True, slots=True)
class TokensConfig:
    """Tokenizer-free prompt-length estimate: chars per token, learned online per model."""

    initial_chars_per_token: PositiveFloat = 4.0
    learn_rate: Annotated[float, FRACTION] = 0.1


def parse_server(raw: Any) -> ServerConfig:
    cfg = read_dataclass(ServerConfig, raw, "server")
    if cfg.workers > 1 and cfg.port == 0:
        raise ConfigError("server.port", SHARED_PORT_ZERO)
    return cfg


def parse_health(raw: Any) -> HealthConfig:
    cfg = read_dataclass(HealthConfig, raw, "health")
    if cfg.max_ejection_s < cfg.base_ejection_s:
        raise ConfigError("health.max_ejection_s", "must be >= health.base_ejection_s")
    return cfg


def parse_scrape(raw: Any) -> ScrapeConfig:
    d: Mapping[str, Any] = as_mapping(raw, "scrape")
    if d.get("foreign_load") is False:  # YAML reads a bare ``off`` as false
        d = {**d, "foreign_load": "off"}
    return read_dataclass(ScrapeConfig, d, "scrape")


def parse_sections(root: Mapping[str, Any]) -> dict[str, Any]:
    """The scalar sections of the decoded config ``root``, keyed as ``Config``'s fields."""
    return {
        "server": parse_server(root.get("server")),
        "timeouts": read_dataclass(TimeoutsConfig, root.get("timeouts"), "timeouts"),
        "retries": read_dataclass(RetryConfig, root.get("retries"), "retries"),
        "health": parse_health(root.get("health")),
        "scrape": parse_scrape(root.get("scrape")),
        "tokens": read_dataclass(TokensConfig, root.get("tokens"), "tokens"),
        "learning": read_dataclass(LearningConfig, root.get("learning"), "learning"),
        "prefix": read_dataclass(PrefixConfig, root.get("prefix"), "prefix"),
    }
