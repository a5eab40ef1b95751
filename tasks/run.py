"""What the flow asks besides the stage tasks: the pipeline resolved once, how a stage task runs (its cache,
its results, a cache hit whose files are gone), what a full disk means, the MLflow run around the stages, the
champion to compare, and the run's summary. The flow (flows/pipeline.py) only orders the stages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fulltune import stages
from fulltune.errors import UserError, disk_full, disk_full_error
from fulltune.logs import quiet_known_noise  # noqa: F401 (the flow quiets library noise first)
from fulltune.planning.autotune_report import log_to_mlflow
from fulltune.stages import BudgetDecision, ResolvedPipeline
from fulltune.stages import registration_present  # noqa: F401
from fulltune.tracking import champion_to_compare  # noqa: F401
from fulltune.tracking import pipeline_run as _pipeline_run
from fulltune.tracking.summary import PipelineSummary, summarise
from tasks.common import results_dir, stage_policy


def prepare(pipelines_file: str, name: str, changes: dict[str, Any] | None) -> ResolvedPipeline:
    """Pipeline `name` with `changes` applied, its local data and workdir checked, its hub commits pinned (one
    commit for the whole run: every stage loads, and every key names, the same hub weights) and `budget:`
    resolved on this machine, once per run."""
    p = stages.resolve_pipeline(pipelines_file, name, changes or None)
    stages.ensure_local_data(p)
    stages.ensure_workdir(p)
    return stages.with_budget(stages.pin_hub_revisions(p))


def stage_task(task: Any, p: ResolvedPipeline, key: str, present: bool | None = None) -> Any:
    """The task with results beside the outputs; a cache hit whose files are gone is refreshed."""
    if present is None:
        present = stages.outputs_present(p.workdir, task.name, key)
    return task.with_options(cache_policy=stage_policy(task.name, p.workdir), result_storage=results_dir(p.workdir),
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
def a_full_disk_stops_the_run(workdir: str, running: dict[str, str | None]) -> Iterator[None]:
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


def log_tuning(run_id: str, decision: BudgetDecision) -> None:
    """The measured candidates' table and picture in MLflow run `run_id`, when autotune ran."""
    log_to_mlflow(run_id, decision.plan)


def summary(p: ResolvedPipeline, done: dict[str, str], decision: BudgetDecision, records: tuple[Any, Any, Any],
            tracking_uri: str, run_id: str) -> PipelineSummary:
    """The run's summary from its stages' records (trained, evaluated, registered)."""
    trained, report, registration = records
    return summarise(p.name, done, stages.describe_settings(decision.settings, decision.num_layers), trained,
                     report, registration, tracking_uri, run_id)


def pipeline_run(p: ResolvedPipeline, data_fingerprint: str, flow_run_id: str, stages_done: dict[str, str]) -> Any:
    """The pipeline's MLflow run (`fulltune.tracking.pipeline_run`) for the resolved pipeline `p`."""
    return _pipeline_run(p.name, p.spec, p.workdir, data_fingerprint, flow_run_id, stages_done)


__all__ = ["PipelineSummary", "a_full_disk_stops_the_run", "champion_to_compare", "log_tuning", "pipeline_run",
           "prepare", "quiet_known_noise", "registration_present", "stage_task", "summary"]
