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

Invariants: a parsed :class:`SimClusterSpec` is frozen and fully validated (through :mod:`hetroute.fields`);
every error is a ``ConfigError`` whose path names the field (``instances[1].tp``); instance names are
unique after expansion of ``count``. GPU/model names are checked against the catalogs when they are passed in.

:func:`build_fleet` resolves a spec against the GPU/model catalogs into a :class:`Fleet`: one
``EngineConfig`` and one ``BackendSpec`` per instance (index i = backend i), the form the simulator
runs and the router sees. A model that does not fit (weights, or ``max_model_len`` beyond the KV
capacity) is reported as a ConfigError naming the instance.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

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
from hetroute.fields import (
    AT_LEAST_ONE,
    FRACTION,
    POSITIVE,
    as_bool,
    as_int,
    as_list,
    as_mapping,
    as_number,
    check_keys,
    choice,
    file_errors,
    integer,
    load_yaml,
    number,
    opt_string,
    string,
)
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

_INSTANCE_KEYS: Final = ("name", "gpu", "tp", "model", "engine", "count", "weight", "profile", "engine_args")
_ROOT_KEYS: Final = ("name", "description", "defaults", "instances")


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
class SimClusterSpec:
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
    out: dict[str, int | float | bool] = {}
    data = as_mapping(raw, path)
    check_keys(data, tuple(ENGINE_ARG_TYPES), path, what="engine setting")
    for key, value in data.items():
        kind, where = ENGINE_ARG_TYPES[key], f"{path}.{key}"
        if kind is bool:
            out[key] = as_bool(value, where)
        elif kind is int:
            out[key] = as_int(value, where, AT_LEAST_ONE)
        else:
            out[key] = as_number(value, where, FRACTION if key == "gpu_memory_utilization" else POSITIVE)
    return out


def _name(raw: Mapping[str, Any], key: str, path: str, known: Collection[str] | None, what: str) -> str:
    value = string(raw, key, path)
    if known is not None and value not in known:
        raise ConfigError(f"{path}.{key}", f"unknown {what} {value!r}; known: {', '.join(sorted(known))}")
    return value


def _instances(
    raw: Mapping[str, Any],
    path: str,
    defaults: Mapping[str, Any],
    base_dir: Path | None,
    known_gpus: Collection[str] | None,
    known_models: Collection[str] | None,
) -> list[InstanceSpec]:
    check_keys(raw, _INSTANCE_KEYS, path)
    merged = {**defaults, **raw}
    gpu = _name(merged, "gpu", path, known_gpus, "GPU")
    model = _name(merged, "model", path, known_models, "model")
    tp = integer(merged, "tp", path, 1, AT_LEAST_ONE)
    count = integer(merged, "count", path, 1, AT_LEAST_ONE)
    engine: EngineFlavour = (
        "tgi" if choice(merged, "engine", path, ("vllm", "tgi"), "vllm") == "tgi" else "vllm"
    )
    profile = opt_string(merged, "profile", path)
    if profile is not None and base_dir is not None and not Path(profile).is_absolute():
        profile = str(base_dir / profile)
    args = {
        **_engine_args(defaults.get("engine_args"), "defaults.engine_args"),
        **_engine_args(raw.get("engine_args"), f"{path}.engine_args"),
    }
    name = string(raw, "name", path, f"{gpu}-tp{tp}")
    weight = number(merged, "weight", path, 1.0, POSITIVE)
    names = [name] if count == 1 else [f"{name}-{k}" for k in range(count)]
    return [InstanceSpec(n, gpu, tp, model, engine, weight, profile, dict(args)) for n in names]


def parse_cluster(
    data: Any,
    *,
    default_name: str = "cluster",
    base_dir: Path | None = None,
    known_gpus: Collection[str] | None = None,
    known_models: Collection[str] | None = None,
) -> SimClusterSpec:
    """Validate decoded YAML into a :class:`SimClusterSpec` (ConfigError naming the field)."""
    root = as_mapping(data, "<root>", none_ok=False)
    check_keys(root, _ROOT_KEYS, "")
    defaults = as_mapping(root.get("defaults"), "defaults")
    for key in defaults:
        if key not in _INSTANCE_KEYS or key in ("name", "count"):
            raise ConfigError(f"defaults.{key}", "not allowed in defaults")
    instances: list[InstanceSpec] = []
    for k, raw in enumerate(as_list(root.get("instances"), "instances", "instances")):
        item = as_mapping(raw, f"instances[{k}]", none_ok=False)
        instances.extend(_instances(item, f"instances[{k}]", defaults, base_dir, known_gpus, known_models))
    seen: set[str] = set()
    for inst in instances:
        if inst.name in seen:
            raise ConfigError(
                "instances", f"duplicate instance name {inst.name!r} (set 'name' to tell them apart)"
            )
        seen.add(inst.name)
    description = root.get("description", "")
    if not isinstance(description, str):
        raise ConfigError("description", f"expected a string, got {description!r}")
    return SimClusterSpec(string(root, "name", "", default_name), tuple(instances), description)


def load_cluster_file(
    path: str | Path,
    *,
    known_gpus: Collection[str] | None = None,
    known_models: Collection[str] | None = None,
) -> SimClusterSpec:
    """Read and validate a cluster file; errors are prefixed with the file name."""
    p = Path(path)
    with file_errors(str(p)):
        return parse_cluster(
            load_yaml(p),
            default_name=p.stem,
            base_dir=p.parent,
            known_gpus=known_gpus,
            known_models=known_models,
        )


@dataclass(frozen=True, slots=True)
class Fleet:
    """A cluster resolved against the catalogs: per instance an engine config and a backend spec."""

    cluster: SimClusterSpec
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
    cluster: SimClusterSpec,
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
            engine = EngineModel(config)
            capacity, window = engine.kv_capacity_tokens, engine.max_model_len
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
                max_model_len=window,  # as discovery reads it from the engine's /v1/models or /info
            )
        )
    return Fleet(
        cluster=cluster,
        configs=tuple(configs),
        backends=tuple(backends),
        flavours=tuple(inst.engine for inst in cluster.instances),
        models=cluster.models(),
    )


def blind_fleet(fleet: Fleet, keep_kv_capacity: bool = True) -> Fleet:
    """``fleet`` as a router knows it in front of engines serving a house model name with no profile:
    no GPU/TP labels, no profile, no ``max_num_seqs`` (its policies fall back to the neutral default).
    A configured KV capacity stays unless ``keep_kv_capacity`` is false (engines report it in their
    metrics anyway; without it the router knows it only from the first scrape on). The engines
    themselves are unchanged."""
    blind = tuple(
        replace(
            b,
            gpu=None,
            tp=None,
            labels={},
            profile=None,
            profile_path=None,
            max_num_seqs=None,
            kv_capacity_tokens=b.kv_capacity_tokens if keep_kv_capacity else None,
        )
        for b in fleet.backends
    )
    return replace(fleet, backends=blind)
