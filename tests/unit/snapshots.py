"""Builders for table-driven policy tests: specs and snapshots without a running router."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetroute.types import BackendSpec, ClusterSnapshot, EngineMetrics, RequestFeatures


def spec(
    name: str, *, weight: float = 1.0, models: tuple[str, ...] = ("m",), engine: str = "vllm"
) -> BackendSpec:
    return BackendSpec(name=name, url=f"http://127.0.0.1/{name}", engine=engine, models=models, weight=weight)  # type: ignore[arg-type]


def snapshot(
    backends: Sequence[BackendSpec],
    *,
    in_flight: Sequence[int] | None = None,
    workload: Sequence[float] | None = None,
    kv_capacity: Sequence[float] | None = None,
    input_tokens: Sequence[float] | None = None,
    metrics: Sequence[EngineMetrics | None] | None = None,
    prefill_pending: Sequence[float] | None = None,
) -> ClusterSnapshot:
    n = len(backends)

    def arr(values: Sequence[float] | None, dtype: type) -> np.ndarray:
        return np.array(values if values is not None else [0] * n, dtype=dtype)

    return ClusterSnapshot(
        now_s=0.0,
        backends=tuple(backends),
        metrics=tuple(metrics) if metrics is not None else (None,) * n,
        requests_in_flight=arr(in_flight, np.int64),
        input_tokens_in_flight=arr(input_tokens, np.float64),
        remaining_predicted_tokens=arr(None, np.float64),
        generated_tokens_in_flight=arr(None, np.float64),
        predicted_output_tokens_in_flight=arr(None, np.float64),
        workload=arr(workload, np.float64),
        prefill_pending_tokens=arr(prefill_pending, np.float64),
        available=np.ones(n, dtype=np.bool_),
        kv_capacity_tokens=np.array(
            kv_capacity if kv_capacity is not None else [np.nan] * n, dtype=np.float64
        ),
    )


def features(input_tokens: int = 100, predicted: int = 50, max_tokens: int | None = None) -> RequestFeatures:
    return RequestFeatures(
        request_id="r",
        model="m",
        api="openai",
        input_tokens=input_tokens,
        max_tokens=max_tokens,
        predicted_output_tokens=predicted,
    )
