"""The cluster file of ``hetroute tune-deploy``: a YAML description of a fleet, validated into frozen specs.

Owns: :class:`ClusterSpec` and its parts, :func:`load_cluster` and :func:`cluster_from_dict`. The ``model``/
``models`` section is read by :mod:`hetroute.tuner.cluster_models`.

Invariants:
- Every error is a :class:`ClusterError` naming the file and the field (``fleet.yaml: machines[3].gpu: unknown
  GPU 'V200'; valid names: ...``); nothing raises a bare ``KeyError``/``TypeError`` on bad input.
- GPU types come from the GPU catalog; a model is either a catalog reference or given inline (layers, hidden
  size, heads, KV heads, head dim, parameters, dtype).
- A machine entry with ``count: n`` expands to ``n`` machines named ``<name>-0 .. <name>-(n-1)``.
- Profile paths are resolved relative to the cluster file; a profile is keyed by (GPU type, TP, model).

Schema (see docs/tune-deploy.md)::

    models: {<key>: {catalog: Llama-3-8B} | {n_layers: .., hidden_size: .., n_heads: .., n_kv_heads: ..,
                                             head_dim: .., params: .., dtype: fp16, max_model_len: ..}}
    # or  model: <catalog name> | {inline}     (one model for every machine)
    machines: [{name, gpu, gpus, price_per_hour?, model?, count?, host?}]
    engine: {gpu_memory_utilization, overhead_gib_per_gpu, max_num_seqs, max_num_batched_tokens?,
             max_model_len?, tp_degrees?}
    profiles: [{gpu, tp, model?, path}]
    constraints: {min_instances?, max_cost_per_hour?, slo?: {rate_rps, ttft_s?, tpot_s?}}
    workload: {kind?, requests?, seed?}
    deploy: {image?, engine?, base_port?, model_dir?, policy?}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hetroute.catalog.specs import GpuSpec, ModelSpec, UnknownCatalogEntry, lookup_gpu
from hetroute.latency import LatencyProfile, ProfileError, load_profile
from hetroute.policy_names import policy_names
from hetroute.tuner.cluster_models import parse_models
from hetroute.tuner.fields import ClusterError, FieldReader

__all__ = [
    "ClusterError",
    "ClusterSpec",
    "Constraints",
    "DeploySettings",
    "EngineSettings",
    "MachineSpec",
    "SloSpec",
    "WorkloadSettings",
    "cluster_from_dict",
    "load_cluster",
]

_MACHINE_KEYS = {"name", "gpu", "gpus", "price_per_hour", "model", "count", "host"}
_ENGINE_KEYS = {
    "gpu_memory_utilization",
    "overhead_gib_per_gpu",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "tp_degrees",
}


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """vLLM-like engine settings shared by every instance (None = the model's / engine's default)."""

    gpu_memory_utilization: float = 0.9
    overhead_gib_per_gpu: float = 2.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    tp_degrees: tuple[int, ...] | None = None

    def model_len(self, model: ModelSpec) -> int:
        """The effective max model length: the setting, else the model's own limit."""
        return self.max_model_len if self.max_model_len is not None else model.max_model_len

    def batched_tokens(self) -> int:
        """The per-step token budget (vLLM V1 with chunked prefill defaults to 8192, as the engine model)."""
        return self.max_num_batched_tokens if self.max_num_batched_tokens is not None else 8192


@dataclass(frozen=True, slots=True)
class MachineSpec:
    """One host: ``gpus`` accelerators of one catalog type, serving one model."""

    name: str
    gpu: GpuSpec
    gpus: int
    model_key: str
    price_per_hour: float | None = None
    host: str | None = None


@dataclass(frozen=True, slots=True)
class SloSpec:
    """A latency bound at a target cluster arrival rate (requests/s)."""

    rate_rps: float
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True, slots=True)
class Constraints:
    """Optional global constraints that make the per-machine choice non-separable."""

    min_instances: int | None = None
    max_cost_per_hour: float | None = None
    slo: SloSpec | None = None

    @property
    def active(self) -> bool:
        return self.min_instances is not None or self.max_cost_per_hour is not None or self.slo is not None


