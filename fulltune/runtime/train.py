"""The training loop: `python -m fulltune.runtime.train JOB.json`, alone, under torchrun or under accelerate launch.

One explicit loop over `accelerate` (nanoGPT's train.py, torchtune's full-finetune recipe), in the
stages torchtitan's trainer names:

    setup       seed; Accelerator; data order (fulltune/data/batching.py); model in fp32; memory levers
                (gradient checkpointing on k of L layers, pure bf16, activation offload, chunked loss);
                optimizer; LR schedule; torch.compile; accelerate's prepare
    resume      the newest complete checkpoint: weights, optimizer, schedule, grad scaler, every process's
                RNG states (accelerate's save_state) and the data position and counters (trainer_state.json)
    train_step  one optimizer step through fulltune/runtime/step.py (the step the memory trace, the device check and
                the benchmarks run too): the step's micro-batches → forward/backward each, loss summed over
                tokens and divided by the step's target tokens → clip → step, or skip a non-finite step
                (OptimizerStep; under fp16 the grad scaler skips and lowers its scale)
    metrics     TrainMetrics owns every counter the logs and the result report (tokens, the interval's
                loss, targets, rows, FLOPs, time) and logs every `log_every_steps`
    finish      output_dir/model/ (weights + tokenizer), result.json, loss_curve.png

Rerunning a killed job resumes from its newest checkpoint and ends with the same weights, bit for bit on
CPU, and the same loss history as a run that was never interrupted: the data order is a pure function of
(seed, epoch), checkpoints are taken at optimizer-step boundaries and written atomically.

Exit codes: 0 done; 2 user error (one line on stderr, output_dir/error.json); 3 out of device memory
(output_dir/oom.json). Only the main process writes checkpoints' metadata, the model and the results.
Tests inject faults at named hook points (fulltune/runtime/faults.py); real runs' hooks do nothing.

Host syncs are labelled `# Sync point`: one boolean per optimizer step (the finite check), the metrics
every `log_every_steps`, and checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from fulltune.memory import flops
from fulltune.runtime import sharding
from fulltune.data.batching import StepSchedule, TokenizedRows, micro_batch_inputs
from fulltune.data import pad_token_id_of
from fulltune.errors import ConfigError, DataError, TrainingError, UserError, disk_full
from fulltune.runtime.faults import TrainHooks, hooks_from_env
from fulltune.storage import atomic_dir, atomic_write_text, fsync_dir, fsync_tree
from fulltune.runtime.loss import TargetHead
from fulltune.runtime import allocator
from fulltune.runtime.offload import ActivationOffload
from fulltune.runtime import pipeline_parallel
from fulltune.runtime.pipeline_parallel import PipelineRun
from fulltune.runtime.step import OptimizerStep, StepOutcome, StepParts, run_step
from fulltune.logs import quiet_known_noise
from fulltune.runtime.launch import (ERROR_FILE, MODEL_DIR, OOM_FILE, PROGRESS_FILE, RESULT_FILE, TrainJob,
                             TrainResult, completed_result, validate_job, watch_launcher)

__all__ = ["StepSchedule", "TokenizedRows", "TrainingRun", "setup", "resume", "train_step", "TrainMetrics",
           "finish", "train", "main"]

EXIT_USER_ERROR = 2
EXIT_OUT_OF_MEMORY = 3
CHECKPOINT_DIR = "checkpoints"
TRAINER_STATE_FILE = "trainer_state.json"
CHECKPOINT_MANIFEST = "manifest.json"  # every file's size and xxh3-128, written last (write_checkpoint_manifest)
CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------------------------------
# Optimizer, peak FLOPs and metric sinks


def build_optimizer(job: TrainJob, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The job's optimizer from the one builder (fulltune/runtime/optim.py) with the plan's levers.

    Raises:
        ConfigError: a combination the optimizer's library cannot do, naming the setting.
    """
    from fulltune.runtime import optim

    try:
        return optim.optimizer_for(model, job.plan, lr=job.train.learning_rate, weight_decay=job.train.weight_decay,
                                   max_grad_norm=job.train.max_grad_norm)
    except ValueError as exc:
        raise ConfigError(f"train.optimizer: {exc}") from None


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


