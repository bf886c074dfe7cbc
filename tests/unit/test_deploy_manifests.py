"""deploy/kubernetes/ and deploy/compose/: checked without a cluster, a Docker engine or a network.

Kubernetes: every manifest (and the ConfigMap and Secret that kustomization.yaml generates) validates
against the Kubernetes JSON schemas that the ``kubernetes-validate`` package bundles (strict: unknown
fields fail), with sockets blocked so nothing is fetched; the ServiceMonitor, a Prometheus Operator
CRD outside those schemas, validates against tests/data/servicemonitor-v1.schema.json. The router
config loads with hetroute's own loader and lists every vLLM pod by its stable DNS name; the probes
and the scrape path are routes of the app built from that config, and answer over HTTP with emulated
backends; the command parses with the real CLI and its paths are the mounted volumes.

Compose: the two-replica variant runs the same emulators and router config as docker-compose.yml,
behind nginx, whose config is parsed and checked for round robin, keep-alive and SSE settings.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry

from hetroute.app import build_app, start_app
from hetroute.catalog.specs import load_gpu_catalog, lookup_gpu
from hetroute.cli import build_parser
from hetroute.config import PEER_KEY_ENV, Config, load_config
from hetroute.errors import ConfigError
from tests.conftest import EmulateFn

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy/kubernetes"
COMPOSE_DIR = REPO / "deploy/compose"
KUSTOMIZATION: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
NOT_RESOURCES = {"kustomization.yaml", "router.yaml"}  # router.yaml becomes the generated ConfigMap
OLDEST_K8S = (1, 27)  # unhealthyPodEvictionPolicy (PodDisruptionBudget) is beta and on from 1.27


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _schema_versions() -> list[str]:
    """The oldest Kubernetes we support (or the oldest the package still bundles) and the newest."""
    bundled = sorted(set(kv.all_versions()), key=_minor)
    oldest = next((v for v in bundled if _minor(v) >= OLDEST_K8S), bundled[-1])
    return sorted({oldest, bundled[-1]}, key=_minor)


def _resources() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in KUSTOMIZATION["resources"]:
        text = (K8S / name).read_text(encoding="utf-8")
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


RESOURCES = _resources()


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [r for r in RESOURCES if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


DEPLOYMENT = _one("Deployment", "hetroute")
POD = DEPLOYMENT["spec"]["template"]["spec"]
CONTAINER = POD["containers"][0]
STATEFULSET = _one("StatefulSet")


def _generator_files(generator: dict[str, Any]) -> dict[str, str]:
    """{key: file} of a kustomize generator's ``files`` (``key=file`` or ``file``)."""
    out = {}
    for entry in generator["files"]:
        key, _, file = entry.rpartition("=")
        out[key or Path(file).name] = file
    return out


