"""``memory_minmax``: the paper's memory-based variant "MB" (Xiong et al. §5.2).

The min-max mapper of ``workload_minmax`` with the time term removed, ``T_r^s ≡ 1``:

    w_r^s = exp(θ · kvusage_s),   kvusage_s = Σ_{in flight on s} (I + generated + remaining Õ) / cap_s
    c     = argmin_s max( max_{j≠s} L_j , L_s + w_r^s )
            (ties: smallest L_s + w, then fewest P_s, then seeded random)

so only KV capacity distinguishes backends. Params: ``theta`` (default 2), ``kv_signal``
(``ledger``/``engine``/``max``, see workload_minmax), ``seed``.
"""

from __future__ import annotations

from collections.abc import Mapping

from hetroute.policies.base import PolicyContext
from hetroute.policies.workload_minmax import MinMaxParams, MinMaxPolicy, build_minmax


def from_config(params: Mapping[str, object], ctx: PolicyContext) -> MinMaxPolicy:
    """``memory_minmax``: the min-max mapper with T ≡ 1 and θ default 2."""
    return build_minmax("memory_minmax", params, ctx, MinMaxParams(theta=2.0), unit_time=True)
