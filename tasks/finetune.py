"""Stage 3: fine-tune in a child process, resuming from the newest checkpoint when retried."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from fulltune.data import TokenizedData
from fulltune.stages import FINE_TUNE, BudgetDecision, ResolvedPipeline, describe_settings, record_outputs
from tasks.common import stage_policy, retry_unless_user_error


@dataclass(frozen=True)
class TrainedModel:
    """The fine-tuned checkpoint and how it was made."""

    key: str
    model_dir: str
    base_model: str
    tokenizer: str
    settings: dict[str, Any]
    metrics: dict[str, float]
    loss_curve: str | None
    replans: tuple[str, ...] = ()


@task(name=FINE_TUNE, cache_policy=stage_policy(FINE_TUNE), persist_result=True, retries=2,
      retry_delay_seconds=5, retry_condition_fn=retry_unless_user_error)
def finetune_task(p: ResolvedPipeline, key: str, data: TokenizedData, tokenizer: str, decision: BudgetDecision,
                  mlflow_uri: str, mlflow_run_id: str) -> TrainedModel:
    """Train with the planned settings; on an out-of-memory crash replan and try again, at most twice,
    resuming from the newest checkpoint when the replanned settings can (fulltune/replan.py)."""
    from fulltune import launch
    from fulltune.memory import Settings
    from fulltune.models import prepare_base_model
    from fulltune.registry import set_run_tags
    from fulltune.replan import train_with_oom_replans

    logger = get_run_logger()
    base_model = prepare_base_model(p.spec.model, tokenizer, p.workdir, p.spec.train.seed)

    def make_job(plan: Settings, output_dir: Path) -> Any:
        return launch.job_from_pipeline(p.spec, plan, model_path=base_model, tokenizer_path=tokenizer,
                                        train_file=data.train_file, output_dir=str(output_dir),
                                        mlflow_tracking_uri=mlflow_uri, mlflow_run_id=mlflow_run_id)

    def run(job: Any) -> Any:
        with _progress(p, Path(job.paths.output_dir)):
            return launch.run_training(job)

    def on_replan(replan: int, why: str) -> None:
        logger.warning(why)
        set_run_tags(mlflow_run_id, {f"fulltune.oom_replan.{replan}": why})

    logger.info("training with %s", describe_settings(decision.settings, decision.num_layers))
    trained = train_with_oom_replans(p, decision, key, make_job, run=run, on_replan=on_replan)
    result = trained.result
    metrics = {
        "train_loss": result.train_loss, "steps": float(result.steps), "tokens": float(result.tokens),
        "tokens_per_second": result.tokens_per_second, "train_seconds": result.seconds,
        "nonfinite_steps": float(result.nonfinite_steps),
    }
    if result.peak_memory_bytes is not None:
        metrics["peak_memory_bytes"] = float(result.peak_memory_bytes)
    curve = Path(result.model_dir).parent / "loss_curve.png"
    record_outputs(p.workdir, FINE_TUNE, key, [result.model_dir, base_model] if base_model.startswith("/")
                   else [result.model_dir])
    return TrainedModel(key, result.model_dir, base_model, tokenizer, asdict(trained.settings), metrics,
                        str(curve) if curve.exists() else None, trained.replans)


class _progress:
    """Mirror the child's `progress.json` into a Prefect progress artifact while it trains."""

    def __init__(self, p: ResolvedPipeline, output_dir: Path) -> None:
        self.file = output_dir / "progress.json"
        self.stop = threading.Event()
        self.artifact_id = create_progress_artifact(progress=0.0, key=f"{p.name}-training-progress",
                                                    description=f"Training progress of {p.name}")
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _progress:
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
        try:
            progress = json.loads(self.file.read_text())
            percent = 100.0 * progress["step"] / max(progress["total_steps"], 1)
        except (OSError, ValueError, KeyError):
            return
        update_progress_artifact(self.artifact_id, progress=min(percent, 100.0))
