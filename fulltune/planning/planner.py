"""Choose micro-batch, gradient checkpointing, mixed precision and optimizer to fit a memory budget.

The planner only changes fields the user left on auto, keeps the effective batch
(micro_batch_size × gradient_accumulation_steps × num_processes) fixed, and among the settings
whose estimated device memory fits in budget × (1 − headroom) picks the fastest by a simple
step-time model. Gradient checkpointing is turned on for as few layers as needed.

A setting fits when its estimate plus the estimate's uncertainty for that kind of configuration
(the largest disagreement measured, `uncertainty.py`) fits. Where the step has been traced under
FakeTensorMode (`plan_memory(trace=True)`), it fits when the larger of estimate and trace does.

This module puts a plan together and makes the next one after an out-of-memory crash; its parts are:
`search` (the candidates and what fits), `step_time` (the step-time model that ranks them), `reasons` (what the
plan says), `strategy` (`distributed.strategy: auto`), `pipeline` (pipeline stages' step and the plan's
pipeline advice) and `trace` (the FakeTensor trace of the chosen step).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fulltune import degrees, levers
from fulltune.memory.budget import usable_bytes
from fulltune.memory.estimate import _estimate
from fulltune.memory.evaluation import with_evaluation
from fulltune.memory.shapes import ModelShape, model_shape
from fulltune.memory.types import MemoryEstimate, MemoryPlan, PlanRequest, Settings
from fulltune.memory.uncertainty import Uncertainty, traced_uncertainty
from fulltune.memory.units import format_bytes
from fulltune.planning.pipeline import needs_advice, pipeline_advice, pipeline_reasons
from fulltune.planning.reasons import (alternatives_for, change_reasons, checkpoint_reasons, configured_reason,
                                       degree_reasons, describe, host_reasons, optimizer_reasons, strategy_reasons,
                                       suggestions_for)
from fulltune.planning.search import (Candidate, configured_for, configured_request, configured_settings,
                                      divisors, fits_budget, host_budget_for, make_candidate, per_process,
                                      staged_search)
from fulltune.planning.step_time import host_step, step_seconds
from fulltune.planning.strategy import host_parameters

__all__ = ["configured_settings", "plan_memory", "replan_after_oom", "step_seconds", "trace_is_cheap"]


def plan_memory(config: Any, request: PlanRequest, trace: bool | None = False) -> MemoryPlan:
    """Plan the settings of a run so that one training step fits `request.budget_bytes`.

    With no budget, the configured settings run as they are (fits=True). Otherwise every
    combination of the auto fields is estimated; the fastest one whose `device_bytes` plus the
    estimate's uncertainty for its kind of configuration (`uncertainty.py`) fits in budget ×
    (1 − headroom) wins. When none fits, `fits` is False, `settings` is the candidate with the
    smallest footprint and `suggestions` say what would fit (more memory, more GPUs with
    FSDP/ZeRO-3, a shorter max_length).

    `trace=True` also traces the chosen step under FakeTensorMode (`simulate_memory`; one process
    only) and plans for the larger of estimate and trace; when the trace does not fit, the next
    candidate is traced (at most `MAX_TRACES`). `trace=None` traces when that is cheap
    (`trace_is_cheap`). The plan's `uncertainty` says which basis it rests on.
    """
    shape = model_shape(config)
    request = levers_for_model(shape, request)
    configured = configured_for(shape, configured_request(request))
    configured_estimate = _estimate(shape, configured)
    if request.budget_bytes is None:
        return with_evaluation(shape, request, host_budget_for(request), MemoryPlan(
            device=request.device,
            budget_bytes=None,
            fits=True,
            configured_estimate=configured_estimate,
            settings=configured,
            plan_estimate=configured_estimate,
            reasons=(
                "no memory budget given: running the configured settings "
                f"(estimated peak {format_bytes(configured_estimate.peak_bytes)})",
                *optimizer_reasons(shape, configured),
            ),
            smallest_peak_bytes=configured_estimate.peak_bytes,
            estimated_step_seconds=step_seconds(shape, configured),
            uncertainty=make_candidate(shape, configured).uncertainty.to_dict(),
            expected_bytes=configured_estimate.device_bytes,
        ))
    usable = request.usable_bytes
    candidates = staged_search(shape, request, usable)
    reasons: tuple[str, ...] = ()
    if trace or (trace is None and trace_is_cheap(shape, request)):
        candidates, reasons = _traced(config, shape, candidates, usable)
    return with_evaluation(shape, request, host_budget_for(request),
                           _finish(shape, request, usable, configured, configured_estimate, candidates, reasons))


# --- tracing the chosen step ------------------------------------------------------------------


def _widened(c: Candidate, seen: Uncertainty) -> Candidate:
    """An untraced candidate's uncertainty, at least what a trace of this model just showed."""
    if c.uncertainty.basis == "trace" or seen.fraction <= c.uncertainty.fraction:
        return c
    evidence = f"a trace of this model read {seen.fraction:.2%} off its estimate"
    return replace(c, uncertainty=replace(c.uncertainty, bytes=int(seen.fraction * c.estimate.peak_bytes),
                                          fraction=seen.fraction, basis="measured", evidence=evidence))

