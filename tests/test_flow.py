"""The pipeline flow end to end on real Prefect and real MLflow: caching, re-runs and the champion gate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

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


def mlflow_run_of(path: Path, summary):
    from fulltune.tracking import registry

    registry.configure(path.parent / "work")
    return MlflowClient().get_run(summary.mlflow_run_id)


def versions(path: Path) -> list[str]:
    from fulltune.tracking import registry

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
    # What MLflow shows of the run: its outcome as its name, the tokenized data as its datasets, the plan's files.
    mlflow_run = mlflow_run_of(workspace, summary)
    assert mlflow_run.info.run_name == "tiny · v1 · champion"
    datasets = {d.dataset.name: d.dataset for d in mlflow_run.inputs.dataset_inputs}
    assert set(datasets) == {"tiny-train", "tiny-eval"}
    profile = json.loads(datasets["tiny-train"].profile)
    assert profile["rows"] > 0 and profile["tokens"] > profile["target tokens"] > 0
    assert datasets["tiny-train"].digest == profile["fingerprint"][:12]
    logged = {a.path for a in MlflowClient().list_artifacts(mlflow_run.info.run_id, "memory_plan")}
    assert logged == {"memory_plan/memory_plan.txt", "memory_plan/memory_plan.json", "memory_plan/memory_plan.png"}
    assert "trains.micro_batch_size" in mlflow_run.data.params and "eval/fine_tuned.eval_loss" in mlflow_run.data.metrics


def test_unchanged_rerun_is_all_cached_and_registers_nothing(workspace):
    summary = run(workspace)
    assert summary.stages == {stage: "cached" for stage in ALL_STAGES}
    assert versions(workspace) == ["1"]
    assert mlflow_run_of(workspace, summary).info.run_name == "tiny · v1 · nothing new registered"


def test_changing_evaluation_reruns_only_evaluate_and_register(workspace):
    # The plan fits the evaluate stage's batches to the budget: it is planned again (in seconds), training is not.
    summary = run(workspace, **{"evaluate.max_new_tokens": 2})
    assert summary.stages == {"tokenize": "cached", "memory-budget": "ran", "fine-tune": "cached",
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


def test_damaged_cached_outputs_rerun_their_stages(workspace):
    """A truncated eval.parquet and truncated model weights (a disk error, an interrupted copy): the cache
    hits are refused, both stages run again, the damaged copies are set aside, nothing new is registered."""
    work = workspace.parent / "work"
    for damaged in [*work.glob("tokenized/*/eval.parquet"), *work.glob("runs/*/model/model.safetensors")]:
        with open(damaged, "r+b") as handle:
            handle.truncate(damaged.stat().st_size // 2)
    summary = run(workspace, **{"evaluate.max_new_tokens": 4})  # evaluate reads eval.parquet again
    # The budget stage plans the evaluate stage too (its generation length): it plans again, to the same settings.
    assert summary.stages == {"tokenize": "ran", "memory-budget": "ran", "fine-tune": "ran", "evaluate": "ran",
                              "register": "ran"}
    assert summary.train_metrics["steps"] == 6
    aside = sorted(path.name for path in (work / "damaged").iterdir())
    assert len(aside) == 2 and aside[0].startswith("fine-tune-model-") and aside[1].startswith("tokenize-"), aside
    assert versions(workspace) == ["1"], "the retrained weights are the registered ones"


def test_held_out_data_with_nothing_to_score_is_a_user_error_and_registers_nothing(workspace):
    from fulltune.errors import DataError

    empty = workspace.parent / "empty-eval.jsonl"
    empty.write_text('{"prompt": "", "completion": ""}\n' * 4)
    with pytest.raises(DataError, match=r"data\.eval: no example in .*empty-eval\.jsonl has a target to score"):
        run(workspace, **{"data.eval": str(empty)})
    assert versions(workspace) == ["1"]


def test_worse_model_becomes_challenger_not_champion(workspace, monkeypatch):
    import sqlite3

    import mlflow
    from sqlalchemy.exc import OperationalError

    from fulltune.errors import DiskFull

    worse = {"train.max_steps": 1, "train.learning_rate": 1e-6}
    # First the registry's SQLite database fills up while the version is logged: one line, no retries,
    # nothing half-registered; the rerun then registers from the cached training and evaluation.
    uploads = []

    def full(*args, **kwargs):
        uploads.append(1)
        raise OperationalError("INSERT INTO model_versions", {}, sqlite3.OperationalError("database or disk is full"))

    with monkeypatch.context() as patched:
        patched.setattr(mlflow.transformers, "log_model", full)
        with pytest.raises(DiskFull, match=r"the filesystem is full .* rerun: training and evaluation are cached"):
            run(workspace, **worse)
    assert len(uploads) == 1, "a full disk is not retried"
    assert versions(workspace) == ["1"]
    summary = run(workspace, **worse)
    assert summary.stages["fine-tune"] == "cached" and summary.stages["register"] == "ran"
    assert summary.aliases == ("challenger",)
    assert not summary.promoted
    assert versions(workspace) == ["1", "2"]
    from fulltune.tracking import registry

    assert registry.current_champion("tiny-model").version == "1"


def test_a_list_of_weighted_sources_trains_and_registers(workspace):
    """data.train as a list (a reference and a weighted mapping, relative to the pipelines file) runs
    every stage; the registered description names both sources."""
    from pipelines_fixture import write_addition_data

    write_addition_data(workspace.parent / "more.jsonl", 16, seed=2)
    summary = run(workspace, **{"data.train": ["train.jsonl", {"path": "more.jsonl", "weight": 2}],
                                "train.max_steps": 2})
    assert summary.stages == {stage: "ran" for stage in ALL_STAGES}
    description = MlflowClient().get_model_version("tiny-model", summary.version).description
    assert "train.jsonl, " in description and "more.jsonl (weight 2)" in description
