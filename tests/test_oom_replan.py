"""Out-of-memory survival: training replans a smaller micro-batch with the same effective batch and tries
again, at most twice (fulltune/planning/replan.py), and the fine-tune task says why in the log and in MLflow. The
replanned run resumes from the newest checkpoint unless its settings make the checkpoints unusable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fulltune.runtime import launch
from fulltune.tracking import registry
from fulltune.data import tokenize_dataset
from fulltune.runtime.launch import OutOfMemory, TrainResult
from fulltune.stages import resolve_pipeline
from fulltune.stages.budget import plan_budget
from fulltune.planning.replan import train_with_oom_replans
from fulltune.data.tokenizer import prepare_tokenizer

from pipelines_fixture import tiny_pipeline


def prepare(tmp_path, **train):
    path = tiny_pipeline(tmp_path, train={"effective_batch_size": 8, "micro_batch_size": "auto",
                                          "gradient_accumulation_steps": "auto", **train})
    p = resolve_pipeline(str(path), "tiny")
    tokenizer = prepare_tokenizer(p.spec.model, p.spec.data, p.workdir)
    data = tokenize_dataset(p.spec.data, tokenizer, p.workdir, 0)
    from fulltune.models import load_tokenizer

    decision = plan_budget(p, data.max_row_length, len(load_tokenizer(tokenizer)))
    assert decision.settings.micro_batch_size == 8
    registry.configure(p.workdir)
    run_id = registry.start_pipeline_run("tiny", {}, {}, p.workdir)
    return p, data, tokenizer, decision, run_id


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return prepare(tmp_path)


def fake_training(ooms: int, jobs: list):
    """run_training that runs out of memory `ooms` times, then 'trains' instantly."""

    def run_training(job):
        jobs.append(job)
        if len(jobs) <= ooms:
            raise OutOfMemory(observed_peak_bytes=None)
        model_dir = Path(job.paths.output_dir) / "model"
        model_dir.mkdir(parents=True)
        return TrainResult(str(model_dir), steps=6, epochs=1.0, train_loss=1.0, tokens=100, tokens_per_second=1.0,
                           seconds=1.0, peak_memory_bytes=None, nonfinite_steps=0, resumed_from_step=None)

    return run_training


def run_finetune(p, data, tokenizer, decision, run_id):
    from prefect import flow

    from fulltune.stages import MEMORY_BUDGET, TOKENIZE, finetune
    from fulltune.stages.runner import Inputs
    from fulltune.stages.tokenize import Tokenized
    from tasks.stage_task import stage_task

    inputs = Inputs(p, records={TOKENIZE: Tokenized(data, tokenizer), MEMORY_BUDGET: decision},
                    mlflow_uri=registry.tracking_uri(p.workdir), mlflow_run_id=run_id)

    @flow
    def only_finetune():
        return stage_task(finetune.STAGE).with_options(refresh_cache=True, retries=0)(inputs, "oom-test")

    return only_finetune()


def test_oom_replans_smaller_micro_batch_with_same_effective_batch(prepared, monkeypatch, prefect_server):
    p, data, tokenizer, decision, run_id = prepared
    jobs: list = []
    monkeypatch.setattr(launch, "run_training", fake_training(ooms=1, jobs=jobs))
    trained = run_finetune(p, data, tokenizer, decision, run_id)
    first, second = jobs
    assert second.plan.micro_batch_size < first.plan.micro_batch_size
    assert second.paths.output_dir == first.paths.output_dir  # the same checkpoints: the replanned run resumes
    assert "resuming from the newest checkpoint" in trained.replans[0]
    assert second.plan.micro_batch_size * second.plan.gradient_accumulation_steps == 8
    assert first.plan.micro_batch_size * first.plan.gradient_accumulation_steps == 8
    assert len(trained.replans) == 1 and "out of memory" in trained.replans[0]
    assert trained.settings["micro_batch_size"] == second.plan.micro_batch_size
    from mlflow.tracking import MlflowClient

    tags = MlflowClient().get_run(run_id).data.tags
    assert "out of memory" in tags["fulltune.oom_replan.1"]


def test_oom_gives_up_after_two_replans(prepared) -> None:
    # The engine's loop alone, without Prefect: each replan is announced, then the third OOM is raised.
    p, data, tokenizer, decision, _ = prepared
    jobs: list = []
    heard: list = []

    def make_job(plan, output_dir):
        return launch.job_from_pipeline(p.spec, plan, model_path="base", tokenizer_path=tokenizer,
                                        train_file=data.train_file, output_dir=str(output_dir))

    with pytest.raises(OutOfMemory):
        train_with_oom_replans(p, decision, "oom-test", make_job, run=fake_training(ooms=10, jobs=jobs),
                               on_replan=lambda replan, why: heard.append((replan, why)))
    assert len(jobs) == 3
    assert [replan for replan, _ in heard] == [1, 2] and all("out of memory" in why for _, why in heard)
    micro = [job.plan.micro_batch_size for job in jobs]
    assert micro == sorted(micro, reverse=True) and len(set(micro)) == 3


@pytest.mark.slow
def test_a_replanned_run_resumes_from_the_newest_checkpoint(tmp_path, monkeypatch, prefect_server):
    # 6 steps of 8 rows, a checkpoint every 3: out of memory at the start of step 5, after checkpoint 3.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    p, data, tokenizer, decision, run_id = prepare(tmp_path, optimizer="adamw", max_steps=6, checkpoint_every_steps=3)
    jobs: list = []

    def first_attempt_runs_out_of_memory(job, on_output=None):
        jobs.append(job)
        with monkeypatch.context() as patch:
            if len(jobs) == 1:
                patch.setenv("FULLTUNE_TEST_FAULT", "oom:5")
            return real_run_training(job, on_output)

    real_run_training = launch.run_training
    monkeypatch.setattr(launch, "run_training", first_attempt_runs_out_of_memory)
    trained = run_finetune(p, data, tokenizer, decision, run_id)
    first, second = jobs
    assert second.plan.micro_batch_size < first.plan.micro_batch_size
    assert second.paths.output_dir == first.paths.output_dir
    result = json.loads((Path(trained.model_dir).parent / "result.json").read_text())
    assert result["resumed_from_step"] == 3 and result["steps"] == 6
    assert "resuming from the newest checkpoint" in trained.replans[0]


def test_resume_conflict_allows_a_new_split_and_refuses_other_changes():
    job = launch.job_with("m", "t", "o", micro_batch_size=8, gradient_accumulation_steps=1, optimizer="adamw",
                          mixed_precision="no")
    split = job.replace(micro_batch_size=2, gradient_accumulation_steps=4, gradient_checkpointing=2,
                        mixed_precision="bf16", output_dir="elsewhere")
    assert launch.resume_conflict(job, split) is None
    assert "effective batch" in launch.resume_conflict(job, job.replace(micro_batch_size=4))
    assert "optimizer state cannot be loaded" in launch.resume_conflict(job, job.replace(optimizer="adamw_8bit"))
    assert "grad scaler" in launch.resume_conflict(job, job.replace(mixed_precision="fp16"))
    assert "train.learning_rate" in launch.resume_conflict(job, job.replace(learning_rate=1.0))
