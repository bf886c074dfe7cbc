"""The latency-profile artifact schema and its evaluator (method.md §3, §5).

A profile holds the eight parameters of the paper's latency model for one
(GPU type, TP degree, model, engine version), plus the KV capacity and engine limits:

    T_prefill(b, I) = p1·b·I + p2·b + p3·I + p4                       (Eq. 3)
    τ_decode(L, b)  = p5·b·L + p6·b + p7·L + p8                       (one decode step)
    T_decode(b,I,O) = p5·b·S + p6·b·O + p7·S + p8·O,  S = O·I + O(O+1)/2   (Eq. 4)

``profiling/`` writes exactly this schema (``dump_profile``); the router, the simulator
and ``tune-deploy`` read it with ``load_profile``. Nothing here imports fitting code.
Every loading error is a :class:`ProfileError` naming the file and the field (read through
:mod:`hetroute.fields`; the dataclasses' annotations are their bounds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hetroute.errors import ConfigError, HetrouteError
from hetroute.fields import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    Range,
    as_mapping,
    check_keys,
    choice,
    file_errors,
    load_yaml,
    number,
    read_dataclass,
    string,
)

SCHEMA_VERSION = 1
PARAM_NAMES = ("p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8")
PROFILE_SOURCES = ("profiled", "emulated", "roofline-prior", "live")
EMULATOR_MARK = "hetroute_emulated"
"""Key that ``hetroute emulate`` adds (true) to its ``GET /version`` (vLLM flavour) and ``GET /info`` (TGI):
``hetroute profile`` then labels the profile ``source: emulated``. Real engines have no such key."""
_ROOT_KEYS = (
    "schema_version",
    "source",
    "labels",
    "params",
    "stderr",
    "kv_capacity",
    "limits",
    "quality",
    "sweep",
)
"""``profiled``: ``hetroute profile`` against a live engine; ``roofline-prior``: derived from the catalogs;
``live``: learned from served traffic by the router (``hetroute serve --state-dir``)."""


class ProfileError(HetrouteError, ValueError):
    """A profile artifact is unreadable, corrupt or of an incompatible schema.

    Still a ``ValueError`` for callers that catch that."""

    def __init__(self, source: str, field_path: str, message: str) -> None:
        super().__init__(f"{source}: {field_path}: {message}")
        self.source = source
        self.field_path = field_path
        self.message = message

    def __reduce__(self) -> tuple[type[ProfileError], tuple[str, str, str]]:
        """Picklable with its constructor's arguments (a worker process's error reaches its parent)."""
        return (type(self), (self.source, self.field_path, self.message))


@dataclass(frozen=True, slots=True)
class LatencyParams:
    """p1..p8 in seconds (per token, per sequence, per token·sequence as their terms need)."""

    p1: float
    p2: float
    p3: float
    p4: float
    p5: float
    p6: float
    p7: float
    p8: float

    def as_tuple(self) -> tuple[float, ...]:
        return (self.p1, self.p2, self.p3, self.p4, self.p5, self.p6, self.p7, self.p8)

    def prefill_s(self, batch: float, input_tokens: float) -> float:
        """T_prefill(b, I) of Eq. 3: time to prefill a batch of b prompts of length I."""
        return self.p1 * batch * input_tokens + self.p2 * batch + self.p3 * input_tokens + self.p4

    def decode_step_s(self, batch: float, kv_len: float) -> float:
        """τ_decode(L, b): one decode step for b sequences each holding L tokens of KV."""
        return self.p5 * batch * kv_len + self.p6 * batch + self.p7 * kv_len + self.p8

    def decode_s(self, batch: float, input_tokens: float, output_tokens: float) -> float:
        """T_decode(b, I, O) of Eq. 4 in closed form: Σ_{k=1..O} τ_decode(I+k, b)."""
        o = output_tokens
        s = o * input_tokens + o * (o + 1) / 2.0
        return self.p5 * batch * s + self.p6 * batch * o + self.p7 * s + self.p8 * o


@dataclass(frozen=True, slots=True)
class FitQuality:
    """Held-out fit quality per phase: MAPE as a fraction (0.05 = 5 %) and R²."""

    prefill_mape: NonNegativeFloat
    prefill_r2: float
    decode_mape: NonNegativeFloat
    decode_r2: float
    heldout_batches: NonNegativeInt = 0


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Engine limits discovered while profiling (None when unknown)."""

    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    max_model_len: PositiveInt | None = None


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """One fitted (or prior) latency model, shared by identical instances.

    ``source`` is ``"profiled"`` for a fit against a live engine, ``"emulated"`` for the same fit
    against ``hetroute emulate`` (a model of a GPU, not a GPU), ``"roofline-prior"``
    for parameters derived from the GPU/model catalogs without measurement, or ``"live"`` for a
    model the router learned from served traffic.
    ``kv_capacity_source`` says where the capacity came from (``"vllm:cache_config_info"``,
    ``"tgi:/info"``, ``"catalog"``, ...).
    """

    params: LatencyParams
    kv_capacity_tokens: int
    kv_capacity_source: str
    limits: EngineLimits = field(default_factory=EngineLimits)
    stderr: LatencyParams | None = None
    quality: FitQuality | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    sweep: Mapping[str, Any] = field(default_factory=dict)
    source: str = "profiled"
    schema_version: int = SCHEMA_VERSION

    def amortised_request_s(self, input_tokens: float, output_tokens: float) -> float:
        """T_r^s of method.md §5: the time one request costs on this backend, amortised.

        b = max(1, floor(cap / (I + Õ))) capped at max_num_seqs; the batch's prefill and
        decode time divided by b.
        """
        per_request = max(1.0, input_tokens + output_tokens)
        b = max(1.0, math.floor(self.kv_capacity_tokens / per_request))
        if self.limits.max_num_seqs is not None:
            b = min(b, float(self.limits.max_num_seqs))
        total = self.params.prefill_s(b, input_tokens) + self.params.decode_s(b, input_tokens, output_tokens)
        return max(total, 0.0) / b


