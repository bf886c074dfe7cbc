"""The simulator's cluster file: which engine instances exist (GPU, TP, model, engine settings).

Format (YAML; documented in docs/simulate.md, example in config/simulate/)::

    name: my-cluster                  # optional, defaults to the file stem
    description: free text            # optional
    defaults: {model: Llama-3-8B, engine: vllm, engine_args: {max_num_seqs: 256}}   # optional
    instances:
      - name: v100-tp4                # optional; default "<gpu>-tp<tp>" (+ "-<k>" when count > 1)
        gpu: V100-SXM2-32GB           # a GPU catalog name (config/catalog)
        tp: 4                         # tensor-parallel degree, >= 1
        model: Llama-3-8B             # a model catalog name
        engine: vllm                  # vllm | tgi
        count: 1                      # identical replicas of this instance
        weight: 4                     # BackendSpec.weight (weighted_round_robin)
        profile: ../profiles/x.yaml   # optional latency profile, relative to this file
        engine_args: {max_num_seqs: 256, max_num_batched_tokens: 8192, ...}

Invariants: a parsed :class:`ClusterSpec` is frozen and fully validated; every error is a
``ConfigError`` whose path names the field (``instances[1].tp``); instance names are unique after
expansion of ``count``. GPU/model names are checked against the catalogs when they are passed in.

:func:`build_fleet` resolves a spec against the GPU/model catalogs into a :class:`Fleet`: one
``EngineConfig`` and one ``BackendSpec`` per instance (index i = backend i), the form the simulator
runs and the router sees. A model that does not fit (weights, or ``max_model_len`` beyond the KV
capacity) is reported as a ConfigError naming the instance.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import yaml

from hetroute.catalog.specs import (
    GpuSpec,
    ModelSpec,
    UnknownCatalogEntry,
    WeightsDoNotFit,
    load_gpu_catalog,
    load_model_catalog,
    lookup_gpu,
    lookup_model,
)
from hetroute.errors import ConfigError
from hetroute.latency import ProfileError, load_profile
from hetroute.sim.engine_model import EngineConfig, EngineFlavour, EngineModel
from hetroute.types import BackendSpec

ENGINE_ARG_TYPES: Final[dict[str, type]] = {
    "block_size": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "enable_chunked_prefill": bool,
    "enable_prefix_caching": bool,
    "gpu_memory_utilization": float,
    "overhead_gib_per_gpu": float,
    "max_model_len": int,
    "num_gpu_blocks_override": int,
    "max_batch_total_tokens": int,
}
"""Engine settings a cluster file may give (``EngineConfig`` fields besides gpu/model/tp/engine)."""

_INSTANCE_KEYS: Final = frozenset(
    {"name", "gpu", "tp", "model", "engine", "count", "weight", "profile", "engine_args"}
)
_ROOT_KEYS: Final = frozenset({"name", "description", "defaults", "instances"})


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One engine instance (one backend): ``engine_args`` are EngineConfig keyword arguments."""

    name: str
    gpu: str
    tp: int
    model: str
    engine: EngineFlavour = "vllm"
    weight: float = 1.0
    profile_path: str | None = None
    engine_args: Mapping[str, int | float | bool] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A cluster to simulate: instances in backend order (index i = backend i)."""

    name: str
    instances: tuple[InstanceSpec, ...]
    description: str = ""

    def models(self) -> tuple[str, ...]:
        """Distinct models served, in first-appearance order."""
        return tuple(dict.fromkeys(inst.model for inst in self.instances))

    def gpus_total(self) -> int:
        return sum(inst.tp for inst in self.instances)


def _engine_args(raw: Any, path: str) -> dict[str, int | float | bool]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected a mapping, got {type(raw).__name__}")
    out: dict[str, int | float | bool] = {}
    for key, value in raw.items():
        kind = ENGINE_ARG_TYPES.get(str(key))
        where = f"{path}.{key}"
        if kind is None:
            raise ConfigError(where, f"unknown engine setting; expected one of {', '.join(ENGINE_ARG_TYPES)}")
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(where, f"expected true or false, got {value!r}")
            out[str(key)] = value
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(where, f"expected a positive integer, got {value!r}")
            out[str(key)] = value
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value <= 0:
                raise ConfigError(where, f"expected a positive number, got {value!r}")
            out[str(key)] = float(value)
    util = out.get("gpu_memory_utilization")
    if util is not None and not 0 < float(util) <= 1:
        raise ConfigError(f"{path}.gpu_memory_utilization", f"must be in (0, 1], got {util}")
    return out


def _str(raw: Mapping[str, Any], key: str, path: str, known: Collection[str] | None, what: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}.{key}", f"expected a {what} name, got {value!r}")
    if known is not None and value not in known:
        raise ConfigError(f"{path}.{key}", f"unknown {what} {value!r}; known: {', '.join(sorted(known))}")
    return value


def _pos_int(raw: Mapping[str, Any], key: str, path: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}.{key}", f"expected a positive integer, got {value!r}")
    return value


def _instances(
    raw: Mapping[str, Any],
    path: str,
    defaults: Mapping[str, Any],
    base_dir: Path | None,
    known_gpus: Collection[str] | None,
    known_models: Collection[str] | None,
) -> list[InstanceSpec]:
    unknown = set(raw) - _INSTANCE_KEYS
    if unknown:
        raise ConfigError(
            f"{path}.{sorted(unknown)[0]}",
            f"unknown key; expected one of {', '.join(sorted(_INSTANCE_KEYS))}",
        )
    merged = {**defaults, **raw}
    gpu = _str(merged, "gpu", path, known_gpus, "GPU")
    model = _str(merged, "model", path, known_models, "model")
    tp = _pos_int(merged, "tp", path, 1)
    count = _pos_int(merged, "count", path, 1)
    engine = merged.get("engine", "vllm")
    if engine not in ("vllm", "tgi"):
        raise ConfigError(f"{path}.engine", f"expected one of vllm|tgi, got {engine!r}")
    engine_kind: EngineFlavour = "tgi" if engine == "tgi" else "vllm"
    weight = merged.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise ConfigError(f"{path}.weight", f"expected a positive number, got {weight!r}")
    profile = merged.get("profile")
    if profile is not None and not isinstance(profile, str):
        raise ConfigError(f"{path}.profile", f"expected a path, got {profile!r}")
    if profile is not None and base_dir is not None and not Path(profile).is_absolute():
        profile = str(base_dir / profile)
    args = {
        **_engine_args(defaults.get("engine_args"), "defaults.engine_args"),
        **_engine_args(raw.get("engine_args"), f"{path}.engine_args"),
    }
    name = raw.get("name", f"{gpu}-tp{tp}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.name", f"expected a non-empty string, got {name!r}")
    names = [name] if count == 1 else [f"{name}-{k}" for k in range(count)]
    return [InstanceSpec(n, gpu, tp, model, engine_kind, float(weight), profile, dict(args)) for n in names]


def parse_cluster(
    data: Any,
    *,
    default_name: str = "cluster",
    base_dir: Path | None = None,
    known_gpus: Collection[str] | None = None,
    known_models: Collection[str] | None = None,
) -> ClusterSpec:
    """Validate decoded YAML into a :class:`ClusterSpec` (ConfigError naming the field)."""
    if not isinstance(data, Mapping):
        raise ConfigError("<root>", f"expected a mapping with 'instances', got {type(data).__name__}")
    unknown = set(data) - _ROOT_KEYS
    if unknown:
        raise ConfigError(sorted(unknown)[0], f"unknown key; expected one of {', '.join(sorted(_ROOT_KEYS))}")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise ConfigError("defaults", f"expected a mapping, got {type(defaults).__name__}")
    bad = set(defaults) - (_INSTANCE_KEYS - {"name", "count"})
    if bad:
        raise ConfigError(f"defaults.{sorted(bad)[0]}", "not allowed in defaults")
    raw_instances = data.get("instances")
    if not isinstance(raw_instances, list) or not raw_instances:
        raise ConfigError("instances", "expected a non-empty list of instances")
    instances: list[InstanceSpec] = []
    for k, raw in enumerate(raw_instances):
        if not isinstance(raw, Mapping):
            raise ConfigError(f"instances[{k}]", f"expected a mapping, got {type(raw).__name__}")
        instances.extend(_instances(raw, f"instances[{k}]", defaults, base_dir, known_gpus, known_models))
    seen: set[str] = set()
    for inst in instances:
        if inst.name in seen:
            raise ConfigError(
                "instances", f"duplicate instance name {inst.name!r} (set 'name' to tell them apart)"
            )
        seen.add(inst.name)
    name = data.get("name", default_name)
    description = data.get("description", "")
    if not isinstance(name, str) or not name:
        raise ConfigError("name", f"expected a non-empty string, got {name!r}")
    if not isinstance(description, str):
        raise ConfigError("description", f"expected a string, got {description!r}")
    return ClusterSpec(name=name, instances=tuple(instances), description=description)


def load_cluster_file(
    path: str | Path,
    *,
    known_gpus: Collection[str] | None = None,
    known_models: Collection[str] | None = None,
) -> ClusterSpec:
    """Read and validate a cluster file; errors are prefixed with the file name."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(str(p), f"cannot read: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(str(p), f"not valid YAML: {exc}") from exc
    try:
        return parse_cluster(
            data, default_name=p.stem, base_dir=p.parent, known_gpus=known_gpus, known_models=known_models
        )
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc.path}", exc.message) from exc


