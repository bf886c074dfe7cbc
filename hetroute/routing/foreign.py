"""Load the ledger cannot see: requests other routers (replicas, direct clients) sent to a backend.

A router replica's ledger holds only its own dispatches. The engines' scrapes hold the truth at the
scrape instant t_s: running and waiting requests, whoever sent them. Per backend b, when a scrape is
published (:meth:`ForeignLoad.scraped`), the router's own in-flight count at that instant is set
against it:

    foreign_b = max(running_b(t_s) + waiting_b(t_s) − own_b(t_s), 0)

The router's own dispatches since t_s are in its ledger exactly; what it adds for the others depends
on the mode (``scrape.foreign_load``), with ρ = Σ_b foreign_b / Σ_b own_b(t_s) over freshly scraped
backends, the fleet-wide ratio of the others' requests to this router's:

- ``off``: nothing (each replica balances its own share of the traffic);
- ``raw``: foreign_b, held until the next scrape of b;
- ``scaled``: ρ · own_b(now), the live ledger scaled by the fleet ratio;
- ``scaled_excess`` (default): max(ρ · own_b(now) + foreign_b − ρ · own_b(t_s), 0), scaled plus each
  backend's departure from the fleet ratio at the scrape.

Why ``scaled_excess`` (docs/replicas.md has the figures). The engines' counts are up to one scrape
interval old, and every replica reads the same ones. Held as they are (``raw``), they make the
replicas pile onto the backend that looked least loaded at the last scrape: in the simulator
(``benchmarks/replicas.py``) ``raw`` had the worst p99 TTFT (paper-b at 24 req/s, 4 replicas: 1.68×
one router). Scaling the live ledger keeps each replica's decisions as fresh as its own dispatches,
while its KV-usage term and the weight of a new request against the load already there see the
whole engine. But ``scaled`` alone is blind where this replica has nothing in flight: a backend
that only the other replicas are using looks idle to it; ``scaled_excess`` adds each backend's
departure from the fleet ratio, which there is the others' whole load. Through real gateways
(paper-a, 400 requests, a quiet machine) the three are equal at 24 req/s; at rate ∞
``scaled_excess`` kept 0.984× / 0.968× of one gateway's throughput with 2 / 4 replicas, ``scaled``
0.912× / 0.925×, ``off`` 0.915× / 0.919× (one run each). In the simulator the two scaled modes are
within one cell of each other (43 and 44 of 48 within the bars).

Each counted request is like the router's own requests on b now: the ledger's per-request means on b
(tokens in flight, predicted and generated tokens, workload), or, while the router has nothing in
flight there, the mean of what it last dispatched there (an EWMA at dispatch). A waiting share
``waiting_b / (running_b + waiting_b)`` of them also counts as pending prefill.

The ledger itself is never touched (its accounting stays exact); the foreign load is added to the
snapshot's copies only (:meth:`ForeignLoad.added`). With one router and no other client, the engine
counts exactly the router's own requests and foreign_b is 0: decisions are unchanged. A backend
whose latest scrape is stale or missing (not the one recorded) gets no foreign load.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from hetroute.routing.ledger import (
    FLOAT_ROWS,
    INPUT_ROW,
    PENDING_ROW,
    PREDICTED_ROW,
    REMAINING_ROW,
    WORKLOAD_ROW,
    item_view,
)
from hetroute.types import EngineMetrics, FloatArray, IntArray

ForeignMode = Literal["off", "raw", "scaled", "scaled_excess"]
FOREIGN_MODES: tuple[ForeignMode, ...] = ("off", "raw", "scaled", "scaled_excess")
DEFAULT_FOREIGN_MODE: ForeignMode = "scaled_excess"
DISPATCH_EWMA = 0.1
"""Weight of the latest dispatch in the per-backend request profile used while nothing is in flight."""
_PROFILE_ROWS = (INPUT_ROW, REMAINING_ROW, PREDICTED_ROW, WORKLOAD_ROW)
"""The ledger rows a backend's request profile follows (generated tokens and pending prefill stay 0)."""


