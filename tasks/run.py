"""What the flow asks besides the stages' tasks: the pipeline resolved once, and the runner of its stages.

The flow (flows/pipeline.py) only orders the stages; their keys, the champion to compare, the cache-hit rules,
the MLflow run around them and what a full disk means are the engine's runner (fulltune/stages/runner.py),
which runs each stage as its Prefect task (tasks/stage_task.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fulltune import stages
from fulltune.stages import ResolvedPipeline
from fulltune.stages.runner import PipelineRunner, run_pipeline
from fulltune.tracking.registry import run_name
from tasks.stage_task import call


def prepare(pipelines_file: str, name: str, changes: dict[str, Any] | None) -> ResolvedPipeline:
    """Pipeline `name` with `changes` applied, its local data and workdir checked, its hub commits pinned (one
    commit for the whole run: every stage loads, and every key names, the same hub weights) and `budget:`
    resolved on this machine, once per run."""
    p = stages.resolve_pipeline(pipelines_file, name, changes or None)
    stages.ensure_local_data(p)
    stages.ensure_workdir(p)
    return stages.with_budget(stages.pin_hub_revisions(p))


@contextlib.contextmanager
def run_stages(p: ResolvedPipeline, flow_run_id: str | None) -> Iterator[PipelineRunner]:
    """The runner of this pipeline run's stages, each run as its Prefect task; the flow run (None: called outside
    one) is named for what it did when it ends, as its MLflow run is (`demo · v3 · not promoted`, `demo · failed in
    fine-tune`). A Ctrl-C leaves the name alone: the run is stopping, the server may be too."""
    runner: PipelineRunner | None = None
    try:
        with run_pipeline(p, flow_run_id or "local", call) as runner:
            yield runner
    except Exception:
        if runner is not None and flow_run_id is not None:
            stage = runner.running
            _name_flow_run(flow_run_id, run_name(p.name, "failed" + (f" in {stage.name}" if stage else "")))
        raise
    if runner.outcome is not None and flow_run_id is not None:
        _name_flow_run(flow_run_id, run_name(p.name, runner.outcome))


def _name_flow_run(flow_run_id: str, name: str) -> None:
    """Rename the flow run; a Prefect API that refuses says so in the log, and the run's own outcome (or error)
    stands."""
    import httpx
    from prefect import get_run_logger
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run_id, name=name)
    except httpx.HTTPError as exc:
        get_run_logger().warning("could not name the flow run %r: %s", name, exc)


def flow_run_name() -> str:
    """The name a pipeline's flow run starts with (`demo · running`), until `run_stages` names its outcome."""
    from prefect.runtime import flow_run

    return run_name(str(flow_run.parameters.get("pipeline", "pipeline")), "running")
