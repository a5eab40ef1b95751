"""Pipeline parallel: each stage's memory, the bubble, and whether P stages would fit where one device does not.

P stages over L decoder layers (an even split, `stage_layers`): the input embedding on the first stage, the
final norm, output head and loss on the last (a tied head is a copy there, its gradient summed with the
embedding's). Each stage is one process, or dp processes with data parallel beside the stages (below); one
optimizer step runs M micro-batches of b rows through the pipeline (`Settings.micro_batch_size` = b, `gradient_accumulation_steps` = M) under one of two schedules
(`torch.distributed.pipelining`, as fulltune/runtime/pipeline_parallel.py runs them):

- GPipe: every stage runs all M forwards, then all M backwards: it holds M micro-batches' activations.
- 1F1B: stage s runs min(P − s, M) forwards, then alternates one backward and one forward: it holds at most
  min(P − s, M) micro-batches' activations, so the first stage holds the most.

A stage's memory is the single-process step's, walked over that stage's own layers (`fulltune.memory.activations`,
`timeline`, `head`, and the optimizer's bytes from `fulltune.runtime.optim` through `lever_bytes`), plus what the
schedule keeps beside it:

- the other in-flight micro-batches' saved activations (`_replay` follows the schedule's order; before the
  step's first backward the stage has no gradients yet, after it they are accumulated);
- torch.distributed.pipelining's receive buffers, allocated once for every micro-batch of the step: a
  (b, s, h) activation buffer per micro-batch on every stage but the first, and a (b, s, h) gradient buffer
  per micro-batch on every stage but the last; the input gradients a stage sends back live until their send
  is waited for (GPipe: after the last backward; 1F1B: one at a time);
- under GPipe, the last stage's loss graphs: each waiting micro-batch keeps its fp32 log-softmax.

Data parallel beside the stages (num_processes = P × dp, fulltune/runtime/pipeline_parallel.py): under FSDP a
stage's weight shards and optimizer states are FSDP's share (`fsdp.persistent`, 1/dp each); the schedule
accumulates the micro-batches' gradients unsharded and reduces them once, after the step's last backward, and a
unit keeps its gathered weights from its backward until its next forward reshards it, so the stage is walked as the
replicated layout (the unsharded gradients) with the shards, the sharded states and each phase's gathered units
beside it (`fsdp.StageUnits`, the layout's gathered units). Under DDP (`replicate`, FSDP2's replicated layout) the
replicated parameters are a second copy beside the gathered ones. The figure is per rank. Measured per rank on CPU (2 stages × 2:
benchmarks/pipeline_parallel.py's `*-fsdp2` and `*-ddp2` cases, hidden 128, 4 layers, vocabulary 4096, 4
micro-batches of 2 × 128; BENCHMARKS.md): under FSDP from 1.91% below to 0.04% below the measured peak (fp32 and
bf16, 1F1B and GPipe, 2 layers checkpointed; counted as every unit gathered through the step it was 2–10% above);
DDP within 0.2% (fp32 1F1B).

The step time of a pipelined step (the bubble, the point-to-point sends) is the planner's
(`fulltune.planning.step_time.pipeline_step_seconds`), and so is the plan's pipeline advice and search
(`fulltune.planning.pipeline`); this module is the memory arithmetic alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, get_args

from fulltune import spec
from fulltune.levers import PIPELINE_REFUSED_LEVERS
from fulltune.memory.errors import MemoryConfigError
from fulltune.memory.shapes import ModelShape, model_shape
from fulltune.memory.timeline import Timeline
from fulltune.memory.types import MemoryEstimate, Settings

SCHEDULES = get_args(spec.PipelineSchedule)
SCHEDULE_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe"}
# The levers pipeline stages do not run: rules of the lever table (fulltune/levers.py).
UNSUPPORTED_LEVERS = tuple(PIPELINE_REFUSED_LEVERS)


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) decoder layers of each stage: an even split, the first stages one more when it is uneven.

    Raises:
        MemoryConfigError: fewer than one layer per stage.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= num_layers:
        raise MemoryConfigError(f"pipeline stages must be 1 to {num_layers} (one decoder layer or more each); "
                                f"got {num_stages!r}")
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def in_flight(schedule: str, stage: int, num_stages: int, micro_batches: int) -> int:
    """The most micro-batches whose activations stage `stage` holds at once."""
    return micro_batches if schedule == "gpipe" else min(num_stages - stage, micro_batches)


def schedule_order(schedule: str, stage: int, num_stages: int, micro_batches: int) -> list[str]:
    """The forwards ("F") and backwards ("B") of stage `stage` in the order the schedule runs them
    (torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B)."""
    M = micro_batches
    if schedule == "gpipe":
        return ["F"] * M + ["B"] * M
    warmup = in_flight(schedule, stage, num_stages, M)
    order = ["F"] * warmup
    for _ in range(M - warmup):
        order += ["B", "F"]
    return order + ["B"] * warmup


def bubble_fraction(num_stages: int, micro_batches: int) -> float:
    """The share of a GPipe or 1F1B step's micro-batch slots a stage waits: (P − 1) / (M + P − 1)."""
    return (num_stages - 1) / (micro_batches + num_stages - 1)


