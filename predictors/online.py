"""The online predictor: an empirical output-length quantile per (model, input-length bucket).

It learns from completed requests (``observe`` with ``usage.completion_tokens``) and answers a
configurable quantile q of the recent outputs of requests like this one (method.md §6):

    bucket(I)   = number of ``bucket_edges`` ≤ I            (default edges 64, 128, …, 8192 tokens)
    Õ(m, I)     = clamp(Q_q(window of outputs of (m, bucket(I))), 1, max_tokens)

falling back, while a bucket holds fewer than ``min_samples`` outputs, to the quantile of the
model's outputs over all buckets, and while the model has fewer than ``min_samples`` either, to
``prior_tokens``. Each window is a fixed-size ring buffer (``window`` most recent outputs), so
memory is bounded and the predictor follows drift. Quantiles are recomputed lazily, only after a
new observation. The median (q = 0.5) minimises the absolute error; a higher q under-predicts less
often, which matters when an under-prediction lets a backend's KV overflow. ``statistic: mean``
answers the window's mean instead: unbiased in sum, which is what a sum of per-request costs (the
min-max load, the KV reservation) needs when outputs are skewed (Azure conversation: mean 211, p50 129).

Cut outputs: an output that stopped because the prompt and the output filled the engine's context
window (``max_model_len``) is a lower bound of what the model would have written. Taken as is, such
outputs pulled the estimate down: on the Mooncake conversation trace cut to an 8,192-token window,
half the prompts fill the window and end after 1 token, so the median of the 4 K-8 K bucket read 1
token for every prompt of that length, against 340 for those not cut (docs/prefix.md, "Cut
outputs"). ``observe(..., cut=True)`` adds a cut output only when it is at least the current
estimate: there it lies on the same side of the quantile as the true length, so the quantile stays
unbiased; below it, it says nothing and is dropped. The callers also clamp each prediction to the
request's own limit (``output_limit``), so a prompt that fills the window is predicted the 1 token
it can get. An output that reached the request's ``max_tokens`` is learned as it is
(:func:`hetroute.output_limits.output_cut` says why), so clients with tight limits still pull the
estimate down, within each request's own clamp.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np

from hetroute.errors import ConfigError
from hetroute.fields import PositiveInt, Range, Reader
from predictors.base import PARAMS_PATH, clamp_prediction, read_edges, read_params

Statistic = Literal["quantile", "mean"]
DEFAULT_BUCKET_EDGES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_PRIOR_TOKENS = 200.0


@dataclass(frozen=True, slots=True)
class OnlineParams:
    """``predictor.params`` of ``online``; ``min_samples`` may not exceed ``window``."""

    quantile: Annotated[float, Range(above=0, below=1)] = 0.5
    statistic: Statistic = "quantile"
    window: PositiveInt = 512
    min_samples: PositiveInt = 20
    bucket_edges: Annotated[tuple[int, ...], Reader(read_edges)] = DEFAULT_BUCKET_EDGES
    prior_tokens: Annotated[float, Range(minimum=1)] = DEFAULT_PRIOR_TOKENS


class _Window:
    """A ring buffer of the most recent observations with a lazily cached statistic.

    Alongside the ring it keeps the same values sorted (``bisect`` insert and delete), so a
    quantile is two lookups and one interpolation instead of a numpy partition per change. Both
    are plain lists of floats: an observation is one list store and two bisections, with no numpy
    scalar boxed or unboxed on the request path.
    """

    __slots__ = ("_size", "_values", "_sorted", "_next", "_cached")

    def __init__(self, size: int) -> None:
        self._size = size
        self._values: list[float] = []
        self._sorted: list[float] = []
        self._next = 0
        self._cached: float | None = None

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        ordered, values = self._sorted, self._values
        if len(values) == self._size:
            slot = self._next
            del ordered[bisect.bisect_left(ordered, values[slot])]
            values[slot] = value
            self._next = slot + 1 if slot + 1 < self._size else 0
        else:
            values.append(value)
        bisect.insort(ordered, value)
        self._cached = None

    def statistic(self, q: float | None) -> float:
        """The q-quantile of the window, or its mean when ``q`` is None (cached until the next add)."""
        if self._cached is None:
            if q is None:
                self._cached = float(np.mean(np.array(self._values, dtype=np.float64)))
            else:
                self._cached = _linear_quantile(self._sorted, q)
        return self._cached


def _linear_quantile(ordered: list[float], q: float) -> float:
    """``numpy.quantile(values, q)`` (default ``linear`` method) of sorted, non-empty ``ordered``.

    Q = a + (b − a)·γ for γ < 0.5, else b − (b − a)·(1 − γ), with a, b the order statistics
    around the virtual index (n − 1)·q and γ its fractional part: numpy's own arithmetic,
    so the result is bit-identical.
    """
    last = len(ordered) - 1
    virtual = last * q
    if virtual >= last:
        return ordered[last]
    lo = int(virtual)  # floor: virtual >= 0
    a, b = ordered[lo], ordered[lo + 1]
    gamma = virtual - lo
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


class OnlineQuantilePredictor:
    """Quantile of recent outputs per (model, input-length bucket), with model and prior fallbacks."""

    name = "online"

    def __init__(
        self,
        *,
        quantile: float = 0.5,
        window: int = 512,
        min_samples: int = 20,
        bucket_edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES,
        prior_tokens: float = DEFAULT_PRIOR_TOKENS,
        statistic: Statistic = "quantile",
    ) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        self.quantile = quantile
        self.statistic = statistic
        self._q: float | None = quantile if statistic == "quantile" else None
        self.window = max(1, window)
        self.min_samples = max(1, min(min_samples, self.window))
        self.bucket_edges = bucket_edges
        self.prior_tokens = prior_tokens
        self._buckets: dict[tuple[str, int], _Window] = {}
        self._models: dict[str, _Window] = {}

    @classmethod
    def from_params(cls, params: Mapping[str, object], seed: int) -> OnlineQuantilePredictor:
        p = read_params(OnlineParams, params)
        if p.min_samples > p.window:
            message = f"must be <= window ({p.window}), got {p.min_samples}"
            raise ConfigError(f"{PARAMS_PATH}.min_samples", message)
        return cls(
            quantile=p.quantile,
            window=p.window,
            min_samples=p.min_samples,
            bucket_edges=p.bucket_edges,
            prior_tokens=p.prior_tokens,
            statistic=p.statistic,
        )

    def bucket_of(self, input_tokens: int) -> int:
        """Index of the input-length bucket: how many edges are ≤ ``input_tokens``."""
        return bisect.bisect_right(self.bucket_edges, input_tokens)

    def estimate(self, model: str, input_tokens: int) -> tuple[float, str]:
        """The unclamped estimate and where it came from (``bucket``, ``model`` or ``prior``)."""
        bucket = self._buckets.get((model, self.bucket_of(input_tokens)))
        if bucket is not None and len(bucket) >= self.min_samples:
            return bucket.statistic(self._q), "bucket"
        pooled = self._models.get(model)
        if pooled is not None and len(pooled) >= self.min_samples:
            return pooled.statistic(self._q), "model"
        return self.prior_tokens, "prior"

    def predict(self, model: str, input_tokens: int, max_tokens: int | None) -> int:
        value, _ = self.estimate(model, input_tokens)
        return clamp_prediction(value, max_tokens)

    def observe(self, model: str, input_tokens: int, output_tokens: int, cut: bool = False) -> None:
        """Add the output to its bucket's and its model's windows. An output ``cut`` by the full context
        window is a lower bound of the true length: it is added only when it is at least the current
        estimate for its prompt length, where it lies on the same side of the estimate as the true
        length would (module docstring, "Cut outputs")."""
        if output_tokens < 0 or input_tokens < 0:
            return
        if cut and output_tokens < self.estimate(model, input_tokens)[0]:
            return
        key = (model, self.bucket_of(input_tokens))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Window(self.window)
        bucket.add(float(output_tokens))
        pooled = self._models.get(model)
        if pooled is None:
            pooled = self._models[model] = _Window(self.window)
        pooled.add(float(output_tokens))
