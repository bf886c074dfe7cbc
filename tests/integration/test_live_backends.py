"""Live backend changes through the real app: POST and DELETE /admin/backends under load."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from hetroute.app import LEARNER, MEMBERSHIP, ROUTER
from tests.conftest import MODEL, EmulateFn, Gateway, GatewayFn, backend_entry, eventually, metric_sum

SCRAPE_S = 0.5


class Load:
    """``concurrency`` clients sending requests back to back (half streamed) until stopped; every
    answer is checked whole (status 200 and, for a stream, the final ``[DONE]``)."""

    def __init__(self, url: str, concurrency: int, max_tokens: int = 24) -> None:
        self.url = url
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.outcomes: list[tuple[int, str, bool]] = []  # (status, backend, complete)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _client(self, session: aiohttp.ClientSession, k: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = (k + n) % 2 == 0
            body = {"model": MODEL, "prompt": f"client {k} request {n} " * 8, "max_tokens": self.max_tokens}
            if stream:
                body["stream"] = True
            async with session.post(self.url + "/v1/completions", json=body) as r:
                raw = await r.read()
                complete = b"data: [DONE]" in raw if stream else bool(json.loads(raw).get("choices"))
                self.outcomes.append((r.status, r.headers.get("x-hetroute-backend", ""), complete))

    async def __aenter__(self) -> Load:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._tasks = [asyncio.create_task(self._client(self._session, k)) for k in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.gather(*self._tasks), 30)
        finally:
            await self._session.close()


def _auth() -> dict[str, str]:
    return {"Authorization": "Bearer tok"}


async def _admin(gw: Gateway) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/admin/backends", headers=_auth()) as r:
        assert r.status == 200
        return dict(await r.json())


async def test_a_backend_added_under_load_takes_traffic_within_one_scrape_interval(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a = await emulate(name="a", speedup=50.0)
    b = await emulate(name="b", speedup=50.0)
    gw = await gateway([a], policy={"type": "default"}, scrape={"interval_s": SCRAPE_S}, admin_token="tok")
    router = gw.app[ROUTER]
    async with Load(gw.url, concurrency=8) as load:
        await eventually(lambda: len(load.outcomes) >= 20, timeout_s=10)
        async with aiohttp.ClientSession() as s:
            # No engine or models given: the router asks the server, as at start-up.
            entry = {"name": "b", "url": b.url}
            async with s.post(gw.url + "/admin/backends", json=entry, headers=_auth()) as r:
                assert r.status == 201, await r.text()
                added = await r.json()
        joined_at = time.monotonic()
        slot = added["slot"]
        assert added["engine"] == "vllm" and added["models"] == [MODEL] and slot == 1
        took = await eventually(lambda: router.ledger.dispatched_total[slot] > 0, timeout_s=SCRAPE_S)
        waited_s = time.monotonic() - joined_at
        assert took, f"the new backend got no request within one scrape interval ({SCRAPE_S} s)"
        await eventually(lambda: router.ledger.dispatched_total[slot] >= 10, timeout_s=10)
    assert load.outcomes and all(status == 200 and done for status, _, done in load.outcomes)
    assert {"a", "b"} <= {backend for _, backend, _ in load.outcomes}
    assert waited_s <= SCRAPE_S
    admin = await _admin(gw)
    assert [(x["name"], x["state"]) for x in admin["backends"]] == [("a", "member"), ("b", "member")]
    assert metric_sum(gw, "hetroute_backend_available", backend="b") == 1.0
    assert gw.ledger.is_zero()


async def test_removing_a_backend_with_drain_loses_no_request_and_its_slot_is_reused(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a = await emulate(name="a", speedup=20.0)
    b = await emulate(name="b", speedup=20.0)
    gw = await gateway([a, b], admin_token="tok")
    router, membership = gw.app[ROUTER], gw.app[MEMBERSHIP]
    async with Load(gw.url, concurrency=8, max_tokens=48) as load:
        assert await eventually(lambda: router.ledger.requests_in_flight[1] >= 2, timeout_s=10)
        at_leave: list[tuple[int, int]] = []  # (dispatched, in flight) when the removal took effect
        membership.on_leave.append(
            lambda i, _: at_leave.append(
                (int(router.ledger.dispatched_total[i]), int(router.ledger.requests_in_flight[i]))
            )
        )
        async with aiohttp.ClientSession() as s:
            async with s.delete(gw.url + "/admin/backends/b?drain=true", headers=_auth()) as r:
                assert r.status == 200, await r.text()
                removed = await r.json()
            # Drained: nothing was dispatched there after the DELETE, and what was in flight finished.
            ((before, in_flight_then),) = at_leave
            assert int(router.ledger.dispatched_total[1]) == before
            assert int(router.ledger.released_total[1]) == before
            assert removed == {"name": "b", "slot": 1, "state": "free", "in_flight": 0}
            assert in_flight_then >= 2
            served_after = len(load.outcomes)
            assert await eventually(lambda: len(load.outcomes) >= served_after + 20, timeout_s=10)
            # The freed slot is reused by the next backend added.
            async with s.post(gw.url + "/admin/backends", json=backend_entry(b), headers=_auth()) as r:
                assert r.status == 201
                assert (await r.json())["slot"] == 1
            assert await eventually(lambda: router.ledger.dispatched_total[1] > 0, timeout_s=5)
    assert all(status == 200 and done for status, _, done in load.outcomes)
    assert membership.state(1) == "member"
    assert gw.ledger.is_zero()


async def test_removal_without_drain_answers_at_once_and_requests_still_finish(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a = await emulate(name="a", speedup=10.0)
    b = await emulate(name="b", speedup=10.0)
    gw = await gateway([a, b], admin_token="tok")
    router = gw.app[ROUTER]
    async with Load(gw.url, concurrency=6, max_tokens=64) as load:
        assert await eventually(lambda: router.ledger.requests_in_flight[1] >= 1, timeout_s=10)
        async with aiohttp.ClientSession() as s, s.delete(gw.url + "/admin/backends/b", headers=_auth()) as r:
            assert r.status == 202
            body = await r.json()
        assert body["state"] == "draining" and body["in_flight"] >= 1
        admin = await _admin(gw)
        assert [(x["name"], x["state"]) for x in admin["backends"]] == [("a", "member"), ("b", "draining")]
        assert await eventually(lambda: router.ledger.requests_in_flight[1] == 0, timeout_s=15)
    assert all(status == 200 and done for status, _, done in load.outcomes)
    admin = await _admin(gw)
    assert [x["name"] for x in admin["backends"]] == ["a"]
    assert metric_sum(gw, "hetroute_backend_available", backend="b") == 0.0  # the series is gone
    assert gw.ledger.is_zero()


async def test_admin_changes_refuse_bad_input_with_json_errors_and_change_nothing(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a = await emulate(name="a")
    gw = await gateway([a], admin_token="tok")
    router = gw.app[ROUTER]

    async def post(body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        h = {**_auth(), "Content-Type": "application/json"} if headers is None else headers
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/admin/backends", data=body, headers=h) as r,
        ):
            return r.status, dict(await r.json())

    status, err = await post(b'{"name": "x", "url": "http://127.0.0.1:1"}', headers={})
    assert status == 401 and "token" in err["error"]["message"]
    status, err = await post(b"{not json")
    assert status == 400 and "JSON" in err["error"]["message"]
    status, err = await post(b'{"name": "x"}')
    assert status == 400 and err["error"]["param"] == "backend.url"
    status, err = await post(b'{"name": "x", "url": "http://127.0.0.1:9", "weight": "heavy"}')
    assert status == 400 and "backend.weight" in err["error"]["message"]
    status, err = await post(
        json.dumps({"name": "a", "url": a.url, "engine": "vllm", "models": [MODEL]}).encode()
    )
    assert status == 409 and "already" in err["error"]["message"]
    # Unreachable and nothing said about the engine: discovery fails → 502.
    status, err = await post(b'{"name": "y", "url": "http://127.0.0.1:9"}')
    assert status == 502 and "discover" in err["error"]["message"]
    async with aiohttp.ClientSession() as s:
        async with s.delete(gw.url + "/admin/backends/nope", headers=_auth()) as r:
            assert r.status == 404 and "nope" in (await r.json())["error"]["message"]
        async with s.delete(gw.url + "/admin/backends/a?drain=maybe", headers=_auth()) as r:
            assert r.status == 400
    assert [b.name for b in router.backends] == ["a"] and router.members() == (0,)


async def test_a_join_the_policy_cannot_take_is_refused_and_changes_nothing(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a, b = await emulate(name="a"), await emulate(name="b")
    gw = await gateway(
        [a], policy={"type": "weighted_round_robin", "params": {"weights": [2]}}, admin_token="tok"
    )
    entry = backend_entry(b)
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + "/admin/backends", json=entry, headers=_auth()) as r,
    ):
        assert r.status == 409
        assert "weights" in (await r.json())["error"]["message"]
    router = gw.app[ROUTER]
    assert len(router.backends) == 1 and router.ledger.backend_names == ("a",)


async def test_with_several_workers_the_admin_api_points_to_sighup(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a = await emulate(name="a")
    gw = await gateway([a], server={"workers": 2}, admin_token="tok")
    async with aiohttp.ClientSession() as s, s.delete(gw.url + "/admin/backends/a", headers=_auth()) as r:
        assert r.status == 409 and "SIGHUP" in (await r.json())["error"]["message"]
    assert gw.app[ROUTER].members() == (0,)


async def test_a_joining_backend_starts_from_a_replicas_model_or_the_fleets(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a, b, c = [await emulate(name=n) for n in "abc"]
    gw = await gateway(
        [a], policy={"type": "default"}, learning={"refit_interval_s": 0.05}, admin_token="tok"
    )
    learner = gw.app[LEARNER]
    async with aiohttp.ClientSession() as s:
        for k in range(48):
            body = {"model": MODEL, "prompt": f"learn {k}", "max_tokens": 8, "stream": True}
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()
        assert await eventually(lambda: (f := learner.fit_of(0)) is not None and f.samples >= 32, timeout_s=5)
        replica = backend_entry(c)  # a's entry but for name and URL
        unknown = {"name": "b", "url": b.url}  # engine and models asked: its `root` label differs from a's
        for entry in (replica, unknown):
            async with s.post(gw.url + "/admin/backends", json=entry, headers=_auth()) as r:
                assert r.status == 201
    admin = {x["name"]: x["learned_model"] for x in (await _admin(gw))["backends"]}
    assert admin["a"]["prior"]["kind"] == "neutral"
    assert admin["c"]["prior"] == {"kind": "saved", "source": admin["c"]["prior"]["source"]}
    assert admin["c"]["prior"]["source"].startswith("learned by its sibling a (")
    # c has no fit of its own yet when b joins: the median is over a alone.
    assert admin["b"]["prior"] == {"kind": "fleet", "source": "median of 1 learned member(s)"}
    # Both start from what a had learned (a refit may land between the two joins), not from the
    # neutral prior a started from.
    neutral = [p["prior"] for p in admin["a"]["params"].values()]
    assert [p["prior"] for p in admin["c"]["params"].values()] != neutral
    assert [p["prior"] for p in admin["b"]["params"].values()] != neutral
