"""The latency-profile artifact schema and its evaluator (method.md §3, §5).

A profile holds the eight parameters of the paper's latency model for one
(GPU type, TP degree, model, engine version), plus the KV capacity and engine limits:

    T_prefill(b, I) = p1·b·I + p2·b + p3·I + p4                       (Eq. 3)
    τ_decode(L, b)  = p5·b·L + p6·b + p7·L + p8                       (one decode step)
    T_decode(b,I,O) = p5·b·S + p6·b·O + p7·S + p8·O,  S = O·I + O(O+1)/2   (Eq. 4)

``profiling/`` writes exactly this schema (``dump_profile``); the router, the simulator
and ``tune-deploy`` read it with ``load_profile``. Nothing here imports fitting code.
Every loading error names the file and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hetroute.errors import HetrouteError

SCHEMA_VERSION = 1
PARAM_NAMES = ("p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8")
PROFILE_SOURCES = ("profiled", "roofline-prior", "live")
"""``profiled``: ``hetroute profile`` against a live engine; ``roofline-prior``: derived from the catalogs;
``live``: learned from served traffic by the router (``hetroute serve --state-dir``)."""


class ProfileError(HetrouteError, ValueError):
    """A profile artifact is unreadable, corrupt or of an incompatible schema.

    Still a ``ValueError`` for callers that catch that."""

    def __init__(self, source: str, field_path: str, message: str) -> None:
        super().__init__(f"{source}: {field_path}: {message}")
        self.source = source
        self.field_path = field_path


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

    prefill_mape: float
    prefill_r2: float
    decode_mape: float
    decode_r2: float
    heldout_batches: int = 0


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Engine limits discovered while profiling (None when unknown)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """One fitted (or prior) latency model, shared by identical instances.

    ``source`` is ``"profiled"`` for a fit against a live engine, ``"roofline-prior"``
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


def _num(source: str, data: Mapping[str, Any], key: str, path: str, *, minimum: float | None = None) -> float:
    if key not in data:
        raise ProfileError(source, f"{path}{key}", "missing")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise ProfileError(source, f"{path}{key}", f"expected a finite number, got {value!r}")
    if minimum is not None and float(value) < minimum:
        raise ProfileError(source, f"{path}{key}", f"must be >= {minimum}, got {value!r}")
    return float(value)


def _opt_int(source: str, data: Mapping[str, Any], key: str, path: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProfileError(source, f"{path}{key}", f"expected a positive integer or null, got {value!r}")
    return value


def _mapping(source: str, value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProfileError(source, path, f"expected a mapping, got {type(value).__name__}")
    return value


def _params(source: str, data: Any, path: str) -> LatencyParams:
    m = _mapping(source, data, path)
    return LatencyParams(*(_num(source, m, k, f"{path}.") for k in PARAM_NAMES))


def profile_from_dict(data: Any, source: str = "<profile>") -> LatencyProfile:
    """Validate a decoded artifact into a :class:`LatencyProfile` (ProfileError naming the field)."""
    root = _mapping(source, data, "<root>")
    version = root.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(
            source,
            "schema_version",
            f"unsupported schema version {version!r} (this hetroute reads {SCHEMA_VERSION})",
        )
    params = _params(source, root.get("params"), "params")
    stderr = _params(source, root["stderr"], "stderr") if root.get("stderr") is not None else None
    kv = _mapping(source, root.get("kv_capacity"), "kv_capacity")
    cap = _num(source, kv, "tokens", "kv_capacity.", minimum=1)
    if cap != int(cap):
        raise ProfileError(source, "kv_capacity.tokens", f"expected an integer, got {cap!r}")
    kv_source = kv.get("source")
    if not isinstance(kv_source, str) or not kv_source:
        raise ProfileError(source, "kv_capacity.source", "expected a non-empty string")
    limits_raw = _mapping(source, root.get("limits", {}) or {}, "limits")
    limits = EngineLimits(
        max_num_seqs=_opt_int(source, limits_raw, "max_num_seqs", "limits."),
        max_num_batched_tokens=_opt_int(source, limits_raw, "max_num_batched_tokens", "limits."),
        max_model_len=_opt_int(source, limits_raw, "max_model_len", "limits."),
    )
    quality = None
    if root.get("quality") is not None:
        q = _mapping(source, root["quality"], "quality")
        quality = FitQuality(
            prefill_mape=_num(source, q, "prefill_mape", "quality.", minimum=0),
            prefill_r2=_num(source, q, "prefill_r2", "quality."),
            decode_mape=_num(source, q, "decode_mape", "quality.", minimum=0),
            decode_r2=_num(source, q, "decode_r2", "quality."),
            heldout_batches=int(_num(source, q, "heldout_batches", "quality.", minimum=0))
            if "heldout_batches" in q
            else 0,
        )
    labels_raw = _mapping(source, root.get("labels", {}) or {}, "labels")
    labels = {str(k): str(v) for k, v in labels_raw.items() if v is not None}
    sweep = dict(_mapping(source, root.get("sweep", {}) or {}, "sweep"))
    src = root.get("source", "profiled")
    if src not in PROFILE_SOURCES:
        raise ProfileError(source, "source", f"expected one of {', '.join(PROFILE_SOURCES)}, got {src!r}")
    return LatencyProfile(
        params=params,
        kv_capacity_tokens=int(cap),
        kv_capacity_source=kv_source,
        limits=limits,
        stderr=stderr,
        quality=quality,
        labels=labels,
        sweep=sweep,
        source=str(src),
    )


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
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(source, "<file>", f"cannot read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(source, "<file>", f"not valid YAML: {exc}") from exc
    return profile_from_dict(data, source)


def dump_profile(profile: LatencyProfile) -> str:
    """YAML text of the artifact, stable key order."""
    return yaml.safe_dump(profile_to_dict(profile), sort_keys=False)


def save_profile(profile: LatencyProfile, path: str | Path) -> None:
    """Write the artifact atomically (temp file, then rename)."""
    target = Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(dump_profile(profile), encoding="utf-8")
    tmp.replace(target)
