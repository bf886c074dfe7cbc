"""``hetroute emulate``: serve one emulated vLLM or TGI engine over HTTP.

Resolves ``--gpu``/``--model`` against the catalogs (errors list the valid names), builds an
:class:`EngineModel` and the app of :func:`hetroute.sim.emulator.build_emulator_app`, prints the URL and the
KV capacity, and serves until SIGTERM or SIGINT, then shuts down cleanly (exit status 0).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from hetroute.catalog.specs import (
    UnknownCatalogEntry,
    WeightsDoNotFit,
    load_gpu_catalog,
    load_model_catalog,
    lookup_gpu,
    lookup_model,
)
from hetroute.clock import MonotonicClock
from hetroute.errors import ConfigError
from hetroute.sim.emulator import build_emulator_app, run_emulator
from hetroute.sim.emulator_faults import FaultConfig
from hetroute.sim.engine_model import EngineConfig, EngineModel

EXAMPLE = """examples:
  hetroute emulate --gpu V100-SXM2-32GB --tp 4 --model Llama-3-8B --port 8001
  hetroute emulate --gpu A800-80GB-PCIe --model DeepSeek-R1-Distill-Qwen-14B --engine tgi --speedup 10
  hetroute emulate --gpu T4 --model Llama-3-8B --max-num-seqs 4 --num-gpu-blocks 64 --error-rate 0.05
  hetroute emulate --gpu A100-80GB --model Llama-3-8B --no-enable-prefix-caching
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "emulate",
        help="serve an emulated vLLM/TGI engine (real HTTP, modelled GPU timing)",
        description=(
            "Serve one emulated inference engine: the OpenAI API (and TGI's /generate with --engine tgi), "
            "/metrics with the real engine metric names, and step timing from the roofline model of the "
            "chosen GPU and model (config/catalog/*.yaml)."
        ),
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--gpu", required=True, help="GPU catalog name, e.g. V100-SXM2-32GB, A100-80GB, H100-SXM"
    )
    parser.add_argument("--model", required=True, help="model catalog name or HF id, e.g. Llama-3-8B")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument(
        "--engine", choices=("vllm", "tgi"), default="vllm", help="engine flavour (default vllm)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to bind, 0 = any free port (default 8000)"
    )
    parser.add_argument("--speedup", type=float, default=1.0, help="divide every modelled duration by K")
    parser.add_argument("--seed", type=int, default=0, help="seed for output lengths, text and faults")
    parser.add_argument("--served-model-name", help="model name clients must use (default: the catalog name)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="max running requests (default 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument(
        "--num-gpu-blocks", type=int, help="override the KV block count (vLLM's override flag)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="fraction of GPU memory used"
    )
    parser.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "automatic prefix caching, vLLM's flag (default: on, as in vLLM V1 and TGI 3): a request reuses "
            "the cached KV blocks of an earlier prompt's identical prefix and skips their prefill; "
            "--no-enable-prefix-caching turns it off"
        ),
    )
    parser.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests answered 500/503")
    parser.add_argument("--crash-after", type=int, help="drop every connection after N generation requests")
    parser.add_argument("--slow-start-s", type=float, default=0.0, help="answer 503 for this many seconds")
    parser.add_argument("--hang-rate", type=float, default=0.0, help="fraction of requests never answered")
    parser.add_argument("--fail-mid-stream-after", type=int, help="drop each connection after K tokens")
    parser.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="from --slowdown-after-s on, every engine step takes FACTOR times as long (default 1: off)",
    )
    parser.add_argument(
        "--slowdown-after-s",
        type=float,
        default=0.0,
        metavar="T",
        help="seconds after start when --slowdown begins (default 0)",
    )
    parser.set_defaults(func=run)


def _engine(args: argparse.Namespace) -> EngineModel:
    gpu = lookup_gpu(load_gpu_catalog(), args.gpu)
    model = lookup_model(load_model_catalog(), args.model)
    config = EngineConfig(
        gpu=gpu,
        model=model,
        tp=args.tp,
        engine=args.engine,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_gpu_blocks,
    )
    return EngineModel(config)


async def _serve(args: argparse.Namespace, engine: EngineModel, faults: FaultConfig) -> None:
    served = args.served_model_name or engine.config.model.name
    app = build_emulator_app(
        engine,
        served_model=served,
        engine_kind=args.engine,
        speedup=args.speedup,
        faults=faults,
        seed=args.seed,
        clock=MonotonicClock(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with run_emulator(app, args.host, args.port) as url:
        cfg = engine.config
        print(
            f"hetroute emulate: {cfg.engine} engine for {served} on {cfg.tp}x {cfg.gpu.name} at {url} "
            f"(KV capacity {engine.kv_capacity_tokens} tokens = {engine.num_gpu_blocks} blocks x "
            f"{engine.block_size}, "
            f"max_model_len {engine.max_model_len}, speedup {args.speedup:g}, "
            f"prefix caching {'on' if cfg.enable_prefix_caching else 'off'})",
            flush=True,
        )
        await stop.wait()
    print("hetroute emulate: stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        faults = FaultConfig(
            error_rate=args.error_rate,
            crash_after_requests=args.crash_after,
            hang_rate=args.hang_rate,
            slow_start_s=args.slow_start_s,
            fail_mid_stream_after_tokens=args.fail_mid_stream_after,
            slowdown_factor=args.slowdown,
            slowdown_after_s=args.slowdown_after_s,
        )
        engine = _engine(args)
        if args.speedup <= 0:
            raise ConfigError("--speedup", f"expected a positive number, got {args.speedup}")
    except (UnknownCatalogEntry, WeightsDoNotFit, ConfigError, ValueError) as exc:
        print(f"hetroute emulate: error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(args, engine, faults))
    except OSError as exc:
        print(f"hetroute emulate: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
