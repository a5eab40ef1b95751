"""Pipeline stages in the plan: a pipelined step's peaks and step time together (`estimate_pipeline`), and the
plan's pipeline advice — what P stages would need where one device per process does not fit, or fits only with
a lever that moves tensors over PCIe.

The memory of each stage is `fulltune.memory.pipeline`'s arithmetic; the step time (the bubble and the
point-to-point sends) is the planner's step-time model (`step_time.pipeline_step_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fulltune.degrees import UNSPLIT
from fulltune.levers import SLOW_LEVERS
from fulltune.memory.pipeline import (SCHEDULE_NAMES, UNSUPPORTED_LEVERS, StageEstimate, bubble_fraction,
                                      estimate_stages, per_stage, stage_settings, stage_shape, worst_stage)
from fulltune.memory.shapes import ModelShape, model_shape
from fulltune.memory.types import PlanRequest, Settings
from fulltune.memory.uncertainty import estimate_uncertainty
from fulltune.memory.units import format_bytes, format_seconds
from fulltune.planning.search import Candidate, divisors, fits_budget
from fulltune.planning.step_time import pipeline_step_seconds


@dataclass(frozen=True)
class PipelineEstimate:
    """Every stage's peak, the bubble and the step time of one pipelined optimizer step."""

    num_stages: int
    schedule: str
    micro_batches: int
    micro_batch_size: int
    stages: tuple[StageEstimate, ...]
    bubble: float
    step_seconds: float
    p2p_seconds: float  # of step_seconds: the point-to-point sends on the slowest stage's critical path

    @property
    def worst(self) -> StageEstimate:
        """The stage with the largest device bytes: the plan's figure per device."""
        return worst_stage(self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"num_stages": self.num_stages, "schedule": self.schedule, "micro_batches": self.micro_batches,
                "micro_batch_size": self.micro_batch_size, "worst_stage": self.worst.stage,
                "device_bytes": self.worst.device_bytes, "bubble": round(self.bubble, 6),
                "estimated_step_seconds": round(self.step_seconds, 6), "p2p_seconds": round(self.p2p_seconds, 6),
                "stages": [s.to_dict() for s in self.stages]}


def estimate_pipeline(config: Any, settings: Settings, num_stages: int, schedule: str = "1f1b") -> PipelineEstimate:
    """Each stage's peak memory (`memory.pipeline.estimate_stages`) and the step time
    (`step_time.pipeline_step_seconds`) of `settings` run as `num_stages` pipeline stages; `settings` and
    the MemoryConfigError raised are those of `estimate_stages`."""
    shape = config if isinstance(config, ModelShape) else model_shape(config)
    stages = estimate_stages(shape, settings, num_stages, schedule)
    seconds, p2p = pipeline_step_seconds(shape, settings, num_stages)
    return PipelineEstimate(num_stages, schedule, settings.gradient_accumulation_steps, settings.micro_batch_size,
                            stages, bubble_fraction(num_stages, settings.gradient_accumulation_steps), seconds, p2p)


# --- plan advice ------------------------------------------------------------------------------------------

MAX_STAGES = 64


def needs_advice(fits: bool, settings: Settings) -> bool:
    """Whether `fulltune plan` should say what pipeline parallel would do: nothing fits, or only with a lever
    that moves tensors over PCIe (a slow lever of the lever table, fulltune/levers.py)."""
    return not fits or any(getattr(settings, name) for name in SLOW_LEVERS)


