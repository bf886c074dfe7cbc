"""hetroute's errors survive pickling, so an error raised in a worker process (``hetroute serve
--workers``, the benchmarks' process pools) reaches the parent as itself, not as a broken pool."""

from __future__ import annotations

import pickle
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from hetroute.catalog.specs import CatalogError, UnknownCatalogEntry, load_gpu_catalog
from hetroute.errors import ConfigError, FileConfigError, NoBackendAvailable, UnknownModel
from hetroute.latency import ProfileError
from hetroute.tuner.cluster import ClusterError

ERRORS: list[Exception] = [
    ConfigError("backends[2].url", "must be an http(s) URL"),
    FileConfigError("router.yaml", "policy.type", "unknown policy 'x'"),
    CatalogError("gpus.yaml", "gpus[3].name", "must be a string"),
    ClusterError("cluster.yaml", "machines[0].gpus", "must be >= 1"),
    ProfileError("a100.json", "params", "expected 8 numbers"),
    UnknownModel("llama-9"),
    NoBackendAvailable("llama-9"),
    UnknownCatalogEntry("GPU", "X1", ["A100", "H100"]),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_pickles_to_an_equal_one(error: Exception) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert back.__dict__ == error.__dict__


def _load_missing(path: str) -> object:
    return load_gpu_catalog(Path(path))


def test_a_worker_processs_catalog_error_reaches_the_parent_as_itself(tmp_path: Path) -> None:
    missing = tmp_path / "gpus.yaml"
    with ProcessPoolExecutor(1) as pool, pytest.raises(CatalogError) as caught:
        pool.submit(_load_missing, str(missing)).result(timeout=60)
    assert caught.value.source == "gpus.yaml"
    assert "No such file" in caught.value.message
