"""Out-of-memory survival: the fine-tune task replans a smaller micro-batch with the same effective
batch and tries again, at most twice, saying why in the log and in MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fulltune import launch, registry
from fulltune.data import tokenize_dataset
from fulltune.launch import OutOfMemory, TrainResult
from fulltune.pipeline import plan_budget, resolve_pipeline
from fulltune.tokenizer import prepare_tokenizer

from pipelines_fixture import tiny_pipeline


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tiny_pipeline(tmp_path, train={"effective_batch_size": 8, "micro_batch_size": "auto",
                                          "gradient_accumulation_steps": "auto"})
    p = resolve_pipeline(str(path), "tiny")
    tokenizer = prepare_tokenizer(p.spec.model, p.spec.data, p.workdir)
    data = tokenize_dataset(p.spec.data, tokenizer, p.workdir, 0)
    from fulltune.models import load_tokenizer

    decision = plan_budget(p, data.max_row_length, len(load_tokenizer(tokenizer)))
    assert decision.settings["micro_batch_size"] == 8
    registry.configure(p.workdir)
    run_id = registry.start_pipeline_run("tiny", {}, {}, p.workdir)
    return p, data, tokenizer, decision, run_id


def fake_training(ooms: int, jobs: list):
    """run_training that runs out of memory `ooms` times, then 'trains' instantly."""

    def run_training(job):
        jobs.append(job)
        if len(jobs) <= ooms:
            raise OutOfMemory(observed_peak_bytes=None)
        model_dir = Path(job.output_dir) / "model"
        model_dir.mkdir(parents=True)
        return TrainResult(str(model_dir), steps=6, epochs=1.0, train_loss=1.0, tokens=100, tokens_per_second=1.0,
                           seconds=1.0, peak_memory_bytes=None, nonfinite_steps=0, resumed_from_step=None)

    return run_training


def run_finetune(p, data, tokenizer, decision, run_id):
    from prefect import flow

    from tasks.finetune import finetune_task

    @flow
    def only_finetune():
        return finetune_task.with_options(refresh_cache=True, retries=0)(
            p, "oom-test", data, tokenizer, decision, registry.tracking_uri(p.workdir), run_id)

    return only_finetune()


def test_oom_replans_smaller_micro_batch_with_same_effective_batch(prepared, monkeypatch, prefect_server):
    p, data, tokenizer, decision, run_id = prepared
    jobs: list = []
    monkeypatch.setattr(launch, "run_training", fake_training(ooms=1, jobs=jobs))
    trained = run_finetune(p, data, tokenizer, decision, run_id)
    first, second = jobs
    assert second.micro_batch_size < first.micro_batch_size
    assert second.micro_batch_size * second.gradient_accumulation_steps == 8
    assert first.micro_batch_size * first.gradient_accumulation_steps == 8
    assert len(trained.replans) == 1 and "out of memory" in trained.replans[0]
    assert trained.settings["micro_batch_size"] == second.micro_batch_size
    from mlflow.tracking import MlflowClient

    tags = MlflowClient().get_run(run_id).data.tags
    assert "out of memory" in tags["fulltune.oom_replan.1"]


def test_oom_gives_up_after_two_replans(prepared, monkeypatch, prefect_server):
    p, data, tokenizer, decision, run_id = prepared
    jobs: list = []
    monkeypatch.setattr(launch, "run_training", fake_training(ooms=10, jobs=jobs))
    with pytest.raises(OutOfMemory):
        run_finetune(p, data, tokenizer, decision, run_id)
    assert len(jobs) == 3
    micro = [job.micro_batch_size for job in jobs]
    assert micro == sorted(micro, reverse=True) and len(set(micro)) == 3
