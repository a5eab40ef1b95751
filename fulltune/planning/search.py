"""The planner's search: the settings a request leaves on auto, crossed and estimated, each a `Candidate` with
its device and host bytes, the estimate's uncertainty and its step time (`step_time.step_seconds`).

The search keeps the effective batch (micro_batch_size × gradient_accumulation_steps × data-parallel processes),
turns gradient checkpointing on for as few layers as fit (a binary search: memory falls with each layer), and
opens the memory levers one at a time, cheapest first, until something fits (`staged_search`); with
`strategy` or `tensor_parallel` auto it searches every strategy and degree the lever table allows.
"""

from __future__ import annotations

import contextvars
import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from fulltune import degrees
from fulltune import levers as lever_table
from fulltune.memory.budget import host_ram
from fulltune.memory.errors import MemoryConfigError
from fulltune.memory.estimate import _estimate
from fulltune.memory.process import node_host_bytes
from fulltune.memory.shapes import ModelShape, model_shape
from fulltune.memory.types import LEVERS, MemoryEstimate, PlanRequest, Settings
from fulltune.memory.uncertainty import Uncertainty, estimate_uncertainty
from fulltune.optimizers import OPTIMIZER_TABLE
from fulltune.planning.step_time import step_seconds
from fulltune.planning.strategy import naive_strategy, strategy_choices



@dataclass(frozen=True)
class Candidate:
    settings: Settings
    estimate: MemoryEstimate
    seconds: float
    uncertainty: Uncertainty
    host_budget: int | None = None  # host RAM the levers may use; None: no limit
    # Several processes: one machine's host RAM (`process.node_host_bytes`); the estimate's host_bytes is then
    # its total.
    host_parts: dict[str, int] | None = None

    @property
    def host_fits(self) -> bool:
        """The levers' host RAM fits `budget.host_memory` (on a CPU device it is inside the device bytes)."""
        if self.host_budget is None or self.settings.device == "cpu":
            return True
        return self.estimate.host_bytes <= self.host_budget

    @property
    def expected_bytes(self) -> int:
        """Device bytes of the larger of estimate and trace (the estimate where not traced)."""
        traced = self.uncertainty.traced_peak_bytes
        if traced is None or traced <= self.estimate.peak_bytes:
            return self.estimate.device_bytes
        # The traced step with the estimate's own overhead; the process's other phases as estimated.
        return max(self.estimate.device_bytes, traced + self.estimate.step_device_bytes - self.estimate.peak_bytes)

    @property
    def planned_bytes(self) -> int:
        """What must fit: expected bytes plus the uncertainty, unless this very step was traced."""
        margin = 0 if self.uncertainty.basis == "trace" else self.uncertainty.bytes
        return self.expected_bytes + margin


def fits_budget(c: Candidate, usable: int) -> bool:
    return c.planned_bytes <= usable and c.host_fits


def per_process(request: PlanRequest) -> int:
    return request.dims.per_process(request.effective_batch_size)


def device_word(device: str) -> str:
    """What one process's device is called in a plan's reasons: a GPU on cuda, a process on a CPU."""
    return "GPU" if device == "cuda" else "process"


