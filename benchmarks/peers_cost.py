"""What exchanging summaries (``peers``) costs one router: the routing decision, and each summary sent
and received.

Usage: ``python benchmarks/peers_cost.py [--decisions 5000] [--sizes 4,64,512] [--peers 3]``.
Writes ``benchmarks/results/peers_cost.json`` and ``peers_cost.md``.

Per fleet size n (``decision_latency.py``'s fleet of alternating fast and slow profiled backends, the
default policy, 8 × n requests in flight), with the router wired as the gateway wires it:

- ``Router.route`` + ``Router.release`` without a peer view, with one holding ``--peers`` current
  summaries (each as loaded as the router itself), and with them and ``peers.mirror`` on (the default:
  every dispatch and release marked, each decision adding the own change since each summary; the clock
  moves 0.2 ms per decision and the summaries arrive again every 5 ms, untimed);
- one summary: ``Router.publish`` + :func:`~hetroute.routing.peer_wire.encode` (the sender, every
  ``peers.interval_s``), its size, and :func:`~hetroute.routing.peer_wire.decode` + ``Router.receive``
  (each receiver), with 20 observations in it (a busy interval's completions; ``receive`` feeds them
  to the learner), and a receiver's cost for a summary without completions;
- ``PeerChannel.poll`` (run before every decision, peer_channel.py) on a real UDP socket on 127.0.0.1:
  when its interval has passed and nothing is waiting or due (one ``recvfrom`` that finds nothing and
  the due check), and within its interval (a clock read and a comparison). When a summary is waiting
  or due, a poll adds the receive or send costs above: that work moved from the event loop's reader and
  send loop into the decision, at most once per ``interval_s``.

p50 (and p99 for the decision) in microseconds, one core, ``time.perf_counter_ns``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decision_latency import fleet  # noqa: E402

from hetroute.backends.dns import make_resolver  # noqa: E402
from hetroute.clock import ManualClock  # noqa: E402
from hetroute.dns_settings import DnsConfig  # noqa: E402
from hetroute.learning.build import build_live_models  # noqa: E402
from hetroute.learning.settings import LearningConfig  # noqa: E402
from hetroute.peer_channel import PeerChannel  # noqa: E402
from hetroute.peer_settings import PeersConfig  # noqa: E402
from hetroute.policies import PolicyContext, build_policy  # noqa: E402
from hetroute.policies.backend_model import BackendModels  # noqa: E402
from hetroute.routing.ledger import Ledger  # noqa: E402
from hetroute.routing.peer_wire import decode, encode  # noqa: E402
from hetroute.routing.peers import PeerView  # noqa: E402
from hetroute.routing.router import Router  # noqa: E402
from hetroute.types import RequestFeatures  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KEY = b"benchmark-key"
OBSERVATIONS = 20
MIRROR_FOLLOW_S = 0.01
"""2 × the default ``peers.interval_s``."""
MIRROR_STEP_S = 2e-4
"""Modelled time between two decisions with the mirror (5,000 requests a second)."""
MIRROR_SUMMARY_EVERY = 25
"""Decisions between two rounds of the peers' summaries (every 5 ms of modelled time)."""


def _router(n: int, replica: str | None, clock: ManualClock, follow_s: float = 0.0) -> Router:
    backends = fleet(n)
    models = BackendModels.from_specs(backends)
    names = [b.name for b in backends]
    return Router(
        backends,
        build_policy("default", {}, PolicyContext(backends, seed=1, backend_models=models)),
        Ledger(names),
        clock,
        learner=build_live_models(models, LearningConfig()),
        peers=None if replica is None else PeerView(replica, names, stale_s=1e9, follow_s=follow_s),
    )


def _features(count: int, seed: int) -> list[RequestFeatures]:
    rng = np.random.default_rng(seed)
    return [
        RequestFeatures(
            f"r{seed}-{k}", "m", "openai", int(rng.integers(4, 1024)), None, int(rng.integers(4, 600))
        )
        for k in range(count)
    ]


def _decisions_us(
    router: Router, feats: list[RequestFeatures], between: Callable[[int], None] | None = None
) -> np.ndarray:
    """Time route + release of each of ``feats``; ``between(k)`` runs untimed before decision k."""
    for f in feats[:200]:  # warm-up
        router.release(router.route(f))
    out = np.empty(len(feats), dtype=np.float64)
    for k, f in enumerate(feats):
        if between is not None:
            between(k)
        t0 = time.perf_counter_ns()
        router.release(router.route(f))
        out[k] = (time.perf_counter_ns() - t0) / 1e3
    return out


async def _poll_us(router: Router, clock: ManualClock, polls: int) -> tuple[float, float]:
    """p50 of ``PeerChannel.poll`` when it runs (interval passed, nothing waiting or due) and when it
    is skipped (within its interval), on a real socket."""
    cfg = PeersConfig(addresses=(("127.0.0.1", 9),), listen_host="127.0.0.1", listen_port=1)
    channel = PeerChannel(router, cfg, KEY, make_resolver(DnsConfig()))
    channel.listen = ("127.0.0.1", 0)  # any free port
    await channel.start()
    try:
        channel.router.publish()  # nothing due from here on (the clock stays within a heartbeat)
        runs, skips = [], []
        for _ in range(polls):
            clock.set(clock.now() + cfg.interval_s)
            t0 = time.perf_counter_ns()
            channel.poll()
            t1 = time.perf_counter_ns()
            channel.poll()
            t2 = time.perf_counter_ns()
            runs.append((t1 - t0) / 1e3)
            skips.append((t2 - t1) / 1e3)
            if router.summary_due(cfg.stale_after_s / 3):
                router.publish()
        return float(np.median(runs)), float(np.median(skips))
    finally:
        channel.close()


