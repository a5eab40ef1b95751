"""A training run's MLflow side, kept in the process that launches the trainer.

The trainer only appends its metrics to `metrics.jsonl` in its output directory (one JSON line per log
interval: step, time, values); it imports neither MLflow nor matplotlib, so an MLflow server that is slow or
away cannot stop or slow a step, and each trainer starts ~1.5-2 CPU-s sooner and ~100 MiB smaller
(benchmarks/process_memory.py: 764 -> 657 MiB at the peak). While it trains,
`Forwarded` sends the new lines to the run's MLflow run every few seconds, samples the machine's system
metrics (MLflow's monitor: CPU, memory, GPU with nvidia-ml-py) and, once training ends, draws the loss curve
and attaches it. How far it got is kept in `metrics.forwarded` (a byte offset), so a rerun after a crash
forwards what the killed launcher had not, and nothing twice.
"""

from __future__ import annotations

import io
import json
import math
import sys
import threading
from pathlib import Path
from typing import Any

from fulltune.storage import atomic_write_bytes, atomic_write_text

METRICS_FILE = "metrics.jsonl"
FORWARDED_FILE = "metrics.forwarded"
LOSS_CURVE_FILE = "loss_curve.png"
FORWARD_EVERY_S = 3.0
# MLflow's log_batch takes at most 1000 metrics a call.
BATCH_LIMIT = 1000


def metric_line(step: int, timestamp_ms: int, values: dict[str, float]) -> str:
    """One line of metrics.jsonl: the finite values of one log interval."""
    finite = {key: float(value) for key, value in values.items() if math.isfinite(value)}
    return json.dumps({"step": step, "timestamp": timestamp_ms, "values": finite}) + "\n"


def save_loss_curve(history: list[list[float]], path: Path) -> None:
    """The training loss per optimizer step as a PNG at `path` (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
    axes.plot([s for s, _ in history], [loss for _, loss in history], marker="." if len(history) < 50 else None)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("training loss (mean per token)")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png")
    plt.close(figure)
    atomic_write_bytes(path, png.getvalue())


class Forwarded:
    """Around a trainer child: its metrics.jsonl forwarded into MLflow run `run_id`, system metrics sampled.

    A no-op without a run id. `attach(path)` logs a file (the loss curve) into the run. A failure to reach
    MLflow is said once on stderr and retried at the next interval; the lines stay in metrics.jsonl.
    """

    def __init__(self, tracking_uri: str | None, run_id: str | None, output_dir: Path) -> None:
        self.run_id = run_id
        self.output_dir = output_dir
        self.client: Any = None
        self.system: Any = None
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.warned = False
        self.thread: threading.Thread | None = None
        if run_id:
            import mlflow
            from mlflow.tracking import MlflowClient

            if tracking_uri:
                mlflow.set_tracking_uri(tracking_uri)  # the system-metrics monitor logs to the current URI
            self.client = MlflowClient(tracking_uri=tracking_uri)

    def __enter__(self) -> Forwarded:
        if self.client is None:
            return self
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # CPU, memory and (with nvidia-ml-py) GPU utilisation of the machine, sampled beside the training metrics.
        self.system = SystemMetricsMonitor(self.run_id, sampling_interval=10, samples_before_logging=1)
        self.system.start()
        self.thread = threading.Thread(target=self._poll, name="fulltune-metrics-forward", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self.client is None:
            return
        self.stop.set()
        if kind is not None:
            # Interrupted or failed: leave at once, writing nothing more to MLflow from here (Ctrl-C is ending the
            # run's MLflow run meanwhile); the lines wait in metrics.jsonl for the retry or the rerun. The monitor
            # stops in a thread of its own: its `finish` joins its sampler and flushes to MLflow.
            if self.system is not None:
                threading.Thread(target=self.system.finish, name="fulltune-system-metrics-stop", daemon=True).start()
            return
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.forward()  # the last lines
        if self.system is not None:
            self.system.finish()

    def _poll(self) -> None:
        while not self.stop.wait(FORWARD_EVERY_S):
            self.forward()

    def forward(self) -> None:
        """Send the complete lines of metrics.jsonl written since the last call."""
        if self.client is None:
            return
        with self.lock:
            try:
                self._forward()
            except Exception as exc:  # MLflow unreachable or refusing: the lines stay for the next try
                if not self.warned:
                    self.warned = True
                    print(f"fulltune: could not log training metrics to MLflow ({type(exc).__name__}: {exc}); "
                          f"they stay in {self.output_dir / METRICS_FILE}", file=sys.stderr, flush=True)

    def _forward(self) -> None:
        from mlflow.entities import Metric

        source, mark = self.output_dir / METRICS_FILE, self.output_dir / FORWARDED_FILE
        if not source.is_file():
            return
        try:
            offset = int(mark.read_text())
        except (OSError, ValueError):
            offset = 0
        with open(source, "rb") as handle:
            if offset > handle.seek(0, 2):
                offset = 0  # a new file: forward it from its start
            handle.seek(offset)
            chunk = handle.read()
        end = chunk.rfind(b"\n") + 1  # whole lines only: the trainer may be mid-line
        if end == 0:
            return
        metrics = []
        for line in chunk[:end].splitlines():
            try:
                record = json.loads(line)
                metrics += [Metric(key, float(value), int(record["timestamp"]), int(record["step"]))
                            for key, value in record["values"].items()]
            except (ValueError, KeyError, TypeError):
                continue  # a damaged line: skipped, the others still logged
        for start in range(0, len(metrics), BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + BATCH_LIMIT])
        atomic_write_text(mark, str(offset + end))

    def attach(self, path: Path) -> None:
        if self.client is None or not path.is_file():
            return
        try:
            self.client.log_artifact(self.run_id, str(path))
        except Exception as exc:
            print(f"fulltune: could not attach {path.name} to the MLflow run ({type(exc).__name__}: {exc})",
                  file=sys.stderr, flush=True)
