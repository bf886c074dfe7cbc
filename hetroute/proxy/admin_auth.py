"""``/admin`` protection: the bearer-token check, the token file, and the exposure warning.

Owns no state. The scheme of ``Authorization`` is matched case-insensitively (RFC 7235 §2.1);
the token itself is compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

from hetroute.errors import ConfigError


def bearer_token_matches(authorization: str | None, token: str) -> bool:
    """True when ``authorization`` is ``<bearer, any case> <token>``."""
    if not authorization:
        return False
    scheme, _, given = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def read_token_file(path: str) -> str:
    """The admin token in ``path`` (surrounding whitespace dropped); ConfigError names the option."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--admin-token-file", f"cannot read {path!r}: {exc}") from exc
    if not token or any(c.isspace() for c in token):
        raise ConfigError("--admin-token-file", f"{path!r} must hold one non-empty token without spaces")
    return token


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (``127.0.0.0/8``, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def admin_exposure_warning(host: str, admin_token: str | None) -> str | None:
    """The start-up warning when ``/admin/backends`` is open on a non-loopback listener."""
    if admin_token is not None or is_loopback(host):
        return None
    return (
        f"/admin/backends is open without a token on a non-loopback listener ({host}): it shows "
        "backend URLs, health and engine metrics to anyone who can reach the port; set "
        "admin_token, HETROUTE_ADMIN_TOKEN or --admin-token-file, or listen on 127.0.0.1"
    )
