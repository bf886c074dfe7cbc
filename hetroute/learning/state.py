"""Persistence of the live models: one profile artifact per backend in ``--state-dir``.

A saved model is an ordinary latency profile (``hetroute.latency``, ``source: live``), the same kind of
file ``hetroute profile`` writes, so either can be read by the router's ``profile:`` field and both are
shown by the same tools. The file is ``<state_dir>/<backend name>.yaml``; its labels name the backend,
GPU, TP and model it was learned on. At start a saved file whose labels disagree with the backend's
configuration (another GPU or TP) is ignored with a warning; an unreadable one likewise, naming the
file and field. Writes are atomic (temp file, then rename) and small (a few KB per backend).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path

from hetroute.latency import (
    EngineLimits,
    LatencyParams,
    LatencyProfile,
    ProfileError,
    load_profile,
    save_profile,
)
from hetroute.learning.live import LiveModels
from hetroute.types import BackendSpec

log = logging.getLogger(__name__)


def state_file(state_dir: str | Path, backend_name: str) -> Path:
    """``<state_dir>/<name>.yaml``, the name reduced to letters, digits, ``.``, ``_`` and ``-``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", backend_name) or "backend"
    return Path(state_dir) / f"{safe}.yaml"


def _labels(spec: BackendSpec) -> dict[str, str]:
    labels = {"backend": spec.name, "engine": spec.engine}
    if spec.gpu is not None:
        labels["gpu"] = spec.gpu
    if spec.tp is not None:
        labels["tp"] = str(spec.tp)
    if spec.models:
        labels["model"] = spec.models[0]
    return labels


def load_saved(state_dir: str | Path, specs: Sequence[BackendSpec]) -> dict[int, LatencyProfile]:
    """The saved live models that match their backend, by backend index (missing files: none)."""
    found: dict[int, LatencyProfile] = {}
    for i, spec in enumerate(specs):
        path = state_file(state_dir, spec.name)
        if not path.exists():
            continue
        try:
            profile = load_profile(path)
        except ProfileError as exc:
            log.warning("ignoring saved model of backend %s: %s", spec.name, exc)
            continue
        want = _labels(spec)
        for key in ("backend", "gpu", "tp"):
            if key in want and profile.labels.get(key, want[key]) != want[key]:
                log.warning(
                    "ignoring saved model %s: learned on %s=%s, backend %s has %s",
                    path,
                    key,
                    profile.labels.get(key),
                    spec.name,
                    want[key],
                )
                break
        else:
            found[i] = profile
    return found


def live_profile(live: LiveModels, i: int, spec: BackendSpec, capacity_tokens: float) -> LatencyProfile:
    """Backend ``i``'s learned model as a profile artifact (``source: live``)."""
    fit = live.fit_of(i)
    stderr = [v if math.isfinite(v) else 0.0 for v in (fit.stderr if fit is not None else (0.0,) * 8)]
    cap = int(capacity_tokens) if math.isfinite(capacity_tokens) and capacity_tokens >= 1 else 1
    error = live.e2e_error(i)
    return LatencyProfile(
        params=LatencyParams(*(float(v) for v in live.params[i])),
        kv_capacity_tokens=cap,
        kv_capacity_source="live" if cap > 1 else "unknown",
        limits=EngineLimits(max_num_seqs=spec.max_num_seqs),
        stderr=LatencyParams(*stderr),
        labels=_labels(spec),
        sweep={
            "live_samples": fit.samples if fit is not None else 0,
            "observed_total": live.observed_total(i),
            "e2e_error": round(error, 4) if math.isfinite(error) else None,
            "prior": live.prior_of(i).source,
        },
        source="live",
    )


def save_all(
    live: LiveModels, specs: Sequence[BackendSpec], capacities_tokens: Sequence[float], state_dir: str | Path
) -> int:
    """Write every backend that has a fit; returns how many files were written."""
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    written = 0
    for i, spec in enumerate(specs):
        if live.fit_of(i) is None:
            continue
        save_profile(
            live_profile(live, i, spec, float(capacities_tokens[i])), state_file(state_dir, spec.name)
        )
        written += 1
    return written