def pipeline_advice(shape: ModelShape, request: Any, settings: Settings, usable: int,
                    plan_seconds: float | None = None, fits: bool = False) -> dict[str, Any] | None:
    """The fewest pipeline stages (2, 4, 8, … up to the layers) under 1F1B whose worst stage fits `usable`
    bytes per device, with its fastest micro-batch split and checkpointing; or, when none does, what the most
    stages would need. `settings` is the plan's choice (its precision, optimizer and pure bf16 / chunked loss
    are kept; the levers pipeline stages do not model are off); the whole effective batch goes through one
    pipeline (no data parallel). A stage fits with the estimate's measured uncertainty for its kind of step
    on top (`uncertainty.estimate_uncertainty`). None: the request has no budget, or the plan `fits` (with a
    slow lever) and no number of stages would.
    """
    if not usable:
        return None
    base = replace(settings, strategy="none", num_processes=1, **UNSPLIT, **{name: False for name in UNSUPPORTED_LEVERS})
    B = request.effective_batch_size
    best: tuple[PipelineEstimate, int] | None = None
    smallest: tuple[int, PipelineEstimate, int] | None = None  # (planned bytes, ...) of the least demanding
    counts = [n for n in (2, 4, 8, 16, 32, MAX_STAGES) if n <= shape.num_layers]
    for P in counts:
        fitting = []
        for b in (d for d in divisors(B) if B // d >= P):
            for k in sorted({0, shape.num_layers // 2, shape.num_layers}):
                candidate = replace(base, micro_batch_size=b, gradient_accumulation_steps=B // b,
                                    gradient_checkpointing=k)
                estimate = estimate_pipeline(shape, candidate, P, "1f1b")
                worst = estimate.worst
                margin = estimate_uncertainty(stage_shape(shape, P, worst.stage),
                                              stage_settings(candidate, P, worst.stage, shape.num_layers),
                                              worst.peak_bytes).bytes
                planned = worst.device_bytes + margin
                if planned <= usable:
                    fitting.append((estimate, k))
                if smallest is None or planned < smallest[0]:
                    smallest = (planned, estimate, k)
        if fitting:
            best = min(fitting, key=lambda c: (c[0].step_seconds, c[1]))
            break
    if best is None and fits:
        return None  # the plan fits, with its offload, and stages alone would not: nothing to compare
    chosen = best or (smallest[1:] if smallest else None)
    if chosen is None:
        return None
    estimate, k = chosen
    return _advice(shape, estimate, k, best is not None, plan_seconds, fits)


def _advice(shape: ModelShape, e: PipelineEstimate, checkpointing: int, fits: bool, plan_seconds: float | None,
            plan_fits: bool) -> dict[str, Any]:
    worst = e.worst
    where = "the first stage" if worst.stage == 0 else ("the last stage" if worst.stage == e.num_stages - 1
                                                        else f"stage {worst.stage}")
    what = (f"pipeline parallel {e.num_stages} ({SCHEDULE_NAMES[e.schedule]}, {e.micro_batches} micro-batches of "
            f"{e.micro_batch_size}, checkpointing {checkpointing} of {shape.num_layers} layers)")
    if fits:
        text = (f"{what} would fit at {format_bytes(worst.device_bytes)} on {where}, bubble {e.bubble:.0%}, "
                f"step {format_seconds(e.step_seconds)} on {e.num_stages} devices")
        if plan_fits and plan_seconds is not None:
            text += f" (the plan: {format_seconds(plan_seconds)} on one device per process, with its offload)"
    else:
        text = (f"{what} would not fit either: {where} needs {format_bytes(worst.device_bytes)} "
                f"(pipeline stages alone do not shard a stage's weights, gradients or optimizer states)")
    return {**e.to_dict(), "gradient_checkpointing": checkpointing, "fits": fits, "advice": text}


def pipeline_reasons(shape: ModelShape, request: PlanRequest, candidates: list[Candidate], chosen: Candidate,
                     usable: int) -> list[str]:
    """With `pipeline_parallel` auto: the number of stages chosen and why — each stage's peak, the bubble and the
    point-to-point sends of a pipelined choice — and each other number's best candidate (the fastest that fits,
    else the smallest) or why it was not tried."""
    if request.pipeline_parallel is not None:
        return []
    from fulltune.planning.reasons import best_by, device_word
    from fulltune.planning.search import pipeline_degrees

    best = best_by(candidates, lambda c: c.settings.pipeline_parallel, usable)
    s = chosen.settings
    P = s.pipeline_parallel
    head = f"pipeline parallel {P} (distributed.pipeline_parallel auto): "
    if P > 1:
        head += _stages_text(shape, s, chosen)
    else:
        where = f"strategy {s.strategy} over {s.num_processes}" if s.num_processes > 1 else "one"
        head += f"no stages: {where} {device_word(s.device)}{'es' if s.device != 'cuda' and s.num_processes > 1 else ''}"
        head += (f"{'s' if s.device == 'cuda' and s.num_processes > 1 else ''}, "
                 f"{format_seconds(chosen.seconds, 's/step')}")
    others = []
    for degree, c in sorted(best.items()):
        if degree == P:
            continue
        if fits_budget(c, usable):
            verdict = "is slower" if c.seconds > chosen.seconds else "is no faster"
            others.append(f"{degree} {verdict} ({format_seconds(c.seconds, 's/step')})")
        else:
            others.append(f"{degree} does not fit ({format_bytes(c.expected_bytes)} ± "
                          f"{format_bytes(c.uncertainty.bytes)} on its largest {'stage' if degree > 1 else 'process'})")
    _, refused = pipeline_degrees(shape, request)
    others += [f"{degree} not tried ({why})" for degree, why in sorted(refused.items())]
    return [head + ("; " + "; ".join(others) if others else "")]


def _stages_text(shape: ModelShape, s: Settings, chosen: Candidate) -> str:
    """A pipelined choice in words: its schedule and micro-batches, each stage's peak, the bubble, the sends."""
    e = estimate_pipeline(shape, per_stage(s), s.pipeline_parallel, s.pipeline_schedule)
    peaks = ", ".join(format_bytes(stage.device_bytes) for stage in e.stages)
    return (f"{SCHEDULE_NAMES[e.schedule]}, {e.micro_batches} micro-batches of {e.micro_batch_size}; stage peaks "
            f"{peaks} (stage {e.worst.stage} the largest, {format_bytes(chosen.expected_bytes)} expected); bubble "
            f"{e.bubble:.0%} of the micro-batch slots; point-to-point sends {format_seconds(e.p2p_seconds)} of "
            f"{format_seconds(chosen.seconds, 's/step')}")
