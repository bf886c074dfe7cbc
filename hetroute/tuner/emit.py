"""Turning a chosen deployment into files: the ``hetroute serve`` router config and a docker-compose file.

Owns: :func:`router_config`, :func:`compose_file`, :func:`write_router_config`, :func:`write_compose`.

Invariants:
- One backend / one compose service per engine instance, named ``<machine>-tp<t>-<k>``; instance k of a
  machine uses GPUs ``[k·t, (k+1)·t)`` and port ``base_port + k``, so no two instances share a GPU or port.
- The router config follows ``hetroute.config`` (``backends: [{name, url, engine, models, weight, labels,
  gpu, tp, profile, kv_capacity_tokens, max_num_seqs}]``, ``policy: {type, params}``). Each backend refers
  to a latency profile: the measured one the estimate used, or the roofline prior written next to the
  config under ``profiles/`` (so the router never runs without curves). Weights are the estimated
  per-instance throughputs normalised to the slowest instance (for weighted policies).
- The compose file launches ``vllm/vllm-openai`` with ``--tensor-parallel-size`` and the engine settings the
  estimate assumed; each service reserves its GPUs by ``device_ids`` and carries a health check. Services
  are tagged with a compose profile per machine: on host X run ``docker compose --profile X up -d``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from hetroute.catalog.specs import GpuSpec, ModelSpec
from hetroute.latency import LatencyProfile, save_profile
from hetroute.tuner.estimate import PriorFn
from hetroute.tuner.tune import TuneResult


def _served_name(model: ModelSpec) -> str:
    return model.hf_id or model.name


def _instances(result: TuneResult) -> list[dict[str, Any]]:
    """One record per engine instance of the chosen deployment."""
    out = []
    for plan in result.plans:
        if plan.chosen is None:
            continue
        m, e = plan.machine, plan.chosen
        for k in range(e.instances):
            out.append(
                {
                    "name": f"{m.name}-tp{e.tp}-{k}",
                    "machine": m.name,
                    "host": m.host or m.name,
                    "port": result.cluster.deploy.base_port + k,
                    "gpu_ids": [str(g) for g in range(k * e.tp, (k + 1) * e.tp)],
                    "estimate": e,
                    "gpu": m.gpu,
                    "model_key": m.model_key,
                }
            )
    return out


def router_config(
    result: TuneResult, out_dir: Path, prior: PriorFn
) -> tuple[dict[str, Any], dict[str, LatencyProfile]]:
    """The router config as data, plus the prior profiles to write (relative path → profile).

    ``prior(gpu, model, tp)`` builds the roofline prior for instances without a measured profile.
    """
    cluster = result.cluster
    insts = _instances(result)
    if not insts:
        raise ValueError("the deployment has no instance; nothing to emit")
    slowest = min(i["estimate"].iteration_instance_tokens_per_s or 1.0 for i in insts)
    profiles: dict[str, str] = {}
    to_write: dict[str, LatencyProfile] = {}
    backends = []
    for inst in insts:
        e = inst["estimate"]
        gpu: GpuSpec = inst["gpu"]
        model = cluster.models[inst["model_key"]]
        key = f"{gpu.name}-tp{e.tp}-{inst['model_key']}".replace("/", "_")
        if key not in profiles:
            if e.profile_path is not None:
                profiles[key] = os.path.relpath(e.profile_path, out_dir)
            else:
                rel = f"profiles/{key}.yaml"
                to_write[rel] = prior(gpu, model, e.tp)
                profiles[key] = rel
        backends.append(
            {
                "name": inst["name"],
                "url": f"http://{inst['host']}:{inst['port']}",
                "engine": "vllm",
                "models": [_served_name(model)],
                "weight": round((e.iteration_instance_tokens_per_s or slowest) / slowest, 3),
                "gpu": gpu.name,
                "tp": e.tp,
                "profile": key,
                "kv_capacity_tokens": e.kv_capacity_tokens,
                "max_num_seqs": cluster.engine.max_num_seqs,
                "labels": {
                    "machine": inst["machine"],
                    "gpu": gpu.name,
                    "tp": str(e.tp),
                    "profile_source": e.profile_source or "",
                    "generated_by": "hetroute tune-deploy",
                },
            }
        )
    config = {
        "policy": {"type": cluster.deploy.policy, "params": {}},
        "profiles": profiles,
        "backends": backends,
    }
    return config, to_write


def write_router_config(result: TuneResult, path: str | Path, prior: PriorFn) -> Path:
    """Write the router config (and any prior profiles under ``profiles/`` beside it)."""
    target = Path(path)
    out_dir = target.resolve().parent
    config, to_write = router_config(result, out_dir, prior)
    for rel, profile in to_write.items():
        file = out_dir / rel
        file.parent.mkdir(parents=True, exist_ok=True)
        save_profile(profile, file)
    header = (
        f"# hetroute serve config generated by `hetroute tune-deploy --cluster {result.cluster.source}`\n"
    )
    target.write_text(header + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return target


def compose_file(result: TuneResult) -> dict[str, Any]:
    """A docker-compose document launching every chosen instance with vLLM."""
    cluster = result.cluster
    eng = cluster.engine
    dep = cluster.deploy
    services: dict[str, Any] = {}
    for inst in _instances(result):
        e = inst["estimate"]
        model = cluster.models[inst["model_key"]]
        port = inst["port"]
        command = [
            "--model", _served_name(model),
            "--download-dir", "/models",
            "--tensor-parallel-size", str(e.tp),
            "--gpu-memory-utilization", str(eng.gpu_memory_utilization),
            "--max-num-seqs", str(eng.max_num_seqs),
            "--enable-chunked-prefill",
            "--max-num-batched-tokens", str(eng.batched_tokens()),
            "--max-model-len", str(eng.model_len(model)),
            "--host", "0.0.0.0",
            "--port", str(port),
        ]  # fmt: skip
        probe = f"import urllib.request; urllib.request.urlopen('http://localhost:{port}/health', timeout=4)"
        services[inst["name"]] = {
            "image": dep.image,
            "profiles": [inst["machine"]],
            "command": command,
            "ports": [f"{port}:{port}"],
            "ipc": "host",
            "volumes": [f"{dep.model_dir}:/models", "${HOME}/.cache/huggingface:/root/.cache/huggingface"],
            "environment": {"HUGGING_FACE_HUB_TOKEN": "${HF_TOKEN:-}"},
            "labels": {
                "hetroute.machine": inst["machine"],
                "hetroute.gpu": inst["gpu"].name,
                "hetroute.tp": str(e.tp),
            },
            "deploy": {
                "resources": {
                    "reservations": {
                        "devices": [
                            {"driver": "nvidia", "device_ids": inst["gpu_ids"], "capabilities": ["gpu"]}
                        ]
                    }
                }
            },
            "healthcheck": {
                "test": ["CMD", "python3", "-c", probe],
                "interval": "15s",
                "timeout": "5s",
                "retries": 40,
                "start_period": "600s",
            },
            "restart": "unless-stopped",
        }
    if not services:
        raise ValueError("the deployment has no instance; nothing to emit")
    return {"name": "hetroute-fleet", "services": services}


def write_compose(result: TuneResult, path: str | Path) -> Path:
    target = Path(path)
    header = (
        f"# generated by `hetroute tune-deploy --cluster {result.cluster.source}`\n"
        "# one compose profile per machine: on host X run `docker compose --profile X up -d`\n"
    )
    target.write_text(header + yaml.safe_dump(compose_file(result), sort_keys=False), encoding="utf-8")
    return target
