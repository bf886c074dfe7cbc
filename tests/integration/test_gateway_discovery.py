"""Start-up discovery of engine kind and models from running (emulated) backends."""

from __future__ import annotations

import socket

import pytest

from hetroute.backends.discovery import discover
from hetroute.config import config_from_dict, quick_config
from hetroute.errors import ConfigError
from tests.conftest import MODEL, EmulateFn


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_discovers_vllm_and_tgi(emulate: EmulateFn) -> None:
    vllm, tgi = await emulate("vllm"), await emulate("tgi", served_model="tgi-model")
    cfg = await discover(quick_config([vllm.url, tgi.url], env={}))
    assert [(b.engine, b.models) for b in cfg.backends] == [("vllm", (MODEL,)), ("tgi", ("tgi-model",))]
    specs = cfg.specs()
    assert specs[1].serves("tgi-model", "tgi") and not specs[0].serves(MODEL, "tgi")


async def test_configured_fields_are_kept(emulate: EmulateFn) -> None:
    tgi = await emulate("tgi")
    data = {"backends": [{"url": tgi.url, "engine": "tgi", "models": ["alias"]}]}
    cfg = config_from_dict(data, env={})
    assert await discover(cfg) is cfg  # nothing to discover: no request is made
    partial = config_from_dict({"backends": [{"url": tgi.url, "engine": "openai"}]}, env={})
    found = (await discover(partial)).backends[0]
    assert found.engine == "openai" and found.models == (MODEL,)  # /v1/models, engine as configured


async def test_unreachable_backend_names_the_field() -> None:
    cfg = config_from_dict(
        {"backends": [{"url": f"http://127.0.0.1:{_closed_port()}"}], "timeouts": {"discovery_s": 0.5}},
        env={},
    )
    with pytest.raises(ConfigError) as info:
        await discover(cfg)
    assert info.value.path == "backends[0].url"
