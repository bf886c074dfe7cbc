"""Built-in clusters for ``hetroute simulate --scenario`` (method.md §8 and a mixed fleet).

Each scenario is written in the cluster-file format (see ``cluster_file.py``) and parsed by the same
validator, so a built-in and a file behave identically; ``config/simulate/paper-a.yaml`` is the
paper-a scenario as a file. Invariant: every scenario fits its model on its GPUs (checked by the
tests against the catalog's KV-capacity arithmetic).

- ``paper-a``: one 8×V100-SXM2-32GB machine, Llama-3-8B, one TP4 and one TP1 instance (paper §5 A);
  weights 4:1 so ``weighted_round_robin`` reproduces the paper's WRR 4:1.
- ``paper-b``: DeepSeek-R1-Distill-Qwen-14B, four TP2 instances on 8×V100-SXM2-32GB plus one TP1
  instance on an A800-80GB-PCIe (paper §5 B).
- ``mixed``: Llama-3-8B on 1×H100-SXM, 2×A100-80GB, 2×L4 (TP1 each) and 2×T4 (one TP2 instance: the
  8B weights do not fit one 16 GB T4).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

from hetroute.errors import ConfigError
from hetroute.sim.cluster_file import SimClusterSpec, parse_cluster


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named built-in cluster as cluster-file data."""

    name: str
    description: str
    data: Mapping[str, Any]

    def cluster(
        self, *, known_gpus: Collection[str] | None = None, known_models: Collection[str] | None = None
    ) -> SimClusterSpec:
        return parse_cluster(
            {"name": self.name, "description": self.description, **self.data},
            known_gpus=known_gpus,
            known_models=known_models,
        )


SCENARIOS: Final[dict[str, Scenario]] = {
    "paper-a": Scenario(
        "paper-a",
        "8xV100-SXM2-32GB, Llama-3-8B, instances TP4 + TP1 (paper §5 A)",
        {
            "defaults": {"model": "Llama-3-8B", "engine": "vllm", "gpu": "V100-SXM2-32GB"},
            "instances": [
                {"name": "v100-tp4", "tp": 4, "weight": 4},
                {"name": "v100-tp1", "tp": 1, "weight": 1},
            ],
        },
    ),
    "paper-b": Scenario(
        "paper-b",
        "DeepSeek-R1-Distill-Qwen-14B: 4x TP2 on 8xV100-SXM2-32GB + 1x TP1 on A800-80GB-PCIe (paper §5 B)",
        {
            "defaults": {"model": "DeepSeek-R1-Distill-Qwen-14B", "engine": "vllm"},
            "instances": [
                {"name": "v100-tp2", "gpu": "V100-SXM2-32GB", "tp": 2, "count": 4},
                {"name": "a800-tp1", "gpu": "A800-80GB-PCIe", "tp": 1},
            ],
        },
    ),
    "mixed": Scenario(
        "mixed",
        "Llama-3-8B on 1xH100-SXM, 2xA100-80GB, 2xL4 (TP1 each) and 2xT4 (one TP2 instance)",
        {
            "defaults": {"model": "Llama-3-8B", "engine": "vllm"},
            "instances": [
                {"name": "h100", "gpu": "H100-SXM", "tp": 1},
                {"name": "a100", "gpu": "A100-80GB", "tp": 1, "count": 2},
                {"name": "l4", "gpu": "L4", "tp": 1, "count": 2},
                {"name": "t4-tp2", "gpu": "T4", "tp": 2},
            ],
        },
    ),
}


def get_scenario(name: str) -> Scenario:
    """The scenario called ``name`` (ConfigError listing the valid names)."""
    found = SCENARIOS.get(name)
    if found is None:
        raise ConfigError("scenario", f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}")
    return found