@dataclass(frozen=True)
class StageEstimate:
    """One stage's peak (bytes, per process)."""

    stage: int
    layers: tuple[int, int]  # [start, end) of the decoder layers
    in_flight: int  # micro-batches whose activations it holds at once
    peak_bytes: int  # tensors at the step's peak
    device_bytes: int  # with the runtime overhead (CUDA context and allocator slack, or the CPU process)
    peak_phase: str
    breakdown: dict[str, int]
    p2p_bytes: int  # the schedule's receive buffers (activations and gradients, every micro-batch)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "layers": list(self.layers), "in_flight": self.in_flight,
                "peak_bytes": self.peak_bytes, "device_bytes": self.device_bytes, "peak_phase": self.peak_phase,
                "breakdown": dict(self.breakdown), "p2p_bytes": self.p2p_bytes}


def estimate_stages(config: Any, settings: Settings, num_stages: int, schedule: str = "1f1b"
                    ) -> tuple[StageEstimate, ...]:
    """Each stage's peak memory of `settings` run as `num_stages` pipeline stages.

    `settings` is the step as one process would run it: micro-batches of `micro_batch_size` rows,
    `gradient_accumulation_steps` of them per optimizer step (the pipeline's micro-batches), strategy none, or
    fsdp / ddp over `num_processes` (a stage's data-parallel processes).

    Raises:
        MemoryConfigError: an unknown schedule, 1F1B with fewer micro-batches than stages, more stages than
            layers, a strategy other than none, fsdp or ddp, or a lever this model does not cover (`UNSUPPORTED_LEVERS`).
    """
    shape = config if isinstance(config, ModelShape) else model_shape(config)
    _check(shape, settings, num_stages, schedule)
    return tuple(_stage_estimate(shape, settings, num_stages, s, schedule) for s in range(num_stages))


def worst_stage(stages: tuple[StageEstimate, ...]) -> StageEstimate:
    """The stage with the largest device bytes: the plan's figure per device."""
    return max(stages, key=lambda s: (s.device_bytes, -s.stage))


def per_stage(settings: Settings) -> Settings:
    """Pipelined `settings` (`pipeline_parallel` P > 1) as `estimate_stages` reads them: one stage's processes."""
    return replace(settings, num_processes=settings.dims.per_stage().world_size, pipeline_parallel=1)


def stage_memory_estimate(shape: ModelShape, settings: Settings) -> MemoryEstimate:
    """The plan's estimate of pipelined `settings` (`pipeline_parallel` P > 1, num_processes / P processes per
    stage): the largest stage of `estimate_stages` is the figure per device, its peak phase named with its stage.

    Only the step is counted: every process builds the whole model before it keeps its stage, which this does
    not see (a process's load phase; on CPU the step's peak is the larger for any model that trains)."""
    one = per_stage(settings)
    worst = worst_stage(estimate_stages(shape, one, settings.pipeline_parallel, settings.pipeline_schedule))
    first, last = worst.layers
    dp = one.num_processes
    beside = f", per rank of its {dp} {one.strategy.upper()} processes" if dp > 1 and not one.dims.alone else ""
    note = (f"pipeline stage {worst.stage} of {settings.pipeline_parallel} (layers {first}–{last - 1}, "
            f"{worst.in_flight} micro-batch{'es' if worst.in_flight != 1 else ''} in flight{beside}) is the largest: "
            f"its peak is the device figure")
    return MemoryEstimate(worst.peak_bytes, worst.device_bytes, dict(worst.breakdown),
                          f"stage {worst.stage}: {worst.peak_phase}", notes=(note,),
                          step_device_bytes=worst.device_bytes, phases={"training step": worst.device_bytes},
                          process_peak_phase="training step")


