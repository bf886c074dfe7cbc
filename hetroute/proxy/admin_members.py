"""The admin API's live backend changes: ``POST /admin/backends`` and ``DELETE /admin/backends/{name}``.

Both sit behind the admin bearer token, like ``GET /admin/backends``, and answer errors in the OpenAI
error shape the rest of ``/admin`` uses.

- ``POST /admin/backends`` takes one backend entry shaped as an item of the config's ``backends:``
  (``name``, ``url``, and optionally ``engine``, ``models``, ``gpu``, ``tp``, ``weight``, ``labels``,
  ``profile``, ``kv_capacity_tokens``, ``max_num_seqs``, ``max_model_len``). Without ``engine`` or
  ``models`` the server is asked, as at start-up (TGI ``/info``, OpenAI ``/v1/models``; the context
  window comes with the answer). 201 with the backend, its window and its slot;
  400 for a bad entry (the message names the field), 409 when the name is taken, 502 when discovery
  cannot reach the server. The backend takes traffic from the next routing decision on.
- ``DELETE /admin/backends/{name}`` stops routing to the backend at once; its in-flight requests are
  never cut. With ``?drain=true`` the call waits until they have finished (at most ``timeout_s``,
  default ``server.shutdown_grace_s``): 200 once nothing is in flight, 202 with the count when the
  wait ran out; without it the answer comes at once (200 when nothing was in flight, else 202). 404
  for a name not in the cluster.

With ``hetroute serve --workers N`` (N > 1) a request reaches one worker only, so both answer 409:
change the config file and send SIGHUP instead, which every worker applies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from aiohttp import web

from hetroute.backends.discovery import discover_backend
from hetroute.backends.membership import Membership, MembershipError
from hetroute.config import backend_from_dict
from hetroute.errors import ConfigError
from hetroute.proxy.admin_auth import bearer_token_matches
from hetroute.proxy.api_errors import ApiError
from hetroute.proxy.upstream import Upstream

MAX_ADMIN_BODY_BYTES = 64 * 1024


class MemberAdmin:
    """Handlers for the live backend changes of one app."""

    def __init__(
        self,
        membership: Membership,
        upstream: Upstream,
        *,
        admin_token: str | None,
        workers: int,
        discovery_timeout_s: float,
        default_drain_timeout_s: float,
        base_dir: Path | None = None,
    ) -> None:
        """``upstream`` holds the app's client session (opened at start-up); ``base_dir`` is
        where a relative ``profile`` path is looked up (the config file's directory)."""
        self.membership = membership
        self.upstream = upstream
        self.admin_token = admin_token
        self.workers = workers
        self.discovery_timeout_s = discovery_timeout_s
        self.default_drain_timeout_s = default_drain_timeout_s
        self.base_dir = base_dir

    def _check(self, request: web.Request) -> None:
        if self.admin_token is not None and not bearer_token_matches(
            request.headers.get("Authorization"), self.admin_token
        ):
            raise ApiError(401, "missing or wrong admin bearer token")
        if self.workers > 1:
            raise ApiError(
                409,
                f"this router runs {self.workers} worker processes and a request reaches one of them: "
                "change the config file and send SIGHUP to the main process instead",
            )

    async def add(self, request: web.Request) -> web.Response:
        self._check(request)
        if request.content_length is not None and request.content_length > MAX_ADMIN_BODY_BYTES:
            raise ApiError(413, f"a backend entry is limited to {MAX_ADMIN_BODY_BYTES} bytes")
        raw = await request.content.read(MAX_ADMIN_BODY_BYTES + 1)
        if len(raw) > MAX_ADMIN_BODY_BYTES:
            raise ApiError(413, f"a backend entry is limited to {MAX_ADMIN_BODY_BYTES} bytes")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from exc
        try:
            entry = backend_from_dict(data, "backend", base_dir=self.base_dir)
        except ConfigError as exc:
            raise ApiError(400, str(exc), param=exc.path) from exc
        if not entry.resolved:
            try:
                entry = await discover_backend(self.upstream.session, entry, 0, self.discovery_timeout_s)
            except ConfigError as exc:
                raise ApiError(502, f"cannot discover {entry.url}: {exc.message}") from exc
        spec = entry.to_spec(0)
        try:
            slot = self.membership.add(spec, origin="admin")
        except MembershipError as exc:
            raise ApiError(409, str(exc)) from exc
        body = {
            "name": spec.name,
            "url": spec.url,
            "engine": spec.engine,
            "models": list(spec.models),
            "max_model_len": spec.max_model_len,
            "slot": slot,
            "state": "member",
        }
        return web.json_response(body, status=201)

    async def remove(self, request: web.Request) -> web.Response:
        self._check(request)
        name = request.match_info["name"]
        drain = request.query.get("drain", "false").lower()
        if drain not in ("true", "false", "1", "0"):
            raise ApiError(400, f"drain must be true or false, got {drain[:20]!r}", param="drain")
        timeout_s = self.default_drain_timeout_s
        if "timeout_s" in request.query:
            try:
                timeout_s = float(request.query["timeout_s"])
            except ValueError:
                timeout_s = math.nan
            if not math.isfinite(timeout_s) or timeout_s < 0:
                raise ApiError(400, "timeout_s must be a number of seconds >= 0", param="timeout_s")
        try:
            slot = self.membership.remove(name)
        except MembershipError as exc:
            raise ApiError(404, str(exc)) from exc
        drained = True
        if drain in ("true", "1"):
            drained = await self.membership.drain(slot, timeout_s)
        left = self.membership.in_flight(slot)
        body = {"name": name, "slot": slot, "state": self.membership.state(slot), "in_flight": left}
        return web.json_response(body, status=200 if drained and not left else 202)
