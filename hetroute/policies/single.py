"""``single``: every request to one named backend (the paper's "SI" baseline, Xiong et al. §5.2).

Algorithm: choose ``backend`` whenever it is a candidate (serves the model and API and is
available). When it is not, fall back to the first candidate in config order, and say so in the
reason, so the gateway keeps answering instead of failing. Reads nothing else from the snapshot.

Params: ``backend`` (a backend name; default the first configured backend, the paper's "first
instance").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetroute.errors import ConfigError
from hetroute.policies.base import PARAMS_PATH, PolicyContext, read_params
from hetroute.types import ClusterSnapshot, IntArray, RequestFeatures, RoutingDecision


@dataclass(frozen=True, slots=True)
class SingleParams:
    """``policy.params`` of ``single``: the backend's name (None: the first backend)."""

    backend: str | None = None


class Single:
    """Always the same backend while it is a candidate."""

    name = "single"

    def __init__(self, index: int, backend_name: str) -> None:
        self.index = index
        self.backend_name = backend_name

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> Single:
        raw = read_params(SingleParams, params, cls.name).backend
        names = [b.name for b in ctx.backends]
        if not names:
            raise ConfigError("backends", "policy 'single' needs at least one backend")
        raw = names[0] if raw is None else raw
        if raw not in names:
            raise ConfigError(f"{PARAMS_PATH}.backend", f"expected one of {', '.join(names)}, got {raw!r}")
        return cls(names.index(raw), raw)

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        if bool((candidates == self.index).any()):
            return RoutingDecision(index=self.index, reason=f"single backend {self.backend_name}")
        index = int(candidates[0])
        return RoutingDecision(index=index, reason=f"{self.backend_name} is not a candidate: first candidate")
