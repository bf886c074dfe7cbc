"""Every client mistake gets a JSON 4xx, one access-log line, a metric and no traceback.

Issue 12, items 3 (deeply nested JSON) and 4 (errors raised by aiohttp's HTTP parser).
"""

from __future__ import annotations

import json
import logging

import pytest

from hetroute.access_log import ACCESS_LOGGER
from tests.conftest import MODEL, EmulateFn, GatewayFn, metric_sum
from tests.integration.raw_http import exchange, request

MARK = "EVILMARK"  # must never be echoed back

PARSER_CASES = {
    "unknown method": f"{MARK} /v1/completions HTTP/1.1\r\nHost: gw\r\n\r\n".encode(),
    "request line over 8 KB": f"GET /{MARK}{'a' * 9000} HTTP/1.1\r\nHost: gw\r\n\r\n".encode(),
    "header over 8 KB": f"GET /health HTTP/1.1\r\nHost: gw\r\nX-Big: {MARK}{'a' * 9000}\r\n\r\n".encode(),
    "1,000 headers": (
        "GET /health HTTP/1.1\r\nHost: gw\r\n" + "".join(f"X-H{i}: {MARK}\r\n" for i in range(1000)) + "\r\n"
    ).encode(),
    "duplicate Host": f"GET /health HTTP/1.1\r\nHost: gw\r\nHost: {MARK}\r\n\r\n".encode(),
    "NUL byte in a header": f"GET /health HTTP/1.1\r\nHost: gw\r\nX-A: {MARK}\x00b\r\n\r\n".encode(),
    "NUL byte in the path": f"GET /he\x00alth{MARK} HTTP/1.1\r\nHost: gw\r\n\r\n".encode(),
    "bad Content-Length": b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 12abc\r\n\r\n{}",
    "two Content-Lengths": (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"
    ),
    "Content-Length with chunked": (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    ),
    "unknown Transfer-Encoding": (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: EVILMARK\r\n\r\n{}"
    ),
    "bad chunk size": (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n{}\r\n0\r\n\r\n"
    ),
    "not HTTP at all": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03EVILMARK\r\n\r\n",
}


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    for rec in caplog.records:
        assert rec.exc_info is None and rec.levelno < logging.ERROR, rec.getMessage()
        assert "Traceback" not in rec.getMessage()


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]


@pytest.mark.parametrize("case", list(PARSER_CASES))
async def test_parser_errors_are_json_4xx_without_traceback(
    case: str, emulate: EmulateFn, gateway: GatewayFn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    vllm = await emulate()
    gw = await gateway([vllm])
    caplog.clear()
    resp = await exchange(int(gw.url.rsplit(":", 1)[1]), PARSER_CASES[case])
    assert 400 <= resp.status < 500, (resp.status, resp.body[:200])
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.headers["x-hetroute-backend"] == "none" and resp.headers["x-request-id"]
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert MARK not in resp.body.decode("latin-1")
    _no_traceback(caplog)
    lines = _access_lines(caplog)
    assert len(lines) == 1 and lines[0]["status"] == resp.status and lines[0]["backend"] is None
    assert metric_sum(gw, "hetroute_requests_total", backend="none", status=str(resp.status)) == 1
    assert vllm.state.accepted == 0 and gw.ledger.is_zero()


async def test_deeply_nested_json_is_400_with_access_log_and_metric(
    emulate: EmulateFn, gateway: GatewayFn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    vllm = await emulate()
    gw = await gateway([vllm])
    port = int(gw.url.rsplit(":", 1)[1])
    for path, api in (("/v1/completions", "openai"), ("/generate", "tgi")):
        caplog.clear()
        body = b"[" * 1000 + b"]" * 1000  # 2 KB
        resp = await exchange(port, request("POST", path, body, {"Content-Type": "application/json"}))
        assert resp.status == 400 and resp.headers["content-type"].startswith("application/json")
        data = resp.json()
        assert ("error_type" in data) if api == "tgi" else set(data["error"]) >= {"message", "type"}
        nested = json.dumps({"model": MODEL, "prompt": "x", "extra": json.loads("[" * 900 + "]" * 900)})
        resp2 = await exchange(port, request("POST", path, nested.encode()))
        assert resp2.status in (200, 400), resp2.status
        _no_traceback(caplog)
        lines = _access_lines(caplog)
        assert len(lines) == 2 and lines[0]["status"] == 400 and lines[0]["path"] == path
    assert metric_sum(gw, "hetroute_requests_total", backend="none", status="400") >= 2
    assert gw.ledger.is_zero()


async def test_locally_answered_errors_have_one_access_line_each(
    emulate: EmulateFn, gateway: GatewayFn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    vllm = await emulate()
    gw = await gateway([vllm])
    port = int(gw.url.rsplit(":", 1)[1])
    cases = [
        (request("POST", "/v1/completions", b"{bad"), 400),
        (request("GET", "/nope"), 404),
        (request("DELETE", "/v1/completions"), 405),
        (request("POST", "/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode()), 404),
    ]
    for raw, status in cases:
        caplog.clear()
        resp = await exchange(port, raw)
        assert resp.status == status
        lines = _access_lines(caplog)
        assert len(lines) == 1 and lines[0]["status"] == status
    assert metric_sum(gw, "hetroute_requests_total", backend="none") == len(cases)
