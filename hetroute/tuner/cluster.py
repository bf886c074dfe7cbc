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
from typing import Annotated, Any

from hetroute.catalog.specs import GpuSpec, ModelSpec, UnknownCatalogEntry, lookup_gpu
from hetroute.errors import ConfigError, FileConfigError
from hetroute.fields import (
    AT_LEAST_ONE,
    FRACTION,
    NON_NEGATIVE,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    Reader,
    as_int,
    as_list,
    as_mapping,
    check_keys,
    file_errors,
    integer,
    load_yaml,
    opt_number,
    opt_string,
    read_dataclass,
    string,
)
from hetroute.latency import LatencyProfile, ProfileError, load_profile
from hetroute.policy_names import policy_names
from hetroute.tuner.cluster_models import parse_models

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

_MACHINE_KEYS = ("name", "gpu", "gpus", "price_per_hour", "model", "count", "host")


class ClusterError(FileConfigError):
    """An invalid cluster file; names the file and the field."""


def _tp_degrees(value: Any, path: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = as_list(value, path, "positive integers")
    return tuple(as_int(v, f"{path}[{i}]", AT_LEAST_ONE) for i, v in enumerate(items))


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """vLLM-like engine settings shared by every instance (None = the model's / engine's default)."""

    gpu_memory_utilization: Annotated[float, FRACTION] = 0.9
    overhead_gib_per_gpu: NonNegativeFloat = 2.0
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt | None = None
    max_model_len: PositiveInt | None = None
    tp_degrees: Annotated[tuple[int, ...] | None, Reader(_tp_degrees)] = None

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

    rate_rps: PositiveFloat
    ttft_s: PositiveFloat | None = None
    tpot_s: PositiveFloat | None = None


@dataclass(frozen=True, slots=True)
class Constraints:
    """Optional global constraints that make the per-machine choice non-separable."""

    min_instances: PositiveInt | None = None
    max_cost_per_hour: PositiveFloat | None = None
    slo: SloSpec | None = None

    @property
    def active(self) -> bool:
        return self.min_instances is not None or self.max_cost_per_hour is not None or self.slo is not None


@dataclass(frozen=True, slots=True)
class DeploySettings:
    """What the emitted router config and docker-compose file need beyond the deployment itself."""

    image: str = "vllm/vllm-openai:v0.6.3"
    engine: str = "vllm"
    base_port: Annotated[int, Range(minimum=1, maximum=65000)] = 8000
    model_dir: str = "/models"
    policy: str = "round_robin"


@dataclass(frozen=True, slots=True)
class WorkloadSettings:
    """The default request sample: ``requests`` drawn from ``kind``, each repeated ``duplicates`` times."""

    kind: str = "sharegpt"
    requests: PositiveInt = 1000
    seed: NonNegativeInt = 0
    duplicates: PositiveInt = 1


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


def _machine_model(item: Mapping[str, Any], path: str, models: Mapping[str, ModelSpec]) -> str:
    """The key of the model a machine (or a profile) entry serves: its ``model``, or the file's only one."""
    if "model" in item:
        model_key = string(item, "model", path).strip()
        if model_key not in models:
            raise ConfigError(
                f"{path}.model", f"unknown model {model_key!r}; the file defines {', '.join(models)}"
            )
        return model_key
    if len(models) == 1:
        return next(iter(models))
    raise ConfigError(f"{path}.model", f"missing (the file defines several models: {', '.join(models)})")


def _gpu(item: Mapping[str, Any], path: str, gpus: Mapping[str, GpuSpec]) -> GpuSpec:
    try:
        return lookup_gpu(gpus, string(item, "gpu", path).strip())
    except UnknownCatalogEntry as exc:
        raise ConfigError(f"{path}.gpu", str(exc)) from None


def _machines(
    value: Any, gpus: Mapping[str, GpuSpec], models: Mapping[str, ModelSpec]
) -> tuple[MachineSpec, ...]:
    out: list[MachineSpec] = []
    names: set[str] = set()
    for i, raw in enumerate(as_list(value, "machines", "machines")):
        path = f"machines[{i}]"
        item = as_mapping(raw, path, none_ok=False)
        check_keys(item, _MACHINE_KEYS, path)
        name = string(item, "name", path).strip()
        gpu = _gpu(item, path, gpus)
        n_gpus = integer(item, "gpus", path, bounds=AT_LEAST_ONE)
        price = opt_number(item, "price_per_hour", path, NON_NEGATIVE)
        model_key = _machine_model(item, path, models)
        count = integer(item, "count", path, 1, AT_LEAST_ONE)
        host = opt_string(item, "host", path)
        for k in range(count):
            full = name if count == 1 else f"{name}-{k}"
            if full in names:
                raise ConfigError(f"{path}.name", f"duplicate machine name {full!r}")
            names.add(full)
            out.append(MachineSpec(full, gpu, n_gpus, model_key, price, host if count == 1 else None))
    return tuple(out)


def _profiles(
    value: Any, base_dir: Path, gpus: Mapping[str, GpuSpec], models: Mapping[str, ModelSpec]
) -> tuple[dict[tuple[str, int, str], LatencyProfile], dict[tuple[str, int, str], str]]:
    profiles: dict[tuple[str, int, str], LatencyProfile] = {}
    paths: dict[tuple[str, int, str], str] = {}
    if value is None:
        return profiles, paths
    if not isinstance(value, list):
        raise ConfigError("profiles", f"expected a list, got {type(value).__name__}")
    for i, raw in enumerate(value):
        path = f"profiles[{i}]"
        item = as_mapping(raw, path, none_ok=False)
        check_keys(item, ("gpu", "tp", "model", "path"), path)
        gpu = _gpu(item, path, gpus)
        tp = integer(item, "tp", path, bounds=AT_LEAST_ONE)
        model_key = _machine_model(item, path, models)
        file = Path(string(item, "path", path).strip())
        file = file if file.is_absolute() else base_dir / file
        try:
            profile = load_profile(file)
        except ProfileError as exc:
            raise ConfigError(f"{path}.path", str(exc)) from None
        key = (gpu.name, tp, model_key)
        if key in profiles:
            raise ConfigError(path, f"duplicate profile for {gpu.name} TP{tp} {model_key}")
        profiles[key] = profile
        paths[key] = str(file)
    return profiles, paths


def _constraints(value: Any) -> Constraints:
    constraints = read_dataclass(Constraints, value, "constraints")
    slo = constraints.slo
    if slo is not None and slo.ttft_s is None and slo.tpot_s is None:
        raise ConfigError("constraints.slo", "give ttft_s, tpot_s or both")
    return constraints


def _deploy(value: Any) -> DeploySettings:
    deploy = read_dataclass(DeploySettings, value, "deploy")
    if deploy.engine != "vllm":
        raise ConfigError("deploy.engine", f"only 'vllm' deployments can be emitted, got {deploy.engine!r}")
    if deploy.policy not in policy_names():
        raise ConfigError(
            "deploy.policy", f"unknown policy {deploy.policy!r} (valid: {', '.join(policy_names())})"
        )
    return deploy


_TOP_KEYS = ("name", "model", "models", "machines", "engine", "profiles", "constraints", "workload", "deploy")


def _check_models(engine: EngineSettings, model_specs: Mapping[str, ModelSpec]) -> None:
    """The engine settings fit every model: ``max_model_len`` within its limit, each TP divides its heads."""
    for key, spec in model_specs.items():
        if engine.max_model_len is not None and engine.max_model_len > spec.max_model_len:
            raise ConfigError(
                "engine.max_model_len",
                f"{engine.max_model_len} exceeds model {key!r}'s limit of {spec.max_model_len} tokens",
            )
        for i, tp in enumerate(engine.tp_degrees or ()):
            if spec.n_heads % tp != 0:
                raise ConfigError(
                    f"engine.tp_degrees[{i}]",
                    f"TP {tp} does not divide model {key!r}'s {spec.n_heads} attention heads",
                )


def cluster_from_dict(
    data: Any,
    gpus: Mapping[str, GpuSpec],
    models: Mapping[str, ModelSpec],
    *,
    source: str = "<cluster>",
    base_dir: Path | None = None,
) -> ClusterSpec:
    """Validate decoded YAML into a :class:`ClusterSpec` (``ClusterError`` naming the file and the field)."""
    with file_errors(source, ClusterError):
        root = as_mapping(data, "<root>", none_ok=False)
        check_keys(root, _TOP_KEYS, "<root>")
        model_specs = parse_models(root, models)
        engine = read_dataclass(EngineSettings, root.get("engine"), "engine")
        if engine.batched_tokens() < engine.max_num_seqs:  # vLLM refuses to start so
            raise ConfigError(
                "engine.max_num_batched_tokens",
                f"{engine.batched_tokens()} must be >= max_num_seqs ({engine.max_num_seqs})",
            )
        machines = _machines(root.get("machines"), gpus, model_specs)
        _check_models(engine, model_specs)
        constraints = _constraints(root.get("constraints"))
        if constraints.slo is not None and len(model_specs) > 1:
            raise ConfigError(
                "constraints.slo", "an SLO at a target rate is supported for a single-model cluster only"
            )
        profiles, paths = _profiles(root.get("profiles"), base_dir or Path("."), gpus, model_specs)
        return ClusterSpec(
            source=source,
            models=model_specs,
            machines=machines,
            engine=engine,
            profiles=profiles,
            profile_paths=paths,
            constraints=constraints,
            workload=read_dataclass(WorkloadSettings, root.get("workload"), "workload"),
            deploy=_deploy(root.get("deploy")),
        )


def load_cluster(
    path: str | Path, gpus: Mapping[str, GpuSpec], models: Mapping[str, ModelSpec]
) -> ClusterSpec:
    """Read and validate a cluster YAML file."""
    file = Path(path)
    with file_errors(file.name, ClusterError):
        data = load_yaml(file)
    return cluster_from_dict(data, gpus, models, source=file.name, base_dir=file.resolve().parent)
