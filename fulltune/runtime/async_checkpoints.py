"""Step checkpoints written in the background (`train.checkpoint_async`): the step waits only for a copy.

At a checkpoint step every process writes what is small and belongs to the step boundary, as a synchronous
checkpoint does (fulltune/runtime/step_checkpoints.py): the LR schedule, the grad scaler and its RNG states
(accelerate's `save_accelerator_state`, without models or optimizers) and trainer_state.json. What is large, the
weights and the optimizer states, is copied to host RAM (torch.distributed.checkpoint's `DefaultStager`, the copy
DCP's `async_save` makes), and training goes on while a thread writes the copy:

- FSDP2 (and FSDP × tensor parallel): `torch.distributed.checkpoint.async_save` of each process's shards into
  `sharded/`, on a gloo process group of its own, so that its collectives run beside the training's;
- one process and DDP: the main process writes `model.safetensors` and `optimizer.bin` from its copy — the files
  accelerate's `save_state` writes — and the other processes have nothing more to write.

Either way the checkpoint holds the files a synchronous one holds, and resume reads it the same way. Once every file
is in place the main process's thread seals it (the manifest, each file read back; fsync) and renames
`.tmp-step-N` to `step-N`: a run killed before that resumes from the checkpoint before, and resume removes the
leftover `.tmp-step-N`, so a checkpoint in progress is never resumed from. One write is in flight at a time: the
next checkpoint and the final export first wait for it (`wait`), which raises what the write raised (a full
disk: TrainingError, exit 2).

The copy is held from the step boundary until the write is published, beside the steps that run meanwhile: host
RAM on a GPU, the device's own memory on a CPU (fulltune/memory/process.py `checkpoint_staging_bytes`). Pipeline
stages write synchronously (the lever table refuses the combination, fulltune/levers.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from fulltune.runtime import sharding
from fulltune.runtime.step_checkpoints import (TrainState, begin_checkpoint, discard_failed_checkpoint,
                                               publish_checkpoint, seal_checkpoint, write_trainer_state)

if TYPE_CHECKING:
    from fulltune.runtime.train import TrainingRun


class AsyncCheckpointWriter:
    """The run's background checkpoint writer: one thread, one write in flight at a time."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fulltune-checkpoint")
        self._pending: Future | None = None
        self._pending_step = 0
        self._group: Any = None  # the gloo process group DCP's writes use (sharded runs)

    def save(self, run: TrainingRun, state: TrainState, counters: dict[str, Any]) -> None:
        """Checkpoint `state.step` (collective): the step boundary's small files now, the weights and optimizer
        states copied now and written in the background. Waits first for the write before it."""
        self.wait(run)
        accelerator = run.accelerator
        tmp = begin_checkpoint(run, state.step)
        try:
            from accelerate.checkpointing import save_accelerator_state

            save_accelerator_state(str(tmp), [], [], [run.scheduler], [], accelerator.process_index, accelerator.step,
                                   accelerator.scaler)
            if accelerator.is_main_process:
                write_trainer_state(tmp, state, counters)
            write = self._stage(run, tmp)
            accelerator.wait_for_everyone()  # every process's files of the boundary are in place
        except Exception as exc:
            discard_failed_checkpoint(run.checkpoints, tmp, state.step, exc)
            raise
        self._pending = self._executor.submit(_complete, run, tmp, state.step, write)
        self._pending_step = state.step

    def _stage(self, run: TrainingRun, tmp: Path) -> Callable[[], None] | None:
        """Copy this process's weights and optimizer states to host RAM; what the thread then runs to write them."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if sharding.is_sharded(run.model):  # every process writes its shards
            if dist.is_initialized() and self._group is None:
                self._group = dist.new_group(backend="gloo")
            upload = dcp.async_save(sharding.sharded_state(run.model, run.optimizer),
                                    checkpoint_id=str(tmp / sharding.SHARDED_STATE_DIR), process_group=self._group,
                                    no_dist=not dist.is_initialized())
            return lambda: upload.result()
        if not run.accelerator.is_main_process:  # DDP: the main process writes the one copy of the weights
            return None
        staged, stager = staged_copy(run)
        return lambda: _write_prepared(tmp, staged, stager)

    def wait(self, run: TrainingRun) -> None:
        """Block until the write in flight, if any, is published; raise what it raised (a full disk: TrainingError)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:
            discard_failed_checkpoint(run.checkpoints, run.checkpoints / f".tmp-step-{self._pending_step}",
                                      self._pending_step, exc)
            raise

    def close(self, run: TrainingRun) -> None:
        """Wait for the last write and end the thread."""
        try:
            self.wait(run)
        finally:
            self._executor.shutdown(wait=True)


def staged_copy(run: TrainingRun) -> tuple[dict[str, Any], Any]:
    """({"model", "optimizer"}: a copy in host RAM of the state dicts accelerate's save_state writes for a prepared
    model, the stager that holds it): DCP's `DefaultStager`, as `async_save` stages, without pinned memory."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))
    # The module accelerate's save_state reads: the model as prepare received it (without DDP's wrapper).
    return stager.stage({"model": run.accelerator.get_state_dict(run.model),
                         "optimizer": run.optimizer.state_dict()}), stager


def _write_prepared(tmp: Path, staged: dict[str, Any], stager: Any) -> None:
    """The main process's copy of a prepared (one-process or DDP) model and optimizer, written as accelerate's
    `save_state` writes them; the copy is freed afterwards."""
    from accelerate.utils import save
    from accelerate.utils.constants import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME

    try:
        save(staged["model"], tmp / SAFE_WEIGHTS_NAME, safe_serialization=True)
        save(staged["optimizer"], tmp / f"{OPTIMIZER_NAME}.bin")
    finally:
        staged.clear()
        stager.close()


def _complete(run: TrainingRun, tmp: Path, step: int, write: Callable[[], None] | None) -> None:
    """The thread's part of checkpoint `step`: its files written, then (main process) sealed and published."""
    if write is not None:
        write()
    if run.accelerator.is_main_process:
        seal_checkpoint(run, tmp, step)
        publish_checkpoint(run, tmp, step)
        run.hooks.checkpoint_published(step)
