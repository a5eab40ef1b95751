"""A tracking server or Prefect API that does not answer is a user error found before any stage runs:
exit 2 within seconds, one message naming the variable and its URI, nothing written to the workdir.
(Before, MLflow's and Prefect's clients retried for minutes.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from conftest import ROOT
from pipelines_fixture import tiny_pipeline

pytestmark = pytest.mark.slow  # each case starts the CLI in a process of its own

# The clients' retries took minutes; refusing must take seconds (interpreter start-up included).
WITHIN_S = 60


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("variable,uri", [
    ("MLFLOW_TRACKING_URI", "http://127.0.0.1:{port}"),
    ("PREFECT_API_URL", "http://127.0.0.1:{port}/api"),
])
def test_unreachable_server_exits_2_naming_the_uri_before_any_stage(tmp_path, variable, uri):
    path = tiny_pipeline(tmp_path)
    uri = uri.format(port=closed_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT), variable: uri}
    result = subprocess.run([sys.executable, "-m", "fulltune.cli", "run", "tiny", "-f", str(path)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=WITHIN_S)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{variable}={uri}" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "work").exists(), "nothing is written before the servers answer"
