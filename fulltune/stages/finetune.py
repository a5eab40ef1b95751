"""Stage 3: fine-tune with the planned settings in a child process; what the fine-tune task wraps.

The stage prepares the base weights, trains through `fulltune.planning.replan` (which replans after an
out-of-memory crash), records its outputs and returns a `TrainedModel`. Ctrl-C stops the child with
the launcher and becomes `errors.Interrupted`, whose message names the step a rerun resumes from.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fulltune.errors import Interrupted
from fulltune.stages import FINE_TUNE, BudgetDecision, ResolvedPipeline, describe_settings, record_outputs


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


class PrintLog:
    """A logger for `fine_tune` outside Prefect: info and warnings printed."""

    info = warning = staticmethod(print)


def fine_tune(p: ResolvedPipeline, key: str, data: Any, tokenizer: str, decision: BudgetDecision, tracking: Any, *,
              logger: Any = PrintLog,
              watch: Callable[[Path], AbstractContextManager[Any]] = lambda output_dir: nullcontext()) -> TrainedModel:
    """Train `data` (a TokenizedData) with `decision`'s settings under `<workdir>/runs/<key>`, reporting to
    `tracking` (a `fulltune.runtime.launch.Tracking`: the MLflow server and run).

    On an out-of-memory crash the run is replanned and resumed, at most twice (fulltune/planning/replan.py); each
    replan is a warning of `logger` (anything with `info` and `warning`, a `logging.Logger` say) and a tag of the
    MLflow run. `watch(output_dir)` is entered around each training attempt (the task mirrors progress.json into
    a progress artifact there).

    Raises:
        Interrupted: Ctrl-C; the message says which step a rerun resumes from.
        UserError, OutOfMemory, RuntimeError: as fulltune.runtime.launch.run_training.
    """
    from fulltune.runtime import launch
    from fulltune.memory import Settings
    from fulltune.models import prepare_base_model
    from fulltune.tracking.registry import log_metrics, set_run_tags
    from fulltune.planning.replan import train_with_oom_replans

    base_model = prepare_base_model(p.spec.model, tokenizer, p.workdir, p.spec.train.seed)

    def make_job(plan: Settings, output_dir: Path) -> Any:
        return launch.job_from_pipeline(p.spec, plan, model_path=base_model, tokenizer_path=tokenizer,
                                        train_file=data.train_rows_file, output_dir=str(output_dir),
                                        mlflow_tracking_uri=tracking.mlflow_tracking_uri,
                                        mlflow_run_id=tracking.mlflow_run_id)

    def run(job: Any) -> Any:
        output_dir = Path(job.paths.output_dir)
        with _interrupt_names_the_checkpoint(p, output_dir), watch(output_dir):
            return launch.run_training(job)

    def on_replan(replan: int, why: str) -> None:
        logger.warning(why)
        set_run_tags(tracking.mlflow_run_id, {f"fulltune.oom_replan.{replan}": why})

    logger.info(f"training with {describe_settings(decision.settings, decision.num_layers)}")
    trained = train_with_oom_replans(p, decision, key, make_job, run=run, on_replan=on_replan)
    result = trained.result
    metrics = {
        "train_loss": result.train_loss, "steps": float(result.steps), "tokens": float(result.tokens),
        "tokens_per_second": result.tokens_per_second, "train_seconds": result.seconds,
        "nonfinite_steps": float(result.nonfinite_steps),
    }
    if result.peak_memory_bytes is not None:
        metrics["peak_memory_bytes"] = float(result.peak_memory_bytes)
    if result.rank_peaks:  # each process's step peak against its estimate (fulltune/runtime/step_memory.py)
        peaks = {"step_peak_bytes": float(max(r["measured_bytes"] for r in result.rank_peaks)),
                 "step_peak_estimate_error": max((r["error"] for r in result.rank_peaks), key=abs)}
        metrics.update(peaks)
        if tracking.mlflow_run_id:
            log_metrics(tracking.mlflow_run_id, peaks)
    curve = Path(result.model_dir).parent / "loss_curve.png"
    record_outputs(p.workdir, FINE_TUNE, key, [result.model_dir, base_model] if base_model.startswith("/")
                   else [result.model_dir])
    return TrainedModel(key, result.model_dir, base_model, tokenizer, asdict(trained.settings), metrics,
                        str(curve) if curve.exists() else None, trained.replans)


def training_progress(output_dir: Path) -> tuple[int, int] | None:
    """(step, total steps) from the child's progress.json, or None before its first report."""
    from fulltune.runtime.launch import PROGRESS_FILE

    try:
        progress = json.loads((output_dir / PROGRESS_FILE).read_text())
        return int(progress["step"]), int(progress["total_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_step(output_dir: Path) -> int | None:
    """The step of the newest checkpoint under `output_dir`, which a rerun resumes from; None if none."""
    from fulltune.runtime.step_checkpoints import CHECKPOINT_DIR, latest_checkpoint

    newest = latest_checkpoint(output_dir / CHECKPOINT_DIR) if (output_dir / CHECKPOINT_DIR).is_dir() else None
    return int(newest.name.removeprefix("step-")) if newest is not None else None


@contextmanager
def _interrupt_names_the_checkpoint(p: ResolvedPipeline, output_dir: Path) -> Iterator[None]:
    """Turn Ctrl-C during training into Interrupted, saying how far training got and where a rerun resumes.

    By the time the KeyboardInterrupt gets here the launcher has already stopped the child (its
    checkpoints are written atomically, so the newest complete one is what a rerun finds).
    """
    try:
        yield
    except Interrupted:
        raise
    except KeyboardInterrupt:
        step = resume_step(output_dir)
        progress = training_progress(output_dir)
        at = f" at step {progress[0]} of {progress[1]}" if progress else ""
        resume = (f"rerunning resumes from step {step} (the newest checkpoint)" if step is not None
                  else "no checkpoint was written yet, so rerunning trains from the start")
        raise Interrupted(f"{FINE_TUNE} of pipeline {p.name} stopped{at}; {resume}") from None
