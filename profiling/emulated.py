"""Profiling an in-process emulated engine (``hetroute.sim.emulator``) to produce reference profiles.

Owns: serving one emulated vLLM/TGI instance for a catalog (GPU, model, TP) on 127.0.0.1 port 0 and
profiling it through the real HTTP path, with the profiler's clock scaled by the emulator's speedup
so the artifact holds modelled GPU seconds. ``config/profiles/*.yaml`` are made with::

    python -m profiling.emulated --gpu V100-SXM2-32GB --tp 1 --model Llama-3-8B \\
        --out config/profiles/v100-tp1-llama-3-8b.yaml

The same thing with two processes: ``hetroute emulate ... --speedup K`` then
``hetroute profile --backend URL --engine vllm --time-scale K ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from hetroute.catalog.specs import load_gpu_catalog, load_model_catalog, lookup_gpu, lookup_model
from hetroute.clock import MonotonicClock
from hetroute.sim.emulator import build_emulator_app, run_emulator
from hetroute.sim.engine_model import EngineConfig, EngineFlavour, EngineModel
from profiling.collect import SweepConfig
from profiling.runner import ProfileOptions, ProfileOutcome, profile_backend


def emulated_engine(gpu: str, model: str, tp: int, engine: str = "vllm") -> EngineModel:
    """The engine model the emulator serves, with its defaults (as ``hetroute emulate`` builds it)."""
    g = lookup_gpu(load_gpu_catalog(), gpu)
    m = lookup_model(load_model_catalog(), model)
    flavour: EngineFlavour = "tgi" if engine == "tgi" else "vllm"
    return EngineModel(EngineConfig(gpu=g, model=m, tp=tp, engine=flavour))


async def profile_emulated(
    engine_model: EngineModel,
    served_model: str,
    opts: ProfileOptions,
    speedup: float,
    log: Callable[[str], None],
    seed: int = 0,
) -> ProfileOutcome:
    """Serve ``engine_model`` at ``speedup`` on a free port and profile it with ``opts`` (URL filled in)."""
    kind: EngineFlavour = "tgi" if opts.engine == "tgi" else "vllm"
    app = build_emulator_app(
        engine_model, served_model=served_model, engine_kind=kind, speedup=speedup, seed=seed
    )
    async with run_emulator(app) as url:
        run_opts = ProfileOptions(
            backend_url=url,
            engine=opts.engine,
            out=opts.out,
            sweep=opts.sweep,
            overrides=opts.overrides,
            heldout_frac=opts.heldout_frac,
            max_mape=opts.max_mape,
            force=opts.force,
            seed=opts.seed,
            plot=opts.plot,
            time_scale=speedup,
            labels=opts.labels,
        )
        return await profile_backend(run_opts, MonotonicClock(), log)


async def serve_forever(engine_model: EngineModel, served_model: str, engine: str, speedup: float) -> None:
    """Serve one emulator on a free port, print its URL on stdout, run until cancelled or killed."""
    kind: EngineFlavour = "tgi" if engine == "tgi" else "vllm"
    app = build_emulator_app(engine_model, served_model=served_model, engine_kind=kind, speedup=speedup)
    async with run_emulator(app) as url:
        print(url, flush=True)
        await asyncio.Event().wait()


async def profile_subprocess(
    args: argparse.Namespace, opts: ProfileOptions, log: Callable[[str], None]
) -> ProfileOutcome:
    """The emulator in its own process (its own core and event loop), profiled over HTTP from this one."""
    cmd = [sys.executable, "-m", "profiling.emulated", "--serve", "--gpu", args.gpu, "--tp", str(args.tp)]
    cmd += ["--model", args.model, "--engine", args.engine, "--speedup", str(args.speedup), "--out", "-"]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        url = (await asyncio.wait_for(proc.stdout.readline(), timeout=60.0)).decode().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"emulator process did not print its URL (got {url!r})")
        return await profile_backend(
            replace(opts, backend_url=url, time_scale=args.speedup), MonotonicClock(), log
        )
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=10.0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiling.emulated", description=__doc__.splitlines()[0])
    p.add_argument("--serve", action="store_true", help="only serve the emulator and print its URL")
    p.add_argument("--in-process", action="store_true", help="emulator in this process (default: a child)")
    p.add_argument("--gpu", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--engine", choices=("vllm", "tgi"), default="vllm")
    p.add_argument("--out", type=Path, required=True, help="profile to write ('-' with --serve)")
    p.add_argument("--plot", type=Path)
    p.add_argument("--speedup", type=float, default=5.0)
    p.add_argument("--budget-s", type=float, default=600.0, help="wall seconds")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-mape", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    engine = emulated_engine(args.gpu, args.model, args.tp, args.engine)
    if args.serve:
        asyncio.run(serve_forever(engine, args.model, args.engine, args.speedup))
        return 0
    opts = ProfileOptions(
        backend_url="",
        engine=args.engine,
        out=args.out,
        sweep=SweepConfig(reps=args.reps, budget_s=args.budget_s, run_id=f"emu{args.seed}"),
        max_mape=args.max_mape,
        seed=args.seed,
        plot=args.plot,
        labels={"gpu": args.gpu, "tp": str(args.tp), "emulated": "true"},
    )

    def log(line: str) -> None:
        if "ETA" not in line or line.split()[2].split("/")[0].endswith("0"):
            print(line, file=sys.stderr, flush=True)

    if args.in_process:
        outcome = asyncio.run(profile_emulated(engine, args.model, opts, args.speedup, log, args.seed))
    else:
        outcome = asyncio.run(profile_subprocess(args, opts, log))
    log(f"[profile] {outcome.message}")
    return outcome.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