class ForeignLoad:
    """Per-backend foreign requests from the engines' scrapes (see module docstring)."""

    __slots__ = (
        "mode",
        "peers",
        "_calibrated",
        "_counts",
        "_own_at_scrape",
        "_waiting_share",
        "_seen",
        "_profile",
        "_profile_items",
        "_any",
        "_live_key",
        "_live",
    )

    def __init__(self, backends: int, mode: ForeignMode = DEFAULT_FOREIGN_MODE, peers: int = 0) -> None:
        """``peers``: the other router replicas expected to share the engines (a hint, ``replicas`` − 1;
        see :meth:`counts`)."""
        self.mode = mode
        self.peers = peers
        self._calibrated = False
        """A scrape has seen some of this router's own requests (the peer hint is off from then on)."""
        self._counts: FloatArray = np.zeros(backends, dtype=np.float64)
        self._own_at_scrape: FloatArray = np.zeros(backends, dtype=np.float64)
        self._waiting_share: FloatArray = np.zeros(backends, dtype=np.float64)
        self._seen: list[EngineMetrics | None] = [None] * backends
        self._profile: FloatArray = np.zeros((FLOAT_ROWS, backends), dtype=np.float64)
        """Rows as the ledger's; a column of zeros until the first dispatch to that backend."""
        self._bind_profile()
        self._any = False
        self._live_key: tuple[EngineMetrics | None, ...] | None = None
        self._live: tuple[FloatArray, FloatArray, float] = (self._counts, self._own_at_scrape, 0.0)

    def set_slot(self, backend: int) -> None:
        """Slot ``backend`` starts afresh (live backend changes): one past the last grows the arrays."""
        if backend == len(self._seen):
            self._counts = np.append(self._counts, 0.0)
            self._own_at_scrape = np.append(self._own_at_scrape, 0.0)
            self._waiting_share = np.append(self._waiting_share, 0.0)
            self._seen.append(None)
            self._profile = np.hstack([self._profile, np.zeros((FLOAT_ROWS, 1), dtype=np.float64)])
            self._bind_profile()
        else:
            self._counts[backend] = self._own_at_scrape[backend] = self._waiting_share[backend] = 0.0
            self._seen[backend] = None
            self._profile[:, backend] = 0.0
        self._any = self.mode != "off" and bool(self._counts.any())
        self._live_key = None

    def scraped(self, backend: int, metrics: EngineMetrics, own_in_flight: float) -> None:
        """Backend ``backend``'s scrape ``metrics`` was just published; the router had
        ``own_in_flight`` requests there at that instant."""
        running, waiting = metrics.num_requests_running, metrics.num_requests_waiting
        self._seen[backend] = metrics
        if own_in_flight > 0 and running is not None:
            self._calibrated = True
        self._own_at_scrape[backend] = own_in_flight
        if running is None:
            self._counts[backend] = 0.0
        else:
            total = running + (waiting or 0.0)
            self._counts[backend] = max(total - own_in_flight, 0.0)
            self._waiting_share[backend] = (waiting or 0.0) / total if total > 0 else 0.0
        self._any = self.mode != "off" and bool(self._counts.any())
        self._live_key = None

    def dispatched(
        self, backend: int, input_tokens: float, predicted_output_tokens: float, workload_s: float
    ) -> None:
        """Fold a dispatch into ``backend``'s request profile (used while nothing is in flight there)."""
        rows = self._profile_items
        rate = DISPATCH_EWMA if rows[0][backend] > 0.0 else 1.0  # the first dispatch sets it
        for row, value in zip(
            rows, (input_tokens, predicted_output_tokens, predicted_output_tokens, workload_s), strict=True
        ):
            old = row[backend]
            row[backend] = old + rate * (value - old)

    def _bind_profile(self) -> None:
        """Item views of the profile's ``_PROFILE_ROWS`` (plain floats per dispatch, the same arithmetic
        as numpy's), rebound whenever the array is replaced."""
        self._profile_items = tuple(item_view(self._profile[row]) for row in _PROFILE_ROWS)

    def counts(self, metrics: tuple[EngineMetrics | None, ...], own_now: IntArray) -> FloatArray | None:
        """Foreign requests per backend under the latest ``metrics`` (None when there are none).

        Until a scrape has ever seen any of this router's own requests (so nothing has yet measured
        the others' share), a scaled mode with ``peers`` > 0 takes ρ = ``peers``: each other replica is
        assumed to have sent as much as this one (``peers · own_b(now)``). That is the start-up burst,
        routed before any engine has reported it, when nothing else tells a replica that it holds only
        part of the traffic. Once calibrated, the scrapes alone decide (at low load an engine is often
        empty at the scrape instant, which is no evidence that the others send nothing)."""
        if not self._any:
            hinted = self.peers and not self._calibrated and self.mode in ("scaled", "scaled_excess")
            if hinted and own_now.any():
                prior: FloatArray = self.peers * own_now.astype(np.float64)
                return prior
            return None
        if metrics != self._live_key:  # element identity first: cheap while the scrapes are unchanged
            live = np.array([m is not None and m is s for m, s in zip(metrics, self._seen, strict=True)])
            foreign = np.where(live, self._counts, 0.0)
            own_then = np.where(live, self._own_at_scrape, 0.0)
            rho = float(foreign.sum()) / max(float(own_then.sum()), 1.0)
            self._live_key, self._live = metrics, (foreign, own_then, rho)
        out, own_then, rho = self._live
        mode = self.mode
        if mode != "raw":
            scaled: FloatArray = rho * own_now.astype(np.float64)
            out = scaled if mode == "scaled" else np.maximum(scaled + out - rho * own_then, 0.0)
        return out if out.any() else None

    def added(
        self, counts: FloatArray, requests: IntArray, floats: FloatArray
    ) -> tuple[IntArray, FloatArray]:
        """The ledger's snapshot arrays with ``counts`` foreign requests added (read-only copies)."""
        own = requests.astype(np.float64)
        mean: FloatArray = np.where(own > 0, floats / np.maximum(own, 1.0), self._profile)
        extra = mean * counts
        extra[PENDING_ROW] = counts * self._waiting_share * mean[INPUT_ROW]
        out_floats: FloatArray = floats + extra
        out_floats.flags.writeable = False
        out_requests: IntArray = requests + np.rint(counts).astype(requests.dtype)
        out_requests.flags.writeable = False
        return out_requests, out_floats
