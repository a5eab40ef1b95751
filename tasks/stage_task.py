"""Every stage as a Prefect task: its cache key, results beside its outputs, its retries, its artifacts."""

from __future__ import annotations

from functools import cache
from typing import Any

from prefect import get_run_logger, task

from fulltune.stages.runner import Inputs, Stage, StageLog, run_stage
from tasks.artifacts import ARTIFACTS, WATCHES
from tasks.common import results_dir, retry_unless_user_error, stage_policy


@cache
def stage_task(stage: Stage) -> Any:
    """The Prefect task of `stage`: `task(inputs, key)` runs it through the engine's runner (which records its
    marker) and publishes its artifacts; cached by `key`, a crash retried after each of `stage.retry_delays`."""
    artifacts, watch = ARTIFACTS.get(stage.name), WATCHES.get(stage.name)

    def run(inputs: Inputs, key: str) -> Any:
        logger = get_run_logger()
        log = StageLog(logger, watch(inputs)) if watch is not None else StageLog(logger)
        record = run_stage(stage, inputs, key, log)
        if artifacts is not None:
            artifacts(inputs, key, record)
        return record

    # Prefect tells tasks apart by their function's name and code: each stage's its own.
    run.__name__ = run.__qualname__ = stage.name.replace("-", "_")
    return task(run, name=stage.name, cache_policy=stage_policy(stage.name), persist_result=True,
                retries=len(stage.retry_delays), retry_delay_seconds=list(stage.retry_delays) or 0,
                retry_condition_fn=retry_unless_user_error)


def call(stage: Stage, inputs: Inputs, key: str, refresh: bool) -> tuple[Any, bool]:
    """Run `stage`'s task (fulltune/stages/runner.py `Call`): results and cache records under the workdir, a
    cached result refreshed when it no longer stands; (its record, whether it came from the cache)."""
    workdir = inputs.pipeline.workdir
    task_ = stage_task(stage).with_options(cache_policy=stage_policy(stage.name, workdir),
                                           result_storage=results_dir(workdir), refresh_cache=refresh)
    state = task_(inputs, key, return_state=True)
    return state.result(), state.name == "Cached"
