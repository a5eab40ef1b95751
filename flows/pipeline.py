"""The pipeline flow: tokenize → memory budget → fine-tune → evaluate → register. It only orders the stages.

Each stage is an engine function (fulltune/) wrapped by a task (tasks/) that adds its cache policy,
retries and artifacts; the MLflow run around the stages and the registry questions that decide a
cache hit are fulltune/tracking/.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from flows.run_parameters import PIPELINES_FILE, check_deployment_run
from fulltune import stages, tracking
from fulltune.planning import autotune
from fulltune.errors import UserError, disk_full, disk_full_error
from fulltune.logs import quiet_known_noise
from fulltune.tracking.summary import PipelineSummary, summarise
from tasks.budget import memory_budget_task
from tasks.common import clear_stale_locks, results_dir, stage_policy
from tasks.evaluate import evaluate_task
from tasks.finetune import finetune_task
from tasks.register import register_task
from tasks.tokenize import tokenize_task

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


def _stage(task: Any, p: stages.ResolvedPipeline, name: str, key: str, present: bool | None = None) -> Any:
    """The task with results beside the outputs; a cache hit whose files are gone is refreshed."""
    if present is None:
        present = stages.outputs_present(p.workdir, name, key)
    return task.with_options(cache_policy=stage_policy(name, p.workdir), result_storage=results_dir(p.workdir),
                             refresh_cache=not present)


# What a rerun does after a full disk stopped a stage (the stages before it are cached).
RERUN_AFTER = {
    stages.TOKENIZE: "it tokenizes again",
    stages.MEMORY_BUDGET: "the tokenized data is cached; it plans again",
    stages.FINE_TUNE: "it resumes training from the newest checkpoint",
    stages.EVALUATE: "training is cached; it evaluates again",
    stages.REGISTER: "training and evaluation are cached; it registers the new version (none was left half-registered)",
}


@contextlib.contextmanager
def _a_full_disk_stops_the_run(workdir: str, running: dict[str, str | None]) -> Iterator[None]:
    """A full disk anywhere in the stages (their outputs, checkpoints, the exported model, MLflow's
    uploads and its SQLite database) ends the run with one line naming the filesystem and what a rerun
    does (fulltune.errors.DiskFull, exit 2); the stage tasks do not retry it (tasks/common.py)."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if not disk_full(exc):
            raise
        stage = running["stage"]
        raise disk_full_error(exc, workdir, RERUN_AFTER[stage] if stage else "the stages that finished are cached") \
            from None


@flow(name="fulltune-pipeline", log_prints=True)
def finetune_pipeline(pipeline: str = "demo", overrides: Overrides | None = None,
                      pipelines_file: str = PIPELINES_FILE) -> PipelineSummary:
    """Run one pipeline of `pipelines_file`: tokenize, check the memory budget, fine-tune, evaluate, register.

    Started from a deployment, the run's parameters may change only what the pipelines file lets them
    (flows/run_parameters.py), checked before any stage runs."""
    quiet_known_noise()
    logger = get_run_logger()
    changes = check_deployment_run(pipeline, overrides.dotted() if overrides else {}, pipelines_file)
    p = stages.resolve_pipeline(pipelines_file, pipeline, changes or None)
    stages.ensure_local_data(p)
    stages.ensure_workdir(p)
    # One commit for the whole run: every stage loads, and every key names, the same hub weights.
    p = stages.with_budget(stages.pin_hub_revisions(p))  # `budget:` on this machine, resolved once per run
    for lock in clear_stale_locks(p.workdir):
        logger.warning("removed the stale lock %s of a run that no longer exists", lock.name)
    flow_run_id = str(flow_run.id or "local")
    done: dict[str, str] = {}  # each stage: "ran" or "cached"
    running: dict[str, str | None] = {"stage": None}

    def run(task: Any, name: str, key: str, *args: Any, present: bool | None = None) -> Any:
        running["stage"] = name
        state = _stage(task, p, name, key, present)(p, key, *args, return_state=True)
        result = state.result()
        done[name], running["stage"] = "cached" if state.name == "Cached" else "ran", None
        return result

    with _a_full_disk_stops_the_run(p.workdir, running):
        key = stages.tokenize_key(p)
        data, tokenizer = run(tokenize_task, stages.TOKENIZE, key)
        # Budget and training see the training data only; evaluation and registration the held-out data too.
        key = stages.budget_key(p, data.training_fingerprint)
        decision = run(memory_budget_task, stages.MEMORY_BUDGET, key, data, tokenizer)

        with tracking.pipeline_run(p.name, p.spec, p.workdir, data.fingerprint, flow_run_id, done) as mlflow_run:
            uri, run_id = mlflow_run.tracking_uri, mlflow_run.run_id
            autotune.log_to_mlflow(run_id, decision.plan)  # the measured candidates' table and picture, when tuned
            key = stages.train_key(p, data.training_fingerprint, decision.settings)
            trained = run(finetune_task, stages.FINE_TUNE, key, data, tokenizer, decision, uri, run_id)
            champion = tracking.champion_to_compare(p.model_name, trained.key)
            evaluation = decision.plan.get("evaluation")  # the evaluate stage's dtype, batches and placement
            key = stages.evaluate_key(p, trained.key, data.fingerprint, champion.version if champion else None,
                                      evaluation)
            report = run(evaluate_task, stages.EVALUATE, key, data, trained, champion, decision.settings.device,
                         run_id, evaluation)
            key = stages.register_key(p, trained.key, key, uri)
            registration = run(register_task, stages.REGISTER, key, data, trained, report, run_id, flow_run_id,
                               present=stages.registration_present(p.workdir, key, trained.key))

    summary = summarise(p.name, done, stages.describe_settings(decision.settings, decision.num_layers), trained,
                        report, registration, uri, run_id)
    for line in summary.lines():
        logger.info(line)
    return summary
