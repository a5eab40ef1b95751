"""The pipeline flow: tokenize → memory budget → fine-tune → evaluate → register. It only orders the stages.

Each stage is a module of fulltune/stages/ (its code, key, run and files); tasks/stage_task.py makes each one a
Prefect task with its cache policy, retries and artifacts (tasks/artifacts.py), and the engine's runner
(fulltune/stages/runner.py) gives each its key, its cache-hit rule and the MLflow run around it. The flow imports
tasks only.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from flows.run_parameters import PIPELINES_FILE, check_deployment_run
from tasks.common import clear_stale_locks
from tasks.run import flow_run_name, prepare, run_stages

# The stages in the order they run, each a module of fulltune/stages/ by its name: a new stage is its module
# and its name here.
ORDER = ("tokenize", "memory-budget", "fine-tune", "evaluate", "register")

__all__ = ["ORDER", "OVERRIDE_KEYS", "Overrides", "finetune_pipeline"]


class Overrides(BaseModel):
    """Change the pipeline for this run only. Leave a field empty to keep the pipeline's value (each field says
    what it is). Under "extra", set any other field as `dotted.key: value`, e.g. `evaluate.max_new_tokens: 16`:
    the training settings, and the fields the pipeline lists under `run_overrides`."""

    model_config = ConfigDict(extra="forbid", title="Changes for this run")

    learning_rate: float | None = Field(None, gt=0, description="train.learning_rate: the peak learning rate")
    max_steps: int | None = Field(None, ge=1, description="train.max_steps: optimizer steps to train (instead of "
                                                          "num_epochs)")
    num_epochs: float | None = Field(None, gt=0, description="train.num_epochs: passes over the training data")
    effective_batch_size: int | None = Field(None, ge=1, description="train.effective_batch_size: sequences per "
                                                                      "optimizer step")
    seed: int | None = Field(None, ge=0, description="train.seed: the random seed")
    max_length: int | None = Field(None, ge=8, description="data.max_length: tokens per row at most")
    budget_memory: str | None = Field(None, description="budget.memory: the device memory to plan for, e.g. 24GiB")
    extra: dict[str, Any] = Field(default_factory=dict, description="Any other field as dotted.key: value, e.g. "
                                  "evaluate.max_new_tokens: 16")

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


@flow(name="fulltune-pipeline", flow_run_name=flow_run_name, log_prints=True)
def finetune_pipeline(pipeline: str = "demo", overrides: Overrides | None = None,
                      pipelines_file: str = PIPELINES_FILE) -> Any:
    """Run one pipeline of `pipelines_file`: tokenize, check the memory budget, fine-tune, evaluate, register.

    Started from a deployment, the run's parameters may change only what the pipelines file lets them
    (flows/run_parameters.py), checked before any stage runs. Returns the run's summary
    (fulltune/tracking/summary.py `PipelineSummary`)."""
    logger = get_run_logger()
    changes = check_deployment_run(pipeline, overrides.dotted() if overrides else {}, pipelines_file)
    p = prepare(pipelines_file, pipeline, changes)
    for lock in clear_stale_locks(p.workdir):
        logger.warning("removed the stale lock %s of a run that no longer exists", lock.name)
    with run_stages(p, str(flow_run.id) if flow_run.id else None) as stages:
        for name in ORDER:
            stages.run(name)
    result = stages.summary()
    for line in result.lines():
        logger.info(line)
    return result
