"""Router configuration: YAML → frozen, validated dataclasses (house style §5).

Owns the whole ``hetroute serve`` configuration schema and is the only module that reads
environment variables (``HETROUTE_ADMIN_TOKEN``). Invariants:

- every value is checked at load through :mod:`hetroute.fields`; a bad value raises :class:`ConfigError`
  whose ``path`` names the field (``backends[2].url``), and unknown keys are errors, not ignored;
- the result is immutable; a backend's ``engine``/``models`` may be ``None`` only until
  :mod:`hetroute.backends.discovery` fills them from the running backend;
- relative profile paths resolve against the config file's directory.

The sections live in :mod:`hetroute.config.sections`, a backend entry in :mod:`hetroute.config.backends`
(:func:`backend_from_dict` parses one entry, for any source of backends); all are importable from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hetroute.admission.config import AdmissionConfig, parse_admission
from hetroute.config.backends import BackendConfig, backend_from_dict, parse_backends, parse_profiles
from hetroute.config.sections import (
    SHARED_PORT_ZERO,
    HealthConfig,
    RetryConfig,
    ScrapeConfig,
    ServerConfig,
    TimeoutsConfig,
    TokensConfig,
    parse_sections,
)
from hetroute.dns_settings import DNS_DISCOVERY, DnsConfig
from hetroute.errors import ConfigError
from hetroute.fields import (
    NON_NEGATIVE,
    as_mapping,
    check_keys,
    integer,
    load_yaml,
    opt_string,
    read_dataclass,
    string,
)
from hetroute.learning.settings import LearningConfig
from hetroute.peer_settings import PeersConfig, check_peers
from hetroute.policy_names import policy_names
from hetroute.prefix.settings import PrefixConfig
from hetroute.types import BackendSpec

__all__ = [
    "ADMIN_TOKEN_ENV",
    "PEER_KEY_ENV",
    "DEFAULT_POLICY_TYPE",
    "SHARED_PORT_ZERO",
    "AdmissionConfig",
    "BackendConfig",
    "ComponentConfig",
    "Config",
    "DnsConfig",
    "HealthConfig",
    "LearningConfig",
    "PeersConfig",
    "PrefixConfig",
    "RetryConfig",
    "ScrapeConfig",
    "ServerConfig",
    "TimeoutsConfig",
    "TokensConfig",
    "backend_from_dict",
    "config_from_dict",
    "load_config",
    "quick_config",
]

ADMIN_TOKEN_ENV = "HETROUTE_ADMIN_TOKEN"
PEER_KEY_ENV = "HETROUTE_PEER_KEY"
DEFAULT_POLICY_TYPE = "default"


@dataclass(frozen=True, slots=True)
class ComponentConfig:
    """A pluggable component chosen by registry name; params are validated by its factory."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


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
    peers: PeersConfig = field(default_factory=PeersConfig)
    admin_token: str | None = None
    peer_key: str | None = field(default=None, repr=False)
    """The replicas' shared key (``HETROUTE_PEER_KEY``; environment only, never in the file)."""
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


_TOP_KEYS = (
    "backends", "defaults", "profiles", "policy", "predictor", "server", "timeouts", "retries",
    "health", "scrape", "tokens", "learning", "admin_token", "default_model", "seed", "admission",
    "prefix", "dns", "peers",
)  # fmt: skip


def _component(raw: Any, path: str, default_type: str | None) -> ComponentConfig | None:
    if raw is None:
        return ComponentConfig(default_type) if default_type is not None else None
    d = as_mapping({"type": raw} if isinstance(raw, str) else raw, path)
    check_keys(d, ("type", "params"), path)
    kind = string(d, "type", path, default_type) if default_type is not None else string(d, "type", path)
    return ComponentConfig(kind, dict(as_mapping(d.get("params"), f"{path}.params")))


def _policy(raw: Any) -> ComponentConfig:
    comp = _component(raw, "policy", DEFAULT_POLICY_TYPE)
    assert comp is not None
    valid = policy_names()  # the registry is the source of valid names
    if comp.type not in valid:
        raise ConfigError("policy.type", f"unknown policy {comp.type!r} (valid: {', '.join(valid)})")
    return comp


def config_from_dict(
    data: Any, *, base_dir: Path | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Validate decoded YAML into a :class:`Config`; ``env`` defaults to ``os.environ``."""
    env = os.environ if env is None else env
    root = as_mapping(data, "<root>")
    check_keys(root, _TOP_KEYS, "")
    profiles = parse_profiles(root.get("profiles"))
    backends = parse_backends(root.get("backends"), root.get("defaults"), profiles, base_dir or Path.cwd())
    sections = parse_sections(root)
    peers = read_dataclass(PeersConfig, root.get("peers"), "peers")
    peer_key = env.get(PEER_KEY_ENV) or None
    check_peers(peers, peer_key, sections["server"].workers)
    return Config(
        backends=backends,
        policy=_policy(root.get("policy")),
        predictor=_component(root.get("predictor"), "predictor", None),
        admission=parse_admission(root.get("admission")),
        dns=read_dataclass(DnsConfig, root.get("dns"), "dns"),
        peers=peers,
        peer_key=peer_key,
        admin_token=opt_string(root, "admin_token", "<root>") or env.get(ADMIN_TOKEN_ENV) or None,
        default_model=opt_string(root, "default_model", "<root>"),
        seed=integer(root, "seed", "<root>", 0, NON_NEGATIVE),
        **sections,
    )


def load_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> Config:
    """Read a YAML config file; ConfigError names the file (unreadable, not YAML) or the field."""
    file = Path(path)
    return config_from_dict(load_yaml(file, path=str(file)), base_dir=file.parent, env=env)


def quick_config(
    urls: Sequence[str], *, policy: str | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """The config of ``hetroute serve --backend URL ...``: engines and models are discovered."""
    data: dict[str, Any] = {"backends": [{"url": u} for u in urls]}
    if policy is not None:
        data["policy"] = {"type": policy}
    return config_from_dict(data, env=env)
