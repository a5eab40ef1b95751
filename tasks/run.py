"""What the flow asks besides the stages' tasks: the pipeline resolved once, and the runner of its stages.

The flow (flows/pipeline.py) only orders the stages; their keys, the champion to compare, the cache-hit rules,
the MLflow run around them and what a full disk means are the engine's runner (fulltune/stages/runner.py),
which runs each stage as its Prefect task (tasks/stage_task.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from fulltune import stages
from fulltune.stages import ResolvedPipeline
from fulltune.stages.runner import PipelineRunner, run_pipeline
from tasks.stage_task import call


def prepare(pipelines_file: str, name: str, changes: dict[str, Any] | None) -> ResolvedPipeline:
    """Pipeline `name` with `changes` applied, its local data and workdir checked, its hub commits pinned (one
    commit for the whole run: every stage loads, and every key names, the same hub weights) and `budget:`
    resolved on this machine, once per run."""
    p = stages.resolve_pipeline(pipelines_file, name, changes or None)
    stages.ensure_local_data(p)
    stages.ensure_workdir(p)
    return stages.with_budget(stages.pin_hub_revisions(p))


def run_stages(p: ResolvedPipeline, flow_run_id: str) -> AbstractContextManager[PipelineRunner]:
    """The runner of this pipeline run's stages, each run as its Prefect task."""
    return run_pipeline(p, flow_run_id, call)
