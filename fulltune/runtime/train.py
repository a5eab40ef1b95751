"""The training loop: `python -m fulltune.runtime.train JOB.json`, alone, under torchrun or under accelerate launch.

One explicit loop over `accelerate` (nanoGPT's train.py, torchtune's full-finetune recipe), in the
stages torchtitan's trainer names:

    setup       seed; Accelerator; data order (fulltune/data/batching.py); model in fp32; memory levers
                (gradient checkpointing on k of L layers, pure bf16, activation offload, chunked loss);
                optimizer; LR schedule; torch.compile; accelerate's prepare
    resume      the newest complete checkpoint: weights, optimizer, schedule, grad scaler, every process's
                RNG states (accelerate's save_state) and the data position and counters (trainer_state.json);
                saving, verifying and resuming step checkpoints is fulltune/runtime/step_checkpoints.py's
    train_step  one optimizer step through fulltune/runtime/step.py (the step the memory trace, the device check and
                the benchmarks run too): the step's micro-batches → forward/backward each, loss summed over
                tokens and divided by the step's target tokens → clip → step, or skip a non-finite step
                (OptimizerStep; under fp16 the grad scaler skips and lowers its scale)
    metrics     TrainMetrics owns every counter the logs and the result report (tokens, the interval's
                loss, targets, rows, FLOPs, time) and logs every `log_every_steps`
                (fulltune/runtime/train_metrics.py)
    finish      output_dir/model/ (weights + tokenizer), result.json; metrics.jsonl all along (the launcher
                forwards it to MLflow and draws loss_curve.png: fulltune/runtime/run_tracking.py)

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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from fulltune import levers
from fulltune.memory import flops
from fulltune.runtime import sharding
from fulltune.attention import attends_alone
from fulltune.data.batching import StepSchedule, TokenizedRows, micro_batch_inputs
from fulltune.data import pad_token_id_of
from fulltune.errors import ConfigError, DataError, TrainingError, UserError
from fulltune.runtime.faults import TrainHooks, hooks_from_env
from fulltune.storage import atomic_dir, atomic_write_text
from fulltune.runtime.loss import TargetHead
from fulltune.runtime import allocator
from fulltune.runtime import parallelize, pipeline_parallel, step_memory
from fulltune.runtime.step_memory import StepMemory
from fulltune.runtime.pipeline_parallel import PipelineRun
from fulltune.runtime.step import OptimizerStep, StepOutcome, StepParts, run_step
from fulltune.runtime.async_checkpoints import AsyncCheckpointWriter
from fulltune.runtime.step_checkpoints import (CHECKPOINT_DIR, TrainState, resume, save_checkpoint,
                                               wait_for_checkpoint_writes)
from fulltune.runtime.train_metrics import TrainMetrics, memory_metrics
from fulltune.logs import quiet_known_noise
from fulltune.runtime.launch import (ERROR_FILE, MODEL_DIR, OOM_FILE, RESULT_FILE, TrainJob,
                             TrainResult, completed_result, validate_job, watch_launcher)

__all__ = ["StepSchedule", "TokenizedRows", "TrainingRun", "setup", "resume", "train_step", "TrainMetrics",
           "finish", "train", "main"]

EXIT_USER_ERROR = 2
EXIT_OUT_OF_MEMORY = 3


# ---------------------------------------------------------------------------------------------------
# The optimizer


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
    model_config: Any = None  # the whole model's transformers config (the memory estimate per rank reads it)
    context: Any = None  # context_parallel.ContextParallel: this process's share of each row (context_parallel > 1)
    # train.checkpoint_async: writes step checkpoints in the background (fulltune/runtime/async_checkpoints.py)
    checkpoint_writer: AsyncCheckpointWriter | None = None
    padding_free: bool = False  # a packed micro-batch's rows laid end to end, no padding (fulltune/attention.py)

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
    if job.dims.fsdp_enabled and job.plan.offload_optimizer and "WORLD_SIZE" in os.environ:
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
    config = model.config
    model_layers = config.num_hidden_layers
    hooks = hooks or TrainHooks()
    pipeline = None
    if job.dims.pp_enabled:  # this process keeps its stage only (fulltune/runtime/pipeline_parallel.py)
        pipeline = pipeline_stage(job, model, head, int(data.lengths.max()), accelerator.device,
                                  pad_token_id_of(tokenizer), hooks)
        model = pipeline.stage
    optimizer = build_optimizer(job, model)
    scheduler = build_scheduler(job, optimizer, total_steps)
    if job.train.compile and job.dims.cp_enabled:
        raise ConfigError("train.compile: context-parallel attention is not compiled (yet); set compile to false")
    if job.train.compile:
        model = head.compile(model)
    model, optimizer, scheduler = prepare(job, accelerator, model, optimizer, scheduler)
    model.train()
    # Packed documents that attend alone need no rows: a micro-batch trains as one row of its tokens, no padding.
    # Not under pipeline stages, whose schedule sends micro-batches of one shape.
    padding_free = pipeline is None and attends_alone(config, job.plan.micro_batch_size * int(data.lengths.max()))
    return TrainingRun(job, accelerator, data, schedule, total_steps, tokenizer, pad_token_id_of(tokenizer), model,
                       head, optimizer, scheduler, OptimizerStep(accelerator, model, optimizer, scheduler,
                                                                 job.train.max_grad_norm),
                       hooks, use_cache, checkpointed, model_layers, coefficients, pipeline, config,
                       parallelize.row_share(job.dims),
                       AsyncCheckpointWriter() if job.train.checkpoint_async else None, padding_free)


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
                                  device=device, pad_token_id=pad_token_id, hooks=hooks, dims=job.dims)
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

    if parallelize.sharded_load(job.dims):  # FSDP, or tensor parallel's plan then FSDP over "dp"
        plan = job.plan
        model = sharding.load_sharded_model(
            job.paths.model_path, device=plan.device, mixed_precision=plan.mixed_precision, before_shard=before_shard,
            shard=lambda empty: parallelize.apply(empty, job.dims, plan.device, plan.mixed_precision,
                                                  plan.offload_optimizer),
            offload=plan.offload_optimizer, **options)
    else:
        model = load_model(job.paths.model_path, **options)
        before_shard(model)
        parallelize.apply(model, job.dims, job.plan.device, job.plan.mixed_precision, job.plan.offload_optimizer)
    return model, built["use_cache"], built["levers"], built["flops"]


def apply_levers(job: TrainJob, model: torch.nn.Module) -> tuple[int, TargetHead]:
    """Gradient checkpointing and the model-side memory levers (fulltune/runtime/checkpointing.py
    `apply_model_levers`, which the memory trace runs too); returns (checkpointed layers, the loss head).

    The optimizer-side levers (pure bf16 updates, step in backward, optimizer offload) are build_optimizer's.
    """
    from fulltune.runtime.checkpointing import apply_model_levers

    try:
        # Recompute the first k layers' activations in backward: ~1/3 more compute for those layers,
        # their activations shrink to the layer input (Korthikanti et al. 2022).
        checkpointed = apply_model_levers(model, job.plan)
    except ValueError as exc:
        raise ConfigError(f"train.gradient_checkpointing: {exc}") from None
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
    if sharding.is_sharded(model) or job.dims.pp_enabled:
        # FSDP2's model and optimizer, or a pipeline stage's, stay out of prepare (see setup).
        return model, optimizer, accelerator.prepare(scheduler)
    if job.plan.offload_optimizer:
        # Device placement would round-trip the state dict through the device, fp32 masters included.
        model, scheduler = accelerator.prepare(model, scheduler)
        return model, accelerator.prepare_optimizer(optimizer, device_placement=False), scheduler
    return accelerator.prepare(model, optimizer, scheduler)


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
            batch = micro_batch_inputs(run.data, rows, run.pad_token_id, accelerator.device, run.padding_free)
            # Context parallel: this process's share of the rows' positions and their targets.
            yield run.context.shard(*batch) if run.context is not None else batch

    outcome = run_step(run.step_parts, micro_batches(), step, int(run.data.targets[step_rows].sum()))
    if run.job.dims.tp_enabled:  # the step's loss was summed over every process of a tp group too
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


def finish(run: TrainingRun, state: TrainState, metrics: TrainMetrics, resumed_from: int | None,
           memory: StepMemory | None = None) -> TrainResult:
    """Export the model, close metrics.jsonl and write result.json (with each process's step peak beside its
    estimate when they were measured: fulltune/runtime/step_memory.py); returns the result. A checkpoint still
    being written in the background is published first."""
    wait_for_checkpoint_writes(run)
    measured = memory.gathered() if memory is not None else None  # a collective: before rank 0 writes alone
    peaks = step_memory.rank_peaks(measured, run.model_config, run.job.plan) if measured else []
    if peaks and run.main_process:
        print(f"fulltune train: {step_memory.describe(peaks)}", file=sys.stderr, flush=True)
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
        rank_peaks=step_memory.as_dicts(peaks),
    )
    if run.main_process:
        metrics.close()
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
    memory = StepMemory(job.plan.device, run.model, run.optimizer)
    announce(run, resumed_from)
    with metrics.running(state.step):
        while state.step < run.total_steps:
            run.hooks.before_step(state.step + 1)
            step_rows = run.schedule.step_rows(state.step)
            with memory.step():
                outcome = train_step(run, step_rows, state.step + 1)
            count_skipped_step(run, state, outcome)
            state.step += 1
            metrics.record_step(step_rows, outcome)
            if state.step % job.train.log_every_steps == 0 or state.step == run.total_steps:
                metrics.log_interval(state.step)
            every = job.train.checkpoint_every_steps  # 0: never; none at the last step (the model is exported)
            if every and state.step % every == 0 and state.step < run.total_steps:
                save_checkpoint(run, state, metrics.state_dict())
    return finish(run, state, metrics, resumed_from, memory)


def announce(run: TrainingRun, resumed_from: int | None) -> None:
    """One line on stderr before the first step: the data, the split of a step and the levers."""
    if not run.main_process:
        return
    job = run.job
    stages = job.distributed.pipeline_parallel
    pipeline = f" × {stages} pipeline stages ({job.distributed.pipeline_schedule})" if stages > 1 else ""
    if run.context is not None:  # the processes above share their rows with their context-parallel group
        pipeline += f" × context parallel {run.context.degree} ({run.context.method})"
    print(f"fulltune train: {len(run.data)} rows, {run.schedule.per_epoch} optimizer steps per epoch, "
          f"{run.total_steps} steps of {job.plan.micro_batch_size} micro × {job.plan.gradient_accumulation_steps} "
          f"accumulation × {run.processes} processes{pipeline}; gradient checkpointing {run.checkpointed_layers}/"
          f"{run.num_layers} layers; {job.plan.optimizer}; precision {job.plan.mixed_precision}"
          f"{levers.started(job.plan)}; "
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
