"""One training step — forward of each micro-batch → loss normalised by the step's target tokens → backward →
clip → optimizer step — with the levers' hooks. The trainer (fulltune/runtime/train.py), the memory trace and
`measure_memory` (fulltune/planning/trace.py), the device check and the benchmarks all run this function, so
the memory model is checked against the step that trains.

    run_step(parts, micro_batches, step, step_targets)

`parts.accelerator` is accelerate's `Accelerator` in the trainer, or `LocalAccelerator` where a process
measures several settings one after another (Accelerate's state is process-wide: its mixed precision cannot
change between two measurements) or traces under FakeTensorMode. Both give the step the same four things:
`accumulate(model)`, `backward(loss)` (which divides by the accumulation steps), `reduce(tensor, "sum")` and
`clip_grad_norm_(parameters, max_norm)`; `LocalAccelerator` also autocasts the forward, which Accelerate's
`prepare` does inside the model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from fulltune.runtime import pipeline_parallel, sharding
from fulltune.runtime.faults import TrainHooks
from fulltune.runtime.loss import TargetHead, Targets

MicroBatch = tuple[dict[str, Any], Targets]


class LocalAccelerator:
    """The part of accelerate's `Accelerator` that one process's step uses, without its process-wide state.

    What Accelerate adds to a single-process step is reproduced: autocast around the forward for bf16 (and fp16
    on CUDA; Accelerate ignores fp16 on CPU) with the logits upcast to fp32 (`TargetHead.loss_sum` does that),
    and `backward` dividing the loss by the accumulation steps. Inside an initialised process group (FSDP2
    under torchrun) `reduce` sums over it; FSDP reduces the gradients itself. `can_sync=False` (FakeTensorMode) skips the
    host reads a fake tensor cannot answer: the finite checks always pass.
    """

    scaler = None

    def __init__(self, device: str, mixed_precision: str = "no", gradient_accumulation_steps: int = 1,
                 can_sync: bool = True) -> None:
        import torch.distributed as dist

        self.device = torch.device(device)
        self.mixed_precision = mixed_precision
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.can_sync = can_sync
        # In a process group of its own (an FSDP2 measurement under torchrun), the step sums over it.
        grouped = dist.is_available() and dist.is_initialized()
        self.num_processes = dist.get_world_size() if grouped else 1
        self.process_index = dist.get_rank() if grouped else 0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.mixed_precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        if self.mixed_precision == "fp16" and self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.float16)
        return contextlib.nullcontext()

    def accumulate(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gradient_accumulation_steps).backward()

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        if self.num_processes > 1:
            import torch.distributed as dist

            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)


class OptimizerStep:
    """Clip the step's gradients, then take the optimizer step or skip it; `(stepped, grad_norm)`.

    `step_loss` is the step's summed loss, the same on every process. Who decides on a skip:
    - no grad scaler (fp32, bf16): a non-finite loss or gradient norm skips the step.
    - fp16 (torch's GradScaler, through accelerate): the scaler. The optimizer step always goes through
      it: it skips when the unscaled gradients hold an inf or NaN, and its update() lowers the scale.
      That update must follow every unscale_ (done by clipping), or the next clip raises "unscale_() has
      already been called". A non-finite loss whose gradients came out finite is made an overflow (one
      gradient becomes NaN, without a host sync), so the scaler skips it too.
    `scheduler` may be None (the memory trace has no schedule).
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                 max_grad_norm: float) -> None:
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        # A dynamic loss scale skips overflowing steps while it finds its value: fp16 only.
        self.scales_loss = accelerator.scaler is not None
        self.can_sync = getattr(accelerator, "can_sync", True)

    def __call__(self, step_loss: torch.Tensor, step: int) -> tuple[bool, torch.Tensor]:
        if self.accelerator.scaler is not None:
            self._overflow_unless(torch.isfinite(step_loss))
            self._clip()
            self.optimizer.step()  # GradScaler.step, then update(), in accelerate's AcceleratedOptimizer
            stepped = not self.optimizer.step_was_skipped  # the scaler's own host sync
        else:
            self._clip()
            # Sync point (every step): one boolean decides whether the optimizer steps (as torchtitan does).
            stepped = not self.can_sync or bool(torch.isfinite(step_loss) & torch.isfinite(self.grad_norm))
            if stepped:
                self.optimizer.step()
        if stepped and self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stepped, self.grad_norm

    def _clip(self) -> None:
        """Clip the (all-reduced) gradients; under fp16 this unscales them first."""
        wrapper = getattr(self.optimizer, "optimizer", self.optimizer)  # under accelerate's AcceleratedOptimizer
        if hasattr(wrapper, "clip_grad_norm_"):
            # Step in backward / host offload: the gradients are not on the parameters (fulltune/runtime/optim.py).
            norm = wrapper.clip_grad_norm_(self.max_grad_norm)
        elif pipeline_parallel.is_stage(self.model):  # one norm over every stage's (and dp shard's) gradients
            norm = pipeline_parallel.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
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


