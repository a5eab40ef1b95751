"""The job the trainer runs: built from the resolved pipeline and the plan's settings by one table, written
to JOB.json and read back by the child unchanged."""

from __future__ import annotations

import json
from dataclasses import asdict, fields

import pytest

from fulltune import launch
from fulltune.errors import ConfigError
from fulltune.launch import TrainJob, job_from_pipeline
from fulltune.stages import resolve_pipeline

from pipelines_fixture import tiny_pipeline


def planned_settings(**changes):
    from fulltune.memory import Settings

    return asdict(Settings(micro_batch_size=2, seq_len=16, gradient_accumulation_steps=3, gradient_checkpointing=1,
                           mixed_precision="bf16", optimizer="adamw_8bit", pure_bf16=True, chunked_loss=True,
                           **changes))


@pytest.fixture
def spec(tmp_path):
    path = tiny_pipeline(tmp_path, train={"optimizer": "auto", "learning_rate": 1e-3, "seed": 7, "compile": True},
                         distributed={"strategy": "ddp", "num_processes": 2})
    return resolve_pipeline(str(path), "tiny").spec


def build(spec, settings):
    return job_from_pipeline(spec, settings, model_path="/base", tokenizer_path="/tok", train_file="/t.parquet",
                             output_dir="/runs/k", mlflow_tracking_uri="sqlite:///m.db", mlflow_run_id="r1")


def test_job_takes_the_plan_settings_and_the_spec_fields(spec) -> None:
    job = build(spec, planned_settings())
    # From the plan: the split of a step, the precision, the optimizer chosen for `auto`, the levers.
    assert (job.micro_batch_size, job.gradient_accumulation_steps, job.gradient_checkpointing) == (2, 3, 1)
    assert (job.mixed_precision, job.optimizer, job.device) == ("bf16", "adamw_8bit", "cpu")
    assert job.pure_bf16 and job.chunked_loss and not job.offload_optimizer
    # From the spec: the optimisation and the processes.
    assert (job.learning_rate, job.seed, job.compile, job.max_steps) == (1e-3, 7, True, 6)
    assert (job.strategy, job.num_processes, job.attn_implementation) == ("ddp", 2, "sdpa")
    assert (job.model_path, job.output_dir, job.mlflow_run_id) == ("/base", "/runs/k", "r1")


def test_job_json_round_trips_and_reads_as_one_key_per_line(spec) -> None:
    job = build(spec, planned_settings())
    text = job.to_json()
    assert TrainJob.from_json(text) == job
    lines = text.splitlines()
    assert len(lines) == len(fields(TrainJob)) + 2 and '"micro_batch_size": 2,' in [line.strip() for line in lines]
    with pytest.raises(ConfigError, match=r"unknown keys \['learning_rat'\]"):
        TrainJob.from_json(json.dumps({**json.loads(text), "learning_rat": 1}))


def test_plan_only_settings_are_ignored_and_old_plans_have_the_levers_off(spec) -> None:
    settings = planned_settings(strategy="fsdp", attn_implementation="eager", target_fraction=0.5)
    job = build(spec, {**settings, "a_future_setting": 1})
    assert (job.strategy, job.attn_implementation) == ("ddp", "sdpa")  # the spec's, not the plan's echo
    without_levers = {name: value for name, value in settings.items() if name not in launch.LEVERS}
    assert not any(getattr(build(spec, without_levers), lever) for lever in launch.LEVERS)


def test_every_job_field_and_planner_setting_has_one_place() -> None:
    from fulltune.memory import Settings

    listed = [*launch.JOB_FIELDS_PER_RUN, *launch.JOB_FIELDS_FROM_SETTINGS,
              *(name for names in launch.JOB_FIELDS_FROM_SPEC.values() for name in names)]
    assert sorted(listed) == sorted(f.name for f in fields(TrainJob))  # each field once, none forgotten
    # A new planner setting must be wired into the job or declared plan-only here, not silently dropped.
    known = set(launch.JOB_FIELDS_FROM_SETTINGS) | set(launch.PLAN_ONLY_SETTINGS)
    assert {f.name for f in fields(Settings)} <= known
