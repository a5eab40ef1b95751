"""Two runs of the same pipeline at once: one trains, the other waits on the stage lock and reuses the
result; no cache entry, checkpoint or registry version is corrupted or duplicated."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from pipelines_fixture import tiny_pipeline

pytestmark = pytest.mark.slow


def test_concurrent_runs_train_once_and_register_once(tmp_path):
    path = tiny_pipeline(tmp_path, train={"max_steps": 8, "checkpoint_every_steps": 2})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.Popen([sys.executable, "-m", "fulltune.cli", "run", "tiny", "-f", str(path)], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=900)[0] for run in runs]
    for run, output in zip(runs, outputs):
        assert run.returncode == 0, output[-3000:]
    summaries = [output[output.rindex("pipeline tiny:"):] for output in outputs]
    assert all("registered tiny-model version 1" in s for s in summaries), summaries
    # The second run waited for the first one's lock and then found its finished model.
    losses = [line.split("(")[0].strip() for s in summaries for line in s.splitlines() if "train loss" in line]
    assert len(losses) == 2 and losses[0] == losses[1], losses

    work = tmp_path / "work"
    models = list((work / "runs").glob("*/model"))
    assert len(models) == 1 and (models[0] / "model.safetensors").is_file()
    assert not list(work.rglob(".tmp-*")), "no half-written output is left behind"
    assert not list((work / "locks").glob("*.lock"))

    from mlflow.tracking import MlflowClient

    from fulltune import registry

    registry.configure(work)
    assert [str(v.version) for v in MlflowClient().search_model_versions("name='tiny-model'")] == ["1"]
