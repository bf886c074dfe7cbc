"""``hetroute serve --workers N``: N gateway processes share one listening port (``SO_REUSEPORT``).

**Process model.** The parent (the supervisor) loads the config and runs discovery once, then starts
N workers with :mod:`multiprocessing`'s ``spawn`` context, handing each the resolved, frozen
:class:`~hetroute.config.Config`, its index k and its end of a pipe. Why ``spawn`` and not a
``subprocess`` re-running ``python -m hetroute serve ... --worker-index k``: every worker gets the
very config the parent validated and discovered (no second read of the config and token files, no N
discoveries that could disagree about a backend's engine or models, no token on a command line), and
the pipe, which a bare subprocess would need to be given by hand, carries the worker's "listening"
and tells the worker when the parent is gone. Why not ``fork``: a spawned worker starts from a fresh
interpreter, so no event loop, socket or lock of the parent is inherited.

**Workers.** Worker k builds its app with the one composition root (:func:`hetroute.app.build_app`,
``worker=k``) and listens on ``server.host:server.port`` with ``SO_REUSEPORT``: the kernel (Linux)
hashes each new connection to one of the listening workers. From then on a worker is the
single-process gateway: its own ledger, policy, learner, prefix index, admission gate, connection
limit (``server.max_connections`` per worker) and ``/admin``, ``/metrics`` and ``/health``; it
learns from its own traffic only and sees the other workers' requests as the engines' scraped
load (``scrape.foreign_load``, :mod:`hetroute.routing.foreign`). Its random choices are seeded with
``seed + k``; its responses carry ``x-hetroute-worker: k``. **Learned models**: every worker starts
from ``learning.state_dir`` but only worker 0 writes there. Connections are spread by a hash, so
worker 0's traffic is a fair sample of the whole and its models are as good as any worker's; one
writer needs no locking and keeps the directory's layout that of a single process (a restart with
another N, or with one process, starts from the same files).

**Supervision** (all bounded):

- start-up: every worker must be listening within :data:`WORKER_START_S`, else all are stopped and
  the parent exits 1; then it logs one line, ``N workers serving on http://host:port (pids ...)``;
- SIGTERM/SIGINT: forwarded to every worker as SIGTERM; each drains like the single process
  (``server.shutdown_grace_s``); after ``shutdown_grace_s`` + :data:`STOP_MARGIN_S` those left are
  killed. The parent exits 0 when every worker exited 0 (or was stopped before it listened);
- a worker that exits unasked (crash, OOM kill) once all were listening is started again under the
  same index (the others keep serving), at most ``server.worker_restarts`` times in any
  :data:`RESTART_WINDOW_S`; a started-again worker re-reads the config file's backends (as on
  SIGHUP), so it serves what the others serve. One exit more than that, or any exit before every
  worker was listening (a failed bind, a bad environment), stops the others the same way as SIGTERM
  and the parent exits 1, so the process manager restarts the whole group;
- SIGHUP: forwarded to every worker, which applies the config file's backends itself
  (:mod:`hetroute.commands.reload`);
- a worker whose parent disappears (``SIGKILL``) reads end-of-file on its pipe and shuts down
  gracefully: no orphan keeps serving the port.

``multiprocessing`` also starts its resource-tracker helper, one small process that exits when the
parent does.

**Access log.** The workers share the parent's stdout; each writes whole lines, at most ``PIPE_BUF``
bytes per write (:class:`~hetroute.access_log.WholeLineWriter`), so lines never interleave mid-line.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Literal

from hetroute.access_log import WholeLineWriter
from hetroute.app import build_app, start_app
from hetroute.backends.discovery import discover
from hetroute.commands.serving import describe, reload_on_sighup, serve_until, stop_on, warn_if_admin_exposed
from hetroute.config import Config

log = logging.getLogger("hetroute.serve")

WORKER_START_S = 60.0
"""Bound on a worker's start: interpreter, imports, app, listening (seconds)."""
STOP_MARGIN_S = 5.0
"""Beyond ``server.shutdown_grace_s``, how long the parent waits for the workers to exit before
killing them (a worker's own drain ends within grace + 1 s)."""
KILL_WAIT_S = 5.0
"""How long the parent waits for killed workers to be reaped."""
RESTART_WINDOW_S = 60.0
"""``server.worker_restarts`` counts the restarts within this many seconds."""

EventKind = Literal["ready", "exit", "signal"]


