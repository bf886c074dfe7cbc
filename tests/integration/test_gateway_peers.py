"""Two gateway replicas exchanging summaries over UDP on 127.0.0.1 (``peers``): each sees the other's
requests in flight at once and learns from its completions; forged or garbled datagrams change nothing."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
import numpy as np
import pytest

from hetroute.app import PEERS, ROUTER
from hetroute.routing.peer_wire import encode
from hetroute.routing.peers import PeerSummary
from hetroute.types import RequestFeatures
from tests.conftest import MODEL, EmulateFn, Gateway, GatewayFn, eventually, metric_sum

SPEEDUP = 4.0
WAIT_S = 10.0
KEY = "integration-peer-key"


def _udp_ports(n: int) -> list[int]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _peers(listen: int, *targets: int) -> dict[str, Any]:
    return {
        "addresses": [f"127.0.0.1:{p}" for p in targets],
        "listen_host": "127.0.0.1",
        "listen_port": listen,
        "interval_s": 0.05,
        "stale_after_s": 0.5,
    }


async def _long_request(s: aiohttp.ClientSession, gw: Gateway) -> int:
    # ignore_eos: exactly 300 tokens (~1.4 s at SPEEDUP), so the requests stay in flight for many
    # summaries (every 0.05 s)
    body = {"model": MODEL, "prompt": "hello " * 50, "max_tokens": 300, "ignore_eos": True, "stream": True}
    async with s.post(gw.url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


async def _admin(s: aiohttp.ClientSession, gw: Gateway) -> list[dict[str, Any]]:
    async with s.get(gw.url + "/admin/backends") as r:
        body = await r.json()
    backends: list[dict[str, Any]] = body["backends"]
    return backends


async def test_replicas_see_each_others_requests_and_learn_from_each_others_completions(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    a = await emulate(name="a", speedup=SPEEDUP)
    p1, p2 = _udp_ports(2)
    env = {"HETROUTE_PEER_KEY": KEY}
    one = await gateway([a], env=env, policy={"type": "default"}, peers=_peers(p1, p2))
    two = await gateway([a], env=env, policy={"type": "default"}, peers=_peers(p2, p1, p2))  # itself too
    peers = one.app[ROUTER].peers
    assert peers is not None and peers.follow_s == pytest.approx(0.5 / 3)  # mirror on: a heartbeat
    async with aiohttp.ClientSession() as s:
        sent = [asyncio.create_task(_long_request(s, one)) for _ in range(3)]
        assert await eventually(lambda: one.ledger.in_flight() == 3, WAIT_S)
        assert await eventually(lambda: int(two.app[ROUTER].snapshot().requests_in_flight[0]) == 3, WAIT_S)
        assert two.ledger.is_zero()  # the peer's requests are in its snapshot only
        shown = await _admin(s, two)
        assert shown[0]["peer_requests"] == 3.0 and shown[0]["foreign_requests"] == 0.0
        assert metric_sum(two, "hetroute_peer_requests") == 3.0
        assert metric_sum(two, "hetroute_peer_replicas") == 1.0  # its own echoes are not a peer
        learned_before = two.app[ROUTER].learner.observed_total(0)  # type: ignore[union-attr]
        assert await asyncio.gather(*sent) == [200] * 3
        # Replica two served nothing, yet learns backend a from replica one's three completions.
        assert await eventually(
            lambda: two.app[ROUTER].learner.observed_total(0) == learned_before + 3,  # type: ignore[union-attr]
            WAIT_S,
        )
        assert await eventually(lambda: int(two.app[ROUTER].snapshot().requests_in_flight[0]) == 0, WAIT_S)
        assert two.app[PEERS].results["accepted"] > 0
        assert metric_sum(two, "hetroute_peer_datagrams_total") >= two.app[PEERS].results["accepted"]
    assert one.ledger.is_zero() and two.ledger.is_zero()


async def test_forged_and_garbled_datagrams_change_nothing(emulate: EmulateFn, gateway: GatewayFn) -> None:
    a = await emulate(name="a", speedup=SPEEDUP)
    (port,) = _udp_ports(1)
    env = {"HETROUTE_PEER_KEY": KEY}
    gw = await gateway([a], env=env, policy={"type": "default"}, peers=_peers(port, port))
    forged = PeerSummary("intruder", 1, 0.0, ("a",), np.array([500.0]), np.full((6, 1), 1e6))
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        asyncio.DatagramProtocol, remote_addr=("127.0.0.1", port)
    )
    try:
        transport.sendto(encode(forged, b"a guessed key"))
        transport.sendto(b"\x00garbage")
        channel = gw.app[PEERS]
        assert await eventually(
            lambda: channel.results["unauthenticated"] == 1 and channel.results["malformed"] == 1, WAIT_S
        )
    finally:
        transport.close()
    assert int(gw.app[ROUTER].snapshot().requests_in_flight[0]) == 0
    peers = gw.app[ROUTER].peers
    assert peers is not None and peers.received_total == 0


def _busy(seconds: float) -> None:
    """Keep the event loop busy for ``seconds`` (a burst's handlers, which never await meanwhile)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def _features(k: int) -> RequestFeatures:
    return RequestFeatures(f"busy-{k}", MODEL, "openai", 100, 50, 50)


async def test_a_busy_event_loop_still_exchanges_summaries_at_each_decision(
    emulate: EmulateFn, gateway: GatewayFn
) -> None:
    """A burst keeps the event loop from running its reader and send loop; the decisions themselves
    send and take the summaries (``PeerChannel.poll`` before each, at most once per ``interval_s``).
    Here the loop never runs between the dispatches and the decision that sees them."""
    a = await emulate(name="a", speedup=SPEEDUP)
    p1, p2 = _udp_ports(2)
    env = {"HETROUTE_PEER_KEY": KEY}
    one = await gateway([a], env=env, policy={"type": "default"}, peers=_peers(p1, p2))
    two = await gateway([a], env=env, policy={"type": "default"}, peers=_peers(p2, p1))
    router_one, router_two = one.app[ROUTER], two.app[ROUTER]
    assert router_one.before_decide == one.app[PEERS].poll
    assert await eventually(lambda: router_two.peers.received_total > 0, WAIT_S)  # type: ignore[union-attr]
    # From here to the end of the burst nothing awaits: the event loop is as blocked as in a burst.
    received = router_two.peers.received_total  # type: ignore[union-attr]
    _busy(0.06)  # > interval_s (0.05): the next decision of each replica polls
    tickets = [router_one.route(_features(k)) for k in range(3)]  # the first polls, the others do not
    _busy(0.06)
    router_one.decide(_features(3))  # polls: sends replica one's summary, 3 requests in flight
    _busy(0.01)  # loopback delivery into replica two's socket
    assert router_two.peers.received_total == received  # type: ignore[union-attr]  # nobody read it yet
    _, snap = router_two.decide(_features(4))  # polls: reads it before the snapshot
    assert router_two.peers.received_total > received  # type: ignore[union-attr]
    assert int(snap.requests_in_flight[0]) == 3
    _, again = router_two.decide(_features(5))  # within interval_s: no poll, the same view
    assert int(again.requests_in_flight[0]) == 3
    for ticket in tickets:
        assert router_one.release(ticket)
    assert one.ledger.is_zero() and two.ledger.is_zero()


async def test_closing_the_channel_unhooks_it_from_the_router(emulate: EmulateFn, gateway: GatewayFn) -> None:
    a = await emulate(name="a", speedup=SPEEDUP)
    (port,) = _udp_ports(1)
    gw = await gateway(
        [a], env={"HETROUTE_PEER_KEY": KEY}, policy={"type": "default"}, peers=_peers(port, port)
    )
    channel, router = gw.app[PEERS], gw.app[ROUTER]

    def hook() -> object:
        return router.before_decide

    assert hook() == channel.poll
    channel.close()
    assert hook() is None
    router.decide(_features(0))  # decides without the channel
    counted = dict(channel.results)
    _busy(0.06)
    channel.poll()  # a closed channel's poll reads and sends nothing
    channel.close()  # twice is harmless
    assert dict(channel.results) == counted