def _generated() -> list[dict[str, Any]]:
    """The ConfigMap and Secret that kustomize generates (without its hash suffix)."""
    docs: list[dict[str, Any]] = []
    for gen in KUSTOMIZATION["configMapGenerator"]:
        files = _generator_files(gen)
        data = {k: (K8S / f).read_text(encoding="utf-8") for k, f in files.items()}
        meta = {"name": gen["name"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for gen in KUSTOMIZATION["secretGenerator"]:
        data = {k: base64.b64encode(b"example-token").decode() for k in _generator_files(gen)}
        meta = {"name": gen["name"]}
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": data})
    return docs


def _router_config() -> Config:
    (gen,) = KUSTOMIZATION["configMapGenerator"]
    (file,) = _generator_files(gen).values()
    return load_config(K8S / file, env={"HETROUTE_PEER_KEY": "example-key"})  # the Secret's, in the pod


def _secret_generator(name: str) -> dict[str, Any]:
    (gen,) = [g for g in KUSTOMIZATION["secretGenerator"] if g["name"] == name]
    return dict(gen)


def _mount_path(volume_name: str) -> str:
    (mount,) = [m for m in CONTAINER["volumeMounts"] if m["name"] == volume_name]
    return str(mount["mountPath"])


def _volume(name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [v for v in POD["volumes"] if v["name"] == name]
    (volume,) = found
    return volume


def _volume_mounted_at(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(mount, volume) of the container's mount that holds ``path``."""
    mounts = [m for m in CONTAINER["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    mounts += [m for m in CONTAINER["volumeMounts"] if path == m["mountPath"]]
    assert len(mounts) == 1, f"{path} is not on exactly one mounted volume"
    return mounts[0], _volume(mounts[0]["name"])


def _serve_args() -> Any:
    command = CONTAINER["command"]
    assert command[0] == "hetroute" and not CONTAINER.get("args")
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve" and callable(args.func)
    return args


def _get_routes(app: web.Application) -> set[str]:
    return {
        str(r.resource.canonical)
        for r in app.router.routes()
        if r.method == "GET" and r.resource is not None and "{" not in r.resource.canonical
    }


# ---------------------------------------------------------------- Kubernetes: schemas


def test_kustomization_lists_every_manifest_and_generates_config_and_token() -> None:
    assert KUSTOMIZATION["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert KUSTOMIZATION["kind"] == "Kustomization"
    on_disk = {p.name for p in K8S.glob("*.yaml")} - NOT_RESOURCES
    assert set(KUSTOMIZATION["resources"]) == on_disk
    (config_gen,) = KUSTOMIZATION["configMapGenerator"]
    assert all((K8S / f).is_file() for f in _generator_files(config_gen).values())
    assert _volume("config")["configMap"]["name"] == config_gen["name"]
    admin = _secret_generator("hetroute-admin")
    assert _volume("admin-token")["secret"]["secretName"] == admin["name"]
    assert {g["name"] for g in KUSTOMIZATION["secretGenerator"]} == {"hetroute-admin", "hetroute-peer-key"}
    # the token and the peer key are the operator's to create, never committed
    for secret_file in (
        _generator_files(admin)["token"],
        _generator_files(_secret_generator("hetroute-peer-key"))["key"],
    ):
        path = K8S / secret_file
        assert f"{path.relative_to(REPO)}" in (REPO / ".gitignore").read_text(encoding="utf-8").split()
        tracked = subprocess.run(
            ["git", "ls-files", str(path.relative_to(REPO))], cwd=REPO, capture_output=True, text=True
        )
        assert tracked.returncode != 0 or tracked.stdout.strip() == ""
    (image,) = KUSTOMIZATION["images"]
    assert CONTAINER["image"].split(":")[0] == image["name"]
    assert KUSTOMIZATION["namespace"] == _one("Namespace")["metadata"]["name"]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a connection fails: the schemas must come from the installed package."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access during schema validation: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("version", _schema_versions())
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    core = [r for r in RESOURCES if r["kind"] != "ServiceMonitor"] + _generated()
    assert {r["kind"] for r in core} >= {
        "Namespace", "Deployment", "Service", "PodDisruptionBudget", "StatefulSet", "ConfigMap", "Secret",
    }  # fmt: skip
    for resource in core:
        kv.validate(resource, version, strict=True)  # raises kv.ValidationError naming the field


@pytest.mark.usefixtures("no_network")
def test_the_validator_catches_a_misspelt_field() -> None:
    broken = json.loads(json.dumps(DEPLOYMENT))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError, match="readinesProbe"):
        kv.validate(broken, _schema_versions()[0], strict=True)


def test_servicemonitor_validates_against_its_crd_schema_and_scrapes_the_router_service() -> None:
    schema = json.loads((REPO / "tests/data/servicemonitor-v1.schema.json").read_text(encoding="utf-8"))
    monitor = _one("ServiceMonitor")
    jsonschema.Draft202012Validator(schema).validate(monitor)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate({**monitor, "spec": {"endpoints": []}})
    service = _one("Service", "hetroute")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["path"] in _get_routes(build_app(_router_config(), registry=CollectorRegistry()))


# ---------------------------------------------------------------- Kubernetes: the router


def test_configmap_router_config_loads_and_discovers_the_vllm_pods_through_the_headless_service() -> None:
    cfg = _router_config()
    assert cfg.server.host == "0.0.0.0"
    assert cfg.server.port == CONTAINER["ports"][0]["containerPort"]
    headless = _one("Service", STATEFULSET["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    vllm = STATEFULSET["spec"]["template"]["spec"]["containers"][0]
    vllm_args = [str(a) for a in vllm["args"]]
    served = vllm_args[vllm_args.index("--served-model-name") + 1]
    tp = int(vllm_args[vllm_args.index("--tensor-parallel-size") + 1])
    vllm_port = int(vllm_args[vllm_args.index("--port") + 1])
    assert vllm_port == vllm["ports"][0]["containerPort"] == headless["spec"]["ports"][0]["port"]
    # one entry re-resolving the headless Service's name: its A records are the ready pods
    (entry,) = cfg.backends
    assert entry.discovery == "dns" and cfg.dns_entries() == (entry,)
    assert urlsplit(entry.url).hostname == headless["metadata"]["name"]
    assert urlsplit(entry.url).port == vllm_port and entry.engine == "vllm"
    assert entry.models == (served,) and entry.tp == tp == vllm["resources"]["limits"]["nvidia.com/gpu"]
    assert entry.gpu is not None and lookup_gpu(load_gpu_catalog(), entry.gpu)
    assert cfg.specs() == ()  # no fixed backend: the pods join as they are resolved
    assert 0 < cfg.dns.interval_s <= cfg.health.probe_interval_s


def test_deployment_two_replicas_rolling_update_and_security() -> None:
    spec = DEPLOYMENT["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    pod_sc, sc = POD["securityContext"], CONTAINER["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and isinstance(pod_sc["runAsUser"], int) and pod_sc["runAsUser"] > 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert POD["automountServiceAccountToken"] is False
    for kind in ("requests", "limits"):
        assert set(CONTAINER["resources"][kind]) == {"cpu", "memory"}, kind
    # SIGTERM drains for server.shutdown_grace_s (+1 s to exit) after the preStop pause
    pause = CONTAINER["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    grace = _router_config().server.shutdown_grace_s
    assert int(pause[1]) + grace + 1 <= POD["terminationGracePeriodSeconds"]


def test_command_parses_and_its_paths_are_the_mounted_volumes() -> None:
    args = _serve_args()
    # --config: the generated ConfigMap's key, mounted read-only
    mount, volume = _volume_mounted_at(args.config)
    assert mount["readOnly"] is True and "configMap" in volume
    (config_gen,) = KUSTOMIZATION["configMapGenerator"]
    assert Path(args.config).name in _generator_files(config_gen)
    # --admin-token-file: the Secret's key, mounted read-only (not an environment variable)
    mount, volume = _volume_mounted_at(args.admin_token_file)
    assert mount["readOnly"] is True and "secret" in volume
    assert Path(args.admin_token_file).name in _generator_files(_secret_generator("hetroute-admin"))
    assert not any("TOKEN" in e["name"] for e in CONTAINER.get("env", []))
    # --state-dir: the one writable volume (the root filesystem is read-only)
    mount, volume = _volume_mounted_at(args.state_dir)
    assert "emptyDir" in volume and not mount.get("readOnly", False)
    writable = [m for m in CONTAINER["volumeMounts"] if not m.get("readOnly", False)]
    assert writable == [mount]


def test_probes_and_scrape_path_are_routes_of_the_app() -> None:
    routes = _get_routes(build_app(_router_config(), registry=CollectorRegistry()))
    port_names = {p["name"] for p in CONTAINER["ports"]}
    assert CONTAINER["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert CONTAINER["livenessProbe"]["httpGet"]["path"] == "/live"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = CONTAINER[probe]["httpGet"]
        assert get["path"] in routes, probe
        assert get["port"] in port_names, probe


async def test_probes_answer_from_the_app_built_from_the_configmap(emulate: EmulateFn) -> None:
    """The ConfigMap's config with its vLLM pods swapped for emulators: the probe paths answer."""
    cfg = _router_config()
    emus = [await emulate(served_model=b.models[0] if b.models else "") for b in cfg.backends]
    backends = [replace(b, url=e.url) for b, e in zip(cfg.backends, emus, strict=True)]
    app = build_app(cfg.with_backends(backends), registry=CollectorRegistry())
    runner, port = await start_app(app)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(150):  # the first health probe runs at start-up
                async with s.get(base + CONTAINER["readinessProbe"]["httpGet"]["path"]) as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.02)
            assert r.status == 200
            for probe in ("livenessProbe", "startupProbe"):
                async with s.get(base + CONTAINER[probe]["httpGet"]["path"]) as r:
                    assert r.status == 200, probe
            async with s.get(base + _one("ServiceMonitor")["spec"]["endpoints"][0]["path"]) as r:
                assert r.status == 200 and "hetroute_" in await r.text()
    finally:
        await runner.cleanup()


def test_the_routers_exchange_summaries_through_a_headless_service_with_the_secrets_key() -> None:
    cfg = _router_config()
    peers = _one("Service", "hetroute-peers")
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    assert peers["spec"]["selector"].items() <= labels.items()
    (port,) = peers["spec"]["ports"]
    (container_port,) = [p for p in CONTAINER["ports"] if p["name"] == port["targetPort"]]
    assert port["protocol"] == container_port["protocol"] == "UDP"
    assert cfg.peers.enabled and cfg.peers.addresses == (("hetroute-peers", port["port"]),)
    assert cfg.peers.listen_port == container_port["containerPort"] and cfg.peers.listen_host == "0.0.0.0"
    (env,) = [e for e in CONTAINER["env"] if e["name"] == "HETROUTE_PEER_KEY"]
    ref = env["valueFrom"]["secretKeyRef"]
    gen = _secret_generator(ref["name"])
    assert ref["key"] in _generator_files(gen)


def test_service_and_pdb_select_the_router_pods() -> None:
    labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    service = _one("Service", "hetroute")
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in CONTAINER["ports"]}
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_vllm_statefulset_behind_a_headless_service() -> None:
    headless = _one("Service", STATEFULSET["spec"]["serviceName"])
    pod = STATEFULSET["spec"]["template"]
    assert headless["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert STATEFULSET["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (vllm,) = pod["spec"]["containers"]
    assert vllm["image"].startswith("vllm/vllm-openai:") and not vllm["image"].endswith(":latest")
    assert all(vllm[p]["httpGet"]["path"] == "/health" for p in ("startupProbe", "readinessProbe"))
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] >= 1
    router_labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    assert not headless["spec"]["selector"].items() <= router_labels.items()


# ---------------------------------------------------------------- compose: two routers behind nginx

REPLICAS: dict[str, Any] = yaml.safe_load(
    (COMPOSE_DIR / "docker-compose.replicas.yml").read_text(encoding="utf-8")
)
SERVICES: dict[str, Any] = REPLICAS["services"]
BASE: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text(encoding="utf-8"))["services"]
EMULATORS = ("emu-h100", "emu-a100", "emu-l4-tgi")
ROUTERS = ("router-1", "router-2")


def _compose_mount(service: str, target: str) -> Path:
    for volume in SERVICES[service].get("volumes", []):
        source, _, rest = str(volume).partition(":")
        if rest.split(":")[0] == target:
            return (COMPOSE_DIR / source).resolve()  # relative to the compose file's folder
    raise AssertionError(f"{service} does not mount {target}")


def _container_port(service: str) -> int:
    svc = SERVICES[service]
    ports = svc.get("expose") or [p.split(":")[-1] for p in svc.get("ports", [])]
    return int(ports[0])


def test_replicas_variant_reuses_the_emulators_and_the_router_config() -> None:
    assert set(SERVICES) == {*EMULATORS, *ROUTERS, "nginx"}
    for name in EMULATORS:  # exactly docker-compose.yml's CPU engines, built from the same image
        for key in ("command", "expose", "healthcheck", "image"):
            assert SERVICES[name][key] == BASE[name][key], (name, key)
    for name in (*EMULATORS, *ROUTERS):
        build = SERVICES[name]["build"]
        assert build["dockerfile"] == BASE["router"]["build"]["dockerfile"]
        assert (COMPOSE_DIR / build["context"]).resolve() == REPO  # relative to this compose file
    parser = build_parser()
    for name, svc in SERVICES.items():
        command = svc.get("command")
        if command and command[0] == "hetroute":
            assert callable(parser.parse_args(command[1:]).func), name
    for router in ROUTERS:
        svc = SERVICES[router]
        assert svc["command"] == BASE["router"]["command"]
        target = svc["command"][svc["command"].index("--config") + 1]
        assert _compose_mount(router, target) == COMPOSE_DIR / "router-peers.yaml"
        cfg = load_config(_compose_mount(router, target), env={PEER_KEY_ENV: "k" * 64})
        assert cfg.server.port == _container_port(router) and cfg.server.host == "0.0.0.0"
        assert {urlsplit(b.url).hostname for b in cfg.backends} == set(EMULATORS)
        assert all(svc["depends_on"][e] == {"condition": "service_healthy"} for e in EMULATORS)
        assert not svc.get("ports")  # reached through nginx only
        probe = " ".join(svc["healthcheck"]["test"])
        assert f"127.0.0.1:{_container_port(router)}/ready" in probe
    assert "/ready" in _get_routes(build_app(cfg, registry=CollectorRegistry()))


def test_replicas_variant_routers_exchange_summaries_with_a_required_key() -> None:
    """router-peers.yaml is the CPU profile's router config plus exactly a `peers` section naming both
    routers; each router gets the key from the environment (compose refuses to start without it) and
    exposes the peers' UDP port, which is not published."""
    peers_file = COMPOSE_DIR / "router-peers.yaml"
    with_peers = yaml.safe_load(peers_file.read_text(encoding="utf-8"))
    base = yaml.safe_load((REPO / "config/compose/router.yaml").read_text(encoding="utf-8"))
    assert {k: v for k, v in with_peers.items() if k != "peers"} == base
    cfg = load_config(peers_file, env={PEER_KEY_ENV: "k" * 64})
    assert cfg.peers.enabled
    assert set(cfg.peers.addresses) == {(router, cfg.peers.listen_port) for router in ROUTERS}
    with pytest.raises(ConfigError, match=PEER_KEY_ENV):
        load_config(peers_file, env={})
    for router in ROUTERS:
        svc = SERVICES[router]
        assert svc["environment"][PEER_KEY_ENV].startswith("${" + PEER_KEY_ENV + ":?")  # required
        assert f"{cfg.peers.listen_port}/udp" in svc["expose"]
        assert not svc.get("ports")


def test_nginx_service_is_published_and_waits_for_both_routers() -> None:
    nginx = SERVICES["nginx"]
    assert nginx["ports"] == ["8000:8000"]
    assert all(nginx["depends_on"][r] == {"condition": "service_healthy"} for r in ROUTERS)
    assert _compose_mount("nginx", "/etc/nginx/nginx.conf") == COMPOSE_DIR / "nginx.conf"
    image, _, tag = nginx["image"].partition(":")
    version = tuple(int(x) for x in re.findall(r"\d+", tag)[:3])
    assert image == "nginx" and version >= (1, 27, 3)  # `resolve` on upstream servers
    probe = " ".join(nginx["healthcheck"]["test"])
    locations = {d.args[-1] for d in _server(_nginx())["location"]}
    assert any(f"127.0.0.1:{_container_port('nginx')}{loc}" in probe for loc in locations)


@dataclass
class Directive:
    name: str
    args: list[str]
    block: dict[str, list[Directive]] | None


def _parse_nginx(text: str) -> dict[str, list[Directive]]:
    """nginx.conf as {directive name: [Directive]} per block (comments dropped, quotes removed)."""
    text = "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines())
    tokens = re.findall(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{};]|[^\s{};]+', text)
    pos = 0

    def block(nested: bool) -> dict[str, list[Directive]]:
        nonlocal pos
        out: dict[str, list[Directive]] = {}
        words: list[str] = []
        while pos < len(tokens):
            tok = tokens[pos]
            pos += 1
            if tok == ";":
                out.setdefault(words[0], []).append(Directive(words[0], words[1:], None))
                words = []
            elif tok == "{":
                inner = block(nested=True)
                out.setdefault(words[0], []).append(Directive(words[0], words[1:], inner))
                words = []
            elif tok == "}":
                assert nested and not words, f"unbalanced braces or unterminated directive {words}"
                return out
            else:
                words.append(tok[1:-1] if tok[0] in "\"'" else tok)
        assert not nested and not words, f"unbalanced braces or unterminated directive {words}"
        return out

    return block(nested=False)


def _nginx() -> dict[str, list[Directive]]:
    return _parse_nginx((COMPOSE_DIR / "nginx.conf").read_text(encoding="utf-8"))


def _inner(d: Directive) -> dict[str, list[Directive]]:
    assert d.block is not None, d.name
    return d.block


def _http(conf: dict[str, list[Directive]]) -> dict[str, list[Directive]]:
    (http,) = conf["http"]
    return _inner(http)


def _server(conf: dict[str, list[Directive]]) -> dict[str, list[Directive]]:
    (server,) = _http(conf)["server"]
    return _inner(server)


def _value(block: dict[str, list[Directive]], name: str) -> list[str]:
    (d,) = block[name]
    return d.args


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", value)
    assert match, f"not an nginx time: {value!r}"
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return int(match[1]) * units[match[2] or "s"]


def _bytes(value: str) -> int:
    match = re.fullmatch(r"(\d+)([kKmMgG])?", value)
    assert match, f"not an nginx size: {value!r}"
    return int(match[1]) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[(match[2] or "").lower()]


def test_nginx_round_robins_over_both_routers_with_keepalive() -> None:
    conf = _nginx()
    assert "events" in conf
    http = _http(conf)
    (upstream,) = http["upstream"]
    up = _inner(upstream)
    servers = [d.args for d in up["server"]]
    assert {s[0] for s in servers} == {f"{r}:{_container_port(r)}" for r in ROUTERS}
    assert not {"least_conn", "ip_hash", "hash", "random", "least_time"} & set(up)  # round robin
    # re-resolved names need a shared-memory zone and a resolver (Docker's embedded DNS)
    assert all("resolve" in s for s in servers) and "zone" in up
    assert _value(http, "resolver")[0] == "127.0.0.11"
    # idle upstream connections: kept, and closed by nginx before the router closes them
    cfg = load_config(REPO / "config/compose/router.yaml", env={})
    assert int(_value(up, "keepalive")[0]) > 0
    assert _seconds(_value(up, "keepalive_timeout")[0]) < cfg.server.keepalive_idle_s
    (listen,) = _server(conf)["listen"]
    assert listen.args == [str(_container_port("nginx"))]


def test_nginx_proxies_sse_unbuffered_over_http11_with_long_timeouts() -> None:
    conf = _nginx()
    server = _server(conf)
    (root,) = [d for d in server["location"] if d.args == ["/"]]
    loc = _inner(root)
    (upstream,) = _http(conf)["upstream"]
    assert _value(loc, "proxy_pass") == [f"http://{upstream.args[0]}"]
    assert _value(loc, "proxy_http_version") == ["1.1"]
    assert ["Connection", ""] in [d.args for d in loc["proxy_set_header"]]
    assert _value(loc, "proxy_buffering") == ["off"]
    cfg = load_config(REPO / "config/compose/router.yaml", env={})
    read = _seconds(_value(loc, "proxy_read_timeout")[0])
    assert read > cfg.timeouts.request_s and read > cfg.timeouts.first_byte_s and read > cfg.timeouts.idle_s
    assert _bytes(_value(server, "client_max_body_size")[0]) >= cfg.server.max_body_bytes
    # a request that reached a router is never sent to the other one (no duplicate generation)
    retry = _value(loc, "proxy_next_upstream")
    assert "non_idempotent" not in retry and not any(r.startswith("http_") for r in retry)


def test_nginx_parser_reads_quotes_comments_and_nesting() -> None:
    conf = _parse_nginx("a 1; # c\nb { c \"x y\"; d ''; e { f; } }\n")
    assert _value(conf, "a") == ["1"]
    b = _inner(conf["b"][0])
    assert _value(b, "c") == ["x y"] and _value(b, "d") == [""] and "f" in _inner(b["e"][0])
    for broken in ("a { b;", "a; }", "a b"):
        with pytest.raises(AssertionError):
            _parse_nginx(broken)
