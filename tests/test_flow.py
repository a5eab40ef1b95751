"""The pipeline flow end to end on real Prefect and real MLflow: caching, re-runs and the champion gate."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipelines_fixture import tiny_pipeline

pytestmark = pytest.mark.slow

ALL_STAGES = ("tokenize", "memory-budget", "fine-tune", "evaluate", "register")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, prefect_server):
    return tiny_pipeline(tmp_path_factory.mktemp("flow"))


def run(path: Path, **overrides):
    from flows.pipeline import Overrides, finetune_pipeline

    return finetune_pipeline(pipeline="tiny", overrides=Overrides(extra=overrides) if overrides else None,
                             pipelines_file=str(path))


def versions(path: Path) -> list[str]:
    from mlflow.tracking import MlflowClient

    from fulltune import registry

    registry.configure(path.parent / "work")
    return sorted(str(v.version) for v in MlflowClient().search_model_versions("name='tiny-model'"))


def test_first_run_trains_evaluates_and_registers_champion(workspace):
    summary = run(workspace)
    assert summary.stages == {stage: "ran" for stage in ALL_STAGES}
    assert summary.version == "1"
    assert set(summary.aliases) == {"challenger", "champion"}
    assert summary.train_metrics["steps"] == 6
    assert set(summary.evaluation) == {"base", "fine_tuned"}
    assert summary.evaluation["fine_tuned"]["eval_loss"] < summary.evaluation["base"]["eval_loss"]
    assert "exact_match" in summary.evaluation["fine_tuned"]
    model_dirs = list((workspace.parent / "work" / "runs").glob("*/model"))
    assert len(model_dirs) == 1 and (model_dirs[0] / "model.safetensors").is_file()


def test_unchanged_rerun_is_all_cached_and_registers_nothing(workspace):
    summary = run(workspace)
    assert summary.stages == {stage: "cached" for stage in ALL_STAGES}
    assert versions(workspace) == ["1"]


def test_changing_evaluation_reruns_only_evaluate_and_register(workspace):
    summary = run(workspace, **{"evaluate.max_new_tokens": 2})
    assert summary.stages == {"tokenize": "cached", "memory-budget": "cached", "fine-tune": "cached",
                              "evaluate": "ran", "register": "ran"}
    assert versions(workspace) == ["1"], "the same weights are not registered twice"


def test_cache_hit_whose_files_are_gone_reruns(workspace):
    work = workspace.parent / "work"
    for model_dir in (work / "runs").glob("*/model"):
        shutil.rmtree(model_dir)
    summary = run(workspace)
    assert summary.stages["fine-tune"] == "ran"
    assert summary.stages["tokenize"] == "cached"
    assert list((work / "runs").glob("*/model/model.safetensors"))


def test_worse_model_becomes_challenger_not_champion(workspace):
    summary = run(workspace, **{"train.max_steps": 1, "train.learning_rate": 1e-6})
    assert summary.stages["fine-tune"] == "ran"
    assert summary.aliases == ("challenger",)
    assert not summary.promoted
    assert versions(workspace) == ["1", "2"]
    from fulltune import registry

    assert registry.current_champion("tiny-model").version == "1"
