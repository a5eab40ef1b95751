"""The training loop: `python -m fulltune.train JOB.json`, alone, under torchrun or under accelerate launch.

One explicit loop over `accelerate`, read top to bottom (nanoGPT's train.py, torchtune's full-finetune
recipe):

    set-up   seed; data order; model in fp32; gradient checkpointing on k of L layers; Accelerator;
             optimizer; LR schedule; torch.compile
    resume   the newest complete checkpoint: weights, optimizer, schedule, grad scaler, every process's
             RNG states (accelerate's save_state) and the data position and counters (trainer_state.json)
    loop     gather the step's micro-batches → forward/backward each, loss summed over tokens and divided
             by the step's target tokens → clip → step, or skip a non-finite step (OptimizerStep; under
             fp16 the grad scaler skips and lowers its scale) → log → checkpoint
    finish   output_dir/model/ (weights + tokenizer), result.json, loss_curve.png

Rerunning a killed job resumes from its newest checkpoint and ends with the same weights, bit for bit on
CPU, and the same loss history as a run that was never interrupted: the data order is a pure function of
(seed, epoch), checkpoints are taken at optimizer-step boundaries and written atomically.

Exit codes: 0 done; 2 user error (one line on stderr, output_dir/error.json); 3 out of device memory
(output_dir/oom.json). Only the main process writes checkpoints' metadata, the model and the results.

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
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from fulltune import sharding
from fulltune.data import collate, iter_length_grouped_batches, pad_token_id_of, row_target_counts
from fulltune.errors import ConfigError, DataError, TrainingError, UserError
from fulltune.fingerprint import atomic_dir, atomic_write_text, fsync_dir, fsync_tree
from fulltune.loss import TargetHead, Targets
from fulltune.offload import ActivationOffload
from fulltune.launch import (ERROR_FILE, LAUNCHER_ENV, MODEL_DIR, OOM_FILE, PROGRESS_FILE, RESULT_FILE, TrainJob,
                             TrainResult, completed_result, process_gone, validate_job)

EXIT_USER_ERROR = 2
EXIT_OUT_OF_MEMORY = 3
CHECKPOINT_DIR = "checkpoints"
TRAINER_STATE_FILE = "trainer_state.json"
CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")

# Dense 16-bit tensor-core peak per GPU (NVIDIA datasheets), for MFU. Checked in order,
# by substring of torch.cuda.get_device_name(). Other GPUs, fp32 runs and CPUs report no MFU.
GPU_PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


# ---------------------------------------------------------------------------------------------------
# Data: which rows each process trains on, as a pure function of (seed, epoch, step)


class TokenizedRows:
    """train.parquet held as flat numpy arrays and row offsets: a row is a slice, not a Python object.

    Per row it precomputes what the loop needs without touching tensors: `lengths` (non-padding tokens),
    `targets` (loss terms: labels[1:] != -100, the count the loss is divided by) and `attention_pairs`
    (Σ over the row's documents of length², the attention term of the FLOP count).
    """

    COLUMNS = ("input_ids", "labels", "position_ids")

    def __init__(self, path: str) -> None:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: cannot read tokenized data ({exc}); re-run the tokenize stage") from None
        missing = [name for name in self.COLUMNS if name not in table.column_names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; expected {list(self.COLUMNS)}")
        if table.num_rows == 0:
            raise DataError(f"{path}: no rows to train on")
        lengths = {name: pc.list_value_length(table[name]).to_numpy(zero_copy_only=False) for name in self.COLUMNS}
        if any(not np.array_equal(lengths["input_ids"], other) for other in lengths.values()):
            raise DataError(f"{path}: input_ids, labels and position_ids differ in length in some rows")
        # int32 as stored: 12 bytes per token for the three columns.
        self.values = {name: pc.list_flatten(table[name]).to_numpy(zero_copy_only=False) for name in self.COLUMNS}
        self.lengths = lengths["input_ids"].astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        starts = self.offsets[:-1]

        self.targets = row_target_counts(self.values["labels"], self.offsets)
        if self.targets.sum() == 0:
            raise DataError(f"{path}: no token has a label (every label is -100); nothing to train on")

        # Documents: a row start, or a position id of 0 (packed rows restart positions per document).
        doc_start = self.values["position_ids"] == 0
        doc_start[starts[self.lengths > 0]] = True
        first = np.flatnonzero(doc_start)
        doc_lengths = np.diff(np.append(first, len(doc_start)))
        doc_row = np.searchsorted(self.offsets, first, side="right") - 1
        self.attention_pairs = np.bincount(doc_row, weights=doc_lengths.astype(np.float64) ** 2,
                                           minlength=len(self.lengths))

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self, indices: np.ndarray) -> list[dict[str, list[int]]]:
        """The rows as `collate` takes them."""
        spans = [(self.offsets[i], self.offsets[i + 1]) for i in indices]
        return [{name: self.values[name][a:b].tolist() for name in self.COLUMNS} for a, b in spans]


class StepSchedule:
    """Rows of each optimizer step (all micro-batches, all processes): a pure function of (seed, epoch, step).

    An epoch is a length-grouped shuffle seeded with seed + epoch (`data.iter_length_grouped_batches`
    with one batch per optimizer step: rows of similar length share a step, and within it they are sorted
    longest first, so micro-batches pad little; packed rows are all about max_length and it is a plain
    shuffle). How a step is cut into micro-batches and processes does not change which rows it holds, so
    micro 2 × accumulation 2, micro 4 × accumulation 1 and 2 processes × micro 2 train on the same data.
    The last incomplete step of an epoch is dropped. The data position is just the step number.
    """

    def __init__(self, lengths: np.ndarray, rows_per_step: int, seed: int) -> None:
        self.lengths, self.rows_per_step, self.seed = lengths, rows_per_step, seed
        self.per_epoch = len(lengths) // rows_per_step
        self._epoch, self._steps = -1, []

    def step_rows(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._steps = list(iter_length_grouped_batches(self.lengths, self.rows_per_step, self.seed + epoch,
                                                           drop_last=True))
            self._epoch = epoch
        return np.asarray(self._steps[index])

    @staticmethod
    def micro_batch(rows: np.ndarray, index: int, process: int, micro_batch_size: int, processes: int) -> np.ndarray:
        """Process `process`'s rows of micro-batch `index`: each micro-batch is `processes` disjoint slices."""
        start = (index * processes + process) * micro_batch_size
        return rows[start:start + micro_batch_size]


# ---------------------------------------------------------------------------------------------------
# State a checkpoint adds to accelerate's, and the checkpoints themselves


@dataclass
class TrainState:
    """The data position and running counters; saved as trainer_state.json in every checkpoint."""

    step: int = 0  # optimizer steps done; also the data position (StepSchedule.step_rows(step) is next)
    total_steps: int = 0
    tokens: int = 0  # non-padding tokens processed, all processes
    nonfinite_steps: int = 0
    nonfinite_in_a_row: int = 0
    interval_loss_sum: float = 0.0  # Σ token losses of the finite steps since the last log (exact fp32 value)
    interval_targets: int = 0  # their target tokens
    loss_history: list[list[float]] = field(default_factory=list)  # [step, mean token loss of the interval]


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint: `step-N` directories appear only by an atomic rename."""
    steps = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := CHECKPOINT_NAME.match(p.name))]
    return max(steps)[1] if steps else None


def save_checkpoint(accelerator: Accelerator, root: Path, state: TrainState, keep: int, faults: FaultInjection,
                    model: torch.nn.Module, optimizer: Any) -> None:
    """Write checkpoints/.tmp-step-N, fsync, rename to checkpoints/step-N; keep the newest `keep`.

    accelerate's save_state writes the model, optimizer, scheduler and grad scaler states and each
    process's RNG states (python, numpy, torch CPU and CUDA) into the directory; it is not atomic by
    itself, hence the temporary name. Every process takes part (each saves its RNG state; FSDP and
    DeepSpeed save shards), so the directory must be on storage all processes share.
    """
    tmp, final = root / f".tmp-step-{state.step}", root / f"step-{state.step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if sharding.is_sharded(model):  # FSDP2 outside prepare: each process writes its shards (fulltune/sharding.py)
        sharding.save_sharded_state(tmp / sharding.SHARDED_STATE_DIR, model, optimizer)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAINER_STATE_FILE).write_text(json.dumps(asdict(state)))
        faults.maybe_kill("checkpoint_write", state.step)
        fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(root)
        steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := CHECKPOINT_NAME.match(p.name)))
        for old in steps[:-keep]:
            shutil.rmtree(root / f"step-{old}", ignore_errors=True)
    accelerator.wait_for_everyone()


class FaultInjection:
    """Test-only fault injection, read from FULLTUNE_TEST_FAULT=<point>:<n>; unset in real runs.

    micro_step:N        SIGKILL after the N-th micro-batch's backward (1-based, counted over the run)
    checkpoint_write:S  SIGKILL while checkpoint S is half written (files in place, not yet renamed)
    after_checkpoint:S  SIGKILL right after checkpoint S was renamed into place
    stall_<point>:N     at any of the three points above, stop and wait to be killed from outside
    oom:S               raise torch.OutOfMemoryError at the start of optimizer step S (1-based)
    nan_loss:S          make the loss of optimizer step S NaN (the step must be skipped)
    """

    def __init__(self, spec: str | None) -> None:
        point, _, value = (spec or "").partition(":")
        self.point, self.value = point, int(value) if value else -1

    def maybe_kill(self, point: str, value: int) -> None:
        if (point, value) == (self.point, self.value):
            os.kill(os.getpid(), signal.SIGKILL)
        while (f"stall_{point}", value) == (self.point, self.value):
            time.sleep(60)

    def maybe_oom(self, step: int) -> None:
        if ("oom", step) == (self.point, self.value):
            raise torch.OutOfMemoryError(f"FULLTUNE_TEST_FAULT: simulated out of memory at step {step}")

    def maybe_nan(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if ("nan_loss", step) == (self.point, self.value) else loss


# ---------------------------------------------------------------------------------------------------
# Set-up helpers


def build_optimizer(job: TrainJob, model: torch.nn.Module, processes: int = 1) -> torch.optim.Optimizer:
    """The job's optimizer with its memory levers, from the one builder the memory trace uses too
    (fulltune/optim.py): AdamW (fused), 8-bit / 4-bit AdamW, Adafactor; pure bf16 with compensated
    updates, step in backward, states in host RAM.

    Raises:
        ConfigError: a combination the optimizer's library cannot do, naming the setting.
    """
    from fulltune import optim

    try:
        return optim.build_optimizer(
            model, job.optimizer, lr=job.learning_rate, weight_decay=job.weight_decay, pure_bf16=job.pure_bf16,
            step_in_backward=job.optimizer_in_backward, offload=job.offload_optimizer,
            accumulation_steps=job.gradient_accumulation_steps, max_grad_norm=job.max_grad_norm, processes=processes)
    except ValueError as exc:
        raise ConfigError(f"train.optimizer: {exc}") from None


def flop_coefficients(model: torch.nn.Module) -> tuple[float, float, float]:
    """Training FLOPs per token, per target and per (query, key) pair:
    FLOPs = 6·(N - N_head)·tokens + 6·N_head·targets + 12·L·h·Σ_documents length².

    PaLM appendix B's `6N + 12·L·h·s` per token, with s summed per document (packed documents do not
    attend to each other) and the output head counted where it runs, at the positions with a target
    (fulltune/loss.py); recomputation is not counted. N excludes the input embedding, a lookup (unless it
    is tied to the output projection, which multiplies).
    """
    config = model.config
    n = sum(p.numel() for p in model.parameters())
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    if output is None or output.weight is not embedding.weight:
        n -= embedding.weight.numel()
    head = sum(p.numel() for p in output.parameters()) if output is not None else 0
    return 6.0 * (n - head), 6.0 * head, 12.0 * config.num_hidden_layers * config.hidden_size


def peak_flops(job: TrainJob) -> float | None:
    if job.device != "cuda" or job.mixed_precision == "no":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in GPU_PEAK_FLOPS if key in name), None)


def memory_metrics(device: str) -> dict[str, float]:
    if device == "cuda":
        return {"peak_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved()}
    return {"cpu_rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class MlflowMetrics:
    """Metrics into the flow's existing MLflow run (main process only); a no-op without a run id."""

    def __init__(self, job: TrainJob, enabled: bool) -> None:
        self.run_id = job.mlflow_run_id if enabled else None
        self.client = None
        self.system = None
        if self.run_id:
            import mlflow
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
            from mlflow.tracking import MlflowClient

            mlflow.set_tracking_uri(job.mlflow_tracking_uri)
            self.client = MlflowClient(tracking_uri=job.mlflow_tracking_uri)
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


