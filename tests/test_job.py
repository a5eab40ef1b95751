"""The job the trainer runs: the resolved pipeline's sections and the plan's Settings, typed, written to
JOB.json by one function and read back by the child unchanged; the child reads each planned setting from
the plan only."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from fulltune import degrees, levers, spec
from fulltune.runtime import launch
from fulltune.degrees import ParallelDims
from fulltune.errors import ConfigError
from fulltune.runtime.launch import TrainJob, job_from_pipeline
from fulltune.memory import Settings
from fulltune.stages import resolve_pipeline

from pipelines_fixture import tiny_pipeline

ROOT = Path(__file__).resolve().parents[1]
# The modules that read a job: the child, and the launcher that builds its command line.
# The child reads the plan in the trainer, the job and the one optimizer builder (`optim.optimizer_for(model, plan)`).
CHILD_MODULES = ("fulltune/runtime/train.py", "fulltune/runtime/train_metrics.py", "fulltune/runtime/step_checkpoints.py",
                 "fulltune/runtime/launch.py", "fulltune/runtime/optim.py", "fulltune/runtime/parallel.py")


def planned(**changes) -> Settings:
    return Settings(**{**dict(micro_batch_size=2, seq_len=16, gradient_accumulation_steps=3, gradient_checkpointing=1,
                              mixed_precision="bf16", optimizer="adamw_8bit", pure_bf16=True, chunked_loss=True,
                              strategy="ddp", num_processes=2), **changes})


@pytest.fixture
def pipeline(tmp_path) -> spec.PipelineSpec:
    path = tiny_pipeline(tmp_path, train={"optimizer": "auto", "learning_rate": 1e-3, "seed": 7, "compile": True},
                         distributed={"strategy": "ddp", "num_processes": 2})
    return resolve_pipeline(str(path), "tiny").spec


def build(pipeline, plan) -> TrainJob:
    return job_from_pipeline(pipeline, plan, model_path="/base", tokenizer_path="/tok", train_file="/t.parquet",
                             output_dir="/runs/k", mlflow_tracking_uri="sqlite:///m.db", mlflow_run_id="r1")


def test_the_job_holds_the_plan_and_the_spec_sections(pipeline) -> None:
    job = build(pipeline, planned())
    assert job.plan == planned()
    assert (job.train.learning_rate, job.train.seed, job.train.compile, job.train.max_steps) == (1e-3, 7, True, 6)
    assert job.model == pipeline.model
    assert job.distributed.model_dump() == pipeline.distributed.model_dump(exclude=set(launch.PLANNED_DISTRIBUTED_KEYS))
    assert (job.paths.model_path, job.paths.output_dir, job.tracking.mlflow_run_id) == ("/base", "/runs/k", "r1")
    # The spec says `optimizer: auto`; the job's train section has no such key, so only the plan can answer.
    assert pipeline.train.optimizer == "auto" and not hasattr(job.train, "optimizer")


def test_the_tensor_parallel_degree_is_carried_once_the_one_the_plan_chose(tmp_path) -> None:
    path = tiny_pipeline(tmp_path, train={"effective_batch_size": 8},
                         distributed={"strategy": "fsdp", "num_processes": 4, "tensor_parallel": "auto"})
    pipeline = resolve_pipeline(str(path), "tiny").spec
    job = build(pipeline, planned(strategy="fsdp", num_processes=4, tensor_parallel=2, optimizer="adamw",
                                  chunked_loss=False, gradient_accumulation_steps=2))
    assert job.dims == ParallelDims(world_size=4, tp=2, strategy="fsdp") and job.dims.dp == 2
    assert job.to_json().count('"tensor_parallel"') == 1  # the plan's; the distributed section has none
    assert TrainJob.from_json(job.to_json()).dims == job.dims


def test_job_json_round_trips(pipeline) -> None:
    job = build(pipeline, planned())
    text = job.to_json()
    assert TrainJob.from_json(text) == job
    assert set(json.loads(text)) == set(launch.JOB_SECTIONS)


def test_a_plan_made_for_other_processes_is_refused(pipeline) -> None:
    with pytest.raises(ConfigError, match=r"plan.strategy is 'fsdp' but distributed.strategy is 'ddp'"):
        build(pipeline, planned(strategy="fsdp", optimizer="adamw", chunked_loss=False))


def test_an_old_or_foreign_job_file_is_a_config_error_naming_it(pipeline) -> None:
    text = build(pipeline, planned()).to_json()
    flat_old_version = {"model_path": "/base", "tokenizer_path": "/tok", "train_file": "/t.parquet",
                        "output_dir": "/runs/k", "micro_batch_size": 2, "learning_rate": 1e-3}
    for foreign, expected in [
        (json.dumps(flat_old_version), r"JOB.json .*plan: Field required.*micro_batch_size: unknown key"),
        (json.dumps({**json.loads(text), "extra": {}}), r"JOB.json .*extra: unknown key"),
        (json.dumps({**json.loads(text), "train": {**json.loads(text)["train"], "learning_rat": 1}}),
         r"JOB.json .*train.learning_rat: unknown key"),
        (json.dumps({**json.loads(text), "plan": {**json.loads(text)["plan"], "micro_batch_size": 0}}),
         r"JOB.json .*micro_batch_size must be an integer >= 1"),
        ("not json", r"JOB.json: not JSON"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            TrainJob.from_json(foreign)


def test_the_child_refuses_an_old_job_file_with_exit_2(tmp_path) -> None:
    job_file = tmp_path / "JOB.json"
    job_file.write_text(json.dumps({"model_path": "m", "tokenizer_path": "m", "train_file": "t", "output_dir": "o"}))
    done = subprocess.run([sys.executable, "-m", "fulltune.runtime.train", str(job_file)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("fulltune train: error: JOB.json")
    assert "JOB.json" in json.loads((tmp_path / "error.json").read_text())["message"]


def attributes_read(section: str) -> set[str]:
    """Names read as `<...>.section.NAME` or `section.NAME` in the modules that read a job."""
    names = set()
    for module in CHILD_MODULES:
        for node in ast.walk(ast.parse((ROOT / module).read_text())):
            if isinstance(node, ast.Attribute):
                owner = node.value
                if (isinstance(owner, ast.Attribute) and owner.attr == section) or (
                        isinstance(owner, ast.Name) and owner.id == section):
                    names.add(node.attr)
    return names


def test_every_planner_setting_is_read_from_the_plan_or_declared_plan_only() -> None:
    settings = {f.name for f in fields(Settings)}
    read = attributes_read("plan")
    # Checkpointing and the model-side levers with their options are read by apply_model_levers
    # (fulltune/runtime/checkpointing.py), which the child hands its whole plan.
    assert "apply_model_levers(model, job.plan)" in (ROOT / "fulltune/runtime/train.py").read_text()
    read |= {"gradient_checkpointing"} | {name for lever in levers.TABLE if lever.apply
                                          for name in (lever.name, *(option.name for option in lever.options))}
    # The parallel degrees are read together, as the plan's `dims` (fulltune/degrees.py `dims_of`).
    assert "dims" in read
    read |= set(degrees.BY_NAME)
    echoes = set(launch.PLAN_ECHOES)
    # A new planner setting must be read by the child or declared plan-only, not silently dropped.
    assert settings - read - echoes == set(launch.PLAN_ONLY_SETTINGS)
    assert not read & set(launch.PLAN_ONLY_SETTINGS)
    # The settings the plan echoes are read from the spec section they echo.
    for name, section in launch.PLAN_ECHOES.items():
        assert name in attributes_read(section), f"{section}.{name}"


def test_the_train_section_is_the_spec_without_what_the_plan_decides() -> None:
    options, planned_keys = set(launch.TrainOptions.model_fields), set(launch.PLANNED_TRAIN_KEYS)
    assert options | planned_keys == set(spec.TrainSpec.model_fields) and not options & planned_keys
    assert planned_keys - {"effective_batch_size"} <= {f.name for f in fields(Settings)}
    assert options <= attributes_read("train")  # every optimisation key reaches the child


def test_strategy_auto_becomes_the_strategy_the_plan_chose(tmp_path) -> None:
    path = tiny_pipeline(tmp_path, distributed={"strategy": "auto"})
    pipeline = resolve_pipeline(str(path), "tiny").spec
    job = build(pipeline, planned(strategy="fsdp", num_processes=1, optimizer="adamw", gradient_accumulation_steps=1))
    assert job.distributed.strategy == "fsdp" == job.plan.strategy
    assert TrainJob.from_json(job.to_json()).distributed.strategy == "fsdp"
