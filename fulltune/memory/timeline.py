"""The step as a timeline: what persists through it, the per-step numbers, and one record per phase.

`StepTerms` holds the numbers every part of the walk needs (the micro-batch's dimensions, dtypes, the
gradients' sizes, the layer's and the model's activations), computed once by `step_terms`. `Timeline`
holds what persists through the step (weights, optimizer states, communication buffers, the batch) and
turns each phase's varying parts into a breakdown (`Timeline.add`); the estimate is its largest phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fulltune.memory.activations import (LayerBytes, ModelActivations, compute_bytes, layer_bytes, model_activations,
                                         stream_bytes)
from fulltune.memory.lever_bytes import LeverBytes, lever_bytes
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings


@dataclass(frozen=True)
class StepTerms:
    """The numbers of one training step that the phases of the walk share (bytes unless named otherwise)."""

    shape: ModelShape
    settings: Settings
    act: Settings  # the settings whose activations the step makes (`fsdp.activation_settings`)
    levers: LeverBytes
    layer: LayerBytes
    acts: ModelActivations
    t: int  # positions with a target in the micro-batch: the output head's rows
    c: int  # bytes per activation element (compute dtype)
    sb: int  # bytes per residual-stream element
    mixed: bool  # autocast over fp32 weights (16-bit copies of the weights)
    grad_shard: float  # the share of the gradients this process keeps (FSDP)
    grads_total: int  # every gradient, as without the gradient-hook levers
    accumulating: bool  # gradient accumulation above 1: gradients exist through the whole step
    hooks: bool  # a lever takes each gradient as it is made (step in backward, optimizer offload)

    @property
    def bsh4(self) -> int:
        """One residual-stream tensor (b, s, h) in the stream dtype."""
        return self.sb * self.settings.micro_batch_size * self.settings.seq_len * self.shape.hidden

    @property
    def grads_before(self) -> int:
        """Gradients alive when the step starts: all of them when accumulating into .grad."""
        return self.grads_total if self.accumulating else 0

    @property
    def new_grad_added(self) -> bool:
        """Accumulating into an existing .grad makes each new gradient a temporary beside it; with the hooks
        there is no device .grad to add into (the hook takes each one as it is made)."""
        return self.accumulating and not self.hooks

    @property
    def logits_c(self) -> int:
        """The head's (t, V) output in the compute dtype."""
        return self.t * self.shape.vocab * self.c

    @property
    def logits32(self) -> int:
        """One fp32 (t, V) tensor: the upcast logits, log_softmax's output, their gradients."""
        return 4 * self.t * self.shape.vocab


@dataclass(frozen=True)
class Shares:
    """The fraction of the whole model's weights, gradients and optimizer states one process keeps."""

    params: float
    grads: float
    states: float


def shares(settings: Settings) -> Shares:
    """FSDP shards all three over the processes (fulltune/memory/fsdp.py); DDP none."""
    n = settings.num_processes
    if settings.dims.fsdp_enabled:
        return Shares(1.0 / n, 1.0 / n, 1.0 / n)
    return Shares(1.0, 1.0, 1.0)


def step_terms(shape: ModelShape, settings: Settings, act: Settings, layer: LayerBytes | None = None,
               acts: ModelActivations | None = None, terms: type[StepTerms] = StepTerms, **extra: object) -> StepTerms:
    """The shared numbers of a step of `settings` on `shape`, whose activations are those of `act`: a layer's
    (`layer`) and the model's (`acts`) as a parallelism computes them for its rank (fulltune/memory/parallelism.py;
    default the one process's), `terms` a kind's own subclass with its `extra` fields."""
    levers = lever_bytes(shape, settings)
    layer = layer if layer is not None else layer_bytes(shape, act)
    c = compute_bytes(act)
    grad_shard = shares(settings).grads
    return terms(
        shape=shape, settings=settings, act=act, levers=levers, layer=layer,
        acts=acts if acts is not None else model_activations(shape, settings, act, layer),
        t=settings.micro_batch_size * settings.targets_per_row, c=c, sb=stream_bytes(act),
        mixed=c == 2 and not act.pure_bf16, grad_shard=grad_shard,
        grads_total=int(levers.weight_bytes * shape.num_params * grad_shard),
        accumulating=settings.gradient_accumulation_steps > 1,
        hooks=settings.optimizer_in_backward or settings.offload_optimizer,
        **extra,  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class Persistent:
    """What exists through the whole step on this process, beside what the phases add."""

    params: int  # the weights (this process's shard)
    buffers: int  # non-parameter buffers (rotary inverse frequencies)
    states: int  # optimizer states on the device (this process's shard)
    buckets: int  # communication: DDP's gradient buckets
    batch: int  # the micro-batch's index tensors


@dataclass
class Timeline:
    """The phases of one step, each a breakdown of the bytes alive at its peak."""

    terms: StepTerms
    persistent: Persistent
    phases: list[tuple[str, int, dict[str, int]]] = field(default_factory=list)
    # What a layout adds to every phase it records (`walk.Layout.gathered`: FSDP's units beside pipeline stages,
    # `fsdp.StageUnits`); set by the walk.
    gathered: Any = None

    def add(self, phase: str, grads: int, acts: int, logits: int, temp: int, now: int = 0, backward: bool = True,
            unsharded: tuple[int, int] = (0, 0)) -> None:
        """Record a phase: `grads` the gradients alive without the hook levers, `acts` the saved activations,
        `logits` the logit tensors, `temp` the phase's working set; `now` the gradient a hook is about to take;
        `unsharded` FSDP's gathered parameters and (unsharded gradients + reduce-scatter buffers) now. A layout's
        `gathered` units record it with theirs."""
        if self.gathered is None:
            self.record(phase, grads, acts, logits, temp, now, backward, unsharded)
        else:
            self.gathered.record(self, phase, grads, acts, logits, temp, now, backward, unsharded)

    def record(self, phase: str, grads: int, acts: int, logits: int, temp: int, now: int = 0, backward: bool = True,
               unsharded: tuple[int, int] = (0, 0)) -> None:
        """`add` without the layout's units: one phase's breakdown appended."""
        # Called for every phase of every candidate the planner weighs (millions for a 70B plan): plain
        # arithmetic, the breakdown's keys in the order the report shows them.
        x, p = self.terms, self.persistent
        on_host = x.settings.device == "cpu"  # host RAM is the device's memory: count it in the peak
        device_grads = now if x.hooks else grads
        # Offloaded activations move to the host once the forward has passed their layer.
        away = x.acts.offloaded if backward else 0
        # The hook has moved every gradient to the host but the one it is about to take (accumulating,
        # the host holds the sums of the earlier micro-batches already).
        host = x.levers.host_parts(grads if x.accumulating else max(grads - now, 0), away)
        parameters = p.params + p.buffers + unsharded[0] + (host["parameters"] if on_host else 0)
        gradients = device_grads + p.buckets + unsharded[1] + (host["gradients"] if on_host else 0)
        states = p.states + (host["optimizer_states"] if on_host else 0)
        activations = acts + p.batch - (0 if on_host else away)
        parts = {"parameters": parameters, "gradients": gradients, "optimizer_states": states,
                 "activations": activations, "logits": logits, "temporary": temp,
                 "host": host["parameters"] + host["gradients"] + host["optimizer_states"] + host["activations"]}
        self.phases.append((phase, parameters + gradients + states + activations + logits + temp, parts))
