"""What a plan says: why each setting changed from the configured one, what each lever and each parallel
degree costs, why offloading was refused, and — when nothing fits — what would.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fulltune import levers
from fulltune.degrees import DEGREES
from fulltune.memory import parallelism
from fulltune.memory.estimate import _estimate
from fulltune.memory.process import CHECKPOINT, checkpoint_staging_bytes
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import MemoryEstimate, PlanRequest, Settings
from fulltune.memory.units import format_bytes, format_seconds
from fulltune.optimizers import COMPENSATIONS, ParamShapes, compensation_of, optimizer
from fulltune.planning.search import (Candidate, best_by, degree_choices, device_word, fits_budget, over_processes,
                                      staged_search)
from fulltune.planning.step_time import LINK_BYTES_PER_S, kind_seconds, step_seconds
from fulltune.planning.strategy import host_parameters, strategy_choices


def describe(settings: Settings) -> str:
    parts = [f"micro-batch {settings.micro_batch_size} × accumulation {settings.gradient_accumulation_steps}"]
    parts.extend(parallelism.describe(settings))  # each kind's words (tensor parallel T, P pipeline stages)
    parts.append(f"checkpointing {settings.gradient_checkpointing} layers")
    parts.append(f"precision {settings.mixed_precision}")
    parts.append(settings.optimizer)
    parts.extend(name for name, on in settings.levers().items() if on)
    return ", ".join(parts)


def alternative_entry(c: Candidate, why: str) -> dict[str, Any]:
    return {
        **c.settings.choices(),
        **{d.name: getattr(c.settings, d.name) for d in DEGREES if d.always_listed},
        "strategy": c.settings.strategy,
        **{d.name: getattr(c.settings, d.name) for d in DEGREES if not d.always_listed and d.on(c.settings.dims)},
        "peak_bytes": c.estimate.peak_bytes,
        "device_bytes": c.estimate.device_bytes,
        "uncertainty_bytes": c.uncertainty.bytes,
        "estimated_step_seconds": round(c.seconds, 6),
        "rejected_because": why,
    }



def change_reasons(shape: ModelShape, configured: Settings, chosen: Candidate, usable: int) -> list[str]:
    out = []
    s = chosen.settings
    if s == configured:
        return out
    if s.micro_batch_size != configured.micro_batch_size:
        out.append(
            f"micro-batch {configured.micro_batch_size} → {s.micro_batch_size} with gradient accumulation "
            f"{configured.gradient_accumulation_steps} → {s.gradient_accumulation_steps}: the effective batch "
            f"stays {s.micro_batch_size * s.gradient_accumulation_steps * s.dims.dp}"
        )
    if s.mixed_precision != configured.mixed_precision:
        out.append(f"mixed precision {configured.mixed_precision} → {s.mixed_precision}")
    if s.optimizer != configured.optimizer:
        other = _estimate(shape, replace(s, optimizer=configured.optimizer))
        if s.offload_optimizer:  # the states live in host RAM: what the host holds changes
            where, before, after = "host RAM", other.host_bytes, chosen.estimate.host_bytes
        else:
            where = "optimizer states"
            before, after = other.breakdown["optimizer_states"], chosen.estimate.breakdown["optimizer_states"]
        out.append(f"optimizer {configured.optimizer} → {s.optimizer}: {where} {format_bytes(before)} → "
                   f"{format_bytes(after)}")
    out.extend(_lever_reasons(shape, configured, chosen))
    if s.gradient_checkpointing and s.gradient_checkpointing != configured.gradient_checkpointing:
        k = configured.gradient_checkpointing
        # Without checkpointed layers there are no layer inputs to offload either.
        without = _estimate(shape, replace(s, gradient_checkpointing=k, offload_activations=s.offload_activations and k > 0))
        excess = without.device_bytes - usable
        tail = (
            f"{format_bytes(excess)} over budget without it"
            if excess > 0
            else f"{format_bytes(without.device_bytes)} without it"
        )
        out.append(f"gradient checkpointing on {s.gradient_checkpointing} of {shape.num_layers} layers: {tail}")
    return out


def degree_reasons(shape: ModelShape, request: PlanRequest, candidates: list[Candidate], chosen: Candidate,
                   usable: int) -> list[str]:
    """For each degree left auto whose kind explains it (`parallelism.BY_DEGREE`: tensor parallel, context parallel;
    the stages are `planning.pipeline.pipeline_reasons`'), in `DEGREES`' order: the degree chosen and what it costs
    ("context parallel 4 (…, Ulysses, distributed.context_parallel auto): 71.2 GiB per GPU, 38 s/step, of which …
    its all-to-alls"), and each other degree's best candidate (the fastest that fits, else the smallest) or why it
    was not tried."""
    out = []
    for degree in DEGREES:
        kind = parallelism.BY_DEGREE.get(degree.name)
        if kind is None or getattr(request, degree.name) is not None:
            continue
        best = best_by(candidates, lambda c, name=degree.name: getattr(c.settings, name), usable)
        s = chosen.settings
        N = getattr(s, degree.name)
        if N > 1:
            link = LINK_BYTES_PER_S[kind.name][s.device]
            head = (f"{degree.words} {N} ({s.dims.dp} data-parallel × {N}{kind.chosen_words(shape, s)}, {degree.key} "
                    f"auto): {format_bytes(chosen.expected_bytes)} per {device_word(s.device)}, "
                    f"{format_seconds(chosen.seconds, 's/step')}, of which "
                    f"{format_seconds(kind_seconds(shape, s, kind))} are its {kind.traffic_words(shape, s, link)}")
        else:
            head = f"{degree.words} 1 ({degree.key} auto): {kind.alone_words(request)}"
        _, refused = degree_choices(degree.name, shape, request)
        out.append(head + _other_degrees(best, N, usable, refused))
    return out


def _other_degrees(best: dict[int, Candidate], chosen: int, usable: int, refused: dict[int, str]) -> str:
    """"; 2 is slower (…); 4 does not fit (…); 8 not tried (…)": each other degree's best candidate, or why it was
    not tried ("" when there is none)."""
    others = []
    for degree, c in sorted(best.items()):
        if degree == chosen:
            continue
        if fits_budget(c, usable):
            others.append(f"{degree} is slower ({format_seconds(c.seconds, 's/step')})")
        else:
            others.append(f"{degree} does not fit ({format_bytes(c.expected_bytes)} ± {format_bytes(c.uncertainty.bytes)})")
    others += [f"{degree} not tried ({why})" for degree, why in sorted(refused.items())]
    return "; " + "; ".join(others) if others else ""


def lever_trade(shape: ModelShape, settings: Settings) -> dict[str, dict[str, float]]:
    """For each lever on in `settings`: the device bytes it saves and the step time it adds, against the
    same settings with that lever alone off (what `fulltune plan` explains)."""
    out = {}
    on = _estimate(shape, settings)
    seconds = step_seconds(shape, settings)
    for name, value in settings.levers().items():
        if not value:
            continue
        off = replace(settings, **{name: False})
        out[name] = {"saved_bytes": _estimate(shape, off).device_bytes - on.device_bytes,
                     "seconds": seconds - step_seconds(shape, off)}
    return out


def optimizer_reasons(shape: ModelShape, settings: Settings) -> list[str]:
    """What the optimizer that runs does beside AdamW's usual: the split of an optimizer that steps the decoder
    layers' matrices apart (Muon), and the compensation pure bf16 weights get."""
    return _matrices_reasons(shape, settings) + compensation_reasons(shape, settings)


def _matrices_reasons(shape: ModelShape, settings: Settings) -> list[str]:
    """The split of an optimizer that steps the decoder layers' 2-D matrices apart (its record's `matrices`):
    each part's parameters and states per process, and the FLOPs of its own matmuls."""
    from math import prod

    from fulltune.memory.timeline import shares

    record = optimizer(settings.optimizer)
    if not record.matrices:
        return []
    params, share = shape.optimizer_shapes, shares(settings).states
    wb, compensation = 2 if settings.pure_bf16 else 4, compensation_of(settings)
    parts = []
    matrices = f"the decoder layers' {len(params.matrices)} 2-D matrices"
    for what, part in ((matrices, ParamShapes(matrices=params.matrices)),
                       ("the embeddings, output head, norms and biases", ParamShapes(others=params.others))):
        states = int(record.state_bytes(part, wb, compensation)[0] * share)
        parts.append(f"{what}: {sum(map(prod, part.all)):,} parameters, {format_bytes(states)} of states")
    flops = f"; its own matmuls: {record.step_flops(params):.3g} FLOPs per step, on every process" \
        if record.step_flops is not None else ""
    return [f"optimizer {record.name} ({record.description}): " + "; ".join(parts)
            + f" per {device_word(settings.device)}{flops}"]


def compensation_reasons(shape: ModelShape, settings: Settings) -> list[str]:
    """With pure bf16 weights: the compensation that runs (`train.compensation`, or its optimizer's default under
    `auto`), and what it holds on the device and adds to the step against plain rounding."""
    if not settings.pure_bf16 or (settings.offload_optimizer and not settings.dims.fsdp_enabled):
        return []  # fp32 weights, or fp32 masters on the host: nothing to compensate
    compensation = compensation_of(settings)
    source = "train.compensation" + (" auto" if settings.compensation == "auto" else "")
    line = f"compensation {compensation} ({source}): {COMPENSATIONS[compensation]}"
    if compensation == "none":
        return [line]
    plain = replace(settings, compensation="none")
    extra = _estimate(shape, settings).device_bytes - _estimate(shape, plain).device_bytes
    seconds = step_seconds(shape, settings) - step_seconds(shape, plain)
    cost = f"+{format_seconds(seconds, 's/step')}" if seconds >= 0.0005 else "no measurable step time"
    return [f"{line}; against none (plain rounding): {format_bytes(extra)} of device memory, {cost}"]


def _lever_reasons(shape: ModelShape, configured: Settings, chosen: Candidate) -> list[str]:
    out = []
    trade = lever_trade(shape, chosen.settings)
    for name, t in trade.items():
        if getattr(configured, name):
            continue
        cost = f"+{format_seconds(t['seconds'], 's/step')}" if t["seconds"] >= 0.0005 else "no measurable step time"
        text = levers.BY_NAME[name].sentence(chosen.settings)
        out.append(f"{name}: {text}: saves {format_bytes(t['saved_bytes'])} of device memory, {cost}")
    parts = chosen.host_parts
    if parts is not None and chosen.estimate.host_bytes:
        budget = f" of {format_bytes(chosen.host_budget)} budget.host_memory" if chosen.host_budget else ""
        s = chosen.settings
        what = []
        if parts["shards"]:
            what.append(f"{format_bytes(parts['shards'])} of offloaded shards over its ranks "
                        f"({format_bytes(parts['pinned'])} of them pinned)")
        if parts["export"]:
            what.append(f"the final export streams file by file: {format_bytes(parts['export'])} of gathered tensors")
        offload = " under FSDP's CPU offload (the step on the host)" if s.offload_optimizer else ""
        out.append(f"host RAM per machine: {format_bytes(chosen.estimate.host_bytes)}{budget}{offload}: "
                   + "; ".join(what))
    elif chosen.estimate.host_bytes and chosen.settings.device == "cuda":
        budget = f" of {format_bytes(chosen.host_budget)} budget.host_memory" if chosen.host_budget else ""
        out.append(f"host RAM: {format_bytes(chosen.estimate.host_bytes)}{budget} (offloaded "
                   f"{'optimizer states and masters' if chosen.settings.offload_optimizer else 'tensors'})")
    return out


def checkpoint_reasons(shape: ModelShape, chosen: Candidate) -> list[str]:
    """What a background checkpoint write (`train.checkpoint_async`) holds, and where the plan counts it."""
    s = chosen.settings
    staged = checkpoint_staging_bytes(shape, s)
    if not staged:
        return []
    writers = "each process copies its shards" if s.dims.fsdp_enabled else "the main process copies them"
    if s.device == "cpu":
        where = (f"in the device's memory beside the steps that run while it is written: checkpoint phase "
                 f"{format_bytes(chosen.estimate.phases[CHECKPOINT])}")
    else:
        where = f"in host RAM while the steps go on (host figure {format_bytes(chosen.estimate.host_bytes)})"
    return [f"checkpoint_async: each checkpoint's weights and optimizer states are copied at the step boundary "
            f"({writers}: {format_bytes(staged)}) and written in the background, {where}; the step waits only for "
            "the copy, the final export for the last write"]


def host_reasons(request: PlanRequest, candidates: list[Candidate], chosen: Candidate, usable: int) -> list[str]:
    """Why offloading was not chosen when the host RAM budget refused it."""
    refused = [c for c in candidates if c.planned_bytes <= usable and not c.host_fits]
    if not refused or (chosen.seconds <= min(c.seconds for c in refused) and fits_budget(chosen, usable)):
        return []
    best = min(refused, key=lambda c: c.estimate.host_bytes)
    return [f"offloading would fit the device ({describe(best.settings)}) but needs "
            f"{format_bytes(best.estimate.host_bytes)} of host RAM, over budget.host_memory "
            f"({format_bytes(best.host_budget or 0)}): refused"]


def suggestions_for(shape: ModelShape, request: PlanRequest, smallest: Candidate) -> tuple[str, ...]:
    out = []
    need = smallest.planned_bytes / (1.0 - request.headroom)
    # Every constraint the configuration needs: host RAM too, when it is over budget.host_memory.
    host = "" if smallest.host_fits else (
        f" and budget.host_memory of {format_bytes(smallest.estimate.host_bytes)} per machine (it is "
        f"{format_bytes(smallest.host_budget or 0)})")
    out.append(
        f"a budget of {format_bytes(need)} per device{host} would fit {describe(smallest.settings)} "
        f"(peak {format_bytes(smallest.estimate.peak_bytes)})"
    )
    one_gpu = host_parameter_suggestion(shape, request)
    if one_gpu:
        out.append(one_gpu)
    if request.dims.alone or request.dims.ddp_enabled:
        # Shard over the processes already there first, then over more GPUs.
        counts = sorted({n for n in (2, 4, 8, 16, 32, 64) if n >= request.num_processes} | {request.num_processes})
        for n in counts:
            if n < 2 or request.effective_batch_size % n:
                continue
            sharded = replace(request, **over_processes(request, n), micro_batch_size=None,
                              gradient_accumulation_steps=None, optimizer_in_backward=None, offload_optimizer=None)
            usable = request.usable_bytes or 0
            candidates = [c for c in staged_search(shape, sharded, usable) if fits_budget(c, usable)]
            if candidates:
                best = min(candidates, key=lambda c: c.seconds)
                out.append(
                    f"{n} {device_word(request.device)}s with FSDP full shard (distributed.strategy: fsdp, "
                    f"num_processes: {n}) would fit: {format_bytes(best.estimate.device_bytes)} per "
                    f"{device_word(request.device)}"
                )
                break
    usable = request.usable_bytes or 0
    seq = request.seq_len
    while seq > 64:
        seq //= 2
        shorter = replace(request, seq_len=seq)
        candidates = [c for c in staged_search(shape, shorter, usable) if fits_budget(c, usable)]
        if candidates:
            out.append(f"data.max_length {seq} (instead of {request.seq_len}) would fit on this budget")
            break
    return tuple(out)


def configured_reason(configured: Settings, estimate: MemoryEstimate, usable: int) -> str:
    """Whether the configured settings (auto fields at their naive defaults) fit, and by how much they do not."""
    over = estimate.device_bytes - usable
    if over <= 0:
        return f"the configured settings fit: {format_bytes(estimate.device_bytes)} (peak in {estimate.peak_phase})"
    return (f"the configured settings ({describe(configured)}) need {format_bytes(estimate.device_bytes)}, "
            f"{format_bytes(over)} over budget (peak in {estimate.peak_phase})")


def alternatives_for(candidates: list[Candidate], fitting: list[Candidate], chosen: Candidate, usable: int
                     ) -> list[dict[str, Any]]:
    """The plan's alternatives: the next four that fit (slower), then the three fastest that do not; each
    settings once (the search's stages may reach the same settings twice) and never the chosen ones."""
    out = []
    for c in _distinct(fitting, chosen)[:4]:
        out.append(alternative_entry(c, f"slower: {format_seconds(c.seconds, 's/step')} vs "
                                        f"{format_seconds(chosen.seconds, 's/step')}"))
    over_budget = sorted((c for c in candidates if not fits_budget(c, usable)), key=lambda c: c.seconds)
    for c in _distinct(over_budget, chosen)[:3]:
        out.append(alternative_entry(c, f"does not fit: {format_bytes(c.expected_bytes)} ± "
                                        f"{format_bytes(c.uncertainty.bytes)} > {format_bytes(usable)} usable"))
    return out


def _distinct(candidates: list[Candidate], chosen: Candidate) -> list[Candidate]:
    """`candidates` in order, each settings once, without the chosen settings."""
    out: list[Candidate] = []
    for c in candidates:
        if c.settings != chosen.settings and all(c.settings != kept.settings for kept in out):
            out.append(c)
    return out


def strategy_reasons(request: PlanRequest, candidates: list[Candidate], chosen: Candidate, usable: int,
                     host: dict[str, Any] | None) -> list[str]:
    """With strategy auto: the strategy chosen and each other one's best candidate; where the parameters live
    in host RAM (`host`: `step_time.host_step` of the chosen settings), that line with its device and host
    bytes, what `none` needs and the step-time terms."""
    if not request.dims.auto_strategy or len(strategy_choices(request)) == 1:  # nothing was chosen between
        return []
    best = best_by(candidates, lambda c: c.settings.strategy, usable)
    s = chosen.settings
    others = []
    for name, c in best.items():
        if name == s.strategy:
            continue
        if fits_budget(c, usable):
            verdict = "is slower" if c.seconds > chosen.seconds else "is no faster"
            others.append(f"{name} {verdict} ({format_seconds(c.seconds, 's/step')})")
        else:
            others.append(f"{name} does not fit ({format_bytes(c.expected_bytes)} ± {format_bytes(c.uncertainty.bytes)})")
    out = [f"strategy {s.strategy} (distributed.strategy auto): {format_seconds(chosen.seconds, 's/step')}"
           + ("; " + "; ".join(others) if others else "")]
    if host is not None:
        none = best.get("none")
        need = f"; strategy none needs {format_bytes(none.expected_bytes)}" if none is not None else ""
        out.append(f"parameters in host RAM (FSDP2 CPU offload over one GPU): device "
                   f"{format_bytes(chosen.expected_bytes)}, host {format_bytes(chosen.estimate.host_bytes)}{need}")
        out.extend(step_terms(host, s))
    return out


def step_terms(t: dict[str, Any], settings: Settings) -> list[str]:
    """The step time of parameters in host RAM (`t`: `step_time.host_step`) as the sum of its terms, and each
    constant named as the assumption it is (or the measured correction that scales them:
    fulltune/planning/autotune.py)."""
    penalty, assumed, scale = t["penalty"], t["assumed"], t["measured_correction"]
    exposed_out = t["exposed_pcie_s"] - t["params_in_s"]
    ranked = f" × {penalty:g} ({settings.optimizer} converges slower: a ranking term)" if penalty != 1 else ""
    measured = (f"; the sum is then scaled by × {scale:.3g}, measured by autotune on this kind of device"
                if scale is not None else "")
    return [f"step time {format_seconds(t['seconds'])} = compute {format_seconds(t['compute_s'])}{ranked} + "
            f"parameters in {format_seconds(t['params_in_s'])} (on the compute stream: one process's FSDP2 copies "
            f"each unit in as it computes) + gradients out {format_seconds(max(0.0, exposed_out))} (of "
            f"{format_seconds(t['grads_out_s'])}: the rest hidden behind compute) + host optimizer step "
            f"{format_seconds(t['host_step_s'])}"
            + "".join(f" + {name} {format_seconds(v)}" for name, v in t["levers"].items())
            + f"; about {t['tokens_per_s']:,.0f} tokens/s "
            f"({format_bytes(int(t['pcie_bytes']))} over PCIe per step)",
            f"step-time terms assumed, not measured{measured}: compute at {assumed['flops'] / 1e12:.0f} TFLOP/s, "
            f"PCIe at {assumed['pcie_bytes_per_s'] / 1e9:.0f} GB/s each way, {assumed['offload_overlap']:.0%} of "
            f"compute hides the gradient copies, the host optimizer at "
            f"{assumed['host_optimizer_bytes_per_s'] / 1e9:.3g} GB/s (python -m benchmarks.device_check measures each)"]


def host_parameter_suggestion(shape: ModelShape, request: PlanRequest) -> str | None:
    """For one process under strategy none that does not fit: what fsdp over that process (parameters in host
    RAM where the lever table allows offload) would need, if it fits."""
    if not request.dims.alone or request.num_processes != 1 or request.device != "cuda":
        return None
    usable = request.usable_bytes or 0
    sharded = replace(request, strategy="fsdp")
    try:
        fitting = [c for c in staged_search(shape, sharded, usable) if fits_budget(c, usable)]
    except ValueError:  # the fixed fields break the lever table under fsdp
        return None
    if not fitting:
        return None
    best = min(fitting, key=lambda c: c.seconds)
    where = "parameters in host RAM (FSDP2 CPU offload)" if host_parameters(best.settings) else "FSDP over it"
    return (f"distributed.strategy: fsdp (or auto) on this one GPU would fit with {where}: device "
            f"{format_bytes(best.expected_bytes)}, host {format_bytes(best.estimate.host_bytes)}, "
            f"{format_seconds(best.seconds, 's/step')}")