def _check(shape: ModelShape, settings: Settings, num_stages: int, schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise MemoryConfigError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    stage_layers(shape.num_layers, num_stages)
    M = settings.gradient_accumulation_steps
    if schedule == "1f1b" and M < num_stages:
        raise MemoryConfigError(f"1F1B needs at least as many micro-batches as stages: {M} < {num_stages}")
    if settings.dims.alone and settings.num_processes != 1:
        raise MemoryConfigError("pipeline stages are modelled alone (strategy none, one process per stage) or with "
                                "data parallel beside them (strategy fsdp or ddp over a stage's processes)")
    on = [name for name in UNSUPPORTED_LEVERS if getattr(settings, name)]
    if on:
        raise MemoryConfigError(f"pipeline stages are not modelled with {', '.join(on)}")


def stage_shape(shape: ModelShape, num_stages: int, stage: int) -> ModelShape:
    """The part of `shape` stage `stage` holds: its decoder layers, the embedding tables on the first stage,
    the final norm and the output head on the last (a tied head a copy). A stage without the head has
    vocabulary 0, so that neither logits nor head FLOPs are counted on it (the embedding is among its tables)."""
    start, end = stage_layers(shape.num_layers, num_stages)[stage]
    first, last = stage == 0, stage == num_stages - 1
    tables = [s for s in shape.other_params if len(s) == 2]
    norms = [s for s in shape.other_params if len(s) != 2]
    head = (shape.vocab, shape.hidden)
    lookups = tables if shape.tied else tables[:-1]  # untied: the head is the last 2-D tensor (shapes.py)
    other: list[tuple[int, ...]] = (list(lookups) if first else []) + (norms + [head] if last else [])
    return replace(shape, num_layers=end - start, other_params=tuple(other), vocab=shape.vocab if last else 0,
                   tied=False)


def stage_settings(settings: Settings, num_stages: int, stage: int, num_layers: int) -> Settings:
    """`settings` on one stage: its share of the checkpointed layers (the model's first k)."""
    start, end = stage_layers(num_layers, num_stages)[stage]
    return replace(settings, gradient_checkpointing=max(0, min(settings.gradient_checkpointing - start, end - start)))


def _stage_estimate(shape: ModelShape, settings: Settings, P: int, s: int, schedule: str) -> StageEstimate:
    from fulltune.memory.overhead import training_overhead
    from fulltune.memory.process import STEP

    sub, ss = stage_shape(shape, P, s), stage_settings(settings, P, s, shape.num_layers)
    first, last = s == 0, s == P - 1
    start, M = stage_layers(shape.num_layers, P)[s][0], settings.gradient_accumulation_steps
    # Two walks of one micro-batch: before the step's first backward has made the stage's gradients (they
    # appear layer by layer, as without accumulation), and after it (they exist through every pass).
    fresh, per_micro_batch, x = _single_micro_batch(sub, replace(ss, gradient_accumulation_steps=1), first, last,
                                                    start, M)
    steady = _single_micro_batch(sub, ss, first, last, start, M)[0] if M > 1 else fresh
    stream = x.bsh4  # one (b, s, h) tensor of the residual stream: what crosses a stage boundary
    # The schedule keeps a micro-batch's stage output until its backward; on the last stage that is the final
    # norm's output, which nothing else keeps (on the others it is the last layer's, among its saved tensors).
    own_output = stream if last else 0
    per_micro_batch += own_output
    if last and schedule == "gpipe":
        # A waiting micro-batch's loss keeps its fp32 log-softmax (the chunked head: its logsumexp per row).
        per_micro_batch += 4 * x.t if ss.chunked_loss else x.logits32
    receive = (0 if first else M * stream) + (0 if last else M * stream)
    input_grad = 0 if first else stream  # each backward of a later stage sends one back
    largest = {(walk, kind): _largest(phases, kind) for walk, phases in (("fresh", fresh), ("steady", steady))
               for kind in ("F", "B", "O")}
    candidates = [(largest["steady", "O"], receive)]
    for action, alive, done in _replay(schedule_order(schedule, s, P, M)):
        # Beside this micro-batch: the other in-flight ones' activations, and the input gradients sent back and
        # still held by their send: GPipe waits for its backward sends at the end of the backwards, 1F1B for
        # each before the next action (its send op holds the last one until the next backward).
        sending = done if schedule == "gpipe" else min(done, 1)
        others = (alive if action == "F" else alive - 1) * per_micro_batch + sending * input_grad
        others += own_output if action == "B" else 0
        candidates.append((largest["fresh" if done == 0 else "steady", action], receive + others))
    (name, total, parts), extra = max(candidates, key=lambda c: c[0][1] + c[1])
    peak = total + extra
    breakdown = {key: int(value) for key, value in parts.items() if key != "host"}
    breakdown["activations"] += int(extra)
    overhead = training_overhead(ss, peak, STEP, sub)
    breakdown["runtime_overhead"] = int(overhead)
    return StageEstimate(s, tuple(stage_layers(shape.num_layers, P)[s]), in_flight(schedule, s, P, M), int(peak),
                         int(peak + overhead), name, breakdown, int(receive))


def _kind(phase: str) -> str:
    return "O" if phase == "optimizer step" else ("F" if phase.startswith("forward") else "B")


def _largest(phases: list, kind: str) -> tuple[str, int, dict[str, int]]:
    """The largest of a walk's phases of one kind: forward ("F"), backward ("B") or the optimizer step ("O")."""
    return max((p for p in phases if _kind(p[0]) == kind), key=lambda p: p[1])


def _replay(order: list[str]) -> list[tuple[str, int, int]]:
    """(action, micro-batches forwarded and not yet backwarded, backwards done) before each action of a stage."""
    alive = done = 0
    out = []
    for action in order:
        out.append((action, alive, done))
        if action == "F":
            alive += 1
        else:
            alive, done = alive - 1, done + 1
    return out


def _single_micro_batch(sub: ModelShape, ss: Settings, first: bool, last: bool, start: int, micro_batches: int
                        ) -> tuple[list, int, Any]:
    """One micro-batch's forward and backward through a stage, and the optimizer step: the phases, the
    micro-batch's saved activations, and the step's terms. With `ss.gradient_accumulation_steps` above 1 the
    stage's gradients exist from the start (an earlier micro-batch made them); at 1 they appear during its
    backward. The single-process walk (`walk.walk` with `replicated.replicated`) on the stage's layers, with the
    embedding on the first stage and the head on the last; the step's batch has `micro_batches` micro-batches."""
    from fulltune.memory.replicated import replicated
    from fulltune.memory.fsdp import StageUnits, persistent
    from fulltune.memory.timeline import step_terms
    from fulltune.memory.walk import walk

    # Data parallel beside the stages: the schedule accumulates every micro-batch's gradients unsharded and
    # reduces them after the step's last backward, and a unit keeps its gathered weights from its backward on
    # (torch.distributed.pipelining's FSDP support), so the walk is the replicated one. Beside it, FSDP2's own
    # parameters (`fsdp.persistent`, FSDP's share: 1/dp under fsdp, the whole stage under ddp's `replicate`,
    # whose replicated parameter is a copy beside the one the step computes with) and the optimizer states
    # (1/dp under fsdp).
    walked = replace(ss, strategy="none", num_processes=1)
    x = step_terms(sub, walked, walked)
    acts = x.acts
    # A later stage's input is its receive buffer (counted with the schedule's buffers); only the last stage
    # keeps the final norm's tensors and the head's rows.
    acts = replace(acts, stream_in=acts.stream_in if first else 0,
                   final_norm=acts.final_norm if last else 0, lm_head_input=acts.lm_head_input if last else 0)
    x = replace(x, acts=acts)
    p = persistent(x)
    gathered = None
    if not ss.dims.alone and ss.num_processes > 1:
        sharded = persistent(step_terms(sub, ss, ss))
        if ss.dims.fsdp_enabled:  # the units' gathered weights come and go phase by phase (`fsdp.StageUnits`)
            gathered = StageUnits(sub, x.levers.weight_bytes, (start, start + sub.num_layers), first, last,
                                  fresh=ss.gradient_accumulation_steps == 1)
            p = replace(p, params=sharded.params + gathered.root, states=sharded.states)
        else:  # DDP's replicated parameters beside the copy the step computes with
            p = replace(p, params=p.params + sharded.params, states=sharded.states)
    b, s = ss.micro_batch_size, ss.seq_len
    rows = b * micro_batches
    # Every stage has the step's position ids (and attention mask); the first its token ids, the last its
    # labels and one micro-batch's target index and tokens (int64).
    batch = 8 * rows * s * (1 + int(ss.attention_mask) + int(first) + int(last)) + (2 * 8 * x.t if last else 0)
    tl = Timeline(x, replace(p, batch=batch))
    layout = replicated(tl, layers=(start, start + sub.num_layers), embedding=first, head=last)
    walk(tl, replace(layout, gathered=gathered))
    return tl.phases, acts.total, x
