"""The pipeline flow: tokenize → memory budget → fine-tune → evaluate → register. It only orders the stages.

Each stage is an engine function (fulltune/) wrapped by a task (tasks/) that adds its cache policy,
retries and artifacts, and names its cache key; the MLflow run around the stages, the registry questions
that decide a cache hit and what a full disk means are tasks/run.py. The flow imports tasks only.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from flows.run_parameters import PIPELINES_FILE, check_deployment_run
from tasks.budget import budget_key, memory_budget_task
from tasks.common import clear_stale_locks
from tasks.evaluate import evaluate_key, evaluate_task
from tasks.finetune import finetune_task, train_key
from tasks.register import register_key, register_task
from tasks.run import (PipelineSummary, a_full_disk_stops_the_run, champion_to_compare, log_tuning, pipeline_run,
                       prepare, quiet_known_noise, registration_present, stage_task, summary)
from tasks.tokenize import tokenize_key, tokenize_task

__all__ = ["OVERRIDE_KEYS", "Overrides", "PipelineSummary", "finetune_pipeline"]


class Overrides(BaseModel):
    """Changes to the pipeline for one run. The Prefect UI shows this as a form and the server validates
    it; `extra` takes any other field as `dotted.key: value` (what `--set` does on the command line), as
    far as the pipeline lets a run parameter change it (flows/run_parameters.py)."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | None = Field(None, gt=0, description="train.learning_rate")
    max_steps: int | None = Field(None, ge=1, description="train.max_steps")
    num_epochs: float | None = Field(None, gt=0, description="train.num_epochs")
    effective_batch_size: int | None = Field(None, ge=1, description="train.effective_batch_size")
    seed: int | None = Field(None, ge=0, description="train.seed")
    max_length: int | None = Field(None, ge=8, description="data.max_length")
    budget_memory: str | None = Field(None, description="budget.memory, e.g. '24GiB'")
    extra: dict[str, Any] = Field(default_factory=dict, description="Any other field, as dotted.key: value: the "
                                  "training knobs, and what the pipeline's run_overrides lists")

    def dotted(self) -> dict[str, Any]:
        """The overrides as `dotted.key: value` (what `--set` takes); `extra` wins over a typed field."""
        typed = {OVERRIDE_KEYS[name]: value
                 for name, value in self.model_dump(exclude={"extra"}).items() if value is not None}
        return {**typed, **self.extra}


# The YAML key each typed field of Overrides sets.
OVERRIDE_KEYS = {
    "learning_rate": "train.learning_rate",
    "max_steps": "train.max_steps",
    "num_epochs": "train.num_epochs",
    "effective_batch_size": "train.effective_batch_size",
    "seed": "train.seed",
    "max_length": "data.max_length",
    "budget_memory": "budget.memory",
}


@flow(name="fulltune-pipeline", log_prints=True)
def finetune_pipeline(pipeline: str = "demo", overrides: Overrides | None = None,
                      pipelines_file: str = PIPELINES_FILE) -> PipelineSummary:
    """Run one pipeline of `pipelines_file`: tokenize, check the memory budget, fine-tune, evaluate, register.

    Started from a deployment, the run's parameters may change only what the pipelines file lets them
    (flows/run_parameters.py), checked before any stage runs."""
    quiet_known_noise()
    logger = get_run_logger()
    changes = check_deployment_run(pipeline, overrides.dotted() if overrides else {}, pipelines_file)
    p = prepare(pipelines_file, pipeline, changes)
    for lock in clear_stale_locks(p.workdir):
        logger.warning("removed the stale lock %s of a run that no longer exists", lock.name)
    flow_run_id = str(flow_run.id or "local")
    done: dict[str, str] = {}  # each stage: "ran" or "cached"
    running: dict[str, str | None] = {"stage": None}

    def run(task: Any, key: str, *args: Any, present: bool | None = None) -> Any:
        running["stage"] = task.name
        state = stage_task(task, p, key, present)(p, key, *args, return_state=True)
        result = state.result()
        done[task.name], running["stage"] = "cached" if state.name == "Cached" else "ran", None
        return result

    with a_full_disk_stops_the_run(p.workdir, running):
        key = tokenize_key(p)
        data, tokenizer = run(tokenize_task, key)
        # Budget and training see the training data only; evaluation and registration the held-out data too.
        key = budget_key(p, data.training_fingerprint)
        decision = run(memory_budget_task, key, data, tokenizer)

        with pipeline_run(p, data.fingerprint, flow_run_id, done) as mlflow_run:
            uri, run_id = mlflow_run.tracking_uri, mlflow_run.run_id
            log_tuning(run_id, decision)  # the measured candidates' table and picture, when tuned
            key = train_key(p, data.training_fingerprint, decision.settings)
            trained = run(finetune_task, key, data, tokenizer, decision, uri, run_id)
            champion = champion_to_compare(p.model_name, trained.key)
            evaluation = decision.plan.get("evaluation")  # the evaluate stage's dtype, batches and placement
            key = evaluate_key(p, trained.key, data.fingerprint, champion.version if champion else None, evaluation)
            report = run(evaluate_task, key, data, trained, champion, decision.settings.device, run_id, evaluation)
            key = register_key(p, trained.key, key, uri)
            registration = run(register_task, key, data, trained, report, run_id, flow_run_id,
                               present=registration_present(p.workdir, key, trained.key))

    result = summary(p, done, decision, (trained, report, registration), uri, run_id)
    for line in result.lines():
        logger.info(line)
    return result