class MlflowMetrics:
    """Metrics into the flow's existing MLflow run (main process only); a no-op without a run id."""

    def __init__(self, job: TrainJob, enabled: bool) -> None:
        self.run_id = job.tracking.mlflow_run_id if enabled else None
        self.client = None
        self.system = None
        if self.run_id:
            import mlflow
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
            from mlflow.tracking import MlflowClient

            mlflow.set_tracking_uri(job.tracking.mlflow_tracking_uri)
            self.client = MlflowClient(tracking_uri=job.tracking.mlflow_tracking_uri)
            # CPU, memory and (with nvidia-ml-py) GPU utilisation, sampled beside the training metrics.
            self.system = SystemMetricsMonitor(self.run_id, sampling_interval=10, samples_before_logging=1)
            self.system.start()

    def close(self) -> None:
        if self.system is not None:
            self.system.finish()
            self.system = None

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items() if math.isfinite(value)]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_artifact(self, path: Path) -> None:
        if self.client is not None:
            self.client.log_artifact(self.run_id, str(path))


def save_loss_curve(history: list[list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
    axes.plot([s for s, _ in history], [loss for _, loss in history], marker="." if len(history) < 50 else None)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("training loss (mean per token)")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------------
# Setup: everything a step needs, built once


@dataclass
class TrainingRun:
    """What `setup` builds and every later stage reads."""

    job: TrainJob
    accelerator: Accelerator
    data: TokenizedRows
    schedule: StepSchedule
    total_steps: int
    tokenizer: Any
    pad_token_id: int
    model: torch.nn.Module  # as prepared (DDP/compiled wrapper), or FSDP2-sharded / tensor parallel
    head: TargetHead  # runs the output head at the target positions only (fulltune/runtime/loss.py)
    optimizer: Any  # accelerate's AcceleratedOptimizer around the fulltune/runtime/optim.py optimizer
    scheduler: Any
    step_optimizer: OptimizerStep
    hooks: TrainHooks
    use_cache: bool | None  # the model's own setting, restored in the exported config
    checkpointed_layers: int
    num_layers: int
    flops: flops.FlopCoefficients  # of the model, for MFU (fulltune/memory/flops.py)
    pipeline: PipelineRun | None = None  # this process's pipeline stage and its schedule (pipeline_parallel > 1)

    @property
    def processes(self) -> int:
        """Processes that train on different rows: all of them, except that the tensor-parallel processes
        of a group (fulltune/degrees.py) share theirs."""
        return self.job.dims.dp

    @property
    def data_rank(self) -> int:
        """Which of the `processes` row shares of a micro-batch this process trains on."""
        return self.job.dims.data_rank(self.accelerator.process_index)

    @property
    def step_parts(self) -> StepParts:
        """What the one training step (fulltune/runtime/step.py) runs on."""
        plan = self.job.plan
        return StepParts(self.accelerator, self.model, self.head, self.optimizer, self.step_optimizer,
                         plan.gradient_accumulation_steps, plan.optimizer_in_backward, self.hooks,
                         pipeline=self.pipeline)

    @property
    def main_process(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def output_dir(self) -> Path:
        return Path(self.job.paths.output_dir)

    @property
    def checkpoints(self) -> Path:
        return self.output_dir / CHECKPOINT_DIR


def setup(job: TrainJob, hooks: TrainHooks | None = None) -> TrainingRun:
    """Build the run: accelerator, data, model with its levers, optimizer, schedule, then prepare.

    Raises:
        ConfigError: the device or a setting cannot work (e.g. CUDA requested but absent).
        DataError: train_file is unreadable, empty, or has fewer rows than one optimizer step.
    """
    if job.plan.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("budget.device: cuda was planned but this machine has no usable CUDA device")
    if job.distributed.strategy == "fsdp" and job.plan.offload_optimizer and "WORLD_SIZE" in os.environ:
        # FSDP's CPU offload reduces the gradient norm over host shards: gloo beside NCCL (fulltune/runtime/sharding.py).
        sharding.init_process_group(job.plan.device, cpu_offload=True)
    # The scheduler steps once per optimizer step: total_steps already counts every process's
    # micro-batches (accelerate would otherwise step it num_processes times).
    accelerator = Accelerator(cpu=job.plan.device == "cpu", mixed_precision=job.plan.mixed_precision,
                              gradient_accumulation_steps=job.plan.gradient_accumulation_steps,
                              step_scheduler_with_optimizer=False)
    set_seed(job.train.seed)
    data, schedule, total_steps = setup_data(job, job.dims.dp)
    tokenizer = load_job_tokenizer(job)
    model, use_cache, (checkpointed, head), coefficients = load_model_with_levers(job)
    model_layers = model.config.num_hidden_layers
    hooks = hooks or TrainHooks()
    pipeline = None
    if job.distributed.pipeline_parallel > 1:  # this process keeps its stage only (fulltune/runtime/pipeline_parallel.py)
        pipeline = pipeline_stage(job, model, head, int(data.lengths.max()), accelerator.device,
                                  pad_token_id_of(tokenizer), hooks)
        model = pipeline.stage
    optimizer = build_optimizer(job, model)
    scheduler = build_scheduler(job, optimizer, total_steps)
    if job.train.compile:
        model = head.compile(model)
    model, optimizer, scheduler = prepare(job, accelerator, model, optimizer, scheduler)
    model.train()
    return TrainingRun(job, accelerator, data, schedule, total_steps, tokenizer, pad_token_id_of(tokenizer), model,
                       head, optimizer, scheduler, OptimizerStep(accelerator, model, optimizer, scheduler,
                                                                 job.train.max_grad_norm),
                       hooks, use_cache, checkpointed, model_layers, coefficients, pipeline)


def pipeline_stage(job: TrainJob, model: torch.nn.Module, head: TargetHead, length: int, device: Any,
                   pad_token_id: int, hooks: TrainHooks) -> PipelineRun:
    """This process's stage of `model` and the job's schedule over the plan's micro-batches, every one padded
    to `length` tokens (the longest row: the schedule's buffers have one shape), sharded (strategy fsdp) or
    replicated (ddp) over its data-parallel processes. The stage computes its loss itself, so the model's loss
    head is removed.

    Raises:
        ConfigError: the model cannot be split (fewer layers than stages, a tied head, not the Llama layout),
            or torch.compile was asked for.
    """
    distributed = job.distributed
    pipeline_parallel.check_model_config(model.config, distributed.pipeline_parallel)
    if job.train.compile:
        raise ConfigError("train.compile: pipeline stages are not compiled (yet); set compile to false")
    head.remove()
    try:
        return PipelineRun.create(model, job.plan, schedule=distributed.pipeline_schedule, length=length,
                                  device=device, pad_token_id=pad_token_id, hooks=hooks, dims=job.dims,
                                  data_parallel=distributed.strategy)
    except ValueError as exc:
        raise ConfigError(f"{pipeline_parallel.FIELD}: {exc}") from None


def setup_data(job: TrainJob, processes: int) -> tuple[TokenizedRows, StepSchedule, int]:
    """The rows, the step schedule over them and the run's optimizer steps.

    e.g. 2 micro × 4 accumulation × 2 processes = 16 rows (≤ 16 × max_length tokens) per optimizer step.
    """
    micro, accumulation = job.plan.micro_batch_size, job.plan.gradient_accumulation_steps
    data = TokenizedRows(job.paths.train_file)
    schedule = StepSchedule(data.lengths, micro * accumulation * processes, job.train.seed)
    if schedule.per_epoch == 0:
        raise DataError(f"{job.paths.train_file}: {len(data)} rows is less than one optimizer step (micro_batch_size "
                        f"{micro} × gradient_accumulation_steps {accumulation} × {processes} processes)")
    total_steps = job.train.max_steps or max(1, math.ceil(job.train.num_epochs * schedule.per_epoch))
    return data, schedule, total_steps


def load_job_tokenizer(job: TrainJob) -> Any:
    """The tokenizer the job names."""
    from fulltune.models import hub_token, load_tokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # weight loading/saving bars would flood the flow's log
    model, paths = job.model, job.paths
    return load_tokenizer(paths.tokenizer_path, trust_remote_code=model.trust_remote_code,
                          token=hub_token(model.token_env),
                          revision=model.revision if paths.tokenizer_path == paths.model_path else None)


def load_model_with_levers(job: TrainJob) -> tuple[torch.nn.Module, Any, tuple[int, TargetHead], tuple]:
    """The model (fp32 weights, or bf16 under pure bf16) with its model-side levers applied, and sharded
    under FSDP; returns (model, the config's use_cache, (checkpointed layers, loss head), FLOP coefficients).

    Under FSDP every process builds the model empty, applies the levers, shards it and reads only its own
    shards from the checkpoint (fulltune/runtime/sharding.py `load_sharded_model`), so no process holds the whole
    model. FSDP2 is driven directly: Accelerate's CPU mode is DDP only, and a model kept out of prepare keeps
    its gradients sharded while accumulating; bf16 is FSDP's policy, not autocast.
    """
    from fulltune.models import hub_token, load_model

    options = {"revision": job.model.revision, "trust_remote_code": job.model.trust_remote_code,
               "allow_pickle_weights": job.model.allow_pickle_weights,
               "attn_implementation": job.model.attn_implementation, "token": hub_token(job.model.token_env)}
    built: dict[str, Any] = {}

    def before_shard(model: torch.nn.Module) -> None:
        built["use_cache"] = getattr(model.config, "use_cache", None)
        built["levers"] = apply_levers(job, model)
        built["flops"] = flops.from_model(model)  # counts parameters: works on an empty model too

    if job.distributed.strategy == "fsdp" and job.distributed.pipeline_parallel == 1:  # stages: their own FSDP
        # With distributed.tensor_parallel > 1: the TP plan on each block, then FSDP over the data-parallel
        # processes (fulltune/runtime/parallel.py).
        model = sharding.load_sharded_model(job.paths.model_path, device=job.plan.device,
                                            mixed_precision=job.plan.mixed_precision, before_shard=before_shard,
                                            dims=job.dims,
                                            offload=job.plan.offload_optimizer, **options)
    else:
        model = load_model(job.paths.model_path, **options)
        before_shard(model)
    return model, built["use_cache"], built["levers"], built["flops"]


def apply_levers(job: TrainJob, model: torch.nn.Module) -> tuple[int, TargetHead]:
    """Apply the model-side memory levers; returns (checkpointed layers, the loss head).

    The optimizer-side levers (pure bf16 updates, step in backward, optimizer offload) are build_optimizer's.
    """
    from fulltune.runtime.checkpointing import apply_gradient_checkpointing

    try:
        # Recompute the first k layers' activations in backward: ~1/3 more compute for those layers,
        # their activations shrink to the layer input (Korthikanti et al. 2022).
        checkpointed = apply_gradient_checkpointing(model, job.plan.gradient_checkpointing)
    except ValueError as exc:
        raise ConfigError(f"train.gradient_checkpointing: {exc}") from None
    if job.plan.pure_bf16:
        model.to(torch.bfloat16)  # no fp32 master copy: the optimizer compensates its updates (fulltune/runtime/optim.py)
    if job.plan.offload_activations:
        # The checkpointed layers' saved inputs wait in host RAM for their recompute (fulltune/runtime/offload.py).
        ActivationOffload().install(model)
    model.config.use_cache = False
    # The output head runs at target positions only; chunked, no (targets × vocabulary) tensor is ever whole.
    return checkpointed, TargetHead(model, chunked=job.plan.chunked_loss)


def build_scheduler(job: TrainJob, optimizer: Any, total_steps: int) -> Any:
    """The learning-rate schedule: linear warmup over warmup_ratio of the steps, then the job's decay."""
    from transformers import get_scheduler

    warmup_steps = math.ceil(job.train.warmup_ratio * total_steps)
    name = "constant_with_warmup" if job.train.lr_scheduler == "constant" else job.train.lr_scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)


def prepare(job: TrainJob, accelerator: Accelerator, model: torch.nn.Module, optimizer: Any,
            scheduler: Any) -> tuple[torch.nn.Module, Any, Any]:
    """accelerate's prepare, minus what the levers and FSDP2 keep to themselves."""
    if sharding.is_sharded(model) or job.distributed.pipeline_parallel > 1:
        # FSDP2's model and optimizer, or a pipeline stage's, stay out of prepare (see setup).
        return model, optimizer, accelerator.prepare(scheduler)
    if job.plan.offload_optimizer:
        # Device placement would round-trip the state dict through the device, fp32 masters included.
        model, scheduler = accelerator.prepare(model, scheduler)
        return model, accelerator.prepare_optimizer(optimizer, device_placement=False), scheduler
    return accelerator.prepare(model, optimizer, scheduler)


# ---------------------------------------------------------------------------------------------------
# Resume: the data position, the counters and the checkpoints


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
    """
    accelerator, root = run.accelerator, run.checkpoints
    tmp, final = root / f".tmp-step-{state.step}", root / f"step-{state.step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        if sharding.is_sharded(run.model):  # FSDP2 outside prepare: each process writes its shards (fulltune/runtime/sharding.py)
            sharding.save_sharded_state(tmp / sharding.SHARDED_STATE_DIR, run.model, run.optimizer)
        if run.pipeline is not None:  # each stage writes its parameters and optimizer state
            pipeline_parallel.save_stage_state(tmp / pipeline_parallel.STAGE_STATE_DIR, run.model, run.optimizer)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / TRAINER_STATE_FILE).write_text(json.dumps({**asdict(state), **counters}))
            run.hooks.checkpoint_written(state.step)
            write_checkpoint_manifest(tmp)
            fsync_tree(tmp)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took, back; the older checkpoints stand
        if disk_full(exc):
            older = latest_checkpoint(root)
            raise TrainingError(
                f"{root}: the disk filled up while writing checkpoint step-{state.step} "
                f"({shutil.disk_usage(root).free / 2**30:.1f} GiB free now); free some space or lower "
                f"train.keep_checkpoints, then rerun: it resumes from "
                f"{older.name if older is not None else 'the start'}") from None
        raise
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(root)
        steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := CHECKPOINT_NAME.match(p.name)))
        for old in steps[:-run.job.train.keep_checkpoints]:
            shutil.rmtree(root / f"step-{old}", ignore_errors=True)
    accelerator.wait_for_everyone()


# ---------------------------------------------------------------------------------------------------
# One optimizer step


def train_step(run: TrainingRun, step_rows: np.ndarray, step: int) -> StepOutcome:
    """Optimizer step `step` (1-based) on `step_rows`: this process's micro-batches of them through the one
    training step (fulltune/runtime/step.py), the loss normalised by the target tokens of the whole optimizer step (all
    micro-batches, all processes), which every process knows from the data without communicating."""
    plan, accelerator = run.job.plan, run.accelerator
    micro, processes = plan.micro_batch_size, run.processes

    def micro_batches() -> Iterator[tuple[dict[str, Any], Any]]:
        for index in range(plan.gradient_accumulation_steps):
            rows = StepSchedule.micro_batch(step_rows, index, run.data_rank, micro, processes)
            yield micro_batch_inputs(run.data, rows, run.pad_token_id, accelerator.device)

    outcome = run_step(run.step_parts, micro_batches(), step, int(run.data.targets[step_rows].sum()))
    if run.job.dims.tp > 1:  # the step's loss was summed over every process of a tp group too
        outcome.loss_sum = outcome.loss_sum / run.job.dims.tp
    return outcome


def count_skipped_step(run: TrainingRun, state: TrainState, outcome: StepOutcome) -> None:
    """Count a skipped step; TrainingError after `max_nonfinite_steps` non-finite losses in a row."""
    if outcome.stepped:
        state.nonfinite_in_a_row = 0
        return
    state.nonfinite_steps += 1
    # fp16's loss scaler skips overflowing steps while it lowers its scale; only a loss that is itself
    # not finite (or any skip without a loss scaler) counts towards giving up.
    if not run.step_optimizer.scales_loss or not bool(torch.isfinite(outcome.loss_sum)):  # Sync point (skips only)
        state.nonfinite_in_a_row += 1
    if state.nonfinite_in_a_row >= run.job.train.max_nonfinite_steps:
        raise TrainingError(
            f"training stopped: {state.nonfinite_in_a_row} non-finite losses in a row at step {state.step + 1}; "
            "lower train.learning_rate, or use train.mixed_precision bf16 instead of fp16")


# ---------------------------------------------------------------------------------------------------
# Metrics: every counter the logs and the result report


class TrainMetrics:
    """Owns every counter the logs and the result report, and logs them every `log_every_steps`.

    Run totals: `tokens` (non-padding, all processes) and `loss_history` ([step, mean token loss of the
    interval]). Interval counters, reset at each log: the loss sum of the finite steps (on the device:
    read only when logging or checkpointing), their target tokens, tokens, rows, FLOPs and wall time.
    A checkpoint saves `state_dict()` (tokens, loss sum, targets, history), so a resumed run logs the
    same losses as an uninterrupted one.
    """

    def __init__(self, run: TrainingRun, saved: dict[str, Any]) -> None:
        self.run, self.job = run, run.job
        self.tokens: int = saved.get("tokens", 0)
        self.loss_history: list[list[float]] = saved.get("loss_history", [])
        self.interval_loss = torch.tensor(saved.get("interval_loss_sum", 0.0), dtype=torch.float32,
                                          device=run.accelerator.device)
        self.interval_targets: int = saved.get("interval_targets", 0)
        self.grad_norm = torch.zeros((), device=run.accelerator.device)
        self.sink = MlflowMetrics(run.job, run.main_process)
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
        self.start_tokens = self.tokens
        with self.progress:
            yield
        self.seconds = time.perf_counter() - self.started

    def state_dict(self) -> dict[str, Any]:
        """The counters a checkpoint keeps."""
        return {"tokens": self.tokens, "interval_loss_sum": self.interval_loss.item(),  # Sync point (checkpoint)
                "interval_targets": self.interval_targets, "loss_history": self.loss_history}

    def record_step(self, step_rows: np.ndarray, outcome: StepOutcome) -> None:
        """Count a finished optimizer step (taken or skipped)."""
        data = self.run.data
        if outcome.stepped:
            self.interval_loss += outcome.loss_sum
            self.interval_targets += outcome.targets
        self.grad_norm = outcome.grad_norm
        step_tokens = int(data.lengths[step_rows].sum())
        self.tokens += step_tokens
        self.interval_tokens += step_tokens
        self.interval_rows += len(step_rows)
        self.interval_flops += self.run.flops.training_flops(step_tokens, outcome.targets,
                                                             float(data.attention_pairs[step_rows].sum()))
        self.progress.update(1)

    def log_interval(self, step: int) -> None:
        """Close the interval ending at `step`: loss history, MLflow, progress.json; then reset it."""
        # Sync point (every log_every_steps): the interval's loss and the last gradient norm.
        loss_sum, norm = torch.stack([self.interval_loss, self.grad_norm.float()]).tolist()
        loss = loss_sum / self.interval_targets if self.interval_targets else float("nan")
        seconds = time.perf_counter() - self.interval_started
        self.loss_history.append([step, loss])
        if self.run.main_process:
            values = {"train_loss": loss, "learning_rate": self.run.scheduler.get_last_lr()[0], "grad_norm": norm,
                      "tokens_per_second": self.interval_tokens / seconds,
                      "samples_per_second": self.interval_rows / seconds, **memory_metrics(self.job.plan.device)}
            if self.peak:
                values["mfu"] = self.interval_flops / seconds / self.peak
            self.sink.log(step, values)
            atomic_write_text(self.run.output_dir / PROGRESS_FILE,
                              json.dumps({"step": step, "total_steps": self.run.total_steps, "loss": loss}))
            self.progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.interval_loss.zero_()
        self.interval_targets = 0
        self.interval_started, self.interval_tokens, self.interval_rows, self.interval_flops = (
            time.perf_counter(), 0, 0, 0.0)

    @property
    def train_loss(self) -> float:
        return self.loss_history[-1][1] if self.loss_history else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return (self.tokens - self.start_tokens) / self.seconds if self.seconds > 0 else 0.0

    def close(self, curve: Path) -> None:
        """Save the loss curve, attach it to the MLflow run and stop the system-metrics monitor."""
        save_loss_curve(self.loss_history, curve)
        self.sink.log_artifact(curve)
        self.sink.close()


# ---------------------------------------------------------------------------------------------------
# Finish: the model and the result


def export_model(run: TrainingRun) -> Path:
    """output_dir/model/, whole or not at all: gathered on every process (FSDP / tensor-parallel shards), written by one."""
    accelerator, model, model_dir = run.accelerator, run.model, run.output_dir / MODEL_DIR
    if run.pipeline is not None:  # one Hugging Face checkpoint, a shard per stage
        model.config.use_cache = run.use_cache
        pipeline_parallel.save_pretrained(model, model_dir, run.tokenizer)
        return model_dir
    if sharding.is_sharded(model):
        model.config.use_cache = run.use_cache
        sharding.save_pretrained(model, model_dir, run.tokenizer)  # gathered on rank 0, a normal HF checkpoint
        return model_dir
    state_dict = accelerator.get_state_dict(model)
    if run.main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.config.use_cache = run.use_cache
        with atomic_dir(model_dir) as tmp:
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            run.tokenizer.save_pretrained(tmp)
    return model_dir


def finish(run: TrainingRun, state: TrainState, metrics: TrainMetrics, resumed_from: int | None) -> TrainResult:
    """Export the model, write result.json and the loss curve; returns the result."""
    model_dir = export_model(run)
    result = TrainResult(
        model_dir=str(model_dir),
        steps=state.step,
        epochs=state.step / run.schedule.per_epoch,
        train_loss=metrics.train_loss,
        tokens=metrics.tokens,
        tokens_per_second=metrics.tokens_per_second,
        seconds=metrics.seconds,
        peak_memory_bytes=torch.cuda.max_memory_allocated() if run.job.plan.device == "cuda" else None,
        nonfinite_steps=state.nonfinite_steps,
        resumed_from_step=resumed_from,
        loss_history=metrics.loss_history,
    )
    if run.main_process:
        metrics.close(run.output_dir / "loss_curve.png")
        atomic_write_text(run.output_dir / RESULT_FILE, result.to_json())
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    return result


# ---------------------------------------------------------------------------------------------------
# The loop


def train(job: TrainJob, hooks: TrainHooks | None = None) -> TrainResult:
    """Train `job` to the end, resuming from its newest checkpoint; returns what result.json holds.

    `hooks` default to FULLTUNE_TEST_FAULT's (fulltune/runtime/faults.py), which do nothing in real runs.

    Raises:
        ConfigError: the device or a setting cannot work (e.g. CUDA requested but absent).
        DataError: train_file is unreadable, empty, or has fewer rows than one optimizer step.
        TrainingError: `max_nonfinite_steps` non-finite losses in a row.
        torch.OutOfMemoryError: the device ran out of memory (main() turns it into exit code 3).
    """
    run = setup(job, hooks or hooks_from_env())
    state, saved_counters, resumed_from = resume(run)
    metrics = TrainMetrics(run, saved_counters)
    announce(run, resumed_from)
    with metrics.running(state.step):
        while state.step < run.total_steps:
            run.hooks.before_step(state.step + 1)
            step_rows = run.schedule.step_rows(state.step)
            outcome = train_step(run, step_rows, state.step + 1)
            count_skipped_step(run, state, outcome)
            state.step += 1
            metrics.record_step(step_rows, outcome)
            if state.step % job.train.log_every_steps == 0 or state.step == run.total_steps:
                metrics.log_interval(state.step)
            every = job.train.checkpoint_every_steps  # 0: never; none at the last step (the model is exported)
            if every and state.step % every == 0 and state.step < run.total_steps:
                save_checkpoint(run, state, metrics.state_dict())
                run.hooks.checkpoint_published(state.step)
    return finish(run, state, metrics, resumed_from)


def announce(run: TrainingRun, resumed_from: int | None) -> None:
    """One line on stderr before the first step: the data, the split of a step and the levers."""
    if not run.main_process:
        return
    job = run.job
    stages = job.distributed.pipeline_parallel
    pipeline = f" × {stages} pipeline stages ({job.distributed.pipeline_schedule})" if stages > 1 else ""
    print(f"fulltune train: {len(run.data)} rows, {run.schedule.per_epoch} optimizer steps per epoch, "
          f"{run.total_steps} steps of {job.plan.micro_batch_size} micro × {job.plan.gradient_accumulation_steps} "
          f"accumulation × {run.processes} processes{pipeline}; gradient checkpointing {run.checkpointed_layers}/"
          f"{run.num_layers} layers; {job.plan.optimizer}; precision {job.plan.mixed_precision}; "
          f"{f'resumed from step {resumed_from}' if resumed_from is not None else 'from the start'}",
          file=sys.stderr, flush=True)


def end_with_launcher() -> None:
    """SIGKILL this process once the process that launched it is gone (`launch.watch_launcher`)."""
    watch_launcher()


def _write_marker(path: Path, payload: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps(payload))


def main(argv: list[str] | None = None) -> int:
    """`python -m fulltune.runtime.train JOB.json`: 0 done, 2 user error, 3 out of memory."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fulltune.runtime.train JOB.json", file=sys.stderr)
        return EXIT_USER_ERROR
    job_file = Path(args[0])
    if not job_file.is_file():
        print(f"fulltune train: error: {job_file}: job file not found", file=sys.stderr)
        return EXIT_USER_ERROR
    output_dir = job_file.parent
    end_with_launcher()
    quiet_known_noise()
    try:
        job = TrainJob.from_json(job_file.read_text())
        output_dir = Path(job.paths.output_dir)
        validate_job(job)
        if job.plan.device == "cpu":
            allocator.return_large_blocks()  # resident memory follows the live tensors (fulltune/runtime/allocator.py)
        if completed_result(output_dir) is not None:
            print(f"fulltune train: {output_dir / MODEL_DIR} is already complete", file=sys.stderr)
            return 0
        train(job)
    except UserError as exc:
        message = " ".join(str(exc).split())
        _write_marker(output_dir / ERROR_FILE, {"type": type(exc).__name__, "message": message})
        print(f"fulltune train: error: {message}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except torch.OutOfMemoryError as exc:
        # CUDA's allocator peak; on CPU (only ever simulated) the process's RSS peak.
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        peak_bytes = torch.cuda.max_memory_allocated() if cuda else memory_metrics("cpu")["cpu_rss_peak_bytes"]
        _write_marker(output_dir / OOM_FILE, {"peak_bytes": int(peak_bytes)})
        detail = " ".join(str(exc).split())[:300]
        print(f"fulltune train: out of memory (peak {peak_bytes / 2**30:.2f} GiB): {detail}", file=sys.stderr, flush=True)
        return EXIT_OUT_OF_MEMORY
    return 0


if __name__ == "__main__":
    sys.exit(main())