def _params(data: Any, path: str) -> LatencyParams:
    return read_dataclass(LatencyParams, as_mapping(data, path, none_ok=False), path)


def _kv_capacity(raw: Any) -> tuple[int, str]:
    kv = as_mapping(raw, "kv_capacity", none_ok=False)
    check_keys(kv, ("tokens", "source"), "kv_capacity")
    cap = number(kv, "tokens", "kv_capacity", bounds=Range(minimum=1))
    if cap != int(cap):
        raise ConfigError("kv_capacity.tokens", f"expected an integer, got {cap!r}")
    return int(cap), string(kv, "source", "kv_capacity")


def _root(data: Any) -> Mapping[str, Any]:
    root = as_mapping(data, "<root>", none_ok=False)
    version = root.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ConfigError(
            "schema_version", f"unsupported schema version {version!r} (this hetroute reads {SCHEMA_VERSION})"
        )
    check_keys(root, _ROOT_KEYS, "")
    return root


def _profile(root: Mapping[str, Any]) -> LatencyProfile:
    cap, kv_source = _kv_capacity(root.get("kv_capacity"))
    stderr = root.get("stderr")
    quality = root.get("quality")
    labels = as_mapping(root.get("labels"), "labels")
    return LatencyProfile(
        params=_params(root.get("params"), "params"),
        kv_capacity_tokens=cap,
        kv_capacity_source=kv_source,
        limits=read_dataclass(EngineLimits, root.get("limits"), "limits"),
        stderr=None if stderr is None else _params(stderr, "stderr"),
        quality=None if quality is None else read_dataclass(FitQuality, quality, "quality"),
        labels={str(k): str(v) for k, v in labels.items() if v is not None},
        sweep=dict(as_mapping(root.get("sweep"), "sweep")),
        source=choice(root, "source", "", PROFILE_SOURCES, "profiled"),
    )


def profile_from_dict(data: Any, source: str = "<profile>") -> LatencyProfile:
    """Validate a decoded artifact into a :class:`LatencyProfile` (ProfileError naming the field)."""
    with file_errors(source, ProfileError):
        return _profile(_root(data))


def profile_to_dict(profile: LatencyProfile) -> dict[str, Any]:
    """The artifact as plain data (the inverse of :func:`profile_from_dict`)."""
    out: dict[str, Any] = {
        "schema_version": profile.schema_version,
        "source": profile.source,
        "labels": dict(profile.labels),
        "params": asdict(profile.params),
        "stderr": asdict(profile.stderr) if profile.stderr is not None else None,
        "kv_capacity": {"tokens": profile.kv_capacity_tokens, "source": profile.kv_capacity_source},
        "limits": asdict(profile.limits),
        "quality": asdict(profile.quality) if profile.quality is not None else None,
        "sweep": dict(profile.sweep),
    }
    return out


def load_profile(path: str | Path) -> LatencyProfile:
    """Read and validate a YAML profile artifact; errors name the file and the field."""
    with file_errors(str(path), ProfileError):
        data = load_yaml(path)
    return profile_from_dict(data, str(path))


def dump_profile(profile: LatencyProfile) -> str:
    """YAML text of the artifact, stable key order."""
    return yaml.safe_dump(profile_to_dict(profile), sort_keys=False)


def save_profile(profile: LatencyProfile, path: str | Path) -> None:
    """Write the artifact atomically (temp file, then rename)."""
    target = Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(dump_profile(profile), encoding="utf-8")
    tmp.replace(target)
