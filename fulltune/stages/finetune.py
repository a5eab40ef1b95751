"""Stage 3: fine-tune with the planned settings in a child process.

The stage prepares the base weights, trains through `fulltune.planning.replan` (which replans after an
out-of-memory crash) under `<workdir>/runs/<key>` and returns a `TrainedModel`. Ctrl-C stops the child with
the launcher and becomes `errors.Interrupted`, whose message names the step a rerun resumes from. The key sees
the training data only (`TokenizedData.train_fingerprint`), so new held-out data re-evaluates without retraining.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fulltune.errors import Interrupted
from fulltune.planning.inputs import ResolvedPipeline, describe_settings
from fulltune.stages import FINE_TUNE, MEMORY_BUDGET, PLANNED_NOT_WEIGHTS, TOKENIZE, model_source, weights_inputs
from fulltune.stages.runner import Inputs, Stage, StageLog

# An out-of-memory replan plans with the planner and the stages' planning inputs.
CODE = ("stages/finetune.py", "stages/__init__.py", "runtime", "planning/replan.py", "planning/inputs.py",
        "planning/planner.py", "planning/search.py", "planning/step_time.py", "planning/reasons.py",
        "planning/pipeline.py", "planning/strategy.py", "planning/trace.py", "memory", "data", "models.py",
        "attention.py", "levers.py", "lever_record.py", "optimizers.py", "degrees.py", "hub.py", "storage.py", "sizes.py",
        "pipelines_file.py")


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


def code(p: ResolvedPipeline) -> tuple[str, ...]:
    return CODE


def key(inputs: Inputs) -> dict[str, Any]:
    """The fine-tuned weights' identity: training data (not eval data), model, the planned settings (which hold
    the device the budget resolved to) and the optimisation (not what leaves the weights as they are:
    fulltune/stages `OUTSIDE_THE_WEIGHTS`, nor what changes only the plan: `PLANNED_NOT_WEIGHTS`)."""
    p = inputs.pipeline
    spec = p.spec
    settings = inputs.record(MEMORY_BUDGET).settings
    planned = asdict(settings) if not isinstance(settings, dict) else settings
    return {
        "data": inputs.record(TOKENIZE).data.training_fingerprint,
        "settings": {name: value for name, value in planned.items() if name not in PLANNED_NOT_WEIGHTS},
        **{section: {name: value for name, value in values.items() if name not in PLANNED_NOT_WEIGHTS}
           for section, values in weights_inputs(spec).items()},
        "model_source": model_source(p),
        "distributed": spec.distributed.model_dump(mode="json"),
    }


def run(inputs: Inputs, key: str, log: StageLog) -> TrainedModel:
    """Train the tokenized data with the budget's settings under `<workdir>/runs/<key>`, reporting to the
    pipeline's MLflow run.

    On an out-of-memory crash the run is replanned and resumed, at most twice (fulltune/planning/replan.py); each
    replan is a warning of `log` and a tag of the MLflow run. `log.watch(output_dir)` is entered around each
    training attempt (the task mirrors progress.json into a progress artifact there).

    Raises:
        Interrupted: Ctrl-C; the message says which step a rerun resumes from.
        UserError, OutOfMemory, RuntimeError: as fulltune.runtime.launch.run_training.
    """
    from fulltune.runtime import launch
    from fulltune.memory import Settings
    from fulltune.models import prepare_base_model
    from fulltune.tracking.registry import log_metrics, set_run_tags
    from fulltune.planning.replan import train_with_oom_replans

    p, logger = inputs.pipeline, log.logger
    tokenized, decision = inputs.record(TOKENIZE), inputs.record(MEMORY_BUDGET)
    data, tokenizer = tokenized.data, tokenized.tokenizer
    base_model = prepare_base_model(p.spec.model, tokenizer, p.workdir, p.spec.train.seed)

    def make_job(plan: Settings, output_dir: Path) -> Any:
        return launch.job_from_pipeline(p.spec, plan, model_path=base_model, tokenizer_path=tokenizer,
                                        train_file=data.train_rows_file, output_dir=str(output_dir),
                                        mlflow_tracking_uri=inputs.mlflow_uri, mlflow_run_id=inputs.mlflow_run_id)

    def train(job: Any) -> Any:
        output_dir = Path(job.paths.output_dir)
        with _interrupt_names_the_checkpoint(p, output_dir), log.watch(output_dir):
            return launch.run_training(job)

    def on_replan(replan: int, why: str) -> None:
        logger.warning(why)
        set_run_tags(inputs.mlflow_run_id, {f"fulltune.oom_replan.{replan}": why})

    logger.info(f"training with {describe_settings(decision.settings, decision.num_layers)}")
    trained = train_with_oom_replans(p, decision, key, make_job, run=train, on_replan=on_replan)
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
        if inputs.mlflow_run_id:
            log_metrics(inputs.mlflow_run_id, peaks)
    curve = Path(result.model_dir).parent / "loss_curve.png"
    return TrainedModel(key, result.model_dir, base_model, tokenizer, asdict(trained.settings), metrics,
                        str(curve) if curve.exists() else None, trained.replans)


def writes(inputs: Inputs, key: str, record: TrainedModel) -> list[str]:
    """The exported model, and the base weights when this machine made them (a model built from a config)."""
    return [record.model_dir, record.base_model] if record.base_model.startswith("/") else [record.model_dir]


def track(inputs: Inputs, record: TrainedModel) -> None:
    """The loss curve in the pipeline's MLflow run also when training was cached (a run that trained attached it
    as it ended: the same file again)."""
    if record.loss_curve and Path(record.loss_curve).is_file():
        from mlflow.tracking import MlflowClient

        MlflowClient().log_artifact(inputs.mlflow_run_id, record.loss_curve)


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


STAGE = Stage(FINE_TUNE, code, key, run, writes, rerun_after="it resumes training from the newest checkpoint",
              retry_delays=(5, 5), tracked=True, track=track)