@dataclass
class StepParts:
    """What a step runs on, built once per run (`fulltune.runtime.train.setup`, `fulltune.planning.trace`)."""

    accelerator: Any  # accelerate.Accelerator or LocalAccelerator
    model: torch.nn.Module  # as prepared (DDP wrapper, compiled) or FSDP2-sharded
    head: TargetHead
    optimizer: Any  # as prepared (AcceleratedOptimizer) or fulltune's own
    step_optimizer: OptimizerStep
    gradient_accumulation_steps: int
    optimizer_in_backward: bool = False
    hooks: TrainHooks = field(default_factory=TrainHooks)
    before_micro_batch: Callable[[], None] | None = None  # the memory trace resets its tracker's module stats
    pipeline: Any = None  # pipeline_parallel.PipelineRun: its schedule runs the step's micro-batches

    @classmethod
    def assemble(cls, accelerator: Any, model: torch.nn.Module, head: TargetHead, optimizer: Any, plan: Any,
                 scheduler: Any = None, max_grad_norm: float = 1.0, **hooks: Any) -> StepParts:
        """The parts of a step of planned settings `plan` (a `fulltune.memory.Settings`, or anything with its
        gradient_accumulation_steps and optimizer_in_backward): the optimizer step clips to `max_grad_norm`
        and steps `scheduler` (None: no schedule); `hooks` sets `hooks` and `before_micro_batch`."""
        return cls(accelerator, model, head, optimizer,
                   OptimizerStep(accelerator, model, optimizer, scheduler, max_grad_norm),
                   plan.gradient_accumulation_steps, plan.optimizer_in_backward, **hooks)

    @property
    def in_backward(self) -> Any:
        """The optimizer-in-backward wrapper (inside accelerate's AcceleratedOptimizer), or None."""
        return getattr(self.optimizer, "optimizer", self.optimizer) if self.optimizer_in_backward else None


@dataclass
class StepOutcome:
    """What one optimizer step did."""

    loss_sum: torch.Tensor  # Σ token losses of the step, all processes (on the device: no sync)
    targets: int  # target tokens of the step, all processes: the loss is divided by these
    stepped: bool  # False: skipped as non-finite (or by the fp16 grad scaler)
    grad_norm: torch.Tensor


def run_step(parts: StepParts, micro_batches: Iterable[MicroBatch], step: int, step_targets: int,
             first_micro_batch: int = 0) -> StepOutcome:
    """Optimizer step `step` (1-based): forward and backward each of this process's micro-batches, then clip
    and step, or skip a non-finite step (OptimizerStep).

    The loss is normalised by `step_targets`, the target tokens of the whole optimizer step (all micro-batches,
    all processes), which every process knows from the data without communicating. `first_micro_batch` is the
    index of the first micro-batch given (the memory trace runs only a step's last ones). With pipeline stages
    (`parts.pipeline`) the schedule runs the micro-batches in place of the loop; the clip and step are the same.
    """
    if parts.pipeline is not None:
        step_loss = parts.pipeline.forward_backward(micro_batches, step, step_targets)
    else:
        step_loss = _accumulate(parts, micro_batches, step, step_targets, first_micro_batch)
    stepped, grad_norm = parts.step_optimizer(step_loss, step)
    return StepOutcome(step_loss, step_targets, stepped, grad_norm)


def _accumulate(parts: StepParts, micro_batches: Iterable[MicroBatch], step: int, step_targets: int,
                first_micro_batch: int) -> torch.Tensor:
    """Forward and backward each micro-batch, accumulating the gradients; the step's Σ token losses, summed
    over the processes."""
    accelerator, model, in_backward = parts.accelerator, parts.model, parts.in_backward
    accumulation, processes = parts.gradient_accumulation_steps, accelerator.num_processes
    # Accelerate's prepared model autocasts inside its forward; without Accelerate the step does it here.
    forward_context = accelerator.autocast if isinstance(accelerator, LocalAccelerator) else contextlib.nullcontext
    can_sync = getattr(accelerator, "can_sync", True)
    step_loss = torch.zeros((), device=accelerator.device)  # Σ token losses of this process's micro-batches
    step_finite = True
    for index, (inputs, targets) in enumerate(micro_batches, start=first_micro_batch):
        if parts.before_micro_batch is not None:
            parts.before_micro_batch()
        # Forward and backward; accelerate accumulates, syncing DDP gradients on the last micro-batch only.
        with accelerator.accumulate(model):
            with forward_context():
                # The micro-batch's loss: Σ of its token losses, the output head at the target positions only.
                loss_sum = parts.hooks.on_loss(step, parts.head.loss_sum(model, inputs, targets))
            if in_backward is not None:
                # The update runs inside the last micro-batch's backward and cannot be skipped after it:
                # a non-finite loss stops the step's backward passes (sync point, per micro-batch).
                in_backward.set_micro_batch(index)
                if can_sync and step_finite:
                    finite = torch.isfinite(loss_sum.detach())
                    if processes > 1:  # FSDP: all processes take the backward (its reduce-scatters) or none
                        finite = accelerator.reduce(finite.float(), reduction="sum") == processes
                    step_finite = bool(finite)
            if step_finite:
                # accelerator.backward divides by the accumulation steps and DDP averages over processes;
                # scaling back leaves gradients of Σ(all token losses of the step) / step_targets.
                accelerator.backward(loss_sum * (accumulation * processes / step_targets))
        step_loss += loss_sum.detach()
        del loss_sum, inputs, targets
        parts.hooks.after_micro_batch((step - 1) * accumulation + index + 1)
    if processes > 1:
        step_loss = accelerator.reduce(step_loss, reduction="sum")  # the same decision on every process
    return step_loss


@contextlib.contextmanager
def local_parts(model: torch.nn.Module, optimizer: Any, settings: Any, *, device: str, max_grad_norm: float = 1.0,
                can_sync: bool = True, before_micro_batch: Callable[[], None] | None = None) -> Iterator[StepParts]:
    """StepParts for one process without Accelerate, for planned `settings` (a `fulltune.memory.Settings`):
    the model's loss head (chunked or not) is installed for the block and removed after it."""
    accelerator = LocalAccelerator(device, settings.mixed_precision, settings.gradient_accumulation_steps, can_sync)
    head = TargetHead(model, chunked=settings.chunked_loss)
    try:
        yield StepParts.assemble(accelerator, model, head, optimizer, settings, max_grad_norm=max_grad_norm,
                                 before_micro_batch=before_micro_batch)
    finally:
        head.remove()
