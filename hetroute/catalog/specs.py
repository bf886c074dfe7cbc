"""GPU and model catalogs (YAML data) and the KV-capacity arithmetic of method.md §2.

Owns: :class:`GpuSpec`, :class:`ModelSpec`, their loaders and validation, and the pure functions
:func:`kv_bytes_per_token` and :func:`kv_capacity_tokens`.

Invariants:
- Catalog data lives in ``config/catalog/{gpus,models}.yaml`` (reachable as ``hetroute/data``); nothing
  here hard-codes a GPU or model figure.
- Every validation error is a :class:`CatalogError` naming the file and the field
  (``gpus.yaml: gpus[3].mem_bw_gbps: must be > 0, got -1``); the specs' annotations are their bounds,
  read through :mod:`hetroute.fields`, and an unknown key is an error.
- KV per token is GQA-correct: ``2 · n_layers · n_kv_heads · head_dim · kv_dtype_bytes``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from hetroute.errors import ConfigError, FileConfigError
from hetroute.fields import (
    FRACTION,
    POSITIVE,
    UNIT,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    as_mapping,
    file_errors,
    load_yaml,
    number,
    read_dataclass,
)

Interconnect = Literal["nvlink", "pcie"]
GIB = 1024**3
_DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_GPU_CATALOG = _DATA_DIR / "gpus.yaml"
DEFAULT_MODEL_CATALOG = _DATA_DIR / "models.yaml"


class CatalogError(FileConfigError):
    """A catalog file is unreadable or a field is invalid; names the file and the field."""


class UnknownCatalogEntry(KeyError):
    """A GPU or model name that is not in the catalog; the message lists the valid names."""

    def __init__(self, kind: str, name: str, valid: list[str]) -> None:
        super().__init__(name)
        self.kind, self.name, self.valid = kind, name, valid
        self.text = f"unknown {kind} {name!r}; valid names: {', '.join(valid)}"

    def __reduce__(self) -> tuple[type[UnknownCatalogEntry], tuple[str, str, list[str]]]:
        """Picklable with its constructor's arguments (a worker process's error reaches its parent)."""
        return (type(self), (self.kind, self.name, self.valid))

    def __str__(self) -> str:
        return self.text


class WeightsDoNotFit(ValueError):
    """The model's weights (plus engine overhead) do not fit in the GPUs' memory."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU type: datasheet figures plus the roofline efficiency knobs (see roofline.py)."""

    name: str
    fp16_tflops: PositiveFloat
    memory_gib: PositiveFloat
    mem_bw_gbps: PositiveFloat
    interconnect: Interconnect
    interconnect_gbps: PositiveFloat
    decode_bw_eff: Annotated[float, FRACTION]
    prefill_mfu: Annotated[float, FRACTION]
    decode_mfu: Annotated[float, FRACTION]
    compute_overlap: Annotated[float, UNIT]
    step_overhead_s: NonNegativeFloat
    layer_overhead_s: NonNegativeFloat
    allreduce_latency_s: NonNegativeFloat

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model architecture (dense decoder-only transformer)."""

    name: str
    n_layers: PositiveInt
    hidden_size: PositiveInt
    n_heads: PositiveInt
    n_kv_heads: PositiveInt
    head_dim: PositiveInt
    params: PositiveFloat
    dtype_bytes: PositiveInt
    kv_dtype_bytes: PositiveInt
    max_model_len: PositiveInt
    hf_id: str | None = None

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


# ---------------------------------------------------------------- loading


def _yaml11_numbers(item: Mapping[str, Any], text_keys: tuple[str, ...]) -> dict[str, Any]:
    """``item`` with number-like strings read as floats: PyYAML (YAML 1.1) reads ``8.03e9`` as a string,
    and an operator meant the number."""
    out = dict(item)
    for key, value in item.items():
        if key not in text_keys and isinstance(value, str):
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def _read_list(path: Path, key: str) -> list[Any]:
    data = load_yaml(path)
    if not isinstance(data, Mapping) or not isinstance(data.get(key), list):
        raise ConfigError(key, f"expected a top-level mapping with a list under {key!r}")
    return list(data[key])


def _gpu_from(raw: Any, path: str) -> GpuSpec:
    item = _yaml11_numbers(as_mapping(raw, path, none_ok=False), ("name", "interconnect"))
    if "memory_gib" not in item:
        if "memory_gb" not in item:
            raise ConfigError(f"{path}.memory_gib", "missing (give memory_gib or memory_gb)")
        gib = number(item, "memory_gb", path, bounds=POSITIVE) * 1e9 / GIB
        item = {**{k: v for k, v in item.items() if k != "memory_gb"}, "memory_gib": gib}
    spec = read_dataclass(GpuSpec, item, path)
    return replace(spec, name=spec.name.strip())


def _model_from(raw: Any, path: str) -> ModelSpec:
    item = _yaml11_numbers(as_mapping(raw, path, none_ok=False), ("name", "hf_id"))
    spec = read_dataclass(ModelSpec, {"kv_dtype_bytes": item.get("dtype_bytes"), **item}, path)
    if spec.n_heads % spec.n_kv_heads != 0:
        raise ConfigError(f"{path}.n_kv_heads", f"{spec.n_kv_heads} does not divide n_heads={spec.n_heads}")
    return replace(spec, name=spec.name.strip())


_Spec = TypeVar("_Spec", GpuSpec, ModelSpec)


def _load(file: Path, key: str, parse: Callable[[Any, str], _Spec]) -> dict[str, _Spec]:
    """The specs listed under ``key`` in ``file``, keyed by name (unique regardless of case)."""
    by_lower: dict[str, _Spec] = {}
    with file_errors(file.name, CatalogError):
        for i, item in enumerate(_read_list(file, key)):
            spec = parse(item, f"{key}[{i}]")
            if spec.name.lower() in by_lower:
                raise ConfigError(f"{key}[{i}].name", f"duplicate name {spec.name!r}")
            by_lower[spec.name.lower()] = spec
    return {spec.name: spec for spec in by_lower.values()}


def load_gpu_catalog(path: Path | None = None) -> dict[str, GpuSpec]:
    """Load and validate a GPU catalog (default: the packaged ``gpus.yaml``), keyed by name."""
    return _load(path or DEFAULT_GPU_CATALOG, "gpus", _gpu_from)


def load_model_catalog(path: Path | None = None) -> dict[str, ModelSpec]:
    """Load and validate a model catalog (default: the packaged ``models.yaml``), keyed by name."""
    return _load(path or DEFAULT_MODEL_CATALOG, "models", _model_from)


def lookup_gpu(catalog: Mapping[str, GpuSpec], name: str) -> GpuSpec:
    """The GPU called ``name`` (case-insensitive); :class:`UnknownCatalogEntry` lists valid names."""
    for key, spec in catalog.items():
        if key.lower() == name.lower():
            return spec
    raise UnknownCatalogEntry("GPU", name, sorted(catalog))


_ALIAS_SUFFIXES = ("-instruct", "-chat", "-hf", "-base")


def model_alias_key(name: str) -> str:
    """The name a served model is matched by: lower case, without the organisation prefix
    (``meta-llama/``), a local path's directories, a leading ``meta-``, and trailing ``-Instruct``,
    ``-chat``, ``-hf`` or ``-base`` (repeatedly, so ``Llama-2-7b-chat-hf`` becomes ``llama-2-7b``).
    """
    key = name.strip().lower().rstrip("/").rsplit("/", 1)[-1]
    key = key.removeprefix("meta-")
    changed = True
    while changed:
        changed = False
        for suffix in _ALIAS_SUFFIXES:
            if key.endswith(suffix) and len(key) > len(suffix):
                key, changed = key[: -len(suffix)], True
    return key


def lookup_model(catalog: Mapping[str, ModelSpec], name: str) -> ModelSpec:
    """The model called ``name`` or whose ``hf_id`` is ``name`` (case-insensitive), else the one
    whose name or ``hf_id`` has the same alias key (:func:`model_alias_key`): the usual served-model
    names of a catalog model (``meta-llama/Meta-Llama-3-8B``, ``llama-3-8b-instruct``) all match it."""
    for key, spec in catalog.items():
        if name.lower() in (key.lower(), (spec.hf_id or "").lower()):
            return spec
    wanted = model_alias_key(name)
    for key, spec in catalog.items():
        if wanted in (model_alias_key(key), model_alias_key(spec.hf_id or key)):
            return spec
    raise UnknownCatalogEntry("model", name, sorted(catalog))


# ---------------------------------------------------------------- KV arithmetic (method.md §2)


def kv_bytes_per_token(model: ModelSpec) -> int:
    """Bytes of KV cache one token occupies: 2 (K and V) · layers · KV heads · head_dim · bytes."""
    return 2 * model.n_layers * model.n_kv_heads * model.head_dim * model.kv_dtype_bytes


def check_tp(model: ModelSpec, tp: int) -> None:
    """vLLM's rule: TP must be positive and divide the number of attention heads."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if model.n_heads % tp != 0:
        raise ValueError(f"tp={tp} does not divide {model.name}'s {model.n_heads} attention heads")


