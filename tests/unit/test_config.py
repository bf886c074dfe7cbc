"""Config validation: every error names its field; valid files become frozen objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hetroute.config import Config, backend_from_dict, config_from_dict, load_config, quick_config
from hetroute.errors import ConfigError
from hetroute.latency import EngineLimits, LatencyParams, LatencyProfile, save_profile
from hetroute.types import BackendFields

BASE: dict[str, Any] = {
    "backends": [
        {"name": "a", "url": "http://127.0.0.1:8001", "engine": "vllm", "models": ["m"]},
        {"name": "b", "url": "http://127.0.0.1:8002", "engine": "tgi", "models": ["m"]},
    ]
}


def _with(**changes: Any) -> dict[str, Any]:
    data = {"backends": [dict(b) for b in BASE["backends"]]}
    data.update(changes)
    return data


def _backend_err(i: int, **fields: Any) -> ConfigError:
    data = _with()
    data["backends"][i].update(fields)
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, env={})
    return info.value


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"url": "ftp://x"}, "backends[1].url"),
        ({"url": "not a url"}, "backends[1].url"),
        ({"url": "http://h:99999"}, "backends[1].url"),
        ({"engine": "sglang"}, "backends[1].engine"),
        ({"models": []}, "backends[1].models"),
        ({"models": ["ok", 3]}, "backends[1].models[1]"),
        ({"weight": 0}, "backends[1].weight"),
        ({"weight": "heavy"}, "backends[1].weight"),
        ({"tp": 0}, "backends[1].tp"),
        ({"kv_capacity_tokens": -5}, "backends[1].kv_capacity_tokens"),
        ({"max_num_seqs": 1.5}, "backends[1].max_num_seqs"),
        ({"labels": {"tp": "four"}}, "backends[1].labels.tp"),
        ({"colour": "red"}, "backends[1].colour"),
        ({"name": "a"}, "backends[1].name"),
        ({"profile": "/no/such/profile.yaml"}, "backends[1].profile"),
        ({"discovery": "consul"}, "backends[1].discovery"),
    ],
)
def test_backend_errors_name_the_field(fields: dict[str, Any], path: str) -> None:
    assert _backend_err(1, **fields).path == path


def test_missing_url_names_field() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"backends": [{"name": "x"}]}, env={})
    assert info.value.path == "backends[0].url"


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"backends": []}, "backends"),
        (_with(policy={"type": "nope"}), "policy.type"),
        (_with(policy={"type": "round_robin", "extra": 1}), "policy.extra"),
        (_with(server={"port": 70000}), "server.port"),
        (_with(server={"max_body_bytes": 0}), "server.max_body_bytes"),
        (_with(server={"workers": 0}), "server.workers"),
        (_with(server={"workers": "two"}), "server.workers"),
        (_with(server={"workers": True}), "server.workers"),
        (_with(server={"workers": 2, "port": 0}), "server.port"),
        (_with(timeouts={"idle_s": -1}), "timeouts.idle_s"),
        (_with(timeouts={"total_s": 5}), "timeouts.total_s"),
        (_with(health={"max_ejection_percent": 150}), "health.max_ejection_percent"),
        (_with(health={"base_ejection_s": 60, "max_ejection_s": 10}), "health.max_ejection_s"),
        (_with(health={"probe_path": "health"}), "health.probe_path"),
        (_with(retries={"max_attempts": 0}), "retries.max_attempts"),
        (_with(tokens={"learn_rate": 2}), "tokens.learn_rate"),
        (_with(scrape={"enabled": "yes"}), "scrape.enabled"),
        (_with(scrape={"foreign_load": "guess"}), "scrape.foreign_load"),
        (_with(seed=-1), "<root>.seed"),
        (_with(unknown_section=1), "unknown_section"),
        (_with(profiles={"v100": 3}), "profiles.v100"),
        (_with(dns={"interval_s": 0}), "dns.interval_s"),
        (_with(dns={"nameservers": ["10.0.0.1:99999"]}), "dns.nameservers[0]"),
        (_with(dns={"nameservers": [3]}), "dns.nameservers"),
    ],
)
def test_section_errors_name_the_field(data: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, env={})
    assert info.value.path == path


def test_server_workers_default_one_and_the_error_names_the_field() -> None:
    assert config_from_dict(_with(), env={}).server.workers == 1
    assert config_from_dict(_with(server={"workers": 4}), env={}).server.workers == 4
    with pytest.raises(ConfigError) as info:
        config_from_dict(_with(server={"workers": 0}), env={})
    assert str(info.value).startswith("server.workers: ") and ">= 1" in str(info.value)


def test_foreign_load_modes_and_a_bare_yaml_off() -> None:
    assert config_from_dict(_with(), env={}).scrape.foreign_load == "scaled_excess"
    assert config_from_dict(_with(scrape={"foreign_load": "raw"}), env={}).scrape.foreign_load == "raw"
    assert config_from_dict(_with(scrape={"foreign_load": False}), env={}).scrape.foreign_load == "off"


def test_unknown_policy_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(_with(policy={"type": "fastest"}), env={})
    assert "round_robin" in info.value.message and "default" in info.value.message


def test_defaults_and_frozen() -> None:
    cfg = config_from_dict(_with(), env={})
    assert cfg.policy.type == "default" and cfg.predictor is None
    assert cfg.retries.max_attempts == 3 and cfg.timeouts.idle_s == 60.0
    assert cfg.admin_token is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]
    specs = cfg.specs()
    assert [s.name for s in specs] == ["a", "b"] and specs[1].engine == "tgi"


def test_admin_token_from_env_only_when_file_has_none() -> None:
    assert config_from_dict(_with(), env={"HETROUTE_ADMIN_TOKEN": "s3"}).admin_token == "s3"
    assert (
        config_from_dict(_with(admin_token="file"), env={"HETROUTE_ADMIN_TOKEN": "s3"}).admin_token == "file"
    )


def _profile(cap: int) -> LatencyProfile:
    return LatencyProfile(
        params=LatencyParams(1e-6, 1e-4, 1e-5, 1e-3, 1e-8, 1e-4, 1e-6, 1e-2),
        kv_capacity_tokens=cap,
        kv_capacity_source="catalog",
        limits=EngineLimits(max_num_seqs=64),
    )


def test_profiles_shared_by_key_default_and_relative_path(tmp_path: Path) -> None:
    save_profile(_profile(1000), tmp_path / "v100_tp1.yaml")
    save_profile(_profile(9000), tmp_path / "v100_tp4.yaml")
    (tmp_path / "router.yaml").write_text(
        """
