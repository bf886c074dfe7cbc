"""Fault injection of the emulator: what can go wrong, validated; and dropping a connection.

Owns :class:`FaultConfig` and :func:`drop_connection`; :class:`hetroute.sim.emulator_core.Emulator` and
the app's middleware (:mod:`hetroute.sim.emulator`) apply the faults, drawn from the app's seeded RNG:
``error_rate`` (500/503 JSON), ``crash_after_requests`` (the next generation request and every later
request, in-flight ones included, get their connection dropped), ``hang_rate`` with ``hang_after_tokens``
(never answer, or stall a stream after k tokens), ``slow_start_s`` (every endpoint answers 503 for that
many wall seconds), ``fail_mid_stream_after_tokens`` (drop the connection after k tokens), and a slow-down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aiohttp import web

from hetroute.errors import ConfigError


@dataclass(frozen=True)
class FaultConfig:
    """Injected failures; rates are probabilities per generation request, drawn from the app's seeded RNG.

    - ``error_rate``: answer 500 or 503 (even odds) with the engine's JSON error shape.
    - ``crash_after_requests``: after N generation requests, the next one crashes the server: it and
      every later request (any endpoint), and all requests in flight, get their connection dropped.
    - ``hang_rate``: the request is accepted and never answered (``hang_after_tokens`` None) or its
      stream stalls after ``hang_after_tokens`` tokens (a non-stream request then never completes).
    - ``slow_start_s``: every endpoint answers 503 until that many seconds (injected clock) after start.
    - ``fail_mid_stream_after_tokens``: every request's connection is dropped after k tokens.
    - ``slowdown_factor`` / ``slowdown_after_s``: from that many seconds (injected clock) after start,
      every engine step takes ``slowdown_factor`` times its modelled time (another tenant on the GPU,
      thermal throttling); the simulator's ``Slowdown`` is the same fault.
    """

    error_rate: float = 0.0
    crash_after_requests: int | None = None
    hang_rate: float = 0.0
    hang_after_tokens: int | None = None
    slow_start_s: float = 0.0
    fail_mid_stream_after_tokens: int | None = None
    slowdown_factor: float = 1.0
    slowdown_after_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.slowdown_factor > 0 and math.isfinite(self.slowdown_factor)):
            raise ConfigError(
                "faults.slowdown_factor", f"expected a finite number > 0, got {self.slowdown_factor!r}"
            )
        if self.slowdown_after_s < 0 or not math.isfinite(self.slowdown_after_s):
            raise ConfigError(
                "faults.slowdown_after_s", f"expected a finite number >= 0, got {self.slowdown_after_s!r}"
            )
        for name in ("error_rate", "hang_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"faults.{name}", f"expected a probability in [0, 1], got {value!r}")
        if self.slow_start_s < 0 or not math.isfinite(self.slow_start_s):
            raise ConfigError(
                "faults.slow_start_s", f"expected a finite number >= 0, got {self.slow_start_s!r}"
            )
        for name in ("crash_after_requests", "hang_after_tokens", "fail_mid_stream_after_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"faults.{name}", f"expected an integer >= 0 or None, got {value!r}")


def drop_connection(request: web.Request) -> web.StreamResponse:
    """Abort the TCP connection (the client sees a disconnect); returns a response aiohttp can discard."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response()
