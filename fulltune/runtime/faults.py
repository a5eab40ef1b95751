"""Named points in the training loop where a test can inject a fault; no-ops in real runs.

The loop calls a `TrainHooks` at five named points. Real runs get `TrainHooks` itself, whose hooks do
nothing; tests set FULLTUNE_TEST_FAULT=<point>:<n> and get a `FaultInjection` that kills the process,
stalls it, raises an out-of-memory error or poisons a loss at that point:

    micro_step:N        SIGKILL after the N-th micro-batch's backward (1-based, counted over the run)
    checkpoint_write:S  SIGKILL while checkpoint S is half written (files in place, not yet renamed)
    after_checkpoint:S  SIGKILL right after checkpoint S was renamed into place
    stall_<point>:N     at any of the three points above, stop and wait to be killed from outside
    oom:S               raise torch.OutOfMemoryError at the start of optimizer step S (1-based)
    nan_loss:S          make the loss of optimizer step S NaN (the step must be skipped)
    nan_losses_from:S   make every loss from optimizer step S on NaN (training must stop)
    disk_full:S         fail writing checkpoint S with ENOSPC, as a full disk does (files half in place)
"""

from __future__ import annotations

import os
import signal
import time
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
    probe (fulltune/planning/autotune.py PROBE_ENV) those hooks wrapped in the probe that times the steps."""
    spec = os.environ.get(FAULT_ENV)
    hooks = FaultInjection(spec) if spec else TrainHooks()
    probe = os.environ.get("FULLTUNE_AUTOTUNE_PROBE")
    if probe:
        from fulltune.planning.autotune import StepProbe

        return StepProbe(probe, hooks)
    return hooks
