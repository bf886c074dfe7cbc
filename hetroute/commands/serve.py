"""``hetroute serve``: run the gateway from a config file or a quick ``--backend`` list.

Owns process-level concerns only: argument parsing, logging set-up, discovery of
backends' engines and models, the uvloop event loop (installed here and nowhere else),
and graceful shutdown: on SIGTERM/SIGINT the listener closes, in-flight streams get
``server.shutdown_grace_s`` to finish, those still running then end with the API's error
event (:mod:`hetroute.proxy.drain`), and the process exits within the grace period + 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
from dataclasses import replace
from typing import TextIO

from hetroute.app import CLIENT_GUARD, FORWARDER, build_app, start_app
from hetroute.backends.discovery import discover
from hetroute.config import Config, load_config, quick_config
from hetroute.errors import ConfigError
from hetroute.proxy.admin_auth import admin_exposure_warning, read_token_file
from hetroute.proxy.drain import drain

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
            "default, and keeps re-learning when a backend's speed changes."
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
    learning = cfg.learning
    if args.state_dir:
        learning = replace(learning, state_dir=args.state_dir)
    cfg = replace(cfg, server=server, learning=learning)
    if args.admin_token_file:
        cfg = replace(cfg, admin_token=read_token_file(args.admin_token_file))
    return cfg


def warn_if_admin_exposed(cfg: Config) -> None:
    """Log a WARNING when ``/admin`` is open to anyone who can reach a non-loopback listener."""
    warning = admin_exposure_warning(cfg.server.host, cfg.admin_token)
    if warning is not None:
        log.warning("%s", warning)


def _describe(cfg: Config) -> str:
    backends = [
        {
            "name": b.name,
            "url": b.url,
            "engine": b.engine,
            "models": list(b.models or ()),
            "profile": b.profile_path,
        }
        for b in cfg.backends
    ]
    return json.dumps(
        {
            "policy": cfg.policy.type,
            "predictor": cfg.predictor.type if cfg.predictor else "default",
            "backends": backends,
            "listen": f"{cfg.server.host}:{cfg.server.port}",
            "client_limits": {
                k: getattr(cfg.server, k)
                for k in ("header_timeout_s", "body_timeout_s", "keepalive_idle_s", "max_connections")
            },
            "admin_token": "set" if cfg.admin_token else "none",
        }
    )


async def _flush_every(stream: TextIO, interval_s: float) -> None:
    """Access-log lines are written to a buffered stdout; push them out periodically."""
    while True:
        await asyncio.sleep(interval_s)
        stream.flush()


async def _serve(cfg: Config) -> None:
    """Discover, start, and on SIGTERM/SIGINT close the listener and drain in-flight requests."""
    cfg = await discover(cfg)
    log.info("effective config: %s", _describe(cfg))
    warn_if_admin_exposed(cfg)
    out = sys.stdout
    app = build_app(cfg, access_sink=out.write)
    runner, port = await start_app(app, cfg.server.host, cfg.server.port)
    # Everything built so far lives as long as the process: keep it out of the cyclic GC's
    # scans, so a full collection does not stall requests for milliseconds.
    gc.freeze()
    flusher = asyncio.create_task(_flush_every(out, 0.5))
    log.info("hetroute listening on http://%s:%d", cfg.server.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down: draining in-flight requests for up to %gs", cfg.server.shutdown_grace_s)
        await drain(runner, app[FORWARDER], app[CLIENT_GUARD], cfg.server.shutdown_grace_s)
    finally:
        await runner.cleanup()  # no-op after drain; cuts everything on an error
        flusher.cancel()
        out.flush()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        cfg = _load(args)
        import uvloop  # the serve command is the only place the event loop is chosen

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve(cfg))
    except ConfigError as exc:
        print(f"hetroute serve: config error: {exc}", file=sys.stderr)
        return 2
    return 0
