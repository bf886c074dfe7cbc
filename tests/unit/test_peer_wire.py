"""Peer summaries on the wire (hetroute.routing.peer_wire) and the ``peers`` config section."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from hetroute.config import config_from_dict
from hetroute.errors import ConfigError
from hetroute.learning.observation import Observation
from hetroute.routing.peer_wire import (
    MAGIC,
    MAX_DATAGRAM_BYTES,
    TAG_BYTES,
    PeerWireError,
    decode,
    encode,
    pack_body,
    signature,
)
from hetroute.routing.peers import PeerSummary

KEY = b"shared secret"


def observation(k: int, ttft_s: float | None = 0.25) -> Observation:
    return Observation(
        backend_index=1,
        finished_at_s=10.0 + k,
        input_tokens=100 + k,
        output_tokens=20,
        ttft_s=ttft_s,
        e2e_s=2.5,
        pending_tokens_ahead=30.0,
        in_flight_at_first=3.0,
        context_at_first=400.0,
        in_flight_at_end=2.0,
        context_at_end=380.0,
        engine_running=None if ttft_s is None else 4.0,
        cached_tokens=64.0,
    )


def summary(observations: int = 2) -> PeerSummary:
    return PeerSummary(
        replica="host-a/12/ab12",
        seq=7,
        sent_at_s=123.5,
        backends=("a100", "v100"),
        requests=np.array([3.0, 1.0]),
        rows=np.array([(float(r), float(r) + 0.5) for r in range(6)]),
        observations=tuple(("v100", observation(k, None if k % 2 else 0.25)) for k in range(observations)),
    )


def test_a_summary_comes_back_whole() -> None:
    sent = summary()
    back = decode(encode(sent, KEY), KEY)
    assert back.replica == sent.replica and back.seq == sent.seq and back.sent_at_s == sent.sent_at_s
    assert back.backends == sent.backends
    assert np.array_equal(back.requests, sent.requests) and np.array_equal(back.rows, sent.rows)
    assert [name for name, _ in back.observations] == ["v100", "v100"]
    for (_, got), (_, want) in zip(back.observations, sent.observations, strict=True):
        assert got.backend_index == -1  # the receiver sets its own index
        assert got._replace(backend_index=1) == want


def test_only_the_newest_observations_travel() -> None:
    data = encode(summary(observations=10), KEY, max_observations=3)
    back = decode(data, KEY)
    assert [o.input_tokens for _, o in back.observations] == [107, 108, 109]
    many = encode(summary(observations=5000), KEY, max_observations=5000)
    assert len(many) <= MAX_DATAGRAM_BYTES
    kept = decode(many, KEY).observations
    assert 0 < len(kept) < 5000 and kept[-1][1].input_tokens == 100 + 4999  # the newest kept


def test_another_key_or_an_altered_byte_is_unauthenticated() -> None:
    data = encode(summary(), KEY)
    with pytest.raises(PeerWireError) as wrong:
        decode(data, b"other")
    assert wrong.value.reason == "unauthenticated"
    altered = bytearray(data)
    altered[-5] ^= 1
    with pytest.raises(PeerWireError) as changed:
        decode(bytes(altered), KEY)
    assert changed.value.reason == "unauthenticated"


def _signed(header: dict[str, Any], numbers: Any = None) -> bytes:
    n = len(header["b"]) if isinstance(header.get("b"), list) else 0
    body = pack_body(header, np.zeros((7, n)) if numbers is None else np.asarray(numbers, dtype=float))
    return MAGIC + signature(KEY, body) + body


GOOD: dict[str, Any] = {"r": "x", "s": 1, "t": 0.0, "b": ["a"], "o": []}


@pytest.mark.parametrize(
    ("change", "numbers", "where"),
    [
        ({"r": ""}, None, "r:"),
        ({"s": -1}, None, "s:"),
        ({"s": True}, None, "s:"),
        ({"t": "now"}, None, "t:"),
        ({"b": [7]}, None, "b:"),
        ({}, np.zeros((7, 2)), "numbers:"),
        ({}, np.zeros((6, 1)), "numbers:"),
        ({}, [[-1.0]] + [[0.0]] * 6, "q[0]"),
        ({}, [[1.0]] + [[0.0]] * 5 + [[math.nan]], "w[5][0]"),
        ({}, [[1.0], [math.inf]] + [[0.0]] * 5, "w[0][0]"),
        ({"o": [["b", *[1.0] * 12]]}, None, "o[0]"),
        ({"o": [["a", *[1.0] * 11]]}, None, "o[0]"),
        ({"o": [["a", 1.0, 1.5, *[1.0] * 10]]}, None, "whole token counts"),
        ({"o": [["a", 1.0, 1.0, 1.0, 1.0, None, *[1.0] * 7]]}, None, "o[0][5]"),
    ],
)
def test_a_malformed_summary_is_refused_naming_the_field(
    change: dict[str, Any], numbers: Any, where: str
) -> None:
    decode(_signed(GOOD), KEY)  # the base is valid
    with pytest.raises(PeerWireError, match="malformed") as caught:
        decode(_signed({**GOOD, **change}, numbers), KEY)
    assert where in str(caught.value)


def test_a_negative_rounding_remainder_in_the_rows_is_accepted() -> None:
    back = decode(_signed(GOOD, [[0.0], [-1e-17]] + [[0.0]] * 5), KEY)
    assert back.rows[0, 0] == -1e-17


def test_more_backends_than_a_datagram_holds_is_refused_at_encoding() -> None:
    n = 2000
    huge = PeerSummary("x", 1, 0.0, tuple(f"backend-{k}" for k in range(n)), np.zeros(n), np.zeros((6, n)))
    with pytest.raises(PeerWireError) as caught:
        encode(huge, KEY)
    assert caught.value.reason == "too_large"


def test_what_is_not_a_peer_datagram_is_malformed() -> None:
    for data in (b"", b"GET / HTTP/1.1\r\n", MAGIC + b"\0" * TAG_BYTES):
        with pytest.raises(PeerWireError) as caught:
            decode(data, KEY)
        assert caught.value.reason in ("malformed", "unauthenticated")
    body = b"\x05\x00\x00\x00[1, 2"
    with pytest.raises(PeerWireError, match="not JSON"):
        decode(MAGIC + signature(KEY, body) + body, KEY)
    body = b"\xff\x00\x00\x00{}"
    with pytest.raises(PeerWireError, match="header longer"):
        decode(MAGIC + signature(KEY, body) + body, KEY)


BACKENDS = [{"name": "a", "url": "http://127.0.0.1:9000", "engine": "vllm", "models": ["m"]}]


def test_the_peers_section_is_validated_naming_the_field() -> None:
    env = {"HETROUTE_PEER_KEY": "s3cr3t-peer-key"}
    cfg = config_from_dict(
        {"backends": BACKENDS, "peers": {"addresses": ["10.0.0.2:9000", "[::1]:9001", "routers.ns:8471"]}},
        env=env,
    )
    assert cfg.peers.enabled and cfg.peer_key == "s3cr3t-peer-key"
    assert cfg.peers.addresses == (("10.0.0.2", 9000), ("::1", 9001), ("routers.ns", 8471))
    assert "s3cr3t" not in repr(cfg)
    off = config_from_dict({"backends": BACKENDS}, env=env)
    assert not off.peers.enabled
    bad: list[tuple[dict[str, Any], dict[str, str], str]] = [
        ({"addresses": ["10.0.0.2:9000"]}, {}, "peers.addresses"),  # no key
        ({"addresses": ["10.0.0.2"]}, env, "peers.addresses[0]"),
        ({"addresses": ["10.0.0.2:0"]}, env, "peers.addresses[0]"),
        ({"addresses": "10.0.0.2:9000", "interval_s": 1.0, "stale_after_s": 0.5}, env, "peers.stale_after_s"),
        ({"addresses": [], "colour": 1}, env, "peers"),
        ({"listen_port": 70000}, env, "peers.listen_port"),
    ]
    for section, environ, field in bad:
        with pytest.raises(ConfigError) as caught:
            config_from_dict({"backends": BACKENDS, "peers": section}, env=environ)
        assert caught.value.path.startswith(field), (section, caught.value)


def test_the_mirror_follows_twice_the_interval_or_a_heartbeat_unless_turned_off() -> None:
    env = {"HETROUTE_PEER_KEY": "s3cr3t-peer-key"}
    section: dict[str, Any] = {"addresses": ["10.0.0.2:9000"], "interval_s": 0.004}
    on = config_from_dict({"backends": BACKENDS, "peers": section}, env=env)
    # the default stale_after_s (0.25 s): a heartbeat every 83 ms is longer than 2 x 4 ms
    assert on.peers.mirror and on.peers.follow_s == pytest.approx(0.25 / 3)
    short = config_from_dict({"backends": BACKENDS, "peers": {**section, "stale_after_s": 0.015}}, env=env)
    assert short.peers.follow_s == pytest.approx(0.008)  # a heartbeat every 5 ms: twice the interval
    off = config_from_dict({"backends": BACKENDS, "peers": {**section, "mirror": False}}, env=env)
    assert not off.peers.mirror and off.peers.follow_s == 0.0
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"backends": BACKENDS, "peers": {**section, "mirror": "sometimes"}}, env=env)
    assert caught.value.path == "peers.mirror"
