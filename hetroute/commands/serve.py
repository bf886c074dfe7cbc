"""``hetroute serve``: run the gateway from a config file or a quick ``--backend`` list.

Owns process-level concerns only: argument parsing, logging set-up, discovery of
backends' engines and models, the uvloop event loop (installed here and in the workers of
:mod:`hetroute.commands.serve_workers`, nowhere else), and graceful shutdown: on SIGTERM/SIGINT
the listener closes, in-flight streams get ``server.shutdown_grace_s`` to finish, those still
running then end with the API's error event (:mod:`hetroute.proxy.drain`), and the process exits
within the grace period + 1 s. On SIGHUP the config file's ``backends:`` are applied without a restart
(:mod:`hetroute.commands.reload`). With ``server.workers`` > 1 (``--workers N``) the process supervises
N worker processes instead (:mod:`hetroute.commands.serve_workers`); with 1 it is the gateway itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import replace
from typing import TextIO

from hetroute.access_log import ACCESS_BUFFER_BYTES, WholeLineWriter
from hetroute.app import build_app, start_app
from hetroute.backends.discovery import discover
from hetroute.commands.serving import describe, reload_on_sighup, serve_until, stop_on, warn_if_admin_exposed
from hetroute.config import SHARED_PORT_ZERO, Config, load_config, quick_config
from hetroute.errors import ConfigError
from hetroute.proxy.admin_auth import read_token_file

log = logging.getLogger("hetroute.serve")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the routing gateway (OpenAI and TGI APIs)",
        description=(
            "Run the gateway in front of vLLM/TGI/OpenAI-compatible backends. Either --config FILE "
            "(every field: docs/configuration.md) or one or more --backend URL, whose engine type and "
            "models are discovered from /info (TGI) or /v1/models. No latency profile is needed: the "
            "router learns each backend's prefill and decode speed from the requests it serves "
            "(docs/learning.md), starting from a profile, the catalog's roofline prior or a neutral "
            "default, and keeps re-learning when a backend's speed changes. Backends change without a "
            "restart: SIGHUP re-reads the config file's backends, POST/DELETE /admin/backends add and "
            "drain one, and an entry with `discovery: dns` follows its host name's addresses "
            "(docs/live-backends.md)."
        ),
    )
    p.add_argument("--config", metavar="FILE", help="YAML config (see config/router.example.yaml)")
    p.add_argument(
        "--backend",
        metavar="URL",
        action="append",
        default=[],
        help="a backend URL (repeatable; no config file)",
    )
    p.add_argument("--policy", metavar="NAME", help="routing policy with --backend (default: 'default')")
    p.add_argument("--host", help="listen address (overrides server.host)")
    p.add_argument("--port", type=int, help="listen port (overrides server.port)")
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help=(
            "save each backend's live-learned latency model here (profile files, source: live) and "
            "start from them next time (overrides learning.state_dir)"
        ),
    )
    p.add_argument(
        "--admin-token-file",
        metavar="FILE",
        help="file holding the bearer token for /admin (overrides admin_token and HETROUTE_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--workers",
        metavar="N",
        type=int,
        help=(
            "run N gateway processes that share the listening port through SO_REUSEPORT (the kernel "
            "spreads new connections across them; Linux only; overrides server.workers, default 1). "
            "Each keeps its own ledger; they see each other's load through the engines' scraped "
            "metrics (scrape.foreign_load) and each learns from its own traffic, or, with peers "
            "configured, they exchange summaries of both (worker k listens on peers.listen_port + k). "
            "/admin, /metrics and "
            "/health answer for the one worker a connection reaches. A worker that dies is started "
            "again, at most server.worker_restarts (default 5) times in 60 s"
        ),
    )
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=run)


def _load(args: argparse.Namespace) -> Config:
    if args.config and args.backend:
        raise ConfigError("--backend", "use either --config or --backend, not both")
    if args.config:
        cfg = load_config(args.config)
        if args.policy:
            raise ConfigError("--policy", "with --config, set policy.type in the file")
    elif args.backend:
        cfg = quick_config(args.backend, policy=args.policy)
    else:
        raise ConfigError("--config", "give --config FILE or at least one --backend URL")
    server = cfg.server
    if args.host:
        server = replace(server, host=args.host)
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            raise ConfigError("--port", f"must be in [0, 65535], got {args.port}")
        server = replace(server, port=args.port)
    if args.workers is not None:
        if args.workers < 1:
            raise ConfigError("--workers", f"must be >= 1, got {args.workers}")
        server = replace(server, workers=args.workers)
    if server.workers > 1:
        option = "--workers" if args.workers is not None else "server.workers"
        if server.port == 0:
            raise ConfigError("--port" if args.port is not None else option, SHARED_PORT_ZERO)
        if not sys.platform.startswith("linux"):
            raise ConfigError(option, "more than 1 needs Linux (SO_REUSEPORT spreads connections there)")
    learning = cfg.learning
    if args.state_dir:
        learning = replace(learning, state_dir=args.state_dir)
    cfg = replace(cfg, server=server, learning=learning)
    if args.admin_token_file:
        cfg = replace(cfg, admin_token=read_token_file(args.admin_token_file))
    return cfg


async def _serve(cfg: Config, config_path: str | None) -> None:
    """Discover, start, reload the backends of ``config_path`` on SIGHUP, and on SIGTERM/SIGINT close
    the listener and drain in-flight requests."""
    cfg = await discover(cfg)
    log.info("effective config: %s", describe(cfg))
    warn_if_admin_exposed(cfg)
    out = access_out()
    app = build_app(cfg, access_sink=out.write)
    runner, port = await start_app(app, cfg.server.host, cfg.server.port)
    reload_on_sighup(app, config_path)
    log.info("hetroute listening on http://%s:%d", cfg.server.host, port)
    await serve_until(stop_on((signal.SIGTERM, signal.SIGINT)), app, runner, out)


def access_out() -> WholeLineWriter | TextIO:
    """Where the access log's lines go: stdout's file descriptor through a buffer of the router's own
    (:data:`ACCESS_BUFFER_BYTES`, written out when full, every 0.5 s and at exit), so that an
    unbuffered stdout (``PYTHONUNBUFFERED``, set in most container images, ours included) does not
    cost a write system call per line; ``sys.stdout`` itself when it has no file descriptor."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return sys.stdout
    sys.stdout.flush()
    return WholeLineWriter(fd, limit=ACCESS_BUFFER_BYTES)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the reload handler is in place
    try:
        cfg = _load(args)
        if cfg.server.workers > 1:
            from hetroute.commands.serve_workers import supervise

            return supervise(cfg, args.log_level, args.config)
        import uvloop  # the serve command is the only place the event loop is chosen

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve(cfg, args.config))
    except ConfigError as exc:
        print(f"hetroute serve: config error: {exc}", file=sys.stderr)
        return 2
    return 0
