"""The prefix-cache check against a real engine, used by the ``real_engine`` tier.

``measure_prefix`` puts the real gateway (prefix index on, its default) in front of ``url``, sends
``requests`` completions one after another that share one long prefix and differ in their last
words, lets the gateway scrape the engine, and returns what each side counted: the engine's own
``vllm:prefix_cache_*_total`` counters (read with the gateway's parser, before and after), the
router's expected hit ratio and its trust in the index for that backend (the gateway's registry, which
its ``/metrics`` exports).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from hetroute.app import build_app, start_app
from hetroute.backends.engines import parse_vllm
from hetroute.config import config_from_dict
from tests.real_engine.tiny_vllm import SERVED

SCRAPE_INTERVAL_S = 0.2


async def _engine_counters(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with session.get(f"{url}/metrics") as resp:
        scraped = parse_vllm(await resp.text())
    assert scraped.prefix_cache_queries_total is not None, "no vllm:prefix_cache_queries_total"
    assert scraped.prefix_cache_hits_total is not None, "no vllm:prefix_cache_hits_total"
    return scraped.prefix_cache_queries_total, scraped.prefix_cache_hits_total


async def measure_prefix(url: str, requests: int, seed: int) -> dict[str, Any]:
    """The module docstring's run."""
    cfg = config_from_dict(
        {
            "backends": [{"name": "cpu", "url": url, "engine": "vllm", "models": [SERVED]}],
            "policy": {"type": "default"},
            "scrape": {"interval_s": SCRAPE_INTERVAL_S},
            "server": {"access_log": False},
        },
        env={},
    )
    rng = random.Random(seed)
    words = ["alpha", "bravo", "delta", "gamma", "kilo", "lima", "omega", "sierra", "tango", "zulu"]
    shared = " ".join(rng.choice(words) for _ in range(250))  # distinct from other tests' prompts
    registry = CollectorRegistry()
    app = build_app(cfg, registry=registry)
    runner, port = await start_app(app)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            queries0, hits0 = await _engine_counters(session, url)
            statuses = []
            for k in range(requests):
                body = {
                    "model": SERVED,
                    "prompt": f"{shared} question {k}: " + " ".join(rng.choice(words) for _ in range(8)),
                    "max_tokens": 4,
                }
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    await resp.read()
                    statuses.append(resp.status)
            await asyncio.sleep(5 * SCRAPE_INTERVAL_S)  # the gateway scrapes the engine's counters
            queries1, hits1 = await _engine_counters(session, url)
            expected = registry.get_sample_value("hetroute_prefix_expected_hit_ratio")
            trust = registry.get_sample_value("hetroute_prefix_trust", {"backend": "cpu"})
    finally:
        await runner.cleanup()
    return {
        "ok": sum(s == 200 for s in statuses),
        "engine_queries_tokens": queries1 - queries0,
        "engine_hits_tokens": hits1 - hits0,
        "engine_hit_ratio": (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0,
        "router_expected_hit_ratio": expected,
        "router_trust": trust,
    }
