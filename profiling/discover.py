"""Discovering what a live engine serves and how much KV cache it has (method.md §2).

Owns: reading the served model, the maximum sequence length, the engine version, the engine limits and
the KV capacity in tokens from the engine itself, and the catalog fallback.

KV capacity, in order of preference:
1. vLLM ``/metrics``: ``vllm:cache_config_info{num_gpu_blocks, block_size}`` → blocks × block size
   (source ``vllm:cache_config_info``);
2. TGI ``/info``: ``max_batch_total_tokens`` (source ``tgi:/info``);
3. an operator's ``--kv-capacity-tokens`` (source ``user``);
4. the GPU/model catalog with the grouped-query-attention formula of §2 (source ``catalog``).
Every lookup is a bounded GET; nothing here sends generation requests.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hetroute.latency import EMULATOR_MARK
from hetroute.types import EngineKind

_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class DiscoveryError(RuntimeError):
    """The backend did not tell us something we cannot profile without."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What discovery found; ``notes`` says where each value came from, for the log and the artifact."""

    engine: EngineKind
    model: str
    kv_capacity_tokens: int
    kv_capacity_source: str
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    engine_version: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    emulated: bool = False
    """The server says it is ``hetroute emulate`` (:data:`hetroute.latency.EMULATOR_MARK`)."""


@dataclass(frozen=True, slots=True)
class Overrides:
    """Operator-supplied values (``None`` = discover) and the labels the catalog fallback needs."""

    model: str | None = None
    kv_capacity_tokens: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu: str | None = None
    tp: int | None = None
    catalog_model: str | None = None


def parse_cache_config_info(metrics_text: str) -> tuple[int, int] | None:
    """(num_gpu_blocks, block_size) from a vLLM ``/metrics`` page, or None when absent."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL_RE.findall(line[line.index("{") : line.rindex("}")]))
            try:
                return int(labels["num_gpu_blocks"]), int(labels["block_size"])
            except (KeyError, ValueError):
                return None
    return None


def catalog_kv_capacity(gpu: str, model: str, tp: int) -> int:
    """KV capacity from ``hetroute.catalog.specs`` (GQA-correct formula of method.md §2)."""
    from hetroute.catalog import specs as catalog

    try:
        gpu_spec = catalog.lookup_gpu(catalog.load_gpu_catalog(), gpu)
        model_spec = catalog.lookup_model(catalog.load_model_catalog(), model)
        return int(catalog.kv_capacity_tokens(gpu_spec, model_spec, tp))
    except (catalog.UnknownCatalogEntry, catalog.WeightsDoNotFit, ValueError) as exc:
        raise DiscoveryError(f"catalog fallback for the KV capacity failed: {exc}") from exc


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any | None:
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _get_text(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url) as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


def _pos_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _pick_model(models: list[Mapping[str, Any]], wanted: str | None, base: str) -> Mapping[str, Any]:
    ids = [str(m.get("id")) for m in models]
    if wanted is None:
        if len(models) != 1:
            raise DiscoveryError(f"{base}/v1/models lists {ids}; pass --model to choose one")
        return models[0]
    for m in models:
        if m.get("id") == wanted:
            return m
    raise DiscoveryError(f"{base}/v1/models does not list --model {wanted!r} (it lists {ids})")


async def discover(
    session: aiohttp.ClientSession, base_url: str, engine: EngineKind, ov: Overrides
) -> EngineInfo:
    """Ask the backend at ``base_url`` what it serves; fill the gaps from ``ov`` and the catalog."""
    base = base_url.rstrip("/")
    notes: list[str] = []
    model = ov.model
    max_len = ov.max_model_len
    max_seqs = ov.max_num_seqs
    max_batched = ov.max_num_batched_tokens
    version: str | None = None
    emulated = False
    kv: int | None = None
    kv_source = ""

    if engine == "tgi":
        info = await _get_json(session, f"{base}/info")
        if isinstance(info, Mapping):
            model = model or str(info.get("model_id") or "") or None
            version = str(info["version"]) if info.get("version") else None
            emulated = info.get(EMULATOR_MARK) is True
            max_len = max_len or _pos_int(info.get("max_total_tokens"))
            max_seqs = max_seqs or _pos_int(info.get("max_batch_size"))
            max_batched = max_batched or _pos_int(info.get("max_batch_prefill_tokens"))
            kv = _pos_int(info.get("max_batch_total_tokens"))
            if kv is not None:
                kv_source = "tgi:/info"
                notes.append(f"KV capacity {kv} tokens from TGI /info max_batch_total_tokens")
        else:
            notes.append("TGI /info unavailable")
    else:
        listed = await _get_json(session, f"{base}/v1/models")
        data = listed.get("data") if isinstance(listed, Mapping) else None
        if not isinstance(data, list) or not data:
            raise DiscoveryError(f"{base}/v1/models did not list any model")
        entry = _pick_model([m for m in data if isinstance(m, Mapping)], model, base)
        model = str(entry.get("id"))
        max_len = max_len or _pos_int(entry.get("max_model_len"))
        ver = await _get_json(session, f"{base}/version")
        if isinstance(ver, Mapping) and ver.get("version"):
            version = str(ver["version"])
        emulated = isinstance(ver, Mapping) and ver.get(EMULATOR_MARK) is True
        metrics = await _get_text(session, f"{base}/metrics")
        found = parse_cache_config_info(metrics) if metrics else None
        if found is not None:
            kv = found[0] * found[1]
            kv_source = "vllm:cache_config_info"
            notes.append(f"KV capacity {kv} tokens = num_gpu_blocks {found[0]} x block_size {found[1]}")
        else:
            notes.append("no vllm:cache_config_info on /metrics")

    if model is None:
        raise DiscoveryError(f"{base}: cannot discover the served model; pass --model")
    if ov.kv_capacity_tokens is not None:
        if kv is not None and kv != ov.kv_capacity_tokens:
            notes.append(f"--kv-capacity-tokens {ov.kv_capacity_tokens} overrides the engine's {kv}")
        kv, kv_source = ov.kv_capacity_tokens, "user"
    if kv is None:
        if ov.gpu is None or ov.tp is None:
            raise DiscoveryError(
                f"{base} does not report its KV capacity; "
                "pass --gpu and --tp (catalog) or --kv-capacity-tokens"
            )
        cat_model = ov.catalog_model or model
        kv, kv_source = catalog_kv_capacity(ov.gpu, cat_model, ov.tp), "catalog"
        notes.append(f"KV capacity {kv} tokens computed from the catalog ({ov.gpu}, TP {ov.tp}, {cat_model})")
    return EngineInfo(
        engine=engine,
        model=model,
        kv_capacity_tokens=kv,
        kv_capacity_source=kv_source,
        max_model_len=max_len,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_batched,
        engine_version=version,
        emulated=emulated,
        notes=tuple(notes),
    )
