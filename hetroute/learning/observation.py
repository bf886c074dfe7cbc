"""One finished request as the latency learner sees it (built by the router from a ticket).

Every field is what the router itself measured, so the same observation comes from the gateway and
from the simulator. Counts are the router's own ledger on that backend (requests it dispatched there),
taken at three instants of the request's life:

- at dispatch: ``pending_tokens_ahead`` (Σ of the uncached prompt tokens, I less the tokens expected in
  the prefix cache, of earlier requests still waiting for their first token),
- at the first token: ``in_flight_at_first`` and ``context_at_first`` (Σ I + generated in flight),
- at the end: ``in_flight_at_end`` and ``context_at_end``.

``ttft_s`` is None when the time to first token was not seen (a non-streaming answer arrives whole).
``engine_running`` is the engine's own count of running sequences in the latest scrape at the end
(None when the engine does not export it): the router's in-flight count also holds requests the
engine keeps waiting, so the decode batch is scaled by ``engine_running / in_flight_at_end`` when
that is below 1.
"""

from __future__ import annotations

from typing import NamedTuple


class Observation(NamedTuple):
    """A successful request on backend ``backend_index`` (times in seconds, counts in tokens).

    Immutable; a named tuple rather than a frozen dataclass because one is built for every
    finished request, at a third of the cost (``_replace`` makes a changed copy)."""

    backend_index: int
    finished_at_s: float
    input_tokens: int
    output_tokens: int
    ttft_s: float | None
    e2e_s: float
    pending_tokens_ahead: float
    in_flight_at_first: float
    context_at_first: float
    in_flight_at_end: float
    context_at_end: float
    engine_running: float | None = None
    cached_tokens: float = 0.0
    """Prompt tokens the router expected in the engine's prefix cache (not prefilled)."""

    @property
    def decode_s(self) -> float | None:
        """Time from the first token to the end, when the first token was seen."""
        return None if self.ttft_s is None else max(self.e2e_s - self.ttft_s, 0.0)
