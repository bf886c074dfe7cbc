"""The one validation layer (``hetroute.fields``): every reader names the field, reads the declared type
within its bounds, and a file's errors name the file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest

from hetroute.errors import ConfigError, FileConfigError
from hetroute.fields import (
    FRACTION,
    PositiveInt,
    Range,
    Reader,
    as_url,
    file_errors,
    load_yaml,
    read_dataclass,
)


@dataclass(frozen=True, slots=True)
class Inner:
    rate_rps: Annotated[float, Range(above=0)]
    note: str | None = None


def _upper(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(path, f"expected text, got {value!r}")
    return value.upper()


@dataclass(frozen=True, slots=True)
class Outer:
    share: Annotated[float, FRACTION] = 0.5
    count: PositiveInt = 3
    mode: Literal["fast", "slow"] = "fast"
    enabled: bool = True
    limit: PositiveInt | None = None
    inner: Inner | None = None
    tag: Annotated[str, Reader(_upper)] = "X"


def _err(raw: Any, **kw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        read_dataclass(Outer, raw, "sec", **kw)
    return info.value


def test_a_dataclass_reads_its_fields_with_their_types_and_defaults() -> None:
    assert read_dataclass(Outer, None, "sec") == Outer()
    got = read_dataclass(
        Outer,
        {
            "share": 1,
            "count": 7,
            "mode": "slow",
            "enabled": False,
            "limit": None,
            "inner": {"rate_rps": 2},
            "tag": "y",
        },
        "sec",
    )
    assert got == Outer(1.0, 7, "slow", False, None, Inner(2.0), "Y")
    assert isinstance(got.share, float)
    assert read_dataclass(Outer, {"count": 9}, "sec", base=Outer(share=0.25)) == Outer(share=0.25, count=9)


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        ({"share": 0}, "sec.share: must be > 0, got 0"),
        ({"share": 1.5}, "sec.share: must be <= 1, got 1.5"),
        ({"share": float("nan")}, "sec.share: expected a finite number, got nan"),
        ({"share": True}, "sec.share: expected a finite number, got True"),
        ({"count": 0}, "sec.count: must be >= 1, got 0"),
        ({"count": 2.0}, "sec.count: expected an integer, got 2.0"),
        ({"mode": "warp"}, "sec.mode: expected one of fast, slow, got 'warp'"),
        ({"enabled": "yes"}, "sec.enabled: expected true or false, got 'yes'"),
        ({"limit": 0}, "sec.limit: must be >= 1, got 0"),
        ({"inner": {}}, "sec.inner.rate_rps: missing"),
        ({"inner": {"rate_rps": 1, "colour": 2}}, "sec.inner.colour: unknown field (valid: rate_rps, note)"),
        ({"inner": {"rate_rps": 1, "note": ""}}, "sec.inner.note: expected a non-empty string, got ''"),
        ({"tag": 3}, "sec.tag: expected text, got 3"),
        ({"colour": 1}, "sec.colour: unknown field (valid: share, count, mode, enabled, limit, inner, tag)"),
        ([1], "sec: expected a mapping, got list"),
        ({1: 2}, "sec: keys must be strings, got 1"),
    ],
)
def test_every_error_names_the_field_and_what_was_wrong(raw: Any, text: str) -> None:
    assert str(_err(raw)) == text


def test_excluded_fields_are_unknown_and_the_key_word_is_the_callers() -> None:
    err = _err({"mode": "slow"}, exclude=("mode",), what="parameter for policy 'p'")
    assert err.path == "sec.mode" and err.message.startswith("unknown parameter for policy 'p'")


def test_urls() -> None:
    assert as_url("http://h:8000/v1/", "u") == "http://h:8000/v1"
    for bad in ("ftp://h", "h:80", "http://h:99999", "http://h/?q=1", 3):
        with pytest.raises(ConfigError) as info:
            as_url(bad, "backends[2].url")
        assert info.value.path == "backends[2].url"


def test_load_yaml_and_file_errors_name_the_file(tmp_path: Path) -> None:
    good = tmp_path / "ok.yaml"
    good.write_text("a: [1, 2]\n", encoding="utf-8")
    assert load_yaml(good) == {"a": [1, 2]}
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [", encoding="utf-8")
    with pytest.raises(FileConfigError) as info, file_errors("bad.yaml"):
        load_yaml(bad)
    assert info.value.path == "bad.yaml: <file>" and "not valid YAML" in info.value.message
    with pytest.raises(ConfigError) as plain:
        load_yaml(tmp_path / "none.yaml", path="cfg")
    assert plain.value.path == "cfg" and "cannot read" in plain.value.message
    with pytest.raises(FileConfigError) as field, file_errors("c.yaml"):
        read_dataclass(Outer, {"count": -1}, "sec")
    assert str(field.value) == "c.yaml: sec.count: must be >= 1, got -1"
    assert (field.value.source, field.value.field_path) == ("c.yaml", "sec.count")


def test_an_error_that_names_its_file_passes_through_unchanged() -> None:
    inner = FileConfigError("inner.yaml", "x", "bad")
    with pytest.raises(FileConfigError) as info, file_errors("outer.yaml"):
        raise inner
    assert info.value is inner


def test_a_type_without_a_reader_is_a_programming_error() -> None:
    @dataclass(frozen=True)
    class Odd:
        items: list[int]

    with pytest.raises(TypeError, match="no reader"):
        read_dataclass(Odd, {"items": [1]}, "odd")
