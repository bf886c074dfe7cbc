"""DNS discovery against a real DNS server on 127.0.0.1 (built on dnspython in this file).

Two emulated engines listen on one port at 127.0.0.2 and 127.0.0.3 (Linux routes all of 127/8 to the
loopback device), as the pods behind a Kubernetes headless Service share their port; the server's
answer for the Service name is changed during the test.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import aiohttp
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
from prometheus_client import CollectorRegistry

from hetroute.app import MEMBERSHIP, ROUTER, build_app, start_app
from hetroute.backends.dns import make_resolver, resolve_addresses
from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog, lookup_gpu, lookup_model
from hetroute.config import DnsConfig, config_from_dict
from hetroute.peer_channel import PeerChannel
from hetroute.sim.emulator import build_emulator_app, run_emulator
from hetroute.sim.engine_model import EngineConfig, EngineModel
from tests.conftest import MODEL, eventually

NAME = "vllm.hetroute.test."
INTERVAL_S = 0.2


class DnsServer(asyncio.DatagramProtocol):
    """Answers A queries for :data:`NAME` with ``addresses`` (NXDOMAIN when ``None``); drops every
    query while ``silent`` (a DNS outage)."""

    def __init__(self) -> None:
        self.addresses: list[str] | None = []
        self.silent = False
        self.queries = 0
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram endpoint's transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.queries += 1
        if self.silent or self.transport is None:
            return
        query = dns.message.from_wire(data)
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        question = query.question[0]
        if str(question.name).lower() != NAME or self.addresses is None:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A and self.addresses:
            reply.answer.append(dns.rrset.from_text_list(NAME, 1, "IN", "A", self.addresses))
        self.transport.sendto(reply.to_wire(), addr)


@pytest.fixture
async def dns_server() -> AsyncIterator[tuple[DnsServer, int]]:
    loop = asyncio.get_running_loop()
    transport, server = await loop.create_datagram_endpoint(DnsServer, local_addr=("127.0.0.1", 0))
    try:
        yield server, transport.get_extra_info("sockname")[1]
    finally:
        transport.close()


async def test_a_short_name_is_resolved_through_the_search_list_as_in_a_pod(
    dns_server: tuple[DnsServer, int],
) -> None:
    server, dns_port = dns_server
    server.addresses = ["127.0.0.2", "127.0.0.3"]
    resolver = make_resolver(DnsConfig(nameservers=(f"127.0.0.1:{dns_port}",), timeout_s=2.0))
    assert await resolve_addresses(resolver, "vllm") == ()  # no search list: only "vllm." is asked
    resolver.search = [dns.name.from_text("hetroute.test.")]  # a pod's resolv.conf: search <ns>.svc...
    assert await resolve_addresses(resolver, "vllm") == ("127.0.0.2", "127.0.0.3")


def _shared_port() -> int:
    """A port free on both 127.0.0.2 and 127.0.0.3."""
    for _ in range(20):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.2", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.3", port))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no port free on both addresses")


async def test_dns_discovery_follows_the_answers_and_survives_an_outage(
    dns_server: tuple[DnsServer, int],
) -> None:
    server, dns_port = dns_server
    gpus, models = load_gpu_catalog(), load_model_catalog()
    port = _shared_port()
    async with AsyncExitStack() as stack:
        for host in ("127.0.0.2", "127.0.0.3"):
            engine = EngineModel(
                EngineConfig(lookup_gpu(gpus, "V100-SXM2-32GB"), lookup_model(models, "Llama-3-8B"), 1)
            )
            app = build_emulator_app(engine, served_model=MODEL, engine_kind="vllm", speedup=200.0)
            await stack.enter_async_context(run_emulator(app, host, port))
        server.addresses = ["127.0.0.2"]
        cfg = config_from_dict(
            {
                # No engine or models: each address found is asked (GET /v1/models), as at start-up.
                "backends": [
                    {"name": "pool", "url": f"http://{NAME.rstrip('.')}:{port}", "discovery": "dns"}
                ],
                "dns": {"nameservers": [f"127.0.0.1:{dns_port}"], "interval_s": INTERVAL_S, "timeout_s": 0.3},
                "health": {"probe_interval_s": 0.2},
                "admin_token": "tok",
            },
            env={},
        )
        gw_app = build_app(cfg, registry=CollectorRegistry())
        runner, gw_port = await start_app(gw_app)
        stack.push_async_callback(runner.cleanup)
        url = f"http://127.0.0.1:{gw_port}"
        router, membership = gw_app[ROUTER], gw_app[MEMBERSHIP]

        def names() -> list[str]:
            return [router.backends[i].name for i in router.members()]

        assert await eventually(lambda: names() == ["pool@127.0.0.2"], timeout_s=5)
        async with aiohttp.ClientSession() as s:

            async def served_by(n: int) -> set[str]:
                seen = set()
                for k in range(n):
                    body = {"model": MODEL, "prompt": f"dns {k}", "max_tokens": 3}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        seen.add(r.headers["x-hetroute-backend"])
                return seen

            async with s.get(url + "/ready") as r:
                assert r.status in (200, 503)
            assert await served_by(4) == {"pool@127.0.0.2"}

            server.addresses = ["127.0.0.2", "127.0.0.3"]  # a pod became ready
            assert await eventually(lambda: names() == ["pool@127.0.0.2", "pool@127.0.0.3"], timeout_s=5)
            assert (
                router.backends[1].url == f"http://127.0.0.3:{port}" and router.backends[1].engine == "vllm"
            )

            server.silent = True  # an outage: what was found stays
            before = server.queries
            await eventually(lambda: server.queries >= before + 4, timeout_s=5)
            assert names() == ["pool@127.0.0.2", "pool@127.0.0.3"]
            server.silent = False

            server.addresses = ["127.0.0.3"]  # a pod went away
            assert await eventually(lambda: names() == ["pool@127.0.0.3"], timeout_s=5)
            assert membership.state(0) == "free"
            assert await served_by(4) == {"pool@127.0.0.3"}

            server.addresses = ["127.0.0.2", "127.0.0.3"]  # it came back: the free slot is reused
            assert await eventually(
                lambda: sorted(names()) == ["pool@127.0.0.2", "pool@127.0.0.3"], timeout_s=5
            )
            assert len(router.backends) == 2

            server.addresses = None  # the Service is gone
            assert await eventually(lambda: names() == [], timeout_s=5)
            async with s.get(url + "/ready") as r:
                assert r.status == 503
            body = {"model": MODEL, "prompt": "nobody home", "max_tokens": 3}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status in (404, 503)
                assert "error" in await r.json()
        assert gw_app[ROUTER].ledger.is_zero()


async def test_peer_addresses_follow_the_answers_on_every_workers_port(
    dns_server: tuple[DnsServer, int],
) -> None:
    """A peers address naming a host (a headless Service of router pods): each of its addresses gets
    the summaries, on each worker's port; a failed resolution keeps the addresses found before."""
    server, dns_port = dns_server
    server.addresses = ["127.0.0.2", "127.0.0.3"]
    cfg = config_from_dict(
        {
            "backends": [{"name": "a", "url": "http://127.0.0.1:9", "engine": "vllm", "models": [MODEL]}],
            "peers": {
                "addresses": [f"{NAME.rstrip('.')}:9100", "127.0.0.9:9200"],
                "listen_host": "127.0.0.1",
            },
            "dns": {"nameservers": [f"127.0.0.1:{dns_port}"], "timeout_s": 1.0},
        },
        env={"HETROUTE_PEER_KEY": "k"},
    )
    app = build_app(cfg, registry=CollectorRegistry())
    channel = PeerChannel(app[ROUTER], cfg.peers, b"k", make_resolver(cfg.dns), worker=0, workers=2)
    await channel.resolve()
    assert channel.targets == (
        ("127.0.0.2", 9100),
        ("127.0.0.2", 9101),
        ("127.0.0.3", 9100),
        ("127.0.0.3", 9101),
        ("127.0.0.9", 9200),
        ("127.0.0.9", 9201),
    )
    server.addresses = ["127.0.0.3"]
    await channel.resolve()
    assert [t for t in channel.targets if t[1] < 9200] == [("127.0.0.3", 9100), ("127.0.0.3", 9101)]
    server.silent = True  # a DNS outage: the last addresses stay
    await channel.resolve()
    assert [t for t in channel.targets if t[1] < 9200] == [("127.0.0.3", 9100), ("127.0.0.3", 9101)]