def kv_capacity_tokens(
    gpu: GpuSpec,
    model: ModelSpec,
    tp: int,
    gpu_memory_utilization: float = 0.9,
    overhead_gib_per_gpu: float = 2.0,
) -> int:
    """KV capacity of one instance in tokens (method.md §2, GQA-correct)::

        free_bytes = tp · (memory · φ_usage − δ_engine) − params · dtype_bytes
        cap        = floor(free_bytes / kv_bytes_per_token)

    When tp exceeds the KV-head count each GPU keeps a replica of a KV head, so the bytes per
    token grow by ``tp / n_kv_heads``. Raises :class:`WeightsDoNotFit` when nothing is left.
    """
    check_tp(model, tp)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if overhead_gib_per_gpu < 0:
        raise ValueError(f"overhead_gib_per_gpu must be >= 0, got {overhead_gib_per_gpu}")
    usable = tp * (gpu.memory_bytes * gpu_memory_utilization - overhead_gib_per_gpu * GIB)
    free_bytes = usable - model.weight_bytes
    per_token = kv_bytes_per_token(model) * max(1.0, tp / model.n_kv_heads)
    if free_bytes < per_token:
        raise WeightsDoNotFit(
            f"{model.name} does not fit on {tp}x {gpu.name}: "
            f"weights need {model.weight_bytes / GIB:.1f} GiB, "
            f"usable memory is {usable / GIB:.1f} GiB (gpu_memory_utilization={gpu_memory_utilization}, "
            f"{overhead_gib_per_gpu} GiB engine overhead per GPU)"
        )
    return int(free_bytes // per_token)