@dataclass(slots=True)
class _Worker:
    index: int
    process: SpawnProcess
    conn: Connection
    """The parent's end of the worker's pipe: one message (the bound port) when it listens; the
    worker reads end-of-file on its end when the parent is gone."""
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    reported: bool = False
    """Its exit was already logged as unexpected."""
    listening: bool = False
    """It reported its port: its SIGHUP handler is in place."""
    reload_pending: bool = False
    """A SIGHUP came before it listened: it is sent one as soon as it does."""
    started_s: float = 0.0
    """Loop time of its start: it must listen within :data:`WORKER_START_S` of it."""


Event = tuple[EventKind, "_Worker | None", int]
"""(kind, the worker it concerns (None for a signal), the port or the signal number). The worker
object, not its index: a worker started again under an index never receives its predecessor's
events."""


def supervise(cfg: Config, log_level: str, config_path: str | None = None) -> int:
    """Run ``cfg.server.workers`` worker processes until SIGTERM/SIGINT or one exits unasked (see the
    module doc); returns the parent's exit status. Config and discovery errors raise ConfigError."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_supervise(cfg, log_level, config_path))


async def _supervise(cfg: Config, log_level: str, config_path: str | None) -> int:
    cfg = await discover(cfg)
    log.info("effective config: %s", describe(cfg))
    warn_if_admin_exposed(cfg)
    if not cfg.scrape.enabled or cfg.scrape.foreign_load == "off":
        log.warning(
            "%d workers that do not read the engines' load (scrape.enabled / scrape.foreign_load) "
            "each route as if they were alone",
            cfg.server.workers,
        )
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before any worker exists: none is left behind
        loop.add_signal_handler(sig, events.put_nowait, ("signal", None, int(sig)))
    workers: list[_Worker] = []
    loop.add_signal_handler(signal.SIGHUP, _forward_sighup, workers)
    ctx = multiprocessing.get_context("spawn")

    def start(index: int) -> _Worker:
        return _start(ctx, cfg, index, log_level, events, config_path)

    failed = True
    try:
        for k in range(cfg.server.workers):
            workers.append(start(k))
        failed = await _until_stopped(cfg, workers, events, start, reload_restarted=config_path is not None)
    finally:
        clean = await _stop(workers, cfg.server.shutdown_grace_s + STOP_MARGIN_S)
        for w in workers:
            w.conn.close()
    return 1 if failed or not clean else 0


def _forward_sighup(workers: list[_Worker]) -> None:
    """SIGHUP reaches the supervisor: every worker reloads the config file's backends itself."""
    log.info("SIGHUP: asking %d workers to reload the backends", len(workers))
    for w in workers:
        if w.listening:
            _sighup(w)
        else:  # still starting: a SIGHUP now would kill it before its handler is in place
            w.reload_pending = True


def _sighup(w: _Worker) -> None:
    if w.process.pid is not None and w.process.exitcode is None:
        os.kill(w.process.pid, signal.SIGHUP)


def _start(
    ctx: multiprocessing.context.SpawnContext,
    cfg: Config,
    index: int,
    log_level: str,
    events: asyncio.Queue[Event],
    config_path: str | None = None,
) -> _Worker:
    """Start worker ``index``; its readiness and its exit arrive on ``events``."""
    mine, theirs = ctx.Pipe()
    process = ctx.Process(
        target=worker_main, args=(cfg, index, theirs, log_level, config_path), name=f"hetroute-worker-{index}"
    )
    process.start()  # fork + exec and a few KB into a pipe: short, and only at start-up
    theirs.close()
    loop = asyncio.get_running_loop()
    worker = _Worker(index, process, mine, started_s=loop.time())

    def on_exit() -> None:
        loop.remove_reader(process.sentinel)
        worker.exited.set()
        events.put_nowait(("exit", worker, 0))

    def on_message() -> None:
        loop.remove_reader(mine.fileno())
        try:
            port = mine.recv()
        except (EOFError, OSError):
            return  # it exited before listening: its sentinel reports that
        events.put_nowait(("ready", worker, int(port)))

    loop.add_reader(process.sentinel, on_exit)
    loop.add_reader(mine.fileno(), on_message)
    return worker


