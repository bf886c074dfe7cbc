"""WholeLineWriter: the access-log sink of ``hetroute serve --workers`` writes whole lines only,
at most ``limit`` bytes per ``os.write``, so processes sharing stdout never interleave mid-line."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from hetroute.access_log import ACCESS_BUFFER_BYTES, WholeLineWriter


def _writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    seen: list[bytes] = []

    def fake_write(fd: int, data: bytes | memoryview) -> int:
        assert fd == 99
        seen.append(bytes(data))
        return len(data)

    monkeypatch.setattr(os, "write", fake_write)
    return seen


def test_whole_lines_at_most_limit_bytes_per_write(monkeypatch: pytest.MonkeyPatch) -> None:
    writes = _writes(monkeypatch)
    out = WholeLineWriter(99, limit=100)
    lines = [f"{i:03d}" + "x" * (i % 40) + "\n" for i in range(60)]
    for line in lines:
        out.write(line)
    assert all(len(w) <= 100 for w in writes)  # nothing waits for flush() beyond the limit
    out.flush()
    assert b"".join(writes) == "".join(lines).encode()
    assert all(w.endswith(b"\n") and len(w) <= 100 for w in writes)
    out.flush()  # nothing buffered: no empty write
    assert all(writes)


def test_a_line_longer_than_the_limit_is_written_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    writes = _writes(monkeypatch)
    out = WholeLineWriter(99, limit=50)
    out.write("short\n")
    out.write("y" * 80 + "\n")
    out.write("tail\n")
    out.flush()
    assert writes == [b"short\n", b"y" * 80 + b"\n", b"tail\n"]


def test_a_partial_write_is_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bytes] = []

    def short_write(fd: int, data: bytes | memoryview) -> int:
        seen.append(bytes(data[:3]))
        return min(3, len(data))

    monkeypatch.setattr(os, "write", short_write)
    out = WholeLineWriter(1)
    out.write("abcdefg\n")
    out.flush()
    assert b"".join(seen) == b"abcdefg\n"


def test_lines_reach_a_real_pipe() -> None:
    r, w = os.pipe()
    try:
        out = WholeLineWriter(w)
        out.write("a" * 10 + "\n")
        out.write("b" * 10 + "\n")
        out.flush()
        assert os.read(r, 100) == b"a" * 10 + b"\n" + b"b" * 10 + b"\n"
    finally:
        os.close(r)
        os.close(w)


def test_serve_buffers_its_lines_on_stdouts_descriptor_whatever_pythonunbuffered_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hetroute serve`` writes access lines through its own buffer (one write per
    ``ACCESS_BUFFER_BYTES`` or per flush), even when stdout itself is unbuffered."""
    from hetroute.commands.serve import access_out

    path = tmp_path / "out.txt"
    with open(path, "w", buffering=1) as unbuffered:  # line-buffered: each line would be a write
        monkeypatch.setattr(sys, "stdout", unbuffered)
        out = access_out()
        assert isinstance(out, WholeLineWriter)
        for k in range(3):
            out.write(f'{{"request_id":"r{k}"}}\n')
        assert path.read_text() == ""  # held in the router's buffer
        out.flush()
        assert path.read_text().splitlines() == [f'{{"request_id":"r{k}"}}' for k in range(3)]
        big = "x" * 1000 + "\n"
        for _ in range(ACCESS_BUFFER_BYTES // len(big) + 1):
            out.write(big)
        assert len(path.read_text()) >= ACCESS_BUFFER_BYTES - len(big)  # a full buffer goes out unasked
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # no descriptor: stdout itself
    assert access_out() is sys.stdout
