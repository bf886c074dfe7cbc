"""Start-up discovery of a backend's engine kind and served models.

TGI answers ``GET /info`` (``model_id``, ``max_total_tokens``, ...); vLLM and other
OpenAI-compatible servers answer ``GET /v1/models`` (vLLM marks its models
``owned_by: "vllm"`` and gives each its ``max_model_len``). Only fields the config leaves empty
are filled (``engine``, ``models``, ``max_model_len``: the context window, TGI's
``max_total_tokens``); a backend that cannot be discovered is a start-up error naming its field.
A backend whose config already names its engine and models is not asked.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import aiohttp

from hetroute.config import BackendConfig, Config
from hetroute.errors import ConfigError
from hetroute.types import EngineKind


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Any:
    async with asyncio.timeout(timeout_s), session.get(url) as resp:
        if resp.status != 200:
            return None
        try:
            return await resp.json(content_type=None)
        except ValueError:
            return None


def _tokens(value: Any) -> int | None:
    """A context window as an engine reports it: a positive integer, else None (not known)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


async def _tgi_info(
    session: aiohttp.ClientSession, base: str, timeout_s: float
) -> tuple[str, int | None] | None:
    """(``model_id``, ``max_total_tokens``) of TGI's ``/info``, or None when it is not TGI."""
    info = await _get_json(session, base + "/info", timeout_s)
    if isinstance(info, dict) and isinstance(info.get("model_id"), str) and info["model_id"]:
        return str(info["model_id"]), _tokens(info.get("max_total_tokens"))
    return None


async def _openai_models(
    session: aiohttp.ClientSession, base: str, timeout_s: float
) -> tuple[tuple[str, ...], EngineKind, str | None, int | None] | None:
    """(model ids, engine kind, vLLM's ``root`` of the first model: the weights it was loaded from,
    which names the architecture when ``--served-model-name`` gave it a house name, and vLLM's
    ``max_model_len``: the smallest any listed model gives, None when one gives none)."""
    listing = await _get_json(session, base + "/v1/models", timeout_s)
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    ids = tuple(str(m["id"]) for m in models)
    if not ids:
        return None
    owners = {m.get("owned_by") for m in data if isinstance(m, dict)}
    root = models[0].get("root")
    windows = [_tokens(m.get("max_model_len")) for m in models]
    known = [w for w in windows if w is not None]
    window = min(known) if known and len(known) == len(windows) else None
    kind: EngineKind = "vllm" if "vllm" in owners else "openai"
    return ids, kind, (root if isinstance(root, str) and root else None), window


async def discover_backend(
    session: aiohttp.ClientSession, backend: BackendConfig, index: int, timeout_s: float
) -> BackendConfig:
    """``backend`` with ``engine`` and ``models`` filled from the running server (an entry with DNS
    discovery is returned as it is: its addresses are asked when they are found, ``backends.dns``)."""
    if backend.resolved or backend.discovery is not None:
        return backend
    path = f"backends[{index}]"
    try:
        if backend.engine in (None, "tgi"):
            tgi = await _tgi_info(session, backend.url, timeout_s)
            if tgi is not None:
                model_id, window = tgi
                return replace(
                    backend,
                    engine="tgi",
                    models=backend.models or (model_id,),
                    max_model_len=backend.max_model_len or window,
                )
        if backend.engine != "tgi":
            found = await _openai_models(session, backend.url, timeout_s)
            if found is not None:
                ids, kind, root, window = found
                labels = dict(backend.labels)
                if root is not None and root not in ids and "model" not in labels:
                    labels["model"] = root  # the catalog prior looks this name up first
                return replace(
                    backend,
                    engine=backend.engine or kind,
                    models=backend.models or ids,
                    labels=labels,
                    max_model_len=backend.max_model_len or window,
                )
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ConfigError(f"{path}.url", f"cannot reach {backend.url} for discovery: {exc}") from exc
    field = "models" if backend.engine is not None else "engine"
    raise ConfigError(
        f"{path}.{field}", f"{backend.url} answers neither TGI /info nor /v1/models; set it in the config"
    )


async def discover(config: Config, session: aiohttp.ClientSession | None = None) -> Config:
    """Resolve every backend of ``config`` concurrently (a private session if none is given)."""
    if all(b.resolved or b.discovery is not None for b in config.backends):
        return config
    if session is None:
        async with aiohttp.ClientSession() as own:
            return await discover(config, own)
    timeout_s = config.timeouts.discovery_s
    resolved = await asyncio.gather(
        *(discover_backend(session, b, i, timeout_s) for i, b in enumerate(config.backends))
    )
    return config.with_backends(resolved)
