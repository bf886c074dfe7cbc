"""The ``model``/``models`` section of the cluster file: catalog references or inline architectures.

Owns :func:`parse_models` and :data:`DTYPE_BYTES`. Invariant: every error is a ``ConfigError`` naming the
field (``models.llama.n_kv_heads: 3 does not divide n_heads=32``), read through :mod:`hetroute.fields`
(``hetroute.tuner.cluster`` adds the file's name); an inline model's KV heads divide its heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hetroute.catalog.specs import ModelSpec, UnknownCatalogEntry, lookup_model
from hetroute.errors import ConfigError
from hetroute.fields import AT_LEAST_ONE, POSITIVE, as_mapping, choice, integer, number, opt_string, string

DTYPE_BYTES = {
    "fp16": 2,
    "bf16": 2,
    "float16": 2,
    "bfloat16": 2,
    "fp32": 4,
    "float32": 4,
    "fp8": 1,
    "int8": 1,
}


def _model(value: Any, path: str, catalog: Mapping[str, ModelSpec], key: str) -> ModelSpec:
    """One model entry: a catalog name, ``{catalog: name, max_model_len?}`` or an inline architecture."""
    item = as_mapping({"catalog": value} if isinstance(value, str) else value, path, none_ok=False)
    if "catalog" in item:
        try:
            base = lookup_model(catalog, string(item, "catalog", path).strip())
        except UnknownCatalogEntry as exc:
            raise ConfigError(f"{path}.catalog", str(exc)) from None
        if "max_model_len" in item:
            return replace(base, max_model_len=integer(item, "max_model_len", path, bounds=AT_LEAST_ONE))
        return base
    dtype = choice(item, "dtype", path, tuple(DTYPE_BYTES), "fp16")
    n_heads = integer(item, "n_heads", path, bounds=AT_LEAST_ONE)
    n_kv_heads = integer(item, "n_kv_heads", path, n_heads, AT_LEAST_ONE)
    if n_heads % n_kv_heads != 0:
        raise ConfigError(f"{path}.n_kv_heads", f"{n_kv_heads} does not divide n_heads={n_heads}")
    hidden = integer(item, "hidden_size", path, bounds=AT_LEAST_ONE)
    return ModelSpec(
        name=str(item.get("name", key)),
        n_layers=integer(item, "n_layers", path, bounds=AT_LEAST_ONE),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=integer(item, "head_dim", path, hidden // n_heads, AT_LEAST_ONE),
        params=number(item, "params", path, bounds=POSITIVE),
        dtype_bytes=DTYPE_BYTES[dtype],
        kv_dtype_bytes=DTYPE_BYTES[dtype],
        max_model_len=integer(item, "max_model_len", path, 4096, AT_LEAST_ONE),
        hf_id=opt_string(item, "hf_id", path),
    )


def parse_models(root: Mapping[str, Any], catalog: Mapping[str, ModelSpec]) -> dict[str, ModelSpec]:
    """The cluster file's models by key, from ``root``'s ``model`` (keyed by its name) or ``models``."""
    if "models" in root and "model" in root:
        raise ConfigError("model", "give either 'model' (one for all machines) or 'models', not both")
    if "model" in root:
        spec = _model(root["model"], "model", catalog, "model")
        return {spec.name: spec}
    if "models" not in root:
        raise ConfigError("models", "missing (give 'model: <catalog name>' or a 'models' mapping)")
    raw = as_mapping(root["models"], "models", none_ok=False)
    if not raw:
        raise ConfigError("models", "expected at least one model")
    return {str(k): _model(v, f"models.{k}", catalog, str(k)) for k, v in raw.items()}