MAX_TRACES = 3
# A FakeTensor trace costs about this much per decoder layer and forward/backward pass on one core of
# the development CPU (the short schedule runs 2 passes, 3 with accumulation: trace.py).
TRACE_SECONDS_PER_LAYER_PASS = 0.35
# `trace=None` (auto) traces when that costs less than this.
CHEAP_TRACE_SECONDS = 10.0


def trace_is_cheap(shape: ModelShape, request: PlanRequest) -> bool:
    """Whether tracing a step of this model costs under `CHEAP_TRACE_SECONDS` (one process only)."""
    if not (request.dims.alone or request.dims.auto_strategy) or request.num_processes != 1:
        return False
    return shape.num_layers * 3 * TRACE_SECONDS_PER_LAYER_PASS <= CHEAP_TRACE_SECONDS


# A trace of the same step of the same model reads the same peak: kept for the process's life, so that planning
# again (autotune's plan, an OOM replan, `plan` before `run` in one process) does not trace it again, and in the
# machine's cache (`trace.stored_peak`: ~/.cache/fulltune/traces), so that another process does not either.
_TRACED_PEAKS: dict[tuple[Any, ...], int] = {}


def traced_peak(config: Any, settings: Settings) -> int:
    """MemTracker's peak of `settings`' step of `config` under FakeTensorMode (`trace.simulate_memory`)."""
    from fulltune.planning import trace

    config_json = config.to_json_string(use_diff=False)
    key = (trace.simulate_memory, config_json, settings)
    if key not in _TRACED_PEAKS:
        stored, peak = (trace.stored_peak(config_json, settings) if trace.simulate_memory is trace.TRACE_FUNCTION
                        else (None, None))
        if peak is None:
            peak = trace.simulate_memory(config, settings).peak_bytes
            if stored is not None:
                trace.keep_peak(stored, peak)
        _TRACED_PEAKS[key] = peak
    return _TRACED_PEAKS[key]


def _traced(config: Any, shape: ModelShape, candidates: list[Candidate], usable: int
            ) -> tuple[list[Candidate], tuple[str, ...]]:
    """Trace the fastest fitting candidate; while the larger of estimate and trace does not fit, the next."""
    candidates = list(candidates)
    reasons = []
    for _ in range(MAX_TRACES):
        fitting = sorted((c for c in candidates if fits_budget(c, usable)),
                         key=lambda c: (c.seconds, c.settings.gradient_checkpointing, -c.settings.micro_batch_size))
        if not fitting or fitting[0].uncertainty.basis == "trace":
            break
        chosen = fitting[0]
        if not chosen.settings.dims.alone or chosen.settings.num_processes != 1:
            reasons.append("not traced: the trace runs one process; the estimate's measured uncertainty applies")
            break
        peak = traced_peak(config, chosen.settings)
        uncertainty = traced_uncertainty(shape, chosen.settings, chosen.estimate.peak_bytes, peak)
        traced = replace(chosen, uncertainty=uncertainty)
        candidates = [traced if c is chosen else _widened(c, uncertainty) for c in candidates]
        reasons.append(
            f"traced {describe(chosen.settings)}: peak {format_bytes(peak)} against the estimate's "
            f"{format_bytes(chosen.estimate.peak_bytes)}; planning for the larger"
            + ("" if fits_budget(traced, usable) else f" ({format_bytes(traced.planned_bytes)}: does not fit)")
        )
    return candidates, tuple(reasons)


def levers_for_model(shape: ModelShape, request: PlanRequest) -> PlanRequest:
    """`request` as each lever can run on this model (its record's `for_model`: an `auto` turned off where the lever
    converts nothing of it).

    Raises:
        MemoryConfigError: a lever set on that this model cannot run, naming its field.
    """
    for lever in levers.TABLE:
        if lever.for_model is not None:
            request = lever.for_model(shape, request)
    return request


