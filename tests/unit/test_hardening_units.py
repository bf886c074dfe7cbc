"""Pure pieces of the issue-12 hardening: the connection deadline state machine, hop-by-hop
stripping, bearer matching, the token file, parser-error mapping and the new config fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, ContentEncodingError, LineTooLong
from multidict import CIMultiDict

from hetroute.config import config_from_dict
from hetroute.errors import ConfigError
from hetroute.proxy.admin_auth import admin_exposure_warning, bearer_token_matches, read_token_file
from hetroute.proxy.client_limits import ClientLimits, ConnectionDeadline
from hetroute.proxy.connection import parser_error
from hetroute.proxy.hop_by_hop import strip_hop_by_hop

LIMITS = ClientLimits(header_timeout_s=2.0, body_timeout_s=5.0, keepalive_idle_s=10.0, max_connections=4)


def phase(d: ConnectionDeadline) -> str:
    """``d.phase`` read afresh: a call, so the type checker does not keep an earlier assert's narrowing."""
    return d.phase


def test_deadline_idle_then_head_then_request_then_idle() -> None:
    d = ConnectionDeadline(LIMITS, now_s=100.0)
    assert phase(d) == "idle" and d.deadline_s == 110.0
    assert d.expired(109.9) is None and d.expired(110.0) == "idle"
    d.bytes_received(105.0)  # the first byte of a head starts the (shorter) head deadline
    assert phase(d) == "head" and d.deadline_s == 107.0
    d.bytes_received(106.5)  # more bytes of the same head do not extend it (slowloris)
    assert d.deadline_s == 107.0 and d.expired(107.0) == "head"
    d.head_complete()
    assert phase(d) == "request" and d.expired(1e9) is None
    d.ready(200.0)
    assert phase(d) == "idle" and d.deadline_s == 210.0


def test_strip_hop_by_hop_removes_connection_nominated_names() -> None:
    h = CIMultiDict(
        [("Connection", "keep-alive, X-A"), ("connection", "x-b"), ("X-A", "1"), ("x-b", "2"),
         ("X-C", "3"), ("Keep-Alive", "5"), ("TE", "trailers"), ("Content-Length", "9")]
    )  # fmt: skip
    strip_hop_by_hop(h, ("content-length",))
    assert list(h.items()) == [("X-C", "3")]


@pytest.mark.parametrize(
    "header, ok",
    [("Bearer tok", True), ("bearer tok", True), ("BeArEr tok", True), (" Bearer   tok ", True),
     ("Bearer tok2", False), ("Basic tok", False), ("tok", False), ("", False), (None, False),
     ("Bearertok", False)],
)  # fmt: skip
def test_bearer_scheme_is_case_insensitive(header: str | None, ok: bool) -> None:
    assert bearer_token_matches(header, "tok") is ok


def test_token_file(tmp_path: Path) -> None:
    f = tmp_path / "t"
    f.write_text("  abc123\n")
    assert read_token_file(str(f)) == "abc123"
    for content in ("", "two words\n"):
        f.write_text(content)
        with pytest.raises(ConfigError) as info:
            read_token_file(str(f))
        assert info.value.path == "--admin-token-file"
    with pytest.raises(ConfigError):
        read_token_file(str(tmp_path / "missing"))


def test_admin_warning_only_for_open_admin_on_non_loopback() -> None:
    assert admin_exposure_warning("0.0.0.0", None) is not None
    assert admin_exposure_warning("127.0.0.2", None) is None
    assert admin_exposure_warning("0.0.0.0", "t") is None


def test_parser_errors_map_to_4xx_without_client_bytes() -> None:
    assert parser_error(LineTooLong(b"SECRET" * 10, 8190)).status == 431
    assert parser_error(BadHttpMethod("SECRET")).status == 400
    assert parser_error(BadHttpMessage("Too many headers")).status == 431
    assert parser_error(ContentEncodingError("br")).status == 415
    for exc in (LineTooLong(b"SECRET"), BadHttpMethod("SECRET"), BadHttpMessage("SECRET")):
        assert "SECRET" not in parser_error(exc).message


BASE: dict[str, Any] = {"backends": [{"url": "http://127.0.0.1:1", "engine": "vllm", "models": ["m"]}]}


def test_new_settings_defaults_and_validation() -> None:
    cfg = config_from_dict(BASE, env={})
    s = cfg.server
    assert (s.header_timeout_s, s.body_timeout_s, s.keepalive_idle_s, s.max_connections) == (15, 60, 75, 2048)
    assert cfg.timeouts.request_s == 600 and cfg.retries.retry_request_timeouts is False
    for section, key, value in [
        ("server", "header_timeout_s", 0),
        ("server", "body_timeout_s", "soon"),
        ("server", "keepalive_idle_s", -1),
        ("server", "max_connections", 0),
        ("timeouts", "request_s", 0),
        ("retries", "retry_request_timeouts", "yes"),
    ]:
        with pytest.raises(ConfigError) as info:
            config_from_dict({**BASE, section: {key: value}}, env={})
        assert info.value.path == f"{section}.{key}"
