"""The typed keys under which :func:`hetroute.app.build_app` stores an app's components (aiohttp
``web.AppKey``): the one way handlers, lifecycle hooks, commands and tests reach them."""

from __future__ import annotations

from aiohttp import web

from hetroute.admission.gate import AdmissionGate
from hetroute.backends.health import HealthTracker
from hetroute.backends.membership import Membership
from hetroute.backends.scrape import MetricsStore
from hetroute.config import Config
from hetroute.learning.live import LiveModels
from hetroute.peer_channel import PeerChannel
from hetroute.proxy.client_limits import ClientGuard
from hetroute.proxy.forward import Forwarder
from hetroute.proxy.upstream import Upstream
from hetroute.routing.ledger import Ledger
from hetroute.routing.router import Router
from hetroute.telemetry import Telemetry

CONFIG = web.AppKey("config", Config)
ROUTER = web.AppKey("router", Router)
LEDGER = web.AppKey("ledger", Ledger)
HEALTH = web.AppKey("health", HealthTracker)
METRICS = web.AppKey("metrics", MetricsStore)
TELEMETRY = web.AppKey("telemetry", Telemetry)
FORWARDER = web.AppKey("forwarder", Forwarder)
UPSTREAM = web.AppKey("upstream", Upstream)
ADMISSION = web.AppKey("admission", AdmissionGate)
MEMBERSHIP = web.AppKey("membership", Membership)
LEARNER = web.AppKey("learner", LiveModels)
CLIENT_GUARD = web.AppKey("client_guard", ClientGuard)
SAVE_DIR = web.AppKey("save_dir", str)
PEERS = web.AppKey("peers", PeerChannel)
"""Where this app writes its learned models (absent: it writes none)."""