class OptimizerStep:
    """Clip the step's gradients, then take the optimizer step or skip it; `(stepped, grad_norm)`.

    `step_loss` is the step's summed loss, the same on every process. Who decides on a skip:
    - no grad scaler (fp32, bf16): a non-finite loss or gradient norm skips the step.
    - fp16 (torch's GradScaler, through accelerate): the scaler. The optimizer step always goes through
      it: it skips when the unscaled gradients hold an inf or NaN, and its update() lowers the scale.
      That update must follow every unscale_ (done by clipping), or the next clip raises "unscale_() has
      already been called". A non-finite loss whose gradients came out finite is made an overflow (one
      gradient becomes NaN, without a host sync), so the scaler skips it too.
    - DeepSpeed: the engine clipped and stepped already, inside accelerator.backward on the last
      micro-batch; its fp16 loss scaler skips overflows itself (step_was_skipped). Any other non-finite
      step has been applied and cannot be undone: TrainingError, and a rerun resumes from the newest
      checkpoint, taken before it.
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                 max_grad_norm: float) -> None:
        from accelerate.utils import DistributedType

        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        # A dynamic loss scale skips overflowing steps while it finds its value: fp16 only.
        self.scales_loss = accelerator.scaler is not None or (self.deepspeed and accelerator.mixed_precision == "fp16")

    def __call__(self, step_loss: torch.Tensor, step: int) -> tuple[bool, torch.Tensor]:
        if self.deepspeed:
            stepped = self._deepspeed(step_loss, step)
        elif self.accelerator.scaler is not None:
            self._overflow_unless(torch.isfinite(step_loss))
            self._clip()
            self.optimizer.step()  # GradScaler.step, then update(), in accelerate's AcceleratedOptimizer
            stepped = not self.optimizer.step_was_skipped  # the scaler's own host sync
        else:
            self._clip()
            # Sync point (every step): one boolean decides whether the optimizer steps (as torchtitan does).
            stepped = bool(torch.isfinite(step_loss) & torch.isfinite(self.grad_norm))
            if stepped:
                self.optimizer.step()
        if stepped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stepped, self.grad_norm

    def _clip(self) -> None:
        """Clip the (all-reduced) gradients; under fp16 this unscales them first."""
        wrapper = getattr(self.optimizer, "optimizer", self.optimizer)  # under accelerate's AcceleratedOptimizer
        if hasattr(wrapper, "clip_grad_norm_"):
            # Step in backward / host offload: the gradients are not on the parameters (fulltune/optim.py).
            norm = wrapper.clip_grad_norm_(self.max_grad_norm)
        elif sharding.is_sharded(self.model):
            norm = sharding.clip_grad_norm_(self.model, self.max_grad_norm)
        else:
            norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.grad_norm = torch.as_tensor(norm if norm is not None else 0.0, device=self.accelerator.device)

    def _overflow_unless(self, finite: torch.Tensor) -> None:
        """NaN-fill one local gradient when `finite` is false, so that the grad scaler sees an overflow."""
        for parameter in self.model.parameters():
            grad = parameter.grad
            grad = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: this process's shard
            if grad is not None and grad.numel() > 0:
                grad.masked_fill_(~finite, float("nan"))
                return

    def _deepspeed(self, step_loss: torch.Tensor, step: int) -> bool:
        self._clip()  # the norm DeepSpeed computed when it clipped
        if self.optimizer.step_was_skipped:
            return False
        if not bool(torch.isfinite(step_loss)):  # Sync point (every step)
            raise TrainingError(
                f"training stopped: the loss of step {step} is not finite and DeepSpeed had already applied the "
                "step (it skips fp16 overflows only); lower train.learning_rate and run again to resume from the "
                "newest checkpoint")
        return True


# ---------------------------------------------------------------------------------------------------
# The loop


def train(job: TrainJob) -> TrainResult:
    """Train `job` to the end, resuming from its newest checkpoint; returns what result.json holds.

    Raises:
        ConfigError: the device or a setting cannot work (e.g. CUDA requested but absent).
        DataError: train_file is unreadable, empty, or has fewer rows than one optimizer step.
        TrainingError: `max_nonfinite_steps` non-finite losses in a row.
        torch.OutOfMemoryError: the device ran out of memory (main() turns it into exit code 3).
    """
    from fulltune.memory.checkpointing import apply_gradient_checkpointing
    from fulltune.models import hub_token, load_model, load_tokenizer
    from transformers import get_scheduler
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # weight loading/saving bars would flood the flow's log
    faults = FaultInjection(os.environ.get("FULLTUNE_TEST_FAULT"))
    output_dir = Path(job.output_dir)
    checkpoints = output_dir / CHECKPOINT_DIR
    if job.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("budget.device: cuda was planned but this machine has no usable CUDA device")

    # The scheduler steps once per optimizer step: total_steps already counts every process's
    # micro-batches (accelerate would otherwise step it num_processes times).
    accelerator = Accelerator(cpu=job.device == "cpu", mixed_precision=job.mixed_precision,
                              gradient_accumulation_steps=job.gradient_accumulation_steps,
                              step_scheduler_with_optimizer=False)
    device, main_process = accelerator.device, accelerator.is_main_process
    processes, rank = accelerator.num_processes, accelerator.process_index
    micro, accumulation = job.micro_batch_size, job.gradient_accumulation_steps
    set_seed(job.seed)

    # Data: the rows of each optimizer step follow from (seed, epoch); this process trains on its slices.
    # e.g. 2 micro × 4 accumulation × 2 processes = 16 rows (≤ 16 × max_length tokens) per optimizer step
    data = TokenizedRows(job.train_file)
    schedule = StepSchedule(data.lengths, micro * accumulation * processes, job.seed)
    if schedule.per_epoch == 0:
        raise DataError(f"{job.train_file}: {len(data)} rows is less than one optimizer step (micro_batch_size "
                        f"{micro} × gradient_accumulation_steps {accumulation} × {processes} processes)")
    total_steps = job.max_steps or max(1, math.ceil(job.num_epochs * schedule.per_epoch))

    token = hub_token(job.token_env)
    tokenizer = load_tokenizer(job.tokenizer_path, trust_remote_code=job.trust_remote_code, token=token,
                               revision=job.revision if job.tokenizer_path == job.model_path else None)
    pad_token_id = pad_token_id_of(tokenizer)
    model = load_model(job.model_path, revision=job.revision, trust_remote_code=job.trust_remote_code,
                       allow_pickle_weights=job.allow_pickle_weights, attn_implementation=job.attn_implementation,
                       token=token)
    use_cache = getattr(model.config, "use_cache", None)
    try:
        # Recompute the first k layers' activations in backward: ~1/3 more compute for those layers,
        # their activations shrink to the layer input (Korthikanti et al. 2022).
        checkpointed = apply_gradient_checkpointing(model, job.gradient_checkpointing)
    except ValueError as exc:
        raise ConfigError(f"train.gradient_checkpointing: {exc}") from None
    if job.pure_bf16:
        model.to(torch.bfloat16)  # no fp32 master copy: the optimizer compensates its updates (fulltune/optim.py)
    if job.offload_activations:
        # The checkpointed layers' saved inputs wait in host RAM for their recompute (fulltune/offload.py).
        ActivationOffload().install(model)
    model.config.use_cache = False
    num_layers = model.config.num_hidden_layers
    flops_per_token, flops_per_target, flops_per_pair = flop_coefficients(model)
    # The output head runs at target positions only; chunked, no (targets × vocabulary) tensor is ever whole.
    head = TargetHead(model, chunked=job.chunked_loss)
    if job.strategy == "fsdp":
        # FSDP2 driven directly (fulltune/sharding.py): Accelerate's CPU mode is DDP only, and a model kept
        # out of prepare keeps its gradients sharded while accumulating. bf16 is FSDP's policy, not autocast.
        sharding.shard_model(model, device=job.device, mixed_precision=job.mixed_precision)
    optimizer = build_optimizer(job, model, processes)
    in_backward = job.optimizer_in_backward
    warmup_steps = math.ceil(job.warmup_ratio * total_steps)
    schedule_name = "constant_with_warmup" if job.lr_scheduler == "constant" else job.lr_scheduler
    scheduler = get_scheduler(schedule_name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)
    if job.compile:
        model = head.compile(model)
    if accelerator.state.deepspeed_plugin is not None:  # DeepSpeed reads it from a prepared dataloader otherwise
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro
    if sharding.is_sharded(model):
        scheduler = accelerator.prepare(scheduler)  # model and optimizer stay FSDP2's (see above)
    elif job.offload_optimizer:
        # Device placement would round-trip the state dict through the device, fp32 masters included.
        model, scheduler = accelerator.prepare(model, scheduler)
        optimizer = accelerator.prepare_optimizer(optimizer, device_placement=False)
    else:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model.train()
    step_optimizer = OptimizerStep(accelerator, model, optimizer, scheduler, job.max_grad_norm)
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)  # the fulltune/optim.py wrapper, if any

    # Resume from the newest complete checkpoint; half-written ones (.tmp-*) are leftovers of a kill.
    state, resumed_from = TrainState(total_steps=total_steps), None
    if main_process:
        for leftover in [*checkpoints.glob(".tmp-*"), *output_dir.glob(".tmp-*")]:
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        checkpoints.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    checkpoint = latest_checkpoint(checkpoints)
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        if sharding.is_sharded(model):
            sharding.load_sharded_state(checkpoint / sharding.SHARDED_STATE_DIR, model, optimizer)
        state = TrainState(**json.loads((checkpoint / TRAINER_STATE_FILE).read_text()))
        if state.total_steps != total_steps:
            raise ConfigError(f"{checkpoint}: written for {state.total_steps} steps, this job has {total_steps}; "
                              f"delete {checkpoints} to start over")
        resumed_from = state.step
    interval_loss = torch.tensor(state.interval_loss_sum, dtype=torch.float32, device=device)

    metrics = MlflowMetrics(job, main_process)
    peak = peak_flops(job)
    if main_process:
        print(f"fulltune train: {len(data)} rows, {schedule.per_epoch} optimizer steps per epoch, {total_steps} "
              f"steps of {micro} micro × {accumulation} accumulation × {processes} processes; gradient "
              f"checkpointing {checkpointed}/{num_layers} layers; {job.optimizer}; precision {job.mixed_precision}; "
              f"{f'resumed from step {resumed_from}' if checkpoint else 'from the start'}", file=sys.stderr, flush=True)
    with tqdm(total=total_steps, initial=state.step, desc="train", unit="step", file=sys.stderr,
              disable=not main_process, mininterval=1.0 if sys.stderr.isatty() else 30.0) as progress:
        started = interval_started = time.perf_counter()
        start_tokens, interval_tokens, interval_rows, interval_flops = state.tokens, 0, 0, 0.0
        grad_norm = torch.zeros((), device=device)

        while state.step < total_steps:
            faults.maybe_oom(state.step + 1)
            # The step's rows first: the loss is normalised by the target tokens of the whole optimizer step
            # (all micro-batches, all processes), which every process knows from the data without communicating.
            step_rows = schedule.step_rows(state.step)
            step_targets = int(data.targets[step_rows].sum())
            step_loss = torch.zeros((), device=device)  # Σ token losses of this process's micro-batches
            step_finite = True
            for index in range(accumulation):
                rows = schedule.micro_batch(step_rows, index, rank, micro, processes)
                batch = collate(data.rows(rows), pad_token_id)
                # Padding is on the right, so in a causal LM no real token attends to it, and it has no
                # labels: the padding mask changes nothing but keeps SDPA off its causal kernel (11% slower
                # per micro-batch of 200 tokens on CPU here). Packed rows are separated by position_ids.
                batch.pop("attention_mask", None)
                targets = Targets.from_labels(batch.pop("labels")).to(device)
                inputs = {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
                # Forward and backward; accelerate accumulates, syncing DDP gradients on the last micro-batch only.
                # The output head runs only at the positions with a target (fulltune/loss.py).
                with accelerator.accumulate(model):
                    loss_sum = faults.maybe_nan(state.step + 1, head.loss_sum(model, inputs, targets))
                    if in_backward:
                        # The update runs inside the last micro-batch's backward and cannot be skipped after
                        # it: a non-finite loss stops the step's backward passes (sync point, per micro-batch).
                        raw_optimizer.set_micro_batch(index)
                        step_finite = step_finite and bool(torch.isfinite(loss_sum))
                    if step_finite:
                        # accelerator.backward divides by the accumulation steps and DDP averages over processes;
                        # scaling back leaves gradients of Σ(all token losses of the step) / step_targets.
                        accelerator.backward(loss_sum * (accumulation * processes / step_targets))
                step_loss += loss_sum.detach()
                faults.maybe_kill("micro_step", state.step * accumulation + index + 1)

            if processes > 1:
                step_loss = accelerator.reduce(step_loss, reduction="sum")  # the same decision on every process
            stepped, grad_norm = step_optimizer(step_loss, state.step + 1)
            if stepped:
                interval_loss += step_loss
                state.interval_targets += step_targets
                state.nonfinite_in_a_row = 0
            else:
                state.nonfinite_steps += 1
                # fp16's loss scaler skips overflowing steps while it lowers its scale; only a loss that is
                # itself not finite (or any skip without a loss scaler) counts towards giving up.
                if not step_optimizer.scales_loss or not bool(torch.isfinite(step_loss)):  # Sync point (skips only)
                    state.nonfinite_in_a_row += 1
                if state.nonfinite_in_a_row >= job.max_nonfinite_steps:
                    raise TrainingError(
                        f"training stopped: {state.nonfinite_in_a_row} non-finite losses in a row at step "
                        f"{state.step + 1}; lower train.learning_rate, or use train.mixed_precision bf16 instead of "
                        "fp16")
            state.step += 1
            step_tokens = int(data.lengths[step_rows].sum())
            state.tokens += step_tokens
            interval_tokens += step_tokens
            interval_rows += len(step_rows)
            interval_flops += (flops_per_token * step_tokens + flops_per_target * step_targets
                               + flops_per_pair * float(data.attention_pairs[step_rows].sum()))
            progress.update(1)

            if state.step % job.log_every_steps == 0 or state.step == total_steps:
                # Sync point (every log_every_steps): the interval's loss and the last gradient norm.
                loss_sum, norm = torch.stack([interval_loss, grad_norm.float()]).tolist()
                loss = loss_sum / state.interval_targets if state.interval_targets else float("nan")
                seconds = time.perf_counter() - interval_started
                state.loss_history.append([state.step, loss])
                if main_process:
                    values = {"train_loss": loss, "learning_rate": scheduler.get_last_lr()[0], "grad_norm": norm,
                              "tokens_per_second": interval_tokens / seconds,
                              "samples_per_second": interval_rows / seconds, **memory_metrics(job.device)}
                    if peak:
                        values["mfu"] = interval_flops / seconds / peak
                    metrics.log(state.step, values)
                    atomic_write_text(output_dir / PROGRESS_FILE,
                                      json.dumps({"step": state.step, "total_steps": total_steps, "loss": loss}))
                    progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
                interval_loss.zero_()
                state.interval_targets = 0
                interval_started, interval_tokens, interval_rows, interval_flops = time.perf_counter(), 0, 0, 0.0

            if job.checkpoint_every_steps and state.step % job.checkpoint_every_steps == 0 and state.step < total_steps:
                state.interval_loss_sum = interval_loss.item()  # Sync point (checkpoint)
                save_checkpoint(accelerator, checkpoints, state, job.keep_checkpoints, faults, model, optimizer)
                faults.maybe_kill("after_checkpoint", state.step)
    seconds = time.perf_counter() - started

    # The final model, whole or not at all: gathered on every process (FSDP/DeepSpeed shards), written by one.
    model_dir = output_dir / MODEL_DIR
    if sharding.is_sharded(model):
        model.config.use_cache = use_cache
        sharding.save_pretrained(model, model_dir, tokenizer)  # gathered on rank 0, a normal HF checkpoint
    state_dict = accelerator.get_state_dict(model) if not sharding.is_sharded(model) else None
    if main_process and state_dict is not None:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.config.use_cache = use_cache
        with atomic_dir(model_dir) as tmp:
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    result = TrainResult(
        model_dir=str(model_dir),
        steps=state.step,
        epochs=state.step / schedule.per_epoch,
        train_loss=state.loss_history[-1][1] if state.loss_history else float("nan"),
        tokens=state.tokens,
        tokens_per_second=(state.tokens - start_tokens) / seconds if seconds > 0 else 0.0,
        seconds=seconds,
        peak_memory_bytes=torch.cuda.max_memory_allocated() if job.device == "cuda" else None,
        nonfinite_steps=state.nonfinite_steps,
        resumed_from_step=resumed_from,
        loss_history=state.loss_history,
    )
    if main_process:
        curve = output_dir / "loss_curve.png"
        save_loss_curve(state.loss_history, curve)
        metrics.log_artifact(curve)
        metrics.close()
        atomic_write_text(output_dir / RESULT_FILE, result.to_json())
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


def end_with_launcher() -> None:
    """SIGKILL this process once the process that launched it (named by LAUNCHER_ENV) is gone.

    The launcher starts training in its own session, so killing `fulltune run`'s process group (a
    preempted node, `kill -9 -PGID`) or only the flow process (the OOM killer) does not reach the child.
    An orphan would go on writing checkpoints into the directory a rerun resumes from. Under torchrun or
    accelerate launch every worker watches; the agent stops the others when one ends.
    """
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher:
        return
    identity = json.loads(launcher)

    def watch() -> None:
        while not process_gone(identity):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fulltune-launcher-watch", daemon=True).start()


def _write_marker(path: Path, payload: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps(payload))


def main(argv: list[str] | None = None) -> int:
    """`python -m fulltune.train JOB.json`: 0 done, 2 user error, 3 out of memory."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fulltune.train JOB.json", file=sys.stderr)
        return EXIT_USER_ERROR
    job_file = Path(args[0])
    if not job_file.is_file():
        print(f"fulltune train: error: {job_file}: job file not found", file=sys.stderr)
        return EXIT_USER_ERROR
    output_dir = job_file.parent
    end_with_launcher()
    try:
        job = TrainJob.from_json(job_file.read_text())
        output_dir = Path(job.output_dir)
        validate_job(job)
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
