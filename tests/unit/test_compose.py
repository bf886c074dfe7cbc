"""docker-compose.yml and config/compose/: parsed and checked without a Docker engine.

Checks the services of both profiles, ports, health checks, GPU reservations and volumes, that every
``hetroute`` command parses with the real CLI, that the emulated engines fit their GPUs, that the
mounted router configs load with the gateway's own loader and point at the compose services, that
Prometheus scrapes every engine and router, and that every metric the Grafana dashboard queries is
one hetroute or the emulators really export.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client import CollectorRegistry

from hetroute.catalog.specs import load_model_catalog
from hetroute.cli import build_parser
from hetroute.config import load_config
from hetroute.sim.cluster_file import build_fleet, parse_cluster
from hetroute.sim.emulator_metrics import EmulatorMetrics
from hetroute.sim.engine_model import EngineModel
from hetroute.telemetry import Telemetry

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text(encoding="utf-8"))
SERVICES: dict[str, Any] = COMPOSE["services"]
CPU = {"emu-h100", "emu-a100", "emu-l4-tgi", "router", "prometheus", "grafana"}
GPU = {"vllm", "tgi", "router-gpu"}
EMULATORS = ("emu-h100", "emu-a100", "emu-l4-tgi")


def _profiles(name: str) -> list[str]:
    return list(SERVICES[name].get("profiles", []))


def _mount(service: str, target: str) -> Path:
    for volume in SERVICES[service].get("volumes", []):
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == target:
            return REPO / str(source)
    raise AssertionError(f"{service} does not mount {target}")


def _container_port(service: str) -> int:
    ports = SERVICES[service].get("expose") or [p.split(":")[-1] for p in SERVICES[service].get("ports", [])]
    return int(ports[0])


def test_services_and_profiles() -> None:
    assert set(SERVICES) == CPU | GPU
    assert all(_profiles(s) == [] for s in CPU)  # the CPU stack is what `docker compose up` starts
    assert all(_profiles(s) == ["gpu"] for s in GPU)


def test_every_service_has_a_health_check() -> None:
    for name, svc in SERVICES.items():
        check = svc.get("healthcheck")
        assert check is not None, name
        assert check["test"][0] == "CMD" and len(check["test"]) > 1, name
        assert check["interval"].endswith("s") and int(check["retries"]) >= 3, name
        text = " ".join(check["test"])
        assert f":{_container_port(name)}/" in text, f"{name} probes the wrong port"


def test_published_ports_are_unique_and_as_documented() -> None:
    published = {name: [p.split(":")[0] for p in svc.get("ports", [])] for name, svc in SERVICES.items()}
    flat = [p for ports in published.values() for p in ports]
    assert len(flat) == len(set(flat))
    assert published["router"] == ["8000"] and published["router-gpu"] == ["8100"]
    assert published["prometheus"] == ["9090"] and published["grafana"] == ["3000"]
    assert all(not published[e] for e in EMULATORS)  # engines are reached through the router only


def test_hetroute_commands_parse_with_the_real_cli() -> None:
    parser = build_parser()
    for name, svc in SERVICES.items():
        command = svc.get("command")
        if command and command[0] == "hetroute":
            args = parser.parse_args(command[1:])
            assert callable(args.func), name
            assert svc["build"]["dockerfile"] == "config/compose/Dockerfile"
    assert (REPO / "config/compose/Dockerfile").is_file()


def test_emulators_are_heterogeneous_and_fit_their_gpus() -> None:
    parser = build_parser()
    parsed = [parser.parse_args(SERVICES[e]["command"][1:]) for e in EMULATORS]
    assert all(a.command == "emulate" and a.host == "0.0.0.0" and a.port == 8000 for a in parsed)
    assert len({a.gpu for a in parsed}) == 3 and {a.engine for a in parsed} == {"vllm", "tgi"}
    spec = parse_cluster(
        {"instances": [{"name": e, "gpu": a.gpu, "tp": a.tp, "model": a.model, "engine": a.engine}
                       for e, a in zip(EMULATORS, parsed, strict=True)]}
    )  # fmt: skip
    fleet = build_fleet(spec)  # raises when a model does not fit
    assert all(
        (b.kv_capacity_tokens or 0) >= load_model_catalog()[b.models[0]].max_model_len for b in fleet.backends
    )


@pytest.mark.parametrize(("router", "engines"), [("router", EMULATORS), ("router-gpu", ("vllm", "tgi"))])
def test_mounted_router_config_is_valid_and_points_at_the_engines(
    router: str, engines: tuple[str, ...]
) -> None:
    command = SERVICES[router]["command"]
    target = command[command.index("--config") + 1]
    cfg = load_config(_mount(router, target), env={})
    assert cfg.server.port == _container_port(router) and cfg.server.host == "0.0.0.0"
    by_host = {urlsplit(b.url).hostname: b for b in cfg.backends}
    assert set(by_host) == set(engines)
    for engine in engines:
        backend = by_host[engine]
        assert urlsplit(backend.url).port == _container_port(engine)
        assert SERVICES[router]["depends_on"][engine] == {"condition": "service_healthy"}
        command = [str(c) for c in SERVICES[engine]["command"]]
        if engine in EMULATORS:
            args = build_parser().parse_args(command[1:])
            assert backend.engine == args.engine and backend.gpu == args.gpu and backend.tp == args.tp
            assert backend.models == (args.served_model_name,)
        else:
            assert backend.engine == engine
    assert cfg.specs()  # every backend resolved (engine and models given, no discovery needed)


def test_gpu_services_reserve_gpus_and_share_a_model_volume() -> None:
    assert "models" in COMPOSE["volumes"]
    for name in ("vllm", "tgi"):
        svc = SERVICES[name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(d["driver"] == "nvidia" and d["capabilities"] == ["gpu"] for d in devices)
        assert any(v.startswith("models:") for v in svc["volumes"])
        assert ":" in svc["image"] and not svc["image"].endswith(":latest")
        assert "HF_TOKEN" in svc["environment"]
        assert svc["healthcheck"]["start_period"].endswith("s")
    assert SERVICES["vllm"]["image"].startswith("vllm/vllm-openai:")
    assert SERVICES["tgi"]["image"].startswith("ghcr.io/huggingface/text-generation-inference:")
    ids = [
        SERVICES[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for n in ("vllm", "tgi")
    ]
    assert ids[0] != ids[1]  # one GPU each


def test_prometheus_scrapes_every_router_and_engine() -> None:
    prom = yaml.safe_load(_mount("prometheus", "/etc/prometheus/prometheus.yml").read_text(encoding="utf-8"))
    targets = {
        t for job in prom["scrape_configs"] for group in job["static_configs"] for t in group["targets"]
    }
    expected = {
        f"{name}:{_container_port(name)}" for name in SERVICES if name not in ("prometheus", "grafana")
    }
    assert targets == expected


def _exported_metric_names() -> set[str]:
    registry = CollectorRegistry()
    Telemetry(registry)
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in registry.collect():
        names.update(family.name + s for s in suffixes[family.type])
    fleet = build_fleet(parse_cluster({"instances": [{"gpu": "L4", "model": "Llama-3-8B"}]}))
    engine = EngineModel(fleet.configs[0])
    text = "".join(EmulatorMetrics(engine, kind, "m").exposition().decode() for kind in ("vllm", "tgi"))
    names.update(line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#")
    return names


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    provisioning = _mount("grafana", "/etc/grafana/provisioning")
    datasource = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text(encoding="utf-8"))
    assert datasource["datasources"][0]["url"] == f"http://prometheus:{_container_port('prometheus')}"
    provider = yaml.safe_load((provisioning / "dashboards/hetroute.yml").read_text(encoding="utf-8"))
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboards = _mount("grafana", "/var/lib/grafana/dashboards")
    dash = json.loads((dashboards / "hetroute.json").read_text(encoding="utf-8"))
    exported = _exported_metric_names()
    assert dash["uid"] == "hetroute" and len(dash["panels"]) >= 4
    pattern = re.compile(r"\b(hetroute_[a-z_]+|vllm:[a-z_:]+|tgi_[a-z_]+)")
    for panel in dash["panels"]:
        used = {m for t in panel["targets"] for m in pattern.findall(t["expr"])}
        assert used, panel["title"]
        assert used <= exported, f"{panel['title']}: {used - exported} are not exported"