def _finish(
    shape: ModelShape,
    request: PlanRequest,
    usable: int,
    configured: Settings,
    configured_estimate: MemoryEstimate,
    candidates: list[Candidate],
    extra_reasons: tuple[str, ...] = (),
) -> MemoryPlan:
    budget = request.budget_bytes
    assert budget is not None
    fitting = sorted(
        (c for c in candidates if fits_budget(c, usable)),
        key=lambda c: (c.seconds, c.settings.gradient_checkpointing, -c.settings.micro_batch_size),
    )
    smallest = min(candidates, key=lambda c: (not c.host_fits, c.planned_bytes, c.seconds))
    fits = bool(fitting)
    chosen = fitting[0] if fits else smallest
    reasons = [
        f"budget {format_bytes(budget)} per {request.device} device; planning for {format_bytes(usable)} "
        f"({request.headroom:.0%} headroom)",
        *request.notes,
        *((request.host_memory_assumed,) if request.host_memory_assumed else ()),
        *extra_reasons,
    ]
    reasons.append(configured_reason(configured, configured_estimate, usable))
    reasons.extend(change_reasons(shape, configured, chosen, usable))
    reasons.extend(optimizer_reasons(shape, chosen.settings))
    # Where the parameters live in host RAM: the step's terms, for the reasons and `plan --json`.
    host = host_step(shape, chosen.settings) if host_parameters(chosen.settings) else None
    reasons.extend(strategy_reasons(request, candidates, chosen, usable, host))
    reasons.extend(degree_reasons(shape, replace(request, strategy=chosen.settings.strategy), candidates, chosen,
                                  usable))
    reasons.extend(pipeline_reasons(shape, request, candidates, chosen, usable))
    reasons.extend(host_reasons(request, candidates, chosen, usable))
    reasons.extend(checkpoint_reasons(shape, chosen))
    reasons.extend(line for lever in levers.TABLE if lever.reasons
                   for line in lever.reasons(shape, request, chosen.settings))
    suggestions: tuple[str, ...] = ()
    if not fits:
        reasons.append(
            f"nothing fits: the smallest configuration ({describe(chosen.settings)}) needs "
            f"{format_bytes(chosen.expected_bytes)} ± {format_bytes(chosen.uncertainty.bytes)}, "
            f"{format_bytes(chosen.planned_bytes - usable)} over budget with that uncertainty"
        )
        suggestions = suggestions_for(shape, request, chosen)
    alternatives = alternatives_for(candidates, fitting, chosen, usable)
    pipeline = pipeline_advice(shape, request, chosen.settings, usable, chosen.seconds, fits) \
        if needs_advice(fits, chosen.settings) else None
    return MemoryPlan(
        device=request.device,
        budget_bytes=budget,
        fits=fits,
        configured_estimate=configured_estimate,
        settings=chosen.settings,
        plan_estimate=chosen.estimate,
        alternatives=alternatives,
        reasons=tuple(reasons),
        smallest_peak_bytes=smallest.estimate.peak_bytes,
        suggestions=suggestions,
        usable_bytes=usable,
        estimated_step_seconds=chosen.seconds,
        uncertainty=chosen.uncertainty.to_dict(),
        expected_bytes=chosen.expected_bytes,
        pipeline_parallel=pipeline,
        host_step=host,
    )


def replan_after_oom(
    config: Any, request: PlanRequest, previous: Settings, observed_peak_bytes: int | None
) -> MemoryPlan:
    """A new plan after `previous` ran out of memory: same effective batch, smaller footprint.

    The overshoot (observed peak over the estimate, or 15% when unknown) tightens the budget;
    the micro-batch shrinks to the largest divisor below the previous one that fits (more
    accumulation); at micro-batch 1, more layers are checkpointed. Fields the user fixed other
    than micro-batch/accumulation stay fixed; those two must change after an OOM.
    """
    shape = model_shape(config)
    if request.dims.auto_strategy or request.pipeline_parallel is None:  # the strategy the run was planned with stays
        request = replace(request, strategy=previous.strategy)
    # An auto degree: the one the run was planned with stays (its processes are set).
    request = replace(request, **{name: getattr(previous, name) for name, value in degrees.values(request).items()
                                  if value is None})
    previous_estimate = _estimate(shape, previous)
    if observed_peak_bytes is not None and observed_peak_bytes > 0:
        ratio = max(observed_peak_bytes / max(previous_estimate.device_bytes, 1), 1.05)
    else:
        ratio = 1.15
    budget = request.budget_bytes or previous_estimate.device_bytes
    tightened = max(int(budget / ratio), 1)
    relaxed = replace(request, budget_bytes=tightened, micro_batch_size=None, gradient_accumulation_steps=None)
    usable = usable_bytes(tightened, request.headroom)
    per = per_process(request)
    smaller = [m for m in divisors(per) if m < previous.micro_batch_size]
    reason = (
        f"out of memory with {describe(previous)}: the estimate was {format_bytes(previous_estimate.device_bytes)}"
        + (f", observed {format_bytes(observed_peak_bytes)}" if observed_peak_bytes else "")
        + f"; planning for {format_bytes(tightened)} (budget ÷ {ratio:.2f})"
    )
    if smaller:
        candidates = staged_search(shape, relaxed, usable, micros=smaller)
    else:
        fixed = replace(relaxed, gradient_checkpointing=None) if request.gradient_checkpointing is None else relaxed
        floor = min(previous.gradient_checkpointing + max(1, shape.num_layers // 4), shape.num_layers)
        candidates = staged_search(shape, fixed, usable, micros=[1], min_checkpointing=floor)
        if request.gradient_checkpointing is not None:
            forced = replace(previous, gradient_checkpointing=floor)
            candidates.append(make_candidate(shape, forced))
    configured = configured_for(shape, request)
    plan = _finish(shape, relaxed, usable, configured, _estimate(shape, configured), candidates, (reason,))
    return replace(plan, budget_bytes=request.budget_bytes)
