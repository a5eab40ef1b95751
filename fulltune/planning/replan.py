"""Train a planned job, replanning a smaller step when the device runs out of memory.

The memory plan is an estimate; when the child still runs out of memory (exit 3), the planner is asked
again with the observed peak (fulltune.planning.replan_after_oom): a smaller micro-batch with the same
effective batch, more checkpointed layers, or a cheaper lever. At most MAX_OOM_REPLANS times. The
replanned run resumes from the failed run's newest checkpoint when it can (launch.resume_conflict).

No Prefect here: the fine-tune task passes callbacks for its progress artifact, its log and MLflow tags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fulltune.runtime import launch
from fulltune.runtime.launch import OutOfMemory, TrainJob, TrainResult, resume_conflict
from fulltune.memory.types import Settings

MAX_OOM_REPLANS = 2


@dataclass(frozen=True)
class ReplannedTraining:
    """The finished run, the settings it finished with and why each replan happened."""

    result: TrainResult
    settings: Settings
    replans: tuple[str, ...]


def train_with_oom_replans(p: Any, decision: Any, key: str,
                           make_job: Callable[[Settings, Path], TrainJob], *,
                           run: Callable[[TrainJob], TrainResult] | None = None,
                           on_replan: Callable[[int, str], None] = lambda replan, why: None,
                           max_replans: int = MAX_OOM_REPLANS) -> ReplannedTraining:
    """Train `make_job(<the plan's settings>, <workdir>/runs/<key>)`; on OutOfMemory replan and try again.

    `p` is the ResolvedPipeline and `decision` its BudgetDecision. `run` trains a job (default
    launch.run_training); `on_replan(n, why)` hears about the n-th replan before it runs.

    Raises:
        OutOfMemory: still out of memory after `max_replans` replans.
        UserError, RuntimeError: as launch.run_training.
    """
    settings = decision.settings
    output_dir = Path(p.workdir) / "runs" / key
    replans: list[str] = []
    for attempt in range(max_replans + 1):
        job = make_job(settings, output_dir)
        try:
            result = (run or launch.run_training)(job)
            return ReplannedTraining(result, settings, tuple(replans))
        except OutOfMemory as oom:
            if attempt == max_replans:
                raise
            settings = replan_settings(p, decision, settings, oom.observed_peak_bytes)
            replanned = make_job(settings, Path(job.paths.output_dir))
            output_dir, where = replan_output_dir(p, key, job, replanned, attempt + 1)
            from fulltune.memory.report import describe_settings

            why = (f"out of memory (peak {oom.observed_peak_bytes or 'unknown'} bytes); retrying with "
                   f"{describe_settings(asdict(settings), decision.num_layers)}; {where}")
            replans.append(why)
            on_replan(attempt + 1, why)
    raise AssertionError("unreachable: the last attempt returns or raises")


def replan_output_dir(p: Any, key: str, failed: TrainJob, replanned: TrainJob, replan: int) -> tuple[Path, str]:
    """Where the replanned run trains, and what that means for its progress.

    A replan keeps the effective batch, so the failed run's checkpoints usually stay valid and the new run
    continues in the same directory, from its newest checkpoint. When they are not (launch.resume_conflict:
    e.g. the replan chose another optimizer, whose state cannot be loaded), it starts from step 0 in
    runs/<key>/replan-N, leaving the old checkpoints untouched.
    """
    conflict = resume_conflict(failed, replanned)
    if conflict is None:
        return Path(failed.paths.output_dir), "resuming from the newest checkpoint, if any (the step schedule is unchanged)"
    fresh = Path(p.workdir) / "runs" / key / f"replan-{replan}"
    return fresh, f"starting from step 0 in {fresh.name}: the checkpoints cannot be resumed, {conflict}"


def replan_settings(p: Any, decision: Any, settings: Settings, peak: int | None) -> Settings:
    """The planner's next settings after `settings` ran out of memory at `peak` bytes (None: unknown)."""
    from fulltune.planning import replan_after_oom
    from fulltune.models import read_model_config
    from fulltune.planning.inputs import plan_request

    config = read_model_config(p.spec.model, decision.vocab_size)
    request = plan_request(p, decision.seq_len, decision.target_fraction, decision.document_length, config)
    return replan_after_oom(config, request, settings, peak).settings