def measure(n: int, decisions: int, peers: int) -> dict[str, float]:
    clock = ManualClock(10.0)
    alone = _router(n, None, clock)
    held = [alone.route(f) for f in _features(8 * n, 1)]
    base = _decisions_us(alone, _features(decisions, 2))
    me = _router(n, "me", clock)
    mine = [me.route(f) for f in _features(8 * n, 1)]
    others = [_router(n, f"peer{p}", clock) for p in range(peers)]
    theirs = [[o.route(f) for f in _features(8 * n, 10 + p)] for p, o in enumerate(others)]
    for o in others:
        me.receive(o.publish())
    with_peers = _decisions_us(me, _features(decisions, 2))
    # The same with peers.mirror on (the default): every dispatch and release is marked, and each
    # decision adds the own change since each peer's summary (peer_mirror.py).
    # The clock moves MIRROR_STEP_S per decision and the peers' summaries arrive every
    # MIRROR_SUMMARY_EVERY decisions (5 ms: a busy exchange), so the marks and windows are as in use.
    mirroring = _router(n, "me", clock, follow_s=MIRROR_FOLLOW_S)
    mirrored_held = [mirroring.route(f) for f in _features(8 * n, 1)]

    def tick(k: int) -> None:
        clock.set(clock.now() + MIRROR_STEP_S)
        if k % MIRROR_SUMMARY_EVERY == 0:
            for o in others:
                mirroring.receive(o.publish())

    tick(0)
    with_mirror = _decisions_us(mirroring, _features(decisions, 2), tick)
    for t in mirrored_held:
        mirroring.release(t)
    # One summary with OBSERVATIONS completions: sender and receiver.
    sender = others[0]
    send_us, recv_us, sizes = [], [], []
    for _ in range(200):
        for t in theirs[0][:OBSERVATIONS]:
            clock.set(clock.now() + 1e-3)
            sender.first_token(t, clock.now())
            sender.complete(t, 50)
        t0 = time.perf_counter_ns()
        data = encode(sender.publish(), KEY)
        t1 = time.perf_counter_ns()
        me.receive(decode(data, KEY))
        t2 = time.perf_counter_ns()
        send_us.append((t1 - t0) / 1e3)
        recv_us.append((t2 - t1) / 1e3)
        sizes.append(len(data))
    empty_us = []
    for _ in range(200):  # a summary without completions (a quiet interval)
        data = encode(sender.publish(), KEY)
        t0 = time.perf_counter_ns()
        me.receive(decode(data, KEY))
        empty_us.append((time.perf_counter_ns() - t0) / 1e3)
    poll_us, poll_skip_us = asyncio.run(_poll_us(me, clock, 2000))
    for t in held:
        alone.release(t)
    for t in mine:
        me.release(t)
    for o, ts in zip(others, theirs, strict=True):
        for t in ts:
            o.release(t)
    return {
        "route_release_p50_us": float(np.percentile(base, 50)),
        "route_release_p99_us": float(np.percentile(base, 99)),
        "with_peers_p50_us": float(np.percentile(with_peers, 50)),
        "with_peers_p99_us": float(np.percentile(with_peers, 99)),
        "with_mirror_p50_us": float(np.percentile(with_mirror, 50)),
        "with_mirror_p99_us": float(np.percentile(with_mirror, 99)),
        "send_p50_us": float(np.median(send_us)),
        "receive_p50_us": float(np.median(recv_us)),
        "receive_empty_p50_us": float(np.median(empty_us)),
        "datagram_bytes": float(np.median(sizes)),
        "poll_p50_us": poll_us,
        "poll_skipped_p50_us": poll_skip_us,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--sizes", default="4,64,512")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rows: dict[str, Any] = {}
    for n in [int(x) for x in args.sizes.split(",")]:
        rows[str(n)] = measure(n, args.decisions, args.peers)
        print(n, json.dumps({k: round(v, 1) for k, v in rows[str(n)].items()}), flush=True)
    lines = [
        "# What exchanging summaries costs (peers)",
        "",
        f"`python benchmarks/peers_cost.py {' '.join(argv if argv is not None else sys.argv[1:])}` on "
        f"{platform.machine()}, Python {platform.python_version()}, one core; µs. Decision: route + "
        f"release, default policy, 8 requests in flight per backend, with {args.peers} current peer "
        f"summaries or none, and with them and `peers.mirror` (the default). One summary: publish + "
        f"encode (sender), decode + receive (each receiver), "
        f"{OBSERVATIONS} completions in it. Poll: `PeerChannel.poll` before a decision, when its "
        "interval has passed with nothing waiting or due, and within its interval.",
        "",
        "| backends | decision p50 / p99 | with peers p50 / p99 | with peers and mirror p50 / p99 "
        "| send p50 | receive p50 | receive p50, no completions | datagram bytes | poll p50 "
        "| poll p50, skipped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, r in rows.items():
        lines.append(
            f"| {n} | {r['route_release_p50_us']:.1f} / {r['route_release_p99_us']:.1f} | "
            f"{r['with_peers_p50_us']:.1f} / {r['with_peers_p99_us']:.1f} | "
            f"{r['with_mirror_p50_us']:.1f} / {r['with_mirror_p99_us']:.1f} | {r['send_p50_us']:.0f} | "
            f"{r['receive_p50_us']:.0f} | {r['receive_empty_p50_us']:.0f} | {r['datagram_bytes']:.0f} | "
            f"{r['poll_p50_us']:.1f} | {r['poll_skipped_p50_us']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers_cost.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "sizes": rows}, indent=1) + "\n"
    )
    (args.out / "peers_cost.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
