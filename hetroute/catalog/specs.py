"""GPU and model catalogs (YAML data) and the KV-capacity arithmetic of method.md §2.

Owns: :class:`GpuSpec`, :class:`ModelSpec`, their loaders and validation, and the pure functions
:func:`kv_bytes_per_token` and :func:`kv_capacity_tokens`.

Invariants:
- Catalog data lives in ``config/catalog/{gpus,models}.yaml`` (reachable as ``hetroute/data``); nothing
  here hard-codes a GPU or model figure.
- Every validation error is a :class:`CatalogError` naming the file and the field
  (``gpus.yaml: gpus[3].mem_bw_gbps: expected a positive number, got -1``).
- KV per token is GQA-correct: ``2 · n_layers · n_kv_heads · head_dim · kv_dtype_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from hetroute.errors import ConfigError

Interconnect = Literal["nvlink", "pcie"]
GIB = 1024**3
_DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_GPU_CATALOG = _DATA_DIR / "gpus.yaml"
DEFAULT_MODEL_CATALOG = _DATA_DIR / "models.yaml"


class CatalogError(ConfigError):
    """A catalog file is unreadable or a field is invalid; names the file and the field."""

    def __init__(self, source: str, field_path: str, message: str) -> None:
        super().__init__(f"{source}: {field_path}", message)
        self.source = source
        self.field_path = field_path


class UnknownCatalogEntry(KeyError):
    """A GPU or model name that is not in the catalog; the message lists the valid names."""

    def __init__(self, kind: str, name: str, valid: list[str]) -> None:
        super().__init__(name)
        self.text = f"unknown {kind} {name!r}; valid names: {', '.join(valid)}"

    def __str__(self) -> str:
        return self.text


class WeightsDoNotFit(ValueError):
    """The model's weights (plus engine overhead) do not fit in the GPUs' memory."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU type: datasheet figures plus the roofline efficiency knobs (see roofline.py)."""

    name: str
    fp16_tflops: float
    memory_gib: float
    mem_bw_gbps: float
    interconnect: Interconnect
    interconnect_gbps: float
    decode_bw_eff: float
    prefill_mfu: float
    decode_mfu: float
    compute_overlap: float
    step_overhead_s: float
    layer_overhead_s: float
    allreduce_latency_s: float

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model architecture (dense decoder-only transformer)."""

    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    params: float
    dtype_bytes: int
    kv_dtype_bytes: int
    max_model_len: int
    hf_id: str | None = None

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


# ---------------------------------------------------------------- validation helpers


def _as_number(value: Any) -> Any:
    # PyYAML (YAML 1.1) reads "8.03e9" as a string; accept it as the number an operator meant.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _positive(source: str, item: Mapping[str, Any], key: str, path: str) -> float:
    if key not in item:
        raise CatalogError(source, f"{path}.{key}", "missing")
    value = _as_number(item[key])
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise CatalogError(source, f"{path}.{key}", f"expected a positive number, got {value!r}")
    return float(value)


def _nonneg(source: str, item: Mapping[str, Any], key: str, path: str, upper: float | None = None) -> float:
    if key not in item:
        raise CatalogError(source, f"{path}.{key}", "missing")
    value = _as_number(item[key])
    bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    if bad or value < 0 or (upper is not None and value > upper):
        bound = f"in [0, {upper}]" if upper is not None else ">= 0"
        raise CatalogError(source, f"{path}.{key}", f"expected a number {bound}, got {value!r}")
    return float(value)


def _fraction(source: str, item: Mapping[str, Any], key: str, path: str) -> float:
    value = _positive(source, item, key, path)
    if value > 1.0:
        raise CatalogError(source, f"{path}.{key}", f"expected a fraction in (0, 1], got {value!r}")
    return value


def _int(source: str, item: Mapping[str, Any], key: str, path: str, default: int | None = None) -> int:
    if key not in item:
        if default is not None:
            return default
        raise CatalogError(source, f"{path}.{key}", "missing")
    value = item[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CatalogError(source, f"{path}.{key}", f"expected a positive integer, got {value!r}")
    return value


def _name(source: str, item: Mapping[str, Any], path: str) -> str:
    value = item.get("name")
    if not isinstance(value, str) or not value.strip():
        raise CatalogError(source, f"{path}.name", f"expected a non-empty string, got {value!r}")
    return value.strip()


def _read_list(path: Path, key: str) -> tuple[str, list[Any]]:
    source = path.name
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(source, "<file>", f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogError(source, "<file>", f"not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping) or not isinstance(data.get(key), list):
        raise CatalogError(source, key, f"expected a top-level mapping with a list under {key!r}")
    return source, list(data[key])


def _gpu_from(source: str, item: Any, path: str) -> GpuSpec:
    if not isinstance(item, Mapping):
        raise CatalogError(source, path, f"expected a mapping, got {type(item).__name__}")
    name = _name(source, item, path)
    if "memory_gib" in item:
        memory_gib = _positive(source, item, "memory_gib", path)
    elif "memory_gb" in item:
        memory_gib = _positive(source, item, "memory_gb", path) * 1e9 / GIB
    else:
        raise CatalogError(source, f"{path}.memory_gib", "missing (give memory_gib or memory_gb)")
    interconnect = item.get("interconnect")
    if interconnect not in ("nvlink", "pcie"):
        raise CatalogError(
            source, f"{path}.interconnect", f"expected one of nvlink|pcie, got {interconnect!r}"
        )
    return GpuSpec(
        name=name,
        fp16_tflops=_positive(source, item, "fp16_tflops", path),
        memory_gib=memory_gib,
        mem_bw_gbps=_positive(source, item, "mem_bw_gbps", path),
        interconnect=interconnect,
        interconnect_gbps=_positive(source, item, "interconnect_gbps", path),
        decode_bw_eff=_fraction(source, item, "decode_bw_eff", path),
        prefill_mfu=_fraction(source, item, "prefill_mfu", path),
        decode_mfu=_fraction(source, item, "decode_mfu", path),
        compute_overlap=_nonneg(source, item, "compute_overlap", path, upper=1.0),
        step_overhead_s=_nonneg(source, item, "step_overhead_s", path),
        layer_overhead_s=_nonneg(source, item, "layer_overhead_s", path),
        allreduce_latency_s=_nonneg(source, item, "allreduce_latency_s", path),
    )


def _model_from(source: str, item: Any, path: str) -> ModelSpec:
    if not isinstance(item, Mapping):
        raise CatalogError(source, path, f"expected a mapping, got {type(item).__name__}")
    name = _name(source, item, path)
    n_heads = _int(source, item, "n_heads", path)
    n_kv_heads = _int(source, item, "n_kv_heads", path)
    if n_heads % n_kv_heads != 0:
        raise CatalogError(source, f"{path}.n_kv_heads", f"{n_kv_heads} does not divide n_heads={n_heads}")
    dtype_bytes = _int(source, item, "dtype_bytes", path)
    hf_id = item.get("hf_id")
    if hf_id is not None and not isinstance(hf_id, str):
        raise CatalogError(source, f"{path}.hf_id", f"expected a string, got {hf_id!r}")
    return ModelSpec(
        name=name,
        n_layers=_int(source, item, "n_layers", path),
        hidden_size=_int(source, item, "hidden_size", path),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=_int(source, item, "head_dim", path),
        params=_positive(source, item, "params", path),
        dtype_bytes=dtype_bytes,
        kv_dtype_bytes=_int(source, item, "kv_dtype_bytes", path, default=dtype_bytes),
        max_model_len=_int(source, item, "max_model_len", path),
        hf_id=hf_id,
    )


def _check_unique(source: str, key: str, names: list[str]) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name.lower() in seen:
            raise CatalogError(source, f"{key}[{i}].name", f"duplicate name {name!r}")
        seen.add(name.lower())


def load_gpu_catalog(path: Path | None = None) -> dict[str, GpuSpec]:
    """Load and validate a GPU catalog (default: the packaged ``gpus.yaml``), keyed by name."""
    source, items = _read_list(path or DEFAULT_GPU_CATALOG, "gpus")
    gpus = [_gpu_from(source, item, f"gpus[{i}]") for i, item in enumerate(items)]
    _check_unique(source, "gpus", [g.name for g in gpus])
    return {g.name: g for g in gpus}


def load_model_catalog(path: Path | None = None) -> dict[str, ModelSpec]:
    """Load and validate a model catalog (default: the packaged ``models.yaml``), keyed by name."""
    source, items = _read_list(path or DEFAULT_MODEL_CATALOG, "models")
    models = [_model_from(source, item, f"models[{i}]") for i, item in enumerate(items)]
    _check_unique(source, "models", [m.name for m in models])
    return {m.name: m for m in models}


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