async def _until_stopped(
    cfg: Config,
    workers: list[_Worker],
    events: asyncio.Queue[Event],
    start: Callable[[int], _Worker],
    reload_restarted: bool = False,
) -> bool:
    """Wait for every worker to listen, then for a signal; start a worker again when it exits unasked
    (within ``server.worker_restarts`` per :data:`RESTART_WINDOW_S`). True: a failure (a worker not
    listening in time, an exit before all listened, or one restart too many)."""
    loop = asyncio.get_running_loop()
    serving = False  # every worker was listening once: exits from now on are restarted
    restarts: deque[float] = deque()
    while True:
        starting = [w.started_s + WORKER_START_S for w in workers if not w.listening]
        try:
            async with asyncio.timeout_at(min(starting) if starting else None):
                kind, w, value = await events.get()
        except TimeoutError:
            late = [w.index for w in workers if not w.listening]
            log.error("workers %s were not listening after %gs; stopping", late, WORKER_START_S)
            return True
        if kind == "signal" or w is None:
            log.info("%s: stopping %d workers", signal.Signals(value).name, len(workers))
            return False
        if workers[w.index] is not w:  # pragma: no cover - events of a replaced worker: none follow its exit
            continue
        if kind == "exit":
            w.process.join()  # already exited: reaps at once
            w.reported = True
            now = loop.time()
            while restarts and restarts[0] <= now - RESTART_WINDOW_S:
                restarts.popleft()
            if not serving or len(restarts) >= cfg.server.worker_restarts:
                log.error(
                    "worker %d (pid %s) exited unexpectedly with status %s; stopping the others%s",
                    w.index,
                    w.process.pid,
                    w.process.exitcode,
                    "" if not serving else f" ({len(restarts)} restarts in the last {RESTART_WINDOW_S:g}s)",
                )
                return True
            restarts.append(now)
            log.error(
                "worker %d (pid %s) exited unexpectedly with status %s; starting it again (restart %d of "
                "at most %d in %gs)",
                w.index,
                w.process.pid,
                w.process.exitcode,
                len(restarts),
                cfg.server.worker_restarts,
                RESTART_WINDOW_S,
            )
            w.conn.close()
            fresh = start(w.index)
            fresh.reload_pending = reload_restarted  # the file's backends, as the others reloaded them
            workers[w.index] = fresh
            continue
        w.listening = True
        if w.reload_pending:
            w.reload_pending = False
            _sighup(w)
        if serving:
            log.info("worker %d listening again (pid %s)", w.index, w.process.pid)
        elif all(x.listening for x in workers):
            serving = True
            log.info(
                "hetroute: %d workers serving on http://%s:%d (pids %s)",
                len(workers),
                cfg.server.host,
                value,
                ", ".join(str(x.process.pid) for x in workers),
            )


async def _stop(workers: list[_Worker], bound_s: float) -> bool:
    """SIGTERM every live worker, kill those left after ``bound_s``, reap all; True when every
    worker exited 0 or by the SIGTERM that came before it was listening."""
    for w in workers:
        if not w.exited.is_set():
            w.process.terminate()
    clean = True
    waits = [asyncio.ensure_future(w.exited.wait()) for w in workers]
    _, late = await asyncio.wait(waits, timeout=bound_s)
    if late:
        for w in workers:
            if not w.exited.is_set():
                log.error(
                    "worker %d (pid %s) still running after %gs: killing it", w.index, w.process.pid, bound_s
                )
                w.process.kill()
        clean = False
        _, lost = await asyncio.wait(late, timeout=KILL_WAIT_S)
        for task in lost:
            task.cancel()
    for w in workers:
        if not w.exited.is_set():
            continue  # not reaped: joining would block; the OS reaps it when the parent exits
        w.process.join()
        if w.process.exitcode not in (0, -signal.SIGTERM):
            clean = False
            if not w.reported:
                log.error(
                    "worker %d (pid %s) exited with status %s", w.index, w.process.pid, w.process.exitcode
                )
    return clean


# ---------------------------------------------------------------- the worker process


def worker_main(
    cfg: Config, index: int, parent: Connection, log_level: str, config_path: str | None = None
) -> None:
    """Entry point of worker ``index`` in its spawned process: the gateway of ``cfg`` on the shared
    port until SIGTERM or until the parent is gone; exits 1 when it cannot listen."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the parent, which stops us
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the loop's reload handler is in place
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(name)s [worker {index}] %(message)s",
    )
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_worker(cfg, index, parent, config_path))


async def _worker(cfg: Config, index: int, parent: Connection, config_path: str | None) -> None:
    stop = stop_on((signal.SIGTERM,))  # before listening: a SIGTERM from now on drains
    loop = asyncio.get_running_loop()

    def parent_gone() -> None:  # the parent never writes: readable means end-of-file
        loop.remove_reader(parent.fileno())
        log.warning("the supervisor is gone: shutting down")
        stop.set()

    loop.add_reader(parent.fileno(), parent_gone)
    out = WholeLineWriter(sys.stdout.fileno())
    app = build_app(cfg, access_sink=out.write, worker=index)
    try:
        runner, port = await start_app(app, cfg.server.host, cfg.server.port, reuse_port=True)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", cfg.server.host, cfg.server.port, exc)
        raise SystemExit(1) from exc
    reload_on_sighup(app, config_path)
    parent.send(port)
    log.info("listening on http://%s:%d (pid %d)", cfg.server.host, port, os.getpid())
    await serve_until(stop, app, runner, out)
