"""``capacity_weighted``: weighted round robin with weights from the profiles (Helix's rule).

Weights are each backend's token throughput at its KV-saturating batch, for a reference request
(``reference_input_tokens`` I_ref, ``reference_output_tokens`` O_ref; backend_model.py):

    rate_s = (I_ref + O_ref) / T_ref^s                         tokens per second

Helix's virtual-load rule (Mei et al., ASPLOS'25, §5.1 and its simulator's scheduler) picks among the
unmasked candidates

    c = argmin_s ( V_s + (I_r + Õ_r) / rate_s ),    then  V_c += (I_r + Õ_r) / rate_c

so over time each backend receives tokens in proportion to its rate, interleaved, without anyone
choosing weights by hand (the paper's complaint about WRR 4:1). ``V`` is cumulative virtual time,
like smooth WRR's current weights (the one kind of state a weighted policy keeps); a candidate that
was absent is lifted to within one round of the others (``V_s ≥ max V − Σ_c cost_c``) so it is not
flooded when it returns. Ties go to the lowest index.

KV high-water-mark mask (Helix §5.2): a candidate is skipped when its estimated KV, counting the
remaining predicted output at ``expected_output_ratio`` (Helix: 0.6 of the average),

    I_s + generated_s + ratio · remaining_s + I_r + ratio · Õ_r  >  high_water_mark · cap_s

(Helix: 0.9). If every candidate is masked, all of them are used (Helix asserts instead).
``workload_cost`` is the charge ``(I_r + Õ_r) / rate_c``, so the ledger shows in-flight virtual time.

Params: ``high_water_mark`` (0-1, default 0.9), ``expected_output_ratio`` (0-1, default 0.6),
``reference_input_tokens`` (default 230), ``reference_output_tokens`` (default 200).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

import numpy as np

from hetroute.fields import NON_NEGATIVE, UNIT, Range
from hetroute.policies.backend_model import BackendModels
from hetroute.policies.base import PolicyContext, read_params
from hetroute.types import ClusterSnapshot, FloatArray, IntArray, RequestFeatures, RoutingDecision


@dataclass(frozen=True, slots=True)
class CapacityWeightedParams:
    """``policy.params`` of ``capacity_weighted``."""

    high_water_mark: Annotated[float, Range(minimum=0.01, maximum=1)] = 0.9
    expected_output_ratio: Annotated[float, UNIT] = 0.6
    reference_input_tokens: Annotated[float, NON_NEGATIVE] = 230.0
    reference_output_tokens: Annotated[float, Range(minimum=1)] = 200.0


class CapacityWeighted:
    """Helix-style virtual-load WRR with profile-derived weights and a KV high-water mask."""

    name = "capacity_weighted"

    def __init__(
        self,
        models: BackendModels,
        *,
        high_water_mark: float = 0.9,
        expected_output_ratio: float = 0.6,
        reference_input_tokens: float = 230.0,
        reference_output_tokens: float = 200.0,
    ) -> None:
        self.models = models
        self.high_water_mark = high_water_mark
        self.expected_output_ratio = expected_output_ratio
        self.reference_input_tokens = reference_input_tokens
        self.reference_output_tokens = reference_output_tokens
        self._virtual: FloatArray = np.zeros(len(models.backends), dtype=np.float64)

    @classmethod
    def from_config(cls, params: Mapping[str, object], ctx: PolicyContext) -> CapacityWeighted:
        p = read_params(CapacityWeightedParams, params, cls.name)
        return cls(
            ctx.backend_models or BackendModels.from_specs(ctx.backends),
            high_water_mark=p.high_water_mark,
            expected_output_ratio=p.expected_output_ratio,
            reference_input_tokens=p.reference_input_tokens,
            reference_output_tokens=p.reference_output_tokens,
        )

    def rates_tokens_s(self, snapshot: ClusterSnapshot, candidates: IntArray) -> FloatArray:
        """Each candidate's saturated token throughput for the reference request."""
        cap = self.models.capacity_tokens(snapshot, candidates)
        return self.models.saturated_throughput_tokens_s(
            candidates,
            self.reference_input_tokens,
            self.reference_output_tokens,
            cap,
            snapshot.latency_params,
        )

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot, candidates: IntArray
    ) -> RoutingDecision:
        cap = self.models.capacity_tokens(snapshot, candidates)
        rate = self.models.saturated_throughput_tokens_s(
            candidates,
            self.reference_input_tokens,
            self.reference_output_tokens,
            cap,
            snapshot.latency_params,
        )
        tokens = float(max(1, features.input_tokens + features.predicted_output_tokens))
        charge: FloatArray = tokens / rate
        ratio = self.expected_output_ratio
        kv = (
            snapshot.input_tokens_in_flight[candidates]
            + snapshot.generated_tokens_in_flight[candidates]
            + ratio * snapshot.remaining_predicted_tokens[candidates]
        )
        need = features.input_tokens + ratio * features.predicted_output_tokens
        ok = kv + need <= self.high_water_mark * cap
        masked = not bool(ok.all())
        if not ok.any():
            ok = np.ones(len(candidates), dtype=np.bool_)
        v = self._virtual[candidates]
        v = np.maximum(v, float(v.max()) - float(charge.sum()))
        self._virtual[candidates] = v
        score = np.where(ok, v + charge, np.inf)
        k = int(np.argmin(score))
        index = int(candidates[k])
        self._virtual[index] += float(charge[k])
        note = (
            ""
            if not masked
            else (" (KV mask)" if bool(ok.sum() < len(ok)) else " (all over high-water mark)")
        )
        return RoutingDecision(
            index=index,
            reason=f"capacity-weighted: rate {rate[k]:.0f} tok/s, virtual load {score[k]:.4g}{note}",
            workload_cost=float(charge[k]),
            scores={"rate_tokens_s": float(rate[k]), "virtual_load": float(score[k])},
        )
