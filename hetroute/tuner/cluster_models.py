"""The ``model``/``models`` section of the cluster file: catalog references or inline architectures.

Owns :func:`parse_models` and :data:`DTYPE_BYTES`. Invariant: every error is a :class:`ClusterError`
naming the field (``models.llama.n_kv_heads: 3 does not divide n_heads=32``); an inline model's KV heads
divide its heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hetroute.catalog.specs import ModelSpec, UnknownCatalogEntry, lookup_model
from hetroute.tuner.fields import FieldReader

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


def _model(r: FieldReader, value: Any, path: str, catalog: Mapping[str, ModelSpec], key: str) -> ModelSpec:
    """One model entry: a catalog name, ``{catalog: name, max_model_len?}`` or an inline architecture."""
    if isinstance(value, str):
        value = {"catalog": value}
    item = r.mapping(value, path)
    if "catalog" in item:
        name = r.string(item, "catalog", path)
        try:
            base = lookup_model(catalog, name)
        except UnknownCatalogEntry as exc:
            raise r.fail(f"{path}.catalog", str(exc)) from None
        if "max_model_len" in item:
            return _replace_len(base, r.integer(item, "max_model_len", path))
        return base
    dtype = item.get("dtype", "fp16")
    if dtype not in DTYPE_BYTES:
        raise r.fail(f"{path}.dtype", f"expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    n_heads = r.integer(item, "n_heads", path)
    n_kv_heads = r.integer(item, "n_kv_heads", path, default=n_heads)
    if n_heads % n_kv_heads != 0:
        raise r.fail(f"{path}.n_kv_heads", f"{n_kv_heads} does not divide n_heads={n_heads}")
    hidden = r.integer(item, "hidden_size", path)
    hf_id = item.get("hf_id")
    if hf_id is not None and not isinstance(hf_id, str):
        raise r.fail(f"{path}.hf_id", f"expected a string, got {hf_id!r}")
    return ModelSpec(
        name=str(item.get("name", key)),
        n_layers=r.integer(item, "n_layers", path),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=r.integer(item, "head_dim", path, default=hidden // n_heads),
        params=r.number(item, "params", path),
        dtype_bytes=DTYPE_BYTES[dtype],
        kv_dtype_bytes=DTYPE_BYTES[dtype],
        max_model_len=r.integer(item, "max_model_len", path, default=4096),
        hf_id=hf_id,
    )


def _replace_len(model: ModelSpec, max_model_len: int) -> ModelSpec:
    """``model`` with another ``max_model_len``."""
    return ModelSpec(
        name=model.name,
        n_layers=model.n_layers,
        hidden_size=model.hidden_size,
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        head_dim=model.head_dim,
        params=model.params,
        dtype_bytes=model.dtype_bytes,
        kv_dtype_bytes=model.kv_dtype_bytes,
        max_model_len=max_model_len,
        hf_id=model.hf_id,
    )


def parse_models(
    r: FieldReader, root: Mapping[str, Any], catalog: Mapping[str, ModelSpec]
) -> dict[str, ModelSpec]:
    """The cluster file's models by key, from ``root``'s ``model`` (keyed by its name) or ``models``."""
    if "models" in root and "model" in root:
        raise r.fail("model", "give either 'model' (one for all machines) or 'models', not both")
    if "model" in root:
        spec = _model(r, root["model"], "model", catalog, "model")
        return {spec.name: spec}
    if "models" not in root:
        raise r.fail("models", "missing (give 'model: <catalog name>' or a 'models' mapping)")
    raw = r.mapping(root["models"], "models")
    if not raw:
        raise r.fail("models", "expected at least one model")
    return {str(k): _model(r, v, f"models.{k}", catalog, str(k)) for k, v in raw.items()}