@dataclass(frozen=True, slots=True)
class DeploySettings:
    """What the emitted router config and docker-compose file need beyond the deployment itself."""

    image: str = "vllm/vllm-openai:v0.6.3"
    engine: str = "vllm"
    base_port: int = 8000
    model_dir: str = "/models"
    policy: str = "round_robin"


@dataclass(frozen=True, slots=True)
class WorkloadSettings:
    """The default request sample: ``requests`` drawn from ``kind``, each repeated ``duplicates`` times."""

    kind: str = "sharegpt"
    requests: int = 1000
    seed: int = 0
    duplicates: int = 1


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A validated cluster file."""

    source: str
    models: Mapping[str, ModelSpec]
    machines: tuple[MachineSpec, ...]
    engine: EngineSettings = field(default_factory=EngineSettings)
    profiles: Mapping[tuple[str, int, str], LatencyProfile] = field(default_factory=dict)
    profile_paths: Mapping[tuple[str, int, str], str] = field(default_factory=dict)
    constraints: Constraints = field(default_factory=Constraints)
    workload: WorkloadSettings = field(default_factory=WorkloadSettings)
    deploy: DeploySettings = field(default_factory=DeploySettings)


def _engine(r: FieldReader, value: Any) -> EngineSettings:
    item = r.mapping(value if value is not None else {}, "engine")
    r.unknown_keys(item, _ENGINE_KEYS, "engine")
    tps: tuple[int, ...] | None = None
    if item.get("tp_degrees") is not None:
        raw = item["tp_degrees"]
        if not isinstance(raw, list) or not raw:
            raise r.fail("engine.tp_degrees", f"expected a non-empty list of positive integers, got {raw!r}")
        for i, v in enumerate(raw):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise r.fail(f"engine.tp_degrees[{i}]", f"expected a positive integer, got {v!r}")
        tps = tuple(raw)
    settings = EngineSettings(
        gpu_memory_utilization=r.number(item, "gpu_memory_utilization", "engine", hi=1.0, default=0.9),
        overhead_gib_per_gpu=r.number(item, "overhead_gib_per_gpu", "engine", lo_open=False, default=2.0),
        max_num_seqs=r.integer(item, "max_num_seqs", "engine", default=256),
        max_num_batched_tokens=r.opt_integer(item, "max_num_batched_tokens", "engine"),
        max_model_len=r.opt_integer(item, "max_model_len", "engine"),
        tp_degrees=tps,
    )
    if settings.batched_tokens() < settings.max_num_seqs:  # vLLM refuses to start so
        raise r.fail(
            "engine.max_num_batched_tokens",
            f"{settings.batched_tokens()} must be >= max_num_seqs ({settings.max_num_seqs})",
        )
    return settings


def _machines(
    r: FieldReader, value: Any, gpus: Mapping[str, GpuSpec], models: Mapping[str, ModelSpec]
) -> tuple[MachineSpec, ...]:
    if not isinstance(value, list) or not value:
        raise r.fail("machines", "expected a non-empty list of machines")
    out: list[MachineSpec] = []
    names: set[str] = set()
    for i, raw in enumerate(value):
        path = f"machines[{i}]"
        item = r.mapping(raw, path)
        r.unknown_keys(item, _MACHINE_KEYS, path)
        name = r.string(item, "name", path)
        try:
            gpu = lookup_gpu(gpus, r.string(item, "gpu", path))
        except UnknownCatalogEntry as exc:
            raise r.fail(f"{path}.gpu", str(exc)) from None
        n_gpus = r.integer(item, "gpus", path)
        price = (
            None
            if item.get("price_per_hour") is None
            else r.number(item, "price_per_hour", path, lo_open=False)
        )
        if "model" in item:
            model_key = r.string(item, "model", path)
            if model_key not in models:
                raise r.fail(
                    f"{path}.model", f"unknown model {model_key!r}; the file defines {', '.join(models)}"
                )
        elif len(models) == 1:
            model_key = next(iter(models))
        else:
            raise r.fail(f"{path}.model", f"missing (the file defines several models: {', '.join(models)})")
        count = r.integer(item, "count", path, default=1)
        host = None if item.get("host") is None else r.string(item, "host", path)
        for k in range(count):
            full = name if count == 1 else f"{name}-{k}"
            if full in names:
                raise r.fail(f"{path}.name", f"duplicate machine name {full!r}")
            names.add(full)
            out.append(MachineSpec(full, gpu, n_gpus, model_key, price, host if count == 1 else None))
    return tuple(out)


def _profiles(
    r: FieldReader, value: Any, base_dir: Path, gpus: Mapping[str, GpuSpec], models: Mapping[str, ModelSpec]
) -> tuple[dict[tuple[str, int, str], LatencyProfile], dict[tuple[str, int, str], str]]:
    profiles: dict[tuple[str, int, str], LatencyProfile] = {}
    paths: dict[tuple[str, int, str], str] = {}
    if value is None:
        return profiles, paths
    if not isinstance(value, list):
        raise r.fail("profiles", f"expected a list, got {type(value).__name__}")
    for i, raw in enumerate(value):
        path = f"profiles[{i}]"
        item = r.mapping(raw, path)
        r.unknown_keys(item, {"gpu", "tp", "model", "path"}, path)
        try:
            gpu = lookup_gpu(gpus, r.string(item, "gpu", path))
        except UnknownCatalogEntry as exc:
            raise r.fail(f"{path}.gpu", str(exc)) from None
        tp = r.integer(item, "tp", path)
        if "model" in item:
            model_key = r.string(item, "model", path)
            if model_key not in models:
                raise r.fail(
                    f"{path}.model", f"unknown model {model_key!r}; the file defines {', '.join(models)}"
                )
        elif len(models) == 1:
            model_key = next(iter(models))
        else:
            raise r.fail(f"{path}.model", "missing (the file defines several models)")
        file = Path(r.string(item, "path", path))
        file = file if file.is_absolute() else base_dir / file
        try:
            profile = load_profile(file)
        except ProfileError as exc:
            raise r.fail(f"{path}.path", str(exc)) from None
        key = (gpu.name, tp, model_key)
        if key in profiles:
            raise r.fail(path, f"duplicate profile for {gpu.name} TP{tp} {model_key}")
        profiles[key] = profile
        paths[key] = str(file)
    return profiles, paths


def _constraints(r: FieldReader, value: Any) -> Constraints:
    item = r.mapping(value if value is not None else {}, "constraints")
    r.unknown_keys(item, {"min_instances", "max_cost_per_hour", "slo"}, "constraints")
    slo = None
    if item.get("slo") is not None:
        s = r.mapping(item["slo"], "constraints.slo")
        r.unknown_keys(s, {"rate_rps", "ttft_s", "tpot_s"}, "constraints.slo")
        if s.get("ttft_s") is None and s.get("tpot_s") is None:
            raise r.fail("constraints.slo", "give ttft_s, tpot_s or both")
        slo = SloSpec(
            rate_rps=r.number(s, "rate_rps", "constraints.slo"),
            ttft_s=None if s.get("ttft_s") is None else r.number(s, "ttft_s", "constraints.slo"),
            tpot_s=None if s.get("tpot_s") is None else r.number(s, "tpot_s", "constraints.slo"),
        )
    return Constraints(
        min_instances=r.opt_integer(item, "min_instances", "constraints"),
        max_cost_per_hour=None
        if item.get("max_cost_per_hour") is None
        else r.number(item, "max_cost_per_hour", "constraints"),
        slo=slo,
    )


def _workload(r: FieldReader, value: Any) -> WorkloadSettings:
    item = r.mapping(value if value is not None else {}, "workload")
    r.unknown_keys(item, {"kind", "requests", "seed", "duplicates"}, "workload")
    seed = item.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise r.fail("workload.seed", f"expected a non-negative integer, got {seed!r}")
    return WorkloadSettings(
        kind=r.string(item, "kind", "workload", default="sharegpt"),
        requests=r.integer(item, "requests", "workload", default=1000),
        seed=seed,
        duplicates=r.integer(item, "duplicates", "workload", default=1),
    )


def _deploy(r: FieldReader, value: Any) -> DeploySettings:
    item = r.mapping(value if value is not None else {}, "deploy")
    r.unknown_keys(item, {"image", "engine", "base_port", "model_dir", "policy"}, "deploy")
    d = DeploySettings()
    engine = r.string(item, "engine", "deploy", default=d.engine)
    if engine != "vllm":
        raise r.fail("deploy.engine", f"only 'vllm' deployments can be emitted, got {engine!r}")
    port = r.integer(item, "base_port", "deploy", default=d.base_port)
    if port > 65000:
        raise r.fail("deploy.base_port", f"expected a port <= 65000, got {port}")
    policy = r.string(item, "policy", "deploy", default=d.policy)
    if policy not in policy_names():
        raise r.fail("deploy.policy", f"unknown policy {policy!r} (valid: {', '.join(policy_names())})")
    return DeploySettings(
        image=r.string(item, "image", "deploy", default=d.image),
        engine=engine,
        base_port=port,
        model_dir=r.string(item, "model_dir", "deploy", default=d.model_dir),
        policy=policy,
    )


_TOP_KEYS = {"name", "model", "models", "machines", "engine", "profiles", "constraints", "workload", "deploy"}


def cluster_from_dict(
    data: Any,
    gpus: Mapping[str, GpuSpec],
    models: Mapping[str, ModelSpec],
    *,
    source: str = "<cluster>",
    base_dir: Path | None = None,
) -> ClusterSpec:
    """Validate decoded YAML into a :class:`ClusterSpec` (``ClusterError`` naming the field)."""
    r = FieldReader(source)
    root = r.mapping(data, "<root>")
    r.unknown_keys(root, _TOP_KEYS, "<root>")
    model_specs = parse_models(r, root, models)
    engine = _engine(r, root.get("engine"))
    machines = _machines(r, root.get("machines"), gpus, model_specs)
    for key, spec in model_specs.items():
        if engine.max_model_len is not None and engine.max_model_len > spec.max_model_len:
            raise r.fail(
                "engine.max_model_len",
                f"{engine.max_model_len} exceeds model {key!r}'s limit of {spec.max_model_len} tokens",
            )
    for key, spec in model_specs.items():
        for i, tp in enumerate(engine.tp_degrees or ()):
            if spec.n_heads % tp != 0:
                raise r.fail(
                    f"engine.tp_degrees[{i}]",
                    f"TP {tp} does not divide model {key!r}'s {spec.n_heads} attention heads",
                )
    constraints = _constraints(r, root.get("constraints"))
    if constraints.slo is not None and len(model_specs) > 1:
        raise r.fail(
            "constraints.slo", "an SLO at a target rate is supported for a single-model cluster only"
        )
    profiles, paths = _profiles(r, root.get("profiles"), base_dir or Path("."), gpus, model_specs)
    return ClusterSpec(
        source=source,
        models=model_specs,
        machines=machines,
        engine=engine,
        profiles=profiles,
        profile_paths=paths,
        constraints=constraints,
        workload=_workload(r, root.get("workload")),
        deploy=_deploy(r, root.get("deploy")),
    )


def load_cluster(
    path: str | Path, gpus: Mapping[str, GpuSpec], models: Mapping[str, ModelSpec]
) -> ClusterSpec:
    """Read and validate a cluster YAML file."""
    file = Path(path)
    source = file.name
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ClusterError(source, "<file>", f"cannot read {file}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ClusterError(source, "<file>", f"not valid YAML: {exc}") from None
    return cluster_from_dict(data, gpus, models, source=source, base_dir=file.resolve().parent)
