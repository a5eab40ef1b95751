"""The trainer's metrics: every counter the logs and the result report (`TrainMetrics`), the metrics file the
launcher forwards to MLflow, the device's memory peaks and MFU's GPU peak."""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from fulltune.memory import flops
from fulltune.runtime.launch import PROGRESS_FILE, TrainJob
from fulltune.runtime.run_tracking import METRICS_FILE, metric_line
from fulltune.runtime.step import StepOutcome
from fulltune.storage import atomic_write_text

if TYPE_CHECKING:
    from fulltune.runtime.train import TrainingRun


def peak_flops(job: TrainJob) -> float | None:
    """The GPU's dense 16-bit peak for MFU (fulltune/memory/flops.py); None for fp32 runs, CPUs and unknown GPUs."""
    if job.plan.device != "cuda" or job.plan.mixed_precision == "no":
        return None
    return flops.peak_flops(torch.cuda.get_device_name())


def memory_metrics(device: str) -> dict[str, float]:
    if device == "cuda":
        return {"peak_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved()}
    return {"cpu_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class MetricsFile:
    """Each log interval's metrics appended to `metrics.jsonl` (main process only), which the launching
    process forwards to MLflow (fulltune/runtime/run_tracking.py): the trainer itself never imports MLflow."""

    def __init__(self, output_dir: Path, enabled: bool) -> None:
        self.handle = open(output_dir / METRICS_FILE, "a") if enabled else None

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.handle is not None:
            self.handle.write(metric_line(step, int(time.time() * 1000), values))
            self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class TrainMetrics:
    """Owns every counter the logs and the result report, and logs them every `log_every_steps`.

    Run totals: `tokens` (non-padding, all processes) and `loss_history` ([step, mean token loss of the step], every
    step that trained, from the first: the loss curve and MLflow's `train_loss` have every step however seldom the
    run logs). Interval counters, reset at each log: each finite step's loss sum (on the device: read only when
    logging or checkpointing, so per-step losses cost no sync point) with its target tokens, and the interval's
    tokens, rows, FLOPs and wall time. A checkpoint saves `state_dict()` (tokens, the interval's step losses,
    history), so a resumed run logs the same losses as an uninterrupted one.
    """

    def __init__(self, run: TrainingRun, saved: dict[str, Any]) -> None:
        self.run, self.job = run, run.job
        self.tokens: int = saved.get("tokens", 0)
        self.loss_history: list[list[float]] = saved.get("loss_history", [])
        device = run.accelerator.device
        # (step, its loss sum on the device, its target tokens) of each finite step since the last log
        self.interval_steps: list[tuple[int, torch.Tensor, int]] = [
            (int(step), torch.tensor(loss_sum, dtype=torch.float32, device=device), int(targets))
            for step, loss_sum, targets in saved.get("interval_steps", [])]
        self.step = 0
        self.grad_norm = torch.zeros((), device=run.accelerator.device)
        self.sink = MetricsFile(run.output_dir, run.main_process)
        self.peak = peak_flops(run.job)
        self.interval_tokens, self.interval_rows, self.interval_flops = 0, 0, 0.0
        self.seconds = 0.0

    @contextlib.contextmanager
    def running(self, step: int) -> Iterator[None]:
        """Around the loop: the progress bar from `step`, and the loop's timing (this process's part of the run).

        The bar is closed on the way out, also when a step raises, so that an error is the last line.
        """
        self.progress = tqdm(total=self.run.total_steps, initial=step, desc="train", unit="step", file=sys.stderr,
                             disable=not self.run.main_process, mininterval=1.0 if sys.stderr.isatty() else 30.0)
        self.started = self.interval_started = time.perf_counter()
        self.start_tokens, self.step = self.tokens, step
        with self.progress:
            yield
        self.seconds = time.perf_counter() - self.started

    def state_dict(self) -> dict[str, Any]:
        """The counters a checkpoint keeps."""
        sums = self._interval_sums()  # Sync point (checkpoint)
        return {"tokens": self.tokens, "loss_history": self.loss_history,
                "interval_steps": [[step, loss_sum, targets]
                                   for (step, _, targets), loss_sum in zip(self.interval_steps, sums)]}

    def _interval_sums(self) -> list[float]:
        """Each finite step's loss sum since the last log, read from the device at once."""
        return torch.stack([loss for _, loss, _ in self.interval_steps]).tolist() if self.interval_steps else []

    def record_step(self, step_rows: np.ndarray, outcome: StepOutcome) -> None:
        """Count a finished optimizer step (taken or skipped)."""
        data = self.run.data
        self.step += 1
        if outcome.stepped:
            self.interval_steps.append((self.step, outcome.loss_sum.detach().float().reshape(()), outcome.targets))
        self.grad_norm = outcome.grad_norm
        step_tokens = int(data.lengths[step_rows].sum())
        self.tokens += step_tokens
        self.interval_tokens += step_tokens
        self.interval_rows += len(step_rows)
        self.interval_flops += self.run.flops.training_flops(step_tokens, outcome.targets,
                                                             float(data.attention_pairs[step_rows].sum()))
        self.progress.update(1)

    def log_interval(self, step: int) -> None:
        """Close the interval ending at `step`: each step's loss into the history and the metrics file, the
        interval's rates and the last step's loss, progress.json; then reset it."""
        # Sync point (every log_every_steps): the interval's step losses and the last gradient norm.
        read = torch.stack([self.grad_norm.float()] + [loss for _, loss, _ in self.interval_steps]).tolist()
        norm, losses = read[0], [[s, loss_sum / targets] for (s, _, targets), loss_sum
                                 in zip(self.interval_steps, read[1:]) if targets]
        loss = losses[-1][1] if losses and losses[-1][0] == step else float("nan")
        seconds = time.perf_counter() - self.interval_started
        self.loss_history.extend(losses)
        if self.run.main_process:
            for earlier, earlier_loss in losses:
                if earlier != step:
                    self.sink.log(earlier, {"train_loss": earlier_loss})
            values = {"train_loss": loss, "learning_rate": self.run.scheduler.get_last_lr()[0], "grad_norm": norm,
                      "tokens_per_second": self.interval_tokens / seconds,
                      "samples_per_second": self.interval_rows / seconds, **memory_metrics(self.job.plan.device)}
            if self.peak:
                values["mfu"] = self.interval_flops / seconds / self.peak
            self.sink.log(step, values)
            atomic_write_text(self.run.output_dir / PROGRESS_FILE,
                              json.dumps({"step": step, "total_steps": self.run.total_steps, "loss": loss}))
            self.progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.interval_steps = []
        self.interval_started, self.interval_tokens, self.interval_rows, self.interval_flops = (
            time.perf_counter(), 0, 0, 0.0)

    @property
    def train_loss(self) -> float:
        return self.loss_history[-1][1] if self.loss_history else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return (self.tokens - self.start_tokens) / self.seconds if self.seconds > 0 else 0.0

    def close(self) -> None:
        """Close the metrics file (the launcher draws the loss curve from result.json's history)."""
        self.sink.close()
