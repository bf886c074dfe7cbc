"""Shared fixtures: a manual clock, in-process emulated backends and the real gateway on 127.0.0.1.

``emulate(...)`` starts a real :mod:`hetroute.sim.emulator` app (vLLM or TGI flavour, with
fault injection) on a free port; ``gateway(backends, **sections)`` builds the real app with
``build_app`` in front of them. Everything is torn down at the end of the test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from hetroute.app import LEDGER, build_app, start_app
from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog, lookup_gpu, lookup_model
from hetroute.clock import ManualClock
from hetroute.config import config_from_dict
from hetroute.routing.ledger import Ledger
from hetroute.sim.emulator import build_emulator_app, emulator_of, run_emulator
from hetroute.sim.emulator_core import Emulator
from hetroute.sim.emulator_faults import FaultConfig
from hetroute.sim.emulator_protocol import EngineKind
from hetroute.sim.engine_model import EngineConfig, EngineModel

MODEL = "llama"


@pytest.fixture
def manual_clock() -> ManualClock:
    return ManualClock()


@dataclass
class Emu:
    name: str
    url: str
    kind: str
    app: web.Application

    @property
    def state(self) -> Emulator:
        return emulator_of(self.app)


@dataclass
class Gateway:
    url: str
    app: web.Application

    @property
    def ledger(self) -> Ledger:
        return self.app[LEDGER]


EmulateFn = Callable[..., Awaitable[Emu]]
GatewayFn = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as st:
        yield st


@pytest.fixture
def emulate(stack: AsyncExitStack) -> EmulateFn:
    gpus, models = load_gpu_catalog(), load_model_catalog()
    count = 0

    async def start(
        kind: EngineKind = "vllm",
        *,
        gpu: str = "V100-SXM2-32GB",
        tp: int = 1,
        speedup: float = 200.0,
        faults: FaultConfig | None = None,
        seed: int = 0,
        served_model: str = MODEL,
        name: str | None = None,
        max_num_seqs: int = 256,
    ) -> Emu:
        nonlocal count
        count += 1
        config = EngineConfig(
            lookup_gpu(gpus, gpu),
            lookup_model(models, "Llama-3-8B"),
            tp,
            engine=kind,
            max_num_seqs=max_num_seqs,
        )
        engine = EngineModel(config)
        app = build_emulator_app(
            engine,
            served_model=served_model,
            engine_kind=kind,
            speedup=speedup,
            faults=faults,
            seed=seed,
        )
        url = await stack.enter_async_context(run_emulator(app))
        return Emu(name or f"{kind}{count}", url, kind, app)

    return start


def backend_entry(emu: Emu) -> dict[str, Any]:
    return {"name": emu.name, "url": emu.url, "engine": emu.kind, "models": [MODEL]}


@pytest.fixture
def gateway(stack: AsyncExitStack) -> GatewayFn:
    async def start(
        backends: Sequence[Emu | dict[str, Any]], env: Mapping[str, str] | None = None, **sections: Any
    ) -> Gateway:
        data: dict[str, Any] = {
            "backends": [b if isinstance(b, dict) else backend_entry(b) for b in backends],
            "policy": {"type": "round_robin"},
            "server": {"shutdown_grace_s": 1.0, "access_log": True},
            "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "idle_s": 5.0, "discovery_s": 1.0},
            "health": {"probe_interval_s": 60.0, "probe_timeout_s": 0.5},
            "scrape": {"interval_s": 0.05, "timeout_s": 0.5},
        }
        for key, value in sections.items():
            data[key] = {**data[key], **value} if isinstance(data.get(key), dict) else value
        app = build_app(config_from_dict(data, env=env or {}), registry=CollectorRegistry())
        runner, port = await start_app(app)
        stack.push_async_callback(runner.cleanup)
        return Gateway(f"http://127.0.0.1:{port}", app)

    return start


async def eventually(check: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    """Poll ``check`` on the event loop until it holds (integration tests only; bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


def metric_sum(gw: Gateway, sample_name: str, **labels: str) -> float:
    """Sum of the gateway's own Prometheus samples called ``sample_name`` matching ``labels``."""
    from hetroute.app import TELEMETRY

    total = 0.0
    for family in gw.app[TELEMETRY].registry.collect():
        for sample in family.samples:
            if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


REAL_ENGINE_MARK = "real_engine"
_CATEGORIES = (("passed", "passed"), ("skipped", "skipped"), ("failed", "failed"), ("error", "failed"))
_RANK = {"passed": 0, "skipped": 1, "failed": 2}


def real_engine_summary(stats: Mapping[str, Sequence[object]]) -> str:
    """One line on what the real_engine tier did in a run, from the terminal reporter's ``stats``.

    Each test counts once, by its worst phase (an error at set-up counts as failed); the line says
    why tests skipped, or that the real engine was not installed."""
    outcome: dict[str, str] = {}
    reasons: list[str] = []
    for category, kind in _CATEGORIES:
        for report in stats.get(category, ()):
            if not isinstance(report, pytest.TestReport) or REAL_ENGINE_MARK not in report.keywords:
                continue
            if _RANK[kind] >= _RANK[outcome.get(report.nodeid, "passed")]:
                outcome[report.nodeid] = kind
            if kind == "skipped" and isinstance(report.longrepr, tuple):
                reasons.append(str(report.longrepr[2]).removeprefix("Skipped: "))
            elif kind == "failed" and "REAL ENGINE NOT INSTALLED" in report.longreprtext:
                reasons.append(report.longreprtext.strip().splitlines()[-1])
    head = "real_engine tier:"
    if not outcome:
        deselected = [
            item
            for item in stats.get("deselected", ())
            if isinstance(item, pytest.Item) and item.get_closest_marker(REAL_ENGINE_MARK)
        ]
        return f"{head} {len(deselected)} deselected, none ran" if deselected else f"{head} not in this run"
    n = {kind: sum(1 for o in outcome.values() if o == kind) for kind in _RANK}
    line = f"{head} {n['passed']} passed / {n['failed']} failed / {n['skipped']} skipped"
    if reasons:
        line += f" ({'failed' if n['failed'] else 'skipped because'}: {'; '.join(dict.fromkeys(reasons))})"
    return line


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(real_engine_summary(terminalreporter.stats))
