"""Policy specs of ``hetroute simulate``: ``NAME[:KEY=VALUE...]`` parsed into a :class:`PolicySpec`.

Policy syntax (``--policies`` is comma-separated; ``--policy`` takes one spec and may repeat)::

    NAME[:KEY=VALUE[:KEY=VALUE...]]        e.g.  weighted_round_robin:weights=4:1
                                                 workload_minmax:theta=1:kv_signal=engine

A ``:``-segment without ``=`` continues the previous value, so ``weights=4:1`` is the list [4, 1]
(in backend order). Values are numbers, ``true``/``false``, lists of numbers (``4:1`` or, in
``--policy``, ``4,1``) or strings. ``default`` is the router's default policy. ``--theta`` sets
``theta`` on every listed policy that has that parameter and was not given one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetroute.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One policy of the matrix: its label (the spec as written), registry name and params."""

    label: str
    name: str
    params: Mapping[str, object]


def _scalar(text: str) -> object:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _value(text: str) -> object:
    for sep in (":", ","):
        parts = text.split(sep)
        if len(parts) > 1:
            values = [_scalar(p) for p in parts]
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                return values
    return _scalar(text)


def parse_policy_spec(text: str) -> PolicySpec:
    """``NAME[:KEY=VALUE...]`` → :class:`PolicySpec` (ConfigError naming ``policies`` when malformed)."""
    spec = text.strip()
    name, _, rest = spec.partition(":")
    if not name:
        raise ConfigError("policies", f"empty policy name in {text!r}")
    params: dict[str, str] = {}
    last: str | None = None
    for segment in rest.split(":") if rest else []:
        if "=" in segment:
            key, _, value = segment.partition("=")
            if not key:
                raise ConfigError("policies", f"empty parameter name in {text!r}")
            params[key] = value
            last = key
        elif last is not None:
            params[last] += ":" + segment
        else:
            raise ConfigError("policies", f"expected KEY=VALUE after {name!r} in {text!r}")
    return PolicySpec(label=spec, name=name, params={k: _value(v) for k, v in params.items()})


def parse_policy_list(text: str) -> list[PolicySpec]:
    return [parse_policy_spec(part) for part in text.split(",") if part.strip()]
