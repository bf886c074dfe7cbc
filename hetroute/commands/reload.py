"""SIGHUP: read the config file again and apply its ``backends:`` to the running gateway.

Only the backend set changes live (:class:`~hetroute.backends.membership.Membership`): entries added
to the file join, entries removed leave (their in-flight requests finish), and entries whose fields
changed are replaced. Entries with ``discovery: dns`` are resolved by the resolvers set up at
start-up, so a change to them is reported as needing a restart. Backends added through the admin API
are not the file's and stay. Every other section is read too, and a change there is reported as
needing a restart (a listener, a policy or a timeout cannot be swapped under running requests without
surprises). A file that no longer parses, or a backend that cannot be discovered, leaves everything
as it was and logs why.

With ``--workers N`` the supervisor forwards SIGHUP to every worker and each applies the file itself.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import fields
from pathlib import Path

from aiohttp import web

from hetroute.app import MEMBERSHIP, UPSTREAM
from hetroute.backends.discovery import discover
from hetroute.backends.membership import Changes, MembershipError
from hetroute.config import Config, load_config
from hetroute.errors import ConfigError

log = logging.getLogger("hetroute.reload")


def changed_sections(old: Config, new: Config) -> tuple[str, ...]:
    """What a reload cannot apply: the top-level sections other than ``backends`` that differ between
    two configs, and ``backends (discovery: dns entries)`` when those entries differ (their resolvers
    are set up at start-up)."""
    stale = tuple(
        f.name
        for f in fields(Config)
        if f.name != "backends" and getattr(old, f.name) != getattr(new, f.name)
    )
    if old.dns_entries() != new.dns_entries():
        stale += ("backends (discovery: dns entries)",)
    return stale


class Reloader:
    """Applies the config file at ``path`` to ``app`` on demand; one reload at a time."""

    def __init__(self, app: web.Application, path: str | Path) -> None:
        self.app = app
        self.path = Path(path)
        self._lock = asyncio.Lock()
        self._last: Config | None = None
        self.reloads = 0

    def remember(self) -> None:
        """Note the file as it is now, so that a later reload reports only what changed since."""
        try:
            self._last = load_config(self.path)
        except ConfigError as exc:
            log.warning("cannot read %s to remember it: %s", self.path, exc)

    async def reload(self) -> Changes | None:
        """Apply the file's backends; None (and a logged error) when nothing could be applied."""
        async with self._lock:
            self.reloads += 1
            try:
                new = load_config(self.path)  # a small local file, read once per SIGHUP
                resolved = await discover(new, self.app[UPSTREAM].session)
                changes = self.app[MEMBERSHIP].reconcile(resolved.specs(), "config")
            except (ConfigError, MembershipError) as exc:
                log.error("reload of %s failed; nothing changed: %s", self.path, exc)
                return None
            if self._last is not None:
                stale = changed_sections(self._last, new)
                if stale:
                    log.warning("reload: %s changed in %s; restart to apply", ", ".join(stale), self.path)
            self._last = new
            log.info(
                "reload of %s: added %s, removed %s, replaced %s",
                self.path,
                list(changes.added),
                list(changes.removed),
                list(changes.replaced),
            )
            return changes

    def on_sighup(self) -> None:
        """Reload on every SIGHUP from now on (on the running loop)."""
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[Changes | None]] = set()

        def fire() -> None:
            task = loop.create_task(self.reload())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        loop.add_signal_handler(signal.SIGHUP, fire)
