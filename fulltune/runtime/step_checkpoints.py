"""Step checkpoints: `checkpoints/step-N/`, written atomically with a manifest, verified and resumed from.

A checkpoint is taken at an optimizer-step boundary (`fulltune.runtime.train.train`): accelerate's save_state
(weights, optimizer, schedule, grad scaler, every process's RNG states), FSDP2 shards or a pipeline stage's
state, and trainer_state.json (`TrainState` and TrainMetrics' counters). Every file's size and xxh3-128 go
into manifest.json, read back when written; resume sets a damaged checkpoint aside as `damaged-step-N` and
takes the newest intact one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.errors import ConfigError, TrainingError, disk_full
from fulltune.runtime import pipeline_parallel, sharding
from fulltune.storage import fsync_dir, fsync_tree

if TYPE_CHECKING:
    from fulltune.runtime.train import TrainingRun

CHECKPOINT_DIR = "checkpoints"
TRAINER_STATE_FILE = "trainer_state.json"
CHECKPOINT_MANIFEST = "manifest.json"  # every file's size and xxh3-128, written last (write_checkpoint_manifest)
CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState:
    """Where the run is; saved in every checkpoint's trainer_state.json beside TrainMetrics' counters."""

    step: int = 0  # optimizer steps done; also the data position (StepSchedule.step_rows(step) is next)
    total_steps: int = 0
    nonfinite_steps: int = 0
    nonfinite_in_a_row: int = 0


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint: `step-N` directories appear only by an atomic rename."""
    steps = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := CHECKPOINT_NAME.match(p.name))]
    return max(steps)[1] if steps else None


def _file_digest(file: Path) -> str:
    """xxh3-128 of a file's bytes: damage detection, not security, at memory speed (~16 GB/s on one
    core against ~1 GB/s for sha256), so hashing a multi-GB checkpoint costs little beside writing it."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(file, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file is not whole (its header names more bytes than the file has), or None.

    Reads only the header: the check a checkpoint written before manifests existed still gets.
    """
    size = file.stat().st_size
    try:
        with open(file, "rb") as handle:
            header_bytes = int.from_bytes(handle.read(8), "little")
            if size < 8 or 8 + header_bytes > size:
                return f"{file.name} is cut short ({size} bytes)"
            header = json.loads(handle.read(header_bytes))
    except (OSError, ValueError) as exc:
        return f"{file.name} has an unreadable header ({exc})"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    expected = 8 + header_bytes + max(ends, default=0)
    return None if size == expected else f"{file.name} is {size} bytes, its header describes {expected}"