profiles: {v100-tp4: v100_tp4.yaml}
defaults: {profile: v100_tp1.yaml, engine: vllm, max_num_seqs: 8}
backends:
  - {name: big, url: "http://127.0.0.1:1", profile: v100-tp4, labels: {gpu: V100, tp: 4}}
  - {name: small1, url: "http://127.0.0.1:2"}
  - {name: small2, url: "http://127.0.0.1:3"}
""",
        encoding="utf-8",
    )
    cfg = load_config(tmp_path / "router.yaml", env={})
    big, s1, s2 = cfg.backends
    assert big.profile is not None and big.profile.kv_capacity_tokens == 9000
    assert s1.profile is not None and s1.profile.kv_capacity_tokens == 1000
    assert s1.profile_path == s2.profile_path == str(tmp_path / "v100_tp1.yaml")
    assert big.gpu == "V100" and big.tp == 4 and s1.max_num_seqs == 8
    with pytest.raises(ConfigError) as info:
        cfg.specs()  # models are left to discovery, which has not run
    assert info.value.path == "backends[0].models"


def test_load_config_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(bad, env={})
    assert info.value.path == str(bad)
    with pytest.raises(ConfigError):
        load_config(tmp_path / "missing.yaml", env={})


def test_quick_config_leaves_discovery_fields_empty() -> None:
    cfg = quick_config(["http://127.0.0.1:9/", "http://127.0.0.1:10"], policy="round_robin", env={})
    assert isinstance(cfg, Config)
    assert [b.url for b in cfg.backends] == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    assert [b.name for b in cfg.backends] == ["127.0.0.1:9", "127.0.0.1:10"]
    assert all(b.engine is None and b.models is None for b in cfg.backends)
    assert cfg.policy.type == "round_robin"


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ({"predictor": {"type": "nope"}}, "predictor.type"),
        (
            {"policy": {"type": "weighted_round_robin", "params": {"weights": {"a": -1}}}},
            "policy.params.weights.a",
        ),
    ],
)
def test_component_params_fail_at_build_naming_the_field(section: dict[str, Any], path: str) -> None:
    from hetroute.app import build_app

    cfg = config_from_dict(_with(**section), env={})
    with pytest.raises(ConfigError) as info:
        build_app(cfg)
    assert info.value.path == path


def test_one_backend_entry_parses_alone_with_the_callers_path() -> None:
    """``backend_from_dict`` parses a ``backends:`` item, for the config file and any other source."""
    entry = {"url": "http://127.0.0.1:8009/", "models": "m", "labels": {"tp": 2, "gpu": "L4"}, "weight": 3}
    alone = backend_from_dict(entry, "backend")
    via_file = config_from_dict({"backends": [entry]}, env={}).backends[0]
    assert alone == via_file
    assert (alone.name, alone.url, alone.models, alone.tp, alone.gpu) == (
        "127.0.0.1:8009",
        "http://127.0.0.1:8009",
        ("m",),
        2,
        "L4",
    )
    assert not alone.resolved
    with pytest.raises(ConfigError) as info:
        backend_from_dict({**entry, "weight": -1}, "body")
    assert info.value.path == "body.weight"
    with pytest.raises(ConfigError) as info:
        backend_from_dict({"name": "x"}, "body")
    assert info.value.path == "body.url" and info.value.message == "missing"
    with pytest.raises(ConfigError) as info:
        backend_from_dict(None, "body")
    assert info.value.path == "body"


def test_the_routing_view_carries_every_shared_field() -> None:
    entry = {
        "name": "n",
        "url": "http://h:1",
        "engine": "vllm",
        "models": ["m"],
        "weight": 2,
        "labels": {"zone": "a"},
        "gpu": "L4",
        "tp": 2,
        "kv_capacity_tokens": 1000,
        "max_num_seqs": 8,
    }
    backend = backend_from_dict(entry, "backends[0]")
    spec = backend.to_spec(0)
    for f in dataclasses.fields(BackendFields):
        assert getattr(spec, f.name) == getattr(backend, f.name), f.name
    assert (spec.engine, spec.models) == ("vllm", ("m",))


def test_an_empty_session_header_is_accepted_as_documented() -> None:
    assert config_from_dict(_with(prefix={"session_header": ""}), env={}).prefix.session_header == ""
    assert (
        config_from_dict(_with(prefix={"session_header": "X-Conv"}), env={}).prefix.session_header == "x-conv"
    )
    with pytest.raises(ConfigError) as info:
        config_from_dict(_with(prefix={"session_header": "a b"}), env={})
    assert info.value.path == "prefix.session_header"
