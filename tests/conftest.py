"""Shared fixtures: an isolated Prefect server per session, and tiny pipelines in temp workdirs."""

from __future__ import annotations

import os

# Before anything imports prefect or tokenizers.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("FULLTUNE_WORKDIR", None)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect API for the whole session (prefect_test_harness)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_mlflow_environment():
    """`mlflow.set_tracking_uri` exports the URI to the environment; keep one test's database from
    leaking into the next test's child processes."""
    yield
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        os.environ.pop(name, None)