def write_checkpoint_manifest(directory: Path) -> None:
    """Record every file of a checkpoint (size, xxh3-128) in its manifest.json, reading each one back.

    Reading back is the check that the bytes landed: a .safetensors file whose header does not match its
    size raises before the checkpoint is published. Resume compares against the manifest.
    """
    files = {}
    for file in sorted(f for f in directory.rglob("*") if f.is_file()):
        if file.suffix == ".safetensors" and (problem := _safetensors_problem(file)):
            raise RuntimeError(f"{directory}: just written, but {problem}")
        files[file.relative_to(directory).as_posix()] = [file.stat().st_size, _file_digest(file)]
    (directory / CHECKPOINT_MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def checkpoint_problem(directory: Path) -> str | None:
    """Why checkpoint `directory` cannot be resumed from (a file missing, of another size or other bytes
    than its manifest records), or None when it is whole. A checkpoint without a manifest (written by
    an earlier fulltune) is checked by its trainer state and safetensors headers only."""
    manifest = directory / CHECKPOINT_MANIFEST
    try:
        json.loads((directory / TRAINER_STATE_FILE).read_text())
    except (OSError, ValueError):
        return f"{TRAINER_STATE_FILE} is missing or unreadable"
    if not manifest.is_file():
        problems = (_safetensors_problem(f) for f in sorted(directory.rglob("*.safetensors")))
        return next((problem for problem in problems if problem), None)
    try:
        recorded = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{CHECKPOINT_MANIFEST} is unreadable"
    for name, (size, digest) in recorded.items():
        file = directory / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, written as {size}"
        if _file_digest(file) != digest:
            return f"{name} does not hold the bytes it was written with"
    return None


def set_aside_damaged_checkpoints(root: Path) -> tuple[Path | None, list[str]]:
    """(the newest intact checkpoint, a line for each damaged one set aside on the way to it).

    A damaged checkpoint (a truncated or deleted file, a disk error) would fail every retry the same way;
    it is renamed to `damaged-step-N` (kept for a look, never resumed from) and the next older one tried.
    """
    notes = []
    while (checkpoint := latest_checkpoint(root)) is not None:
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint, notes
        aside = root / f"damaged-{checkpoint.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(checkpoint, aside)
        fsync_dir(root)
        notes.append(f"checkpoint {checkpoint.name} is damaged ({problem}); set aside as {aside}")
    return None, notes


def resume(run: TrainingRun) -> tuple[TrainState, dict[str, Any], int | None]:
    """(state, the saved metric counters, the step resumed from) from the newest complete checkpoint.

    Half-written checkpoints (.tmp-*) are leftovers of a kill and are removed first; checkpoints whose
    files do not match their manifest are set aside, one line on stderr says so, and the newest intact
    one is used. A fresh run gets step 0, no counters and None.
    """
    accelerator, checkpoints = run.accelerator, run.checkpoints
    if run.main_process:
        for leftover in [*checkpoints.glob(".tmp-*"), *run.output_dir.glob(".tmp-*")]:
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        checkpoints.mkdir(parents=True, exist_ok=True)
        # Verified before anything is loaded: a damaged newest checkpoint gives way to the newest whole one.
        intact, notes = set_aside_damaged_checkpoints(checkpoints)
        if notes:
            then = f"resuming from {intact.name}" if intact is not None else "no intact checkpoint is left: starting over"
            print(f"fulltune train: {'; '.join(notes)}; {then}", file=sys.stderr, flush=True)
    accelerator.wait_for_everyone()  # every process then sees only the checkpoints that passed
    checkpoint = latest_checkpoint(checkpoints)
    if checkpoint is None:
        return TrainState(total_steps=run.total_steps), {}, None
    accelerator.load_state(str(checkpoint))
    if sharding.is_sharded(run.model):
        sharding.load_sharded_state(checkpoint / sharding.SHARDED_STATE_DIR, run.model, run.optimizer)
    if run.pipeline is not None:
        pipeline_parallel.load_stage_state(checkpoint / pipeline_parallel.STAGE_STATE_DIR, run.model, run.optimizer)
    saved = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
    state = TrainState(**{f.name: saved.pop(f.name) for f in fields(TrainState)})
    if state.total_steps != run.total_steps:
        raise ConfigError(f"{checkpoint}: written for {state.total_steps} steps, this job has {run.total_steps}; "
                          f"delete {checkpoints} to start over")
    return state, saved, state.step


def save_checkpoint(run: TrainingRun, state: TrainState, counters: dict[str, Any]) -> None:
    """Write checkpoints/.tmp-step-N, fsync, rename to checkpoints/step-N; keep the newest `keep_checkpoints`.

    accelerate's save_state writes the model, optimizer, scheduler and grad scaler states and each
    process's RNG states (python, numpy, torch CPU and CUDA) into the directory; it is not atomic by
    itself, hence the temporary name. Every process takes part (each saves its RNG state; FSDP saves
    shards), so the directory must be on storage all processes share.

    The main process then reads every file back into manifest.json (sizes and hashes) that resume
    checks. A write that fails for want of disk space removes the half-written directory and raises
    TrainingError (exit 2: retrying cannot help), naming the checkpoint a rerun resumes from.

    Under `train.checkpoint_async` the run's writer (fulltune/runtime/async_checkpoints.py) writes the same files
    in the background and returns once the weights and optimizer states are copied.
    """
    if run.checkpoint_writer is not None:
        run.checkpoint_writer.save(run, state, counters)
        return
    accelerator = run.accelerator
    tmp = begin_checkpoint(run, state.step)
    try:
        accelerator.save_state(str(tmp))
        if sharding.is_sharded(run.model):  # FSDP2 outside prepare: each process writes its shards (fulltune/runtime/sharding.py)
            sharding.save_sharded_state(tmp / sharding.SHARDED_STATE_DIR, run.model, run.optimizer)
        if run.pipeline is not None:  # each stage writes its parameters and optimizer state
            pipeline_parallel.save_stage_state(tmp / pipeline_parallel.STAGE_STATE_DIR, run.model, run.optimizer)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_trainer_state(tmp, state, counters)
            seal_checkpoint(run, tmp, state.step)
    except Exception as exc:
        discard_failed_checkpoint(run.checkpoints, tmp, state.step, exc)
        raise
    if accelerator.is_main_process:
        publish_checkpoint(run, tmp, state.step)
    accelerator.wait_for_everyone()
    run.hooks.checkpoint_published(state.step)


def begin_checkpoint(run: TrainingRun, step: int) -> Path:
    """checkpoints/.tmp-step-`step`, made empty by the main process before every process writes into it."""
    tmp = run.checkpoints / f".tmp-step-{step}"
    if run.accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    run.accelerator.wait_for_everyone()
    return tmp


def write_trainer_state(tmp: Path, state: TrainState, counters: dict[str, Any]) -> None:
    """trainer_state.json: where the run is and TrainMetrics' counters, as of the checkpoint's step boundary."""
    (tmp / TRAINER_STATE_FILE).write_text(json.dumps({**asdict(state), **counters}))


def seal_checkpoint(run: TrainingRun, tmp: Path, step: int) -> None:
    """Main process, once every file of checkpoint `step` is in `tmp`: the manifest (each file read back), fsync."""
    run.hooks.checkpoint_written(step)
    write_checkpoint_manifest(tmp)
    fsync_tree(tmp)


def publish_checkpoint(run: TrainingRun, tmp: Path, step: int) -> None:
    """Main process: rename the sealed `tmp` to checkpoints/step-`step` and drop all but the newest
    `keep_checkpoints`."""
    root = run.checkpoints
    final = root / f"step-{step}"
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(root)
    steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := CHECKPOINT_NAME.match(p.name)))
    for old in steps[:-run.job.train.keep_checkpoints]:
        shutil.rmtree(root / f"step-{old}", ignore_errors=True)


def discard_failed_checkpoint(root: Path, tmp: Path, step: int, exc: BaseException) -> None:
    """Remove the half-written `tmp` (the space it took, back; the older checkpoints stand); a write that failed
    for want of disk space raises TrainingError naming what a rerun resumes from (the caller re-raises the rest)."""
    shutil.rmtree(tmp, ignore_errors=True)
    if disk_full(exc):
        older = latest_checkpoint(root)
        raise TrainingError(
            f"{root}: the disk filled up while writing checkpoint step-{step} "
            f"({shutil.disk_usage(root).free / 2**30:.1f} GiB free now); free some space or lower "
            f"train.keep_checkpoints, then rerun: it resumes from "
            f"{older.name if older is not None else 'the start'}") from None


def wait_for_checkpoint_writes(run: TrainingRun) -> None:
    """Before the final export: the checkpoint still being written in the background (train.checkpoint_async) is
    published first, on every process, and what its write raised is raised here."""
    if run.checkpoint_writer is not None:
        run.checkpoint_writer.close(run)
        run.accelerator.wait_for_everyone()
