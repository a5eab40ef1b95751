"""The training loop's hook points: where a test can inject a fault (no-ops in real runs), and autotune's
probe that times the steps of a short training child (`StepProbe`).

The loop calls a `TrainHooks` at five named points. Real runs get `TrainHooks` itself, whose hooks do
nothing; tests set FULLTUNE_TEST_FAULT=<point>:<n> and get a `FaultInjection` that kills the process,
stalls it, raises an out-of-memory error or poisons a loss at that point:

    micro_step:N        SIGKILL after the N-th micro-batch's backward (1-based, counted over the run)
    checkpoint_write:S  SIGKILL while checkpoint S is half written (files in place, not yet renamed)
    after_checkpoint:S  SIGKILL right after checkpoint S was renamed into place
    stall_<point>:N     at any of the three points above, stop and wait to be killed from outside
                        (under train.checkpoint_async the two checkpoint points run in the background writer:
                        stall_checkpoint_write:S holds the write of checkpoint S while training goes on)
    oom:S               raise torch.OutOfMemoryError at the start of optimizer step S (1-based)
    nan_loss:S          make the loss of optimizer step S NaN (the step must be skipped)
    nan_losses_from:S   make every loss from optimizer step S on NaN (training must stop)
    disk_full:S         fail writing checkpoint S with ENOSPC, as a full disk does (files half in place)
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

FAULT_ENV = "FULLTUNE_TEST_FAULT"


class TrainHooks:
    """The loop's named hook points; every hook does nothing."""

    def before_step(self, step: int) -> None:
        """At the start of optimizer step `step` (1-based)."""

    def on_loss(self, step: int, loss: Any) -> Any:
        """A micro-batch's summed loss in step `step`; returns the loss the step goes on with."""
        return loss

    def after_micro_batch(self, micro_step: int) -> None:
        """After the backward of micro-batch `micro_step` (1-based, counted over the run)."""

    def checkpoint_written(self, step: int) -> None:
        """Checkpoint `step` is complete under its temporary name, not yet renamed into place."""

    def checkpoint_published(self, step: int) -> None:
        """Checkpoint `step` was renamed into place."""


class FaultInjection(TrainHooks):
    """The fault FULLTUNE_TEST_FAULT names (see the module docstring), at its hook point."""

    def __init__(self, spec: str) -> None:
        point, _, value = spec.partition(":")
        self.point, self.value = point, int(value) if value else -1

    def _kill_at(self, point: str, value: int) -> None:
        if (point, value) == (self.point, self.value):
            os.kill(os.getpid(), signal.SIGKILL)
        while (f"stall_{point}", value) == (self.point, self.value):
            time.sleep(60)

    def before_step(self, step: int) -> None:
        if ("oom", step) == (self.point, self.value):
            import torch

            raise torch.OutOfMemoryError(f"{FAULT_ENV}: simulated out of memory at step {step}")

    def on_loss(self, step: int, loss: Any) -> Any:
        poisoned = ("nan_loss", step) == (self.point, self.value) or (
            self.point == "nan_losses_from" and step >= self.value)
        return loss * float("nan") if poisoned else loss

    def after_micro_batch(self, micro_step: int) -> None:
        self._kill_at("micro_step", micro_step)

    def checkpoint_written(self, step: int) -> None:
        if ("disk_full", step) == (self.point, self.value):
            import errno

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._kill_at("checkpoint_write", step)

    def checkpoint_published(self, step: int) -> None:
        self._kill_at("after_checkpoint", step)


def hooks_from_env() -> TrainHooks:
    """FaultInjection when FULLTUNE_TEST_FAULT is set, else the hooks that do nothing; under autotune's
    probe (PROBE_ENV) those hooks wrapped in the probe that times the steps."""
    spec = os.environ.get(FAULT_ENV)
    hooks = FaultInjection(spec) if spec else TrainHooks()
    probe = os.environ.get(PROBE_ENV)
    if probe:
        return StepProbe(probe, hooks)
    return hooks


# The child's probe: JSON {"dir", "stop_at", "deadline"} (see StepProbe).
PROBE_ENV = "FULLTUNE_AUTOTUNE_PROBE"


class StepProbe(TrainHooks):
    """Times the trainer's optimizer steps and reads the peak memory, in the training child.

    `hooks_from_env` (fulltune/runtime/faults.py) returns it when PROBE_ENV is set. At the start of every step it
    records `time.perf_counter()` and the peak so far into `<dir>/probe-<rank>.json`; at the start of step
    `stop_at` the steps before it are complete, and it ends the process (exit 0) before the trainer exports
    anything. Past `deadline` (Unix time) it records the timeout and kills the process. Other hooks (a test's
    fault injection) run as they would without it.
    """

    def __init__(self, config: str, inner: TrainHooks | None = None) -> None:
        probe = json.loads(config)
        self.inner = inner or TrainHooks()
        self.stop_at = int(probe["stop_at"])
        rank = int(os.environ.get("RANK", "0"))
        self.file = Path(probe["dir"]) / f"probe-{rank}.json"
        self.record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "step_starts": [], "cpu_starts": [],
                                       "peak_bytes": None, "done": False, "timed_out": False}
        self._write()
        deadline = probe.get("deadline")
        if deadline is not None:
            timer = threading.Timer(max(0.0, float(deadline) - time.time()), self._time_out)
            timer.daemon = True
            timer.start()

    def _write(self) -> None:
        # Scratch bookkeeping read after the child ends: a rename keeps it whole, no fsync needed.
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record))
        os.replace(tmp, self.file)

    def _time_out(self) -> None:
        self.record["timed_out"] = True
        self._write()
        os.kill(os.getpid(), signal.SIGKILL)

    def before_step(self, step: int) -> None:
        self.record["step_starts"].append(time.perf_counter())
        # The process's CPU time too: on cores shared with other jobs it is the steadier figure.
        self.record["cpu_starts"].append(time.process_time())
        self.record["peak_bytes"] = peak_bytes()
        if step >= self.stop_at:
            self.record["done"] = True
            self._write()
            os._exit(0)  # the measured steps are done; exporting a model nobody keeps would only cost time
        self._write()
        self.inner.before_step(step)

    def on_loss(self, step: int, loss: Any) -> Any:
        return self.inner.on_loss(step, loss)

    def after_micro_batch(self, micro_step: int) -> None:
        self.inner.after_micro_batch(micro_step)

    def checkpoint_written(self, step: int) -> None:
        self.inner.checkpoint_written(step)

    def checkpoint_published(self, step: int) -> None:
        self.inner.checkpoint_published(step)


def peak_bytes() -> int:
    """This process's peak memory so far: CUDA's reserved peak (what the caching allocator held from the
    device) where CUDA is in use, else the resident high-water mark (ru_maxrss, KiB on Linux)."""
    import resource

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_reserved())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
