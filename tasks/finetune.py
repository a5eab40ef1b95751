"""Stage 3: fine-tune in a child process, resuming from the newest checkpoint when retried."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from fulltune.data import TokenizedData
from fulltune.pipeline import BudgetDecision, ResolvedPipeline, describe_settings, record_outputs
from tasks.common import stage_policy, retry_unless_user_error

MAX_OOM_REPLANS = 2
# The memory levers the plan may turn on; each is a TrainJob field of the same name.
LEVERS = ("pure_bf16", "optimizer_in_backward", "offload_optimizer", "offload_activations", "chunked_loss")


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


@task(name="fine-tune", cache_policy=stage_policy("fine-tune"), persist_result=True, retries=2,
      retry_delay_seconds=5, retry_condition_fn=retry_unless_user_error)
def finetune_task(p: ResolvedPipeline, key: str, data: TokenizedData, tokenizer: str, decision: BudgetDecision,
                  mlflow_uri: str, mlflow_run_id: str) -> TrainedModel:
    """Train with the planned settings; on an out-of-memory crash replan a smaller micro-batch (same
    effective batch) and try again, at most twice, resuming from the newest checkpoint when the replanned
    settings can (see _replan_output_dir)."""
    from fulltune.launch import OutOfMemory, run_training
    from fulltune.models import prepare_base_model
    from fulltune.registry import set_run_tags

    logger = get_run_logger()
    base_model = prepare_base_model(p.spec.model, tokenizer, p.workdir, p.spec.train.seed)
    settings = dict(decision.settings)
    output_dir = Path(p.workdir) / "runs" / key
    replans: list[str] = []
    logger.info("training with %s", describe_settings(settings, decision.num_layers))
    for attempt in range(MAX_OOM_REPLANS + 1):
        job = build_job(p, data, tokenizer, base_model, settings, output_dir, mlflow_uri, mlflow_run_id)
        try:
            with _progress(p, output_dir):
                result = run_training(job)
            break
        except OutOfMemory as oom:
            if attempt == MAX_OOM_REPLANS:
                raise
            settings = _replan(p, decision, settings, oom.observed_peak_bytes)
            replanned = build_job(p, data, tokenizer, base_model, settings, Path(job.output_dir), mlflow_uri,
                                  mlflow_run_id)
            output_dir, where = _replan_output_dir(p, key, job, replanned, attempt + 1)
            why = (f"out of memory (peak {oom.observed_peak_bytes or 'unknown'} bytes); retrying with "
                   f"{describe_settings(settings, decision.num_layers)}; {where}")
            logger.warning(why)
            replans.append(why)
            set_run_tags(mlflow_run_id, {f"fulltune.oom_replan.{attempt + 1}": why})
    metrics = {
        "train_loss": result.train_loss, "steps": float(result.steps), "tokens": float(result.tokens),
        "tokens_per_second": result.tokens_per_second, "train_seconds": result.seconds,
        "nonfinite_steps": float(result.nonfinite_steps),
    }
    if result.peak_memory_bytes is not None:
        metrics["peak_memory_bytes"] = float(result.peak_memory_bytes)
    curve = Path(result.model_dir).parent / "loss_curve.png"
    record_outputs(p.workdir, "fine-tune", key, [result.model_dir, base_model] if base_model.startswith("/")
                   else [result.model_dir])
    return TrainedModel(key, result.model_dir, base_model, tokenizer, settings, metrics,
                        str(curve) if curve.exists() else None, tuple(replans))


def build_job(p: ResolvedPipeline, data: TokenizedData, tokenizer: str, base_model: str, settings: dict[str, Any],
              output_dir: Path, mlflow_uri: str, mlflow_run_id: str) -> Any:
    from fulltune.launch import TrainJob

    t, d, m = p.spec.train, p.spec.distributed, p.spec.model
    return TrainJob(
        model_path=base_model, tokenizer_path=tokenizer, trust_remote_code=m.trust_remote_code,
        allow_pickle_weights=m.allow_pickle_weights, attn_implementation=m.attn_implementation,
        revision=m.revision, token_env=m.token_env,
        train_file=data.train_file, output_dir=str(output_dir),
        micro_batch_size=settings["micro_batch_size"],
        gradient_accumulation_steps=settings["gradient_accumulation_steps"],
        gradient_checkpointing=settings["gradient_checkpointing"],
        mixed_precision=settings["mixed_precision"], optimizer=settings["optimizer"],
        learning_rate=t.learning_rate, weight_decay=t.weight_decay, warmup_ratio=t.warmup_ratio,
        lr_scheduler=t.lr_scheduler, max_grad_norm=t.max_grad_norm, num_epochs=t.num_epochs,
        max_steps=t.max_steps, seed=t.seed, checkpoint_every_steps=t.checkpoint_every_steps,
        keep_checkpoints=t.keep_checkpoints, log_every_steps=t.log_every_steps, compile=t.compile,
        max_nonfinite_steps=t.max_nonfinite_steps, strategy=d.strategy, num_processes=d.num_processes,
        num_machines=d.num_machines, device=settings["device"],
        mlflow_tracking_uri=mlflow_uri, mlflow_run_id=mlflow_run_id, progress_artifact_id=None,
        **{lever: bool(settings.get(lever, False)) for lever in LEVERS},
    )


def _replan_output_dir(p: ResolvedPipeline, key: str, failed: Any, replanned: Any, replan: int) -> tuple[Path, str]:
    """Where the replanned run trains, and what that means for its progress.

    A replan keeps the effective batch, so the failed run's checkpoints usually stay valid and the new run
    continues in the same directory, from its newest checkpoint. When they are not (fulltune.launch.
    resume_conflict: e.g. the replan chose another optimizer, whose state cannot be loaded), it starts from
    step 0 in runs/<key>/replan-N, leaving the old checkpoints untouched.
    """
    from fulltune.launch import resume_conflict

    conflict = resume_conflict(failed, replanned)
    if conflict is None:
        return Path(failed.output_dir), "resuming from the newest checkpoint, if any (the step schedule is unchanged)"
    fresh = Path(p.workdir) / "runs" / key / f"replan-{replan}"
    return fresh, f"starting from step 0 in {fresh.name}: the checkpoints cannot be resumed, {conflict}"


def _replan(p: ResolvedPipeline, decision: BudgetDecision, settings: dict[str, Any], peak: int | None) -> dict[str, Any]:
    from dataclasses import asdict

    from fulltune.memory import Settings, replan_after_oom
    from fulltune.models import read_model_config
    from fulltune.pipeline import plan_request, resolved_budget

    device, budget_bytes, bf16 = resolved_budget(p)
    config = read_model_config(p.spec.model, decision.vocab_size)
    request = plan_request(p, decision.seq_len, device, budget_bytes, bf16, decision.target_fraction)
    plan = replan_after_oom(config, request, Settings(**settings), peak)
    return asdict(plan.settings)


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
