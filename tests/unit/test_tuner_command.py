"""The ``tune-deploy`` command: outputs on success, one-line errors (exit 2, no traceback) on bad input."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hetroute.commands import tune_deploy

REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    tune_deploy.add_parser(sub)
    args = parser.parse_args(["tune-deploy", "--quiet", *argv])
    code: int = args.func(args)
    return code


def _write(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return str(path)


def test_paper_c_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    code = _run(
        "--cluster", str(REPO / "config" / "clusters" / "paper-c.yaml"),
        "--requests", "300", "--duplicates", "1",
        "--json", str(out),
        "--emit-config", str(tmp_path / "router.yaml"),
        "--emit-compose", str(tmp_path / "compose.yaml"),
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "chosen: TP" in captured.out
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["workload"] == {"kind": "sharegpt", "requests": 300}
    assert [o["tp"] for o in doc["machines"][0]["options"]] != []
    router = yaml.safe_load((tmp_path / "router.yaml").read_text(encoding="utf-8"))
    compose = yaml.safe_load((tmp_path / "compose.yaml").read_text(encoding="utf-8"))
    assert len(router["backends"]) == len(compose["services"]) == doc["total"]["instances"]
    # every backend refers to a profile; the roofline priors are written beside the config
    for backend in router["backends"]:
        ref = router["profiles"][backend["profile"]]
        assert (tmp_path / ref).is_file()


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"model": "Llama-3-8B", "machines": [{"name": "x", "gpu": "V200", "gpus": 8}]},
            "error: bad.yaml: machines[0].gpu: unknown GPU 'V200'; valid names:",
        ),
        (
            {"model": "Llama-2-70B", "machines": [{"name": "x", "gpu": "L4", "gpus": 4}]},
            "error: models.Llama-2-70B: fits on no machine of the cluster (4x L4: TP1: weights need",
        ),
        (
            {"model": "Llama-3-8B", "machines": [{"name": "x", "gpu": "L4", "gpus": 4}],
             "engine": {"tp_degrees": [3]}},
            "error: bad.yaml: engine.tp_degrees[0]: TP 3 does not divide model 'Llama-3-8B''s 32 attention",
        ),
        (
            {"models": {"m": {"n_layers": 2, "hidden_size": 60, "n_heads": 6, "params": 1e6}},
             "machines": [{"name": "x", "gpu": "L4", "gpus": 4}], "engine": {"tp_degrees": [4]}},
            "error: bad.yaml: engine.tp_degrees[0]: TP 4 does not divide model 'm''s 6 attention heads",
        ),
    ],
)  # fmt: skip
def test_invalid_clusters_get_one_line_errors(
    doc: dict[str, Any], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _run("--cluster", _write(tmp_path, doc), "--requests", "50")
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith(message), captured.err
    assert captured.err.count("\n") == 1
    assert "Traceback" not in captured.err


def test_missing_cluster_file_and_bad_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("--cluster", str(tmp_path / "none.yaml")) == 2
    assert "none.yaml: <file>: cannot read" in capsys.readouterr().err
    good = str(REPO / "config" / "clusters" / "paper-c.yaml")
    assert _run("--cluster", good, "--workload", "nonsense") == 2
    assert "error: --workload: expected one of sharegpt" in capsys.readouterr().err


def test_trace_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    rows = ["num_prefill_tokens,num_decode_tokens"] + [f"{100 + 7 * k},{50 + 3 * k}" for k in range(80)]
    trace.write_text("\n".join(rows) + "\n", encoding="utf-8")
    doc = {"model": "Llama-3-8B", "machines": [{"name": "x", "gpu": "A100-80GB", "gpus": 2}]}
    out = tmp_path / "o.json"
    assert _run("--cluster", _write(tmp_path, doc), "--workload", str(trace), "--json", str(out)) == 0
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["workload"]["requests"] == 80
    assert result["workload"]["kind"] == str(trace)
    capsys.readouterr()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_on_a_terminal_only() -> None:
    tty = _Tty()
    progress = tune_deploy._ProgressLine(tty)
    progress(1, 4, "V100x8 TP1")
    progress(4, 4, "V100x8 TP8")
    text = tty.getvalue()
    assert "1/4 V100x8 TP1" in text and text.endswith("\n")
    quiet = io.StringIO()
    tune_deploy._ProgressLine(quiet)(1, 4, "x")
    assert quiet.getvalue() == ""