@dataclass(frozen=True, slots=True)
class Fleet:
    """A cluster resolved against the catalogs: per instance an engine config and a backend spec."""

    cluster: ClusterSpec
    configs: tuple[EngineConfig, ...]
    backends: tuple[BackendSpec, ...]
    flavours: tuple[EngineFlavour, ...]
    models: tuple[str, ...]

    @property
    def default_model(self) -> str:
        """The model a request that names none goes to (the first the cluster serves)."""
        return self.models[0]

    def max_model_len(self, model: str | None = None) -> int:
        """The smallest engine ``max_model_len`` among instances serving ``model`` (default: the first)."""
        name = model or self.default_model
        return min(
            c.max_model_len or c.model.max_model_len
            for c, inst in zip(self.configs, self.cluster.instances, strict=True)
            if inst.model == name
        )


def build_fleet(
    cluster: ClusterSpec,
    gpus: Mapping[str, GpuSpec] | None = None,
    models: Mapping[str, ModelSpec] | None = None,
) -> Fleet:
    """Resolve ``cluster`` (catalogs default to the packaged ones); ConfigError names the instance."""
    gpu_cat = gpus if gpus is not None else load_gpu_catalog()
    model_cat = models if models is not None else load_model_catalog()
    configs: list[EngineConfig] = []
    backends: list[BackendSpec] = []
    for i, inst in enumerate(cluster.instances):
        path = f"instances[{i}]"
        try:
            gpu = lookup_gpu(gpu_cat, inst.gpu)
        except UnknownCatalogEntry as exc:
            raise ConfigError(f"{path}.gpu", str(exc)) from None
        try:
            model = lookup_model(model_cat, inst.model)
        except UnknownCatalogEntry as exc:
            raise ConfigError(f"{path}.model", str(exc)) from None
        try:
            config = EngineConfig(gpu=gpu, model=model, tp=inst.tp, engine=inst.engine, **inst.engine_args)  # type: ignore[arg-type]
            capacity = EngineModel(config).kv_capacity_tokens
        except ConfigError as exc:
            raise ConfigError(f"{path}.{exc.path}", exc.message) from None
        except (WeightsDoNotFit, ValueError) as exc:
            raise ConfigError(path, str(exc)) from None
        profile = None
        if inst.profile_path is not None:
            try:
                profile = load_profile(inst.profile_path)
            except ProfileError as exc:
                raise ConfigError(f"{path}.profile", str(exc)) from None
        configs.append(config)
        backends.append(
            BackendSpec(
                name=inst.name,
                url=f"sim://{inst.name}",
                engine=inst.engine,
                models=(inst.model,),
                weight=inst.weight,
                gpu=gpu.name,
                tp=inst.tp,
                profile=profile,
                profile_path=inst.profile_path,
                kv_capacity_tokens=capacity,
                max_num_seqs=config.max_num_seqs,
            )
        )
    return Fleet(
        cluster=cluster,
        configs=tuple(configs),
        backends=tuple(backends),
        flavours=tuple(inst.engine for inst in cluster.instances),
        models=cluster.models(),
    )


def blind_fleet(fleet: Fleet) -> Fleet:
    """``fleet`` as a router knows it in front of engines serving a house model name with no profile:
    no GPU/TP labels, no profile, no ``max_num_seqs`` (its policies fall back to the neutral default;
    KV capacity stays, since engines report it in their metrics). The engines themselves are unchanged."""
    blind = tuple(
        replace(b, gpu=None, tp=None, labels={}, profile=None, profile_path=None, max_num_seqs=None)
        for b in fleet.backends
    )
    return replace(fleet, backends=blind)