def divisors(n: int) -> list[int]:
    """The divisors of `n`, largest first (micro-batches, tensor-parallel degrees, pipeline micro-batches)."""
    return sorted({d for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)


def _fixed_checkpointing(value: bool | int | None, num_layers: int) -> int | None:
    if value is None:
        return None
    if value is True:
        return num_layers
    if value is False:
        return 0
    return min(int(value), num_layers)


def _default_precision(request: PlanRequest) -> str:
    if request.device == "cuda" and request.bf16_supported:
        return "bf16"
    return "no"


def configured_settings(config: Any, request: PlanRequest) -> Settings:
    """The settings as configured, auto fields at their naive defaults.

    micro-batch: the whole per-process batch in one pass (accumulation 1), or what the fixed
    accumulation leaves; checkpointing off; mixed precision bf16 on a GPU that supports it, else
    fp32; optimizer AdamW; tensor parallel 1.
    """
    return configured_for(model_shape(config), configured_request(request))


def configured_request(request: PlanRequest) -> PlanRequest:
    """The request with tensor_parallel auto at its naive default, 1 (FSDP alone), and strategy auto at its
    own (`strategy.naive_strategy`), as the other auto fields."""
    if request.pipeline_parallel is None:  # auto: data parallel (or one process), else every process a stage
        stages = request.num_processes if request.dims.alone else 1
        request = as_pipeline(request, stages)
    request = naive_strategy(request)
    if request.context_parallel is None:  # auto: none, as the other auto degrees
        request = replace(request, context_parallel=1)
    return replace(request, tensor_parallel=1) if request.tensor_parallel is None else request


def configured_for(shape: ModelShape, request: PlanRequest) -> Settings:
    per = per_process(request)
    if request.micro_batch_size is not None:
        micro = request.micro_batch_size
    elif request.gradient_accumulation_steps is not None:
        micro = per // request.gradient_accumulation_steps
    elif request.dims.pp_enabled and per % request.pipeline_parallel == 0:
        micro = per // request.pipeline_parallel  # a micro-batch per stage: the fewest 1F1B runs
    else:
        micro = per
    checkpointing = _fixed_checkpointing(request.gradient_checkpointing, shape.num_layers)
    levers = {name: bool(value) for name, value in lever_table.decided(request).items()}  # auto levers start off
    if checkpointing is None:
        # Checkpointing starts off, unless offloaded activations (which are checkpointed layers' inputs) are asked for.
        checkpointing = shape.num_layers if levers["offload_activations"] else 0
    return _settings(request, micro, checkpointing, request.mixed_precision or _default_precision(request),
                     request.optimizer or "adamw", levers)


def _settings(request: PlanRequest, micro: int, checkpointing: int, precision: str, optimizer: str,
              levers: dict[str, bool] | None = None) -> Settings:
    """Settings with the planner's choices filled in and everything else as the request fixes it."""
    return Settings(
        micro_batch_size=micro,
        seq_len=request.seq_len,
        gradient_accumulation_steps=per_process(request) // micro,
        gradient_checkpointing=checkpointing,
        mixed_precision=precision,
        optimizer=optimizer,
        attn_implementation=request.attn_implementation,
        device=request.device,
        strategy=request.strategy,
        num_processes=request.num_processes,
        **degrees.values(request),
        pipeline_schedule=request.pipeline_schedule,
        attention_mask=request.attention_mask,
        document_length=request.document_length,
        target_fraction=request.target_fraction,
        checkpoint_async=request.checkpoint_async,
        **lever_table.options_of(request),
        **(levers or {}),
    )


def _options(shape: ModelShape, request: PlanRequest) -> tuple[list[int], list[str], list[str], int | None]:
    per = per_process(request)
    if request.micro_batch_size is not None:
        micros = [request.micro_batch_size]
    elif request.gradient_accumulation_steps is not None:
        micros = [per // request.gradient_accumulation_steps]
    else:
        micros = divisors(per)
    if request.mixed_precision is not None:
        precisions = [request.mixed_precision]
    elif request.device == "cuda":
        precisions = ["bf16", "no"] if request.bf16_supported else ["fp16", "no"]
    else:
        precisions = ["no", "bf16"]
    optimizers = [request.optimizer] if request.optimizer is not None else [
        r.name for r in OPTIMIZER_TABLE if r.auto == "always"]
    return micros, precisions, optimizers, _fixed_checkpointing(request.gradient_checkpointing, shape.num_layers)


def _lever_sets(request: PlanRequest, stage: int) -> list[dict[str, bool]]:
    """The lever combinations of search stage `stage`: the auto levers among the first `stage` of
    `LEVERS` (cheapest first) on or off, the later auto ones off, the fixed ones as fixed. The lever table
    (fulltune/levers.py) is applied once per choice, with the optimizer, precision and accumulation it goes
    with (`_allowed_choice`); a combination it refuses whatever those are is refused there too."""
    levers = lever_table.decided(request)
    fixed = {name: bool(value) for name, value in levers.items()}
    auto = [name for name in LEVERS[:stage] if levers[name] is None and _may_choose(request, name)]
    return [{**fixed, **dict(zip(auto, values))} for values in itertools.product((False, True), repeat=len(auto))]


def _combination(request: PlanRequest) -> lever_table.Combination:
    """The request as the lever table reads it: auto fields still None."""
    return lever_table.from_settings(request, bf16_supported=request.bf16_supported if request.device == "cuda"
                                     else None)


def _may_choose(request: PlanRequest, lever: str) -> bool:
    """Whether turning an auto lever on can save memory for this request (whether the lever table allows it
    is `_allowed_choice`'s)."""
    # On a CPU device host RAM is the device memory: a lever that moves tensors to the host saves nothing there
    # and costs copies.
    return not (lever_table.BY_NAME[lever].slow and request.device != "cuda")


def _allowed_choice(request: PlanRequest, micro: int, checkpointing: int | None, precision: str, optimizer: str,
                    levers: dict[str, bool]) -> bool:
    """A choice of the search that the lever table allows (checkpointing None: still to be chosen)."""
    chosen = replace(_combination(request), levers=levers, optimizer=optimizer, mixed_precision=precision,
                     gradient_accumulation_steps=per_process(request) // micro,
                     gradient_checkpointing=checkpointing)
    return not lever_table.problems(chosen)


def _lever_options(shape: ModelShape, request: PlanRequest, levers: dict[str, bool], micros: list[int],
                   precisions: list[str], optimizers: list[str], fixed_k: int | None, stage: int
                   ) -> tuple[list[int], list[str], list[str]] | None:
    """The micro-batches, precisions and optimizers that go with one lever combination (None: it makes no sense)."""
    if levers["optimizer_in_backward"]:
        # No accumulation across micro-batches: the effective batch is kept by one larger micro-batch.
        micros = [m for m in micros if m == per_process(request)]
    if levers["pure_bf16"]:
        precisions = ["bf16"] if request.mixed_precision is None else precisions
    if stage > 0 and request.optimizer is None:  # the optimizers `auto` tries once the levers open, if installed
        optimizers = [*optimizers, *(r.name for r in OPTIMIZER_TABLE
                                     if r.auto == "levers" and r.name not in optimizers and r.installed())]
    return (micros, precisions, optimizers) if micros else None


# The candidates of the search under way (`staged_search`): each lever stage repeats the lever sets of the one
# before it, and the strategies and degrees meet the same settings again, so a 70B plan that weighs ~8,600
# candidates estimates ~3,800 distinct ones. Scoped to one search: nothing outlives it.
_SEARCHED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fulltune_searched", default=None)


def make_candidate(shape: ModelShape, settings: Settings, host_budget: int | None = None) -> Candidate:
    searched = _SEARCHED.get()
    key = (shape, settings, host_budget)
    if searched is not None and key in searched:
        return searched[key]
    estimate = _estimate(shape, settings)
    uncertainty = estimate_uncertainty(shape, settings, estimate.peak_bytes)
    candidate = Candidate(settings, estimate, step_seconds(shape, settings), uncertainty, host_budget)
    if searched is not None:
        searched[key] = candidate
    return candidate


def _planned(shape: ModelShape, settings: Settings) -> int:
    return make_candidate(shape, settings).planned_bytes


def _least_checkpointing(shape: ModelShape, base: Settings, usable: int, lowest: int = 0) -> Candidate:
    """The candidate with the fewest checkpointed layers (>= lowest) that fits, else all layers.

    Memory falls monotonically with each layer checkpointed, so a binary search finds it.
    """
    L = shape.num_layers
    top = make_candidate(shape, replace(base, gradient_checkpointing=L))
    if top.planned_bytes > usable:
        # All layers checkpointed has its own (larger) uncertainty: all but one may still fit.
        below = make_candidate(shape, replace(base, gradient_checkpointing=L - 1)) if L - 1 >= max(lowest, 1) else top
        return below if below.planned_bytes <= usable else top
    lo, hi = lowest, L
    while lo < hi:
        mid = (lo + hi) // 2
        if _planned(shape, replace(base, gradient_checkpointing=mid)) <= usable:
            hi = mid
        else:
            lo = mid + 1
    return make_candidate(shape, replace(base, gradient_checkpointing=lo))


def _search(
    shape: ModelShape,
    request: PlanRequest,
    usable: int,
    micros: list[int] | None = None,
    min_checkpointing: int = 0,
    stage: int = 0,
) -> list[Candidate]:
    """One candidate per (micro-batch, precision, optimizer, lever combination of `stage`): fewest
    checkpointed layers that fit."""
    default_micros, precisions, optimizers, fixed_k = _options(shape, request)
    micros = default_micros if micros is None else micros
    host_budget = host_budget_for(request)
    out = []
    for levers in _lever_sets(request, stage):
        options = _lever_options(shape, request, levers, micros, precisions, optimizers, fixed_k, stage)
        if options is None:
            continue
        for micro in options[0]:
            for precision in options[1]:
                for optimizer in options[2]:
                    if not _allowed_choice(request, micro, fixed_k, precision, optimizer, levers):
                        continue
                    # Offloaded activations are checkpointed layers' inputs: at least one layer is checkpointed.
                    lowest = max(min_checkpointing, 1) if levers["offload_activations"] else min_checkpointing
                    base = _settings(request, micro, fixed_k if fixed_k is not None else lowest, precision,
                                     optimizer, levers)
                    if fixed_k is not None:
                        c = make_candidate(shape, base, host_budget)
                    else:
                        c = _least_checkpointing(shape, base, usable, lowest)
                    out.append(_per_machine(shape, c, host_budget, _ranks_per_machine(request)))
    return out


def _ranks_per_machine(request: PlanRequest) -> int:
    return request.dims.per_machine(request.num_machines)


def _per_machine(shape: ModelShape, c: Candidate, host_budget: int | None, ranks: int) -> Candidate:
    """`c` with its host RAM as one machine holds it (`budget.host_memory` is per machine): every rank's
    offloaded tensors and, under FSDP, rank 0's gathered export (`process.node_host_bytes`)."""
    if c.settings.dims.alone or c.settings.device == "cpu":
        return replace(c, host_budget=host_budget)
    node = node_host_bytes(shape, c.settings, c.estimate.host_bytes, ranks)
    return replace(c, host_budget=host_budget, estimate=replace(c.estimate, host_bytes=node["total"]),
                   host_parts=node)


def staged_search(shape: ModelShape, request: PlanRequest, usable: int, micros: list[int] | None = None,
                   min_checkpointing: int = 0) -> list[Candidate]:
    """Search without the auto levers first (today's choices where they fit), then allow them one more at a
    time, cheapest first (`LEVERS`), until something fits; every candidate seen is returned. With
    `strategy` auto, that search for every strategy `strategy.strategy_choices` offers; with
    `tensor_parallel` or `context_parallel` auto (None), for every degree `tensor_parallel_degrees` or
    `context_parallel_degrees` allows."""
    if _SEARCHED.get() is None:  # the outermost call: one memo of candidates for the whole search
        token = _SEARCHED.set({})
        try:
            return staged_search(shape, request, usable, micros, min_checkpointing)
        finally:
            _SEARCHED.reset(token)
    if request.pipeline_parallel is None:
        degrees, _ = pipeline_degrees(shape, request)
        if not degrees:
            _, refused = pipeline_degrees(shape, request)
            raise MemoryConfigError("distributed.pipeline_parallel: auto has nothing to choose from: " + "; ".join(
                f"{degree} stage{'s' if degree > 1 else ''}: {why}" for degree, why in sorted(refused.items())))
        return [c for degree in degrees
                for c in staged_search(shape, as_pipeline(request, degree), usable, micros, min_checkpointing)]
    if request.dims.auto_strategy:
        return [c for strategy in allowed_strategies(request)
                for c in staged_search(shape, replace(request, strategy=strategy), usable, micros,
                                        min_checkpointing)]
    if request.tensor_parallel is None:
        degrees, _ = tensor_parallel_degrees(shape, request)
        return [c for degree in degrees
                for c in staged_search(shape, replace(request, tensor_parallel=degree), usable, micros,
                                        min_checkpointing)]
    if request.context_parallel is None:
        degrees, _ = context_parallel_degrees(shape, request)
        return [c for degree in degrees
                for c in staged_search(shape, replace(request, context_parallel=degree), usable, micros,
                                        min_checkpointing)]
    if request.dims.cp_enabled:
        context_parallel_degrees(shape, request)  # a fixed degree that cannot attend on this device is refused
    return _staged_levers(shape, request, usable, micros, min_checkpointing)


def _staged_levers(shape: ModelShape, request: PlanRequest, usable: int, micros: list[int] | None,
                   min_checkpointing: int) -> list[Candidate]:
    """`staged_search` of one strategy and one set of degrees: the auto levers opened one at a time."""
    out: list[Candidate] = []
    for stage in range(len(LEVERS) + 1):
        if stage > 0 and lever_table.decided(request)[LEVERS[stage - 1]] is not None:
            continue  # a fixed lever opens no new stage
        out.extend(_search(shape, request, usable, micros, min_checkpointing, stage))
        if any(fits_budget(c, usable) for c in out):
            break
    return out


def tensor_parallel_degrees(shape: ModelShape, request: PlanRequest) -> tuple[list[int], dict[int, str]]:
    """The tensor-parallel degrees `distributed.tensor_parallel: auto` may choose, and why the other divisors
    of the processes may not: a degree splits the blocks of one machine's processes (parallel.py's "tp" groups
    are consecutive ranks), the heads, key/value heads and MLP width and keeps the effective batch over the
    data-parallel processes (`degrees.ParallelDims`), and breaks no rule of the lever table with the fixed
    fields (`levers.from_settings`). 1 is always among them unless the request fixes another degree."""
    if request.tensor_parallel is not None:
        return [request.tensor_parallel], {}
    degrees, refused = [1], {}
    if not request.dims.fsdp_enabled:
        return degrees, refused
    for degree in sorted(divisors(request.num_processes)):
        if degree == 1:
            continue
        if _ranks_per_machine(request) % degree:
            refused[degree] = f"more than one machine's {_ranks_per_machine(request)} processes"
            continue
        if shape.layout != "llama" or shape.qk_norm:
            refused[degree] = f"{shape.model_type}'s blocks are not split (Llama layout only)"
            continue
        split = request.dims.with_tp(degree).split_problem(shape.heads, shape.kv_heads, shape.intermediate,
                                                           shape.num_layers)
        if split:
            refused[degree] = split
            continue
        try:  # the request checks the batch rule and the lever table's rules for the degree
            candidate = replace(request, tensor_parallel=degree)
        except ValueError as exc:
            refused[degree] = str(exc).split(": ", 1)[-1]
            continue
        found = lever_table.problems(_combination(candidate))
        if found:
            refused[degree] = found[0]
            continue
        degrees.append(degree)
    return degrees, refused


def degree_choices(name: str, shape: ModelShape, request: PlanRequest) -> tuple[list[int], dict[int, str]]:
    """The degrees of `name` (a `DEGREES` name whose kind explains its auto) `auto` may choose, and why the others
    may not (`tensor_parallel_degrees`, `context_parallel_degrees`)."""
    return {"tensor_parallel": tensor_parallel_degrees, "context_parallel": context_parallel_degrees}[name](shape, request)


def over_processes(request: PlanRequest, processes: int) -> dict[str, Any]:
    """The fields that put `request` under FSDP over `processes` processes (what more GPUs would do): no stages; a
    context-parallel degree auto stays auto, a fixed one the processes do not divide is none."""
    cp = request.context_parallel
    return {"strategy": "fsdp", "num_processes": processes, "pipeline_parallel": 1,
            "context_parallel": cp if cp is None or processes % cp == 0 else 1}


def context_parallel_degrees(shape: ModelShape, request: PlanRequest) -> tuple[list[int], dict[int, str]]:
    """The context-parallel degrees `distributed.context_parallel: auto` may choose, and why the other divisors of
    the processes may not: a degree keeps the effective batch over the data-parallel processes and breaks no rule of
    the lever table with the fixed fields (a strategy that sums the group's gradients, no tensor parallel or
    stages); where it does not divide the attention heads it is ring attention, CUDA only
    (`ParallelDims.context_problem`); each process keeps at least one position of each of its two chunks. 1 is
    always among them unless the request fixes another degree."""
    if request.context_parallel is not None:
        problem = request.dims.context_problem(shape.heads, request.device)
        if problem:
            raise MemoryConfigError(f"distributed.context_parallel: {problem}")
        return [request.context_parallel], {}
    degrees, refused = [1], {}
    for degree in sorted(divisors(request.num_processes)):
        if degree == 1:
            continue
        problem = request.dims.with_cp(degree).context_problem(shape.heads, request.device)
        if problem is None and request.seq_len < 2 * degree:
            problem = f"rows of {request.seq_len} positions cannot give each of {degree} processes two chunks"
        if problem is None:
            try:  # the request checks the batch rule and the lever table's rules for the degree
                candidate = replace(request, context_parallel=degree)
                found = lever_table.problems(_combination(candidate))
                problem = found[0] if found else None
            except ValueError as exc:
                problem = str(exc).split(": ", 1)[-1]
        if problem:
            refused[degree] = problem
        else:
            degrees.append(degree)
    return degrees, refused


def host_budget_for(request: PlanRequest) -> int:
    return request.host_memory_bytes if request.host_memory_bytes is not None else host_ram()


def allowed_strategies(request: PlanRequest) -> list[str]:
    """The strategies `strategy` auto offers (`strategy.strategy_choices`) that the fixed fields allow (the lever
    table: a fixed 8-bit optimizer refuses fsdp)."""
    out = []
    for strategy in strategy_choices(request):
        try:
            replace(request, strategy=strategy)
        except ValueError:
            continue
        out.append(strategy)
    return out


def pipeline_degrees(shape: ModelShape, request: PlanRequest) -> tuple[list[int], dict[int, str]]:
    """The numbers of pipeline stages `distributed.pipeline_parallel: auto` may choose, and why the other divisors
    of the processes may not: 1 is data parallel over the processes (a strategy other than none, or one
    process); P > 1 stages are every process a stage (strategy none or auto), or P stages with data parallel
    beside them (strategy ddp or fsdp over num_processes / P replicas), each stage with a decoder layer or more,
    an untied head and no rule of the lever table broken with the fixed fields. Each is the request as `staged_search` searches it."""
    if request.pipeline_parallel is not None:
        return [request.pipeline_parallel], {}
    n = request.num_processes
    degrees, refused = [], {}
    for degree in sorted(divisors(n)):
        if degree == 1:
            if request.dims.alone and n > 1:
                refused[1] = f"strategy none: {n} processes are pipeline stages (data parallel needs ddp, fsdp or auto)"
            else:
                degrees.append(1)
            continue
        why = _stages_problem(shape, request, degree)
        if why:
            refused[degree] = why
        else:
            degrees.append(degree)
    return degrees, refused


def _stages_problem(shape: ModelShape, request: PlanRequest, degree: int) -> str | None:
    """Why `degree` pipeline stages over the request's processes cannot train (None: they can)."""
    if degree < request.num_processes and request.dims.alone:
        return "strategy none: every process is a stage (data parallel beside the stages needs ddp or fsdp)"
    if degree > shape.num_layers:
        return f"{degree} stages need a decoder layer each; the model has {shape.num_layers}"
    if shape.tied:
        return ("the model ties its output head to its input embedding (tie_word_embeddings), which pipeline "
                "stages do not train yet")
    try:
        staged = as_pipeline(request, degree)
    except ValueError as exc:
        return str(exc).split(": ", 1)[-1]
    found = lever_table.problems(_combination(staged))
    return found[0] if found else None


def as_pipeline(request: PlanRequest, degree: int) -> PlanRequest:
    """The request with `degree` pipeline stages: the request's own strategy for 1 and for stages with data
    parallel beside them (ddp, fsdp, or auto: the search then tries both over each stage's processes), strategy
    none where every process is a stage."""
    alone = degree > 1 and (request.dims.alone or degree == request.num_processes)
    return replace(request, pipeline_parallel=degree, strategy="none" if alone else request.strategy)


def best_by(candidates: list[Candidate], key: Any, usable: int) -> dict[Any, Candidate]:
    """Each `key(candidate)`'s best candidate: the fastest that fits, else the smallest."""
    def rank(c: Candidate) -> tuple[bool, float]:
        fits = fits_budget(c, usable)
        return not fits, c.seconds if fits else c.planned_bytes

    best: dict[Any, Candidate] = {}
    for c in candidates:
        if key(c) not in best or rank(c) < rank(best[key(c)]):
            best[key(c)] = c
    return best
