"""Stage 3: fine-tune (fulltune/stages/finetune.py) as a Prefect task: retries that resume, a progress artifact."""

from __future__ import annotations

import threading
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from fulltune.data import TokenizedData
from fulltune.stages.finetune import TrainedModel, fine_tune, training_progress
from fulltune.stages import FINE_TUNE, BudgetDecision, ResolvedPipeline
# The stage's cache key, which the flow computes before it runs the task (fulltune/stages: content and code).
from fulltune.stages import train_key  # noqa: F401
from tasks.common import retry_unless_user_error, stage_policy

__all__ = ["TrainedModel", "finetune_task"]


@task(name=FINE_TUNE, cache_policy=stage_policy(FINE_TUNE), persist_result=True, retries=2,
      retry_delay_seconds=5, retry_condition_fn=retry_unless_user_error)
def finetune_task(p: ResolvedPipeline, key: str, data: TokenizedData, tokenizer: str, decision: BudgetDecision,
                  mlflow_uri: str, mlflow_run_id: str) -> TrainedModel:
    """Train with the planned settings; a retry resumes from the newest checkpoint."""
    from fulltune.runtime.launch import Tracking

    tracking = Tracking(mlflow_tracking_uri=mlflow_uri, mlflow_run_id=mlflow_run_id)
    return fine_tune(p, key, data, tokenizer, decision, tracking, logger=get_run_logger(),
                     watch=lambda output_dir: _Progress(p.name, output_dir))


class _Progress:
    """Mirror the child's `progress.json` into a Prefect progress artifact while it trains."""

    def __init__(self, pipeline: str, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.stop = threading.Event()
        self.artifact_id = create_progress_artifact(progress=0.0, key=f"{pipeline}-training-progress",
                                                    description=f"Training progress of {pipeline}")
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self._update()

    def _poll(self) -> None:
        while not self.stop.wait(3.0):
            self._update()

    def _update(self) -> None:
        progress = training_progress(self.output_dir)
        if progress is not None:
            update_progress_artifact(self.artifact_id, progress=min(100.0 * progress[0] / max(progress[1], 1), 100.0))
