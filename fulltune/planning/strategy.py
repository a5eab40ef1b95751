"""`distributed.strategy: auto`: the planner chooses how the processes hold the model.

For one process the choices are `none` (parameters on the device) and `fsdp` over that one process, which with
`train.offload_optimizer` is FSDP2's CPU offload: parameters, gradients and optimizer states in pinned host RAM,
each unit brought to the GPU for its forward and backward (fulltune/runtime/sharding.py). For several processes
they are `ddp` and `fsdp`. Each strategy gets the planner's whole search (levers, micro-batch, checkpointing,
tensor-parallel degrees); the fastest candidate that fits wins, as for `tensor_parallel: auto`. Where two tie
(fsdp over one process without offload holds what `none` holds and takes as long), the first choice, the
strategy without sharding, stays.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fulltune.memory.types import PlanRequest
from fulltune.memory.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from fulltune.memory.shapes import ModelShape
    from fulltune.planning.search import Candidate


def choices(strategy: str, num_processes: int) -> tuple[str, ...]:
    """The strategies `strategy` (auto or fixed) may be for that many processes, the unsharded one first."""
    if strategy != "auto":
        return (strategy,)
    return ("none", "fsdp") if num_processes == 1 else ("ddp", "fsdp")


def strategy_choices(request: PlanRequest) -> tuple[str, ...]:
    """The strategies `auto` may choose for the request's processes, the unsharded one first."""
    return choices(request.strategy, request.num_processes)


def naive_strategy(request: PlanRequest) -> PlanRequest:
    """The request with strategy auto at its naive default (what the configured settings are estimated under):
    the first of `strategy_choices`."""
    return replace(request, strategy=strategy_choices(request)[0]) if request.strategy == "auto" else request


def host_parameters(settings: object) -> bool:
    """The parameters live in host RAM: FSDP2's CPU offload over one process on a GPU."""
    s = settings
    return (s.strategy == "fsdp" and s.offload_optimizer and s.num_processes == 1  # type: ignore[attr-defined]
            and s.device == "cuda")  # type: ignore[attr-defined]


def strategy_reasons(shape: ModelShape, request: PlanRequest, candidates: list[Candidate], chosen: Candidate,
                     usable: int) -> list[str]:
    """With strategy auto: the strategy chosen and each other one's best candidate; where the parameters live
    in host RAM, that line with its device and host bytes, what `none` needs and the step-time terms."""
    from fulltune.planning.reasons import best_by
    from fulltune.planning.search import fits_budget

    if request.strategy != "auto":
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
    if host_parameters(s):
        none = best.get("none")
        need = f"; strategy none needs {format_bytes(none.expected_bytes)}" if none is not None else ""
        out.append(f"parameters in host RAM (FSDP2 CPU offload over one GPU): device "
                   f"{format_bytes(chosen.expected_bytes)}, host {format_bytes(chosen.estimate.host_bytes)}{need}")
        out.extend(step_terms(shape, s))
    return out


def host_step(shape: ModelShape, settings: object) -> dict[str, Any]:
    """A step with the parameters in host RAM, term by term (`step_time.fsdp_offload_terms`, the other levers'
    seconds): `seconds` as the planner ranks it (the optimizer's penalty included, `step_seconds` without a
    measured correction), `wall_s` without that penalty, and the `tokens_per_s` it predicts."""
    from fulltune.planning import step_time as p

    s = settings
    t = p.fsdp_offload_terms(shape, s)  # type: ignore[arg-type]
    penalty = p.OPTIMIZER_PENALTY[s.optimizer]  # type: ignore[attr-defined]
    levers = {name: v for name, v in p.lever_seconds(shape, s).items() if name != "offload_optimizer"}  # type: ignore[arg-type]
    wall = t["compute_s"] + t["exposed_pcie_s"] + t["host_step_s"] + sum(levers.values())
    tokens = s.micro_batch_size * s.gradient_accumulation_steps * s.seq_len * s.num_processes  # type: ignore[attr-defined]
    correction = p.STEP_TIME_CORRECTION.get()
    assumed = {"flops": p.FLOPS[("cuda", s.mixed_precision)], "pcie_bytes_per_s": p.PCIE_BYTES_PER_S,  # type: ignore[attr-defined]
               "offload_overlap": p.OFFLOAD_OVERLAP, "host_optimizer_bytes_per_s": p.HOST_OPTIMIZER_BYTES_PER_S}
    return {**t, "penalty": penalty, "levers": levers, "seconds": wall + t["compute_s"] * (penalty - 1),
            "wall_s": wall, "tokens_per_s": tokens / wall, "assumed": assumed,
            "measured_correction": correction(s) if correction is not None else None}  # type: ignore[arg-type]


def step_terms(shape: ModelShape, settings: object) -> list[str]:
    """The step time of parameters in host RAM as the sum of its terms, and each constant named as the
    assumption it is (or the measured correction that scales them: fulltune/planning/autotune.py)."""
    from fulltune.planning import step_time as p

    s = settings
    t = host_step(shape, s)
    penalty, levers, total = t["penalty"], t["levers"], t["seconds"]
    exposed_out = t["exposed_pcie_s"] - t["params_in_s"]
    ranked = f" × {penalty:g} ({s.optimizer} converges slower: a ranking term)" if penalty != 1 else ""  # type: ignore[attr-defined]
    scale = t["measured_correction"]
    measured = (f"; the sum is then scaled by × {scale:.3g}, measured by autotune on this kind of device"
                if scale is not None else "")
    flops = p.FLOPS[("cuda", s.mixed_precision)]  # type: ignore[attr-defined]
    return [f"step time {format_seconds(total)} = compute {format_seconds(t['compute_s'])}{ranked} + parameters in "
            f"{format_seconds(t['params_in_s'])} (on the compute stream: one process's FSDP2 copies each unit in "
            f"as it computes) + gradients out {format_seconds(max(0.0, exposed_out))} (of "
            f"{format_seconds(t['grads_out_s'])}: the rest hidden behind compute) + host optimizer step "
            f"{format_seconds(t['host_step_s'])}"
            + "".join(f" + {name} {format_seconds(v)}" for name, v in levers.items())
            + f"; about {t['tokens_per_s']:,.0f} tokens/s "
            f"({format_bytes(int(t['pcie_bytes']))} over PCIe per step)",
            f"step-time terms assumed, not measured{measured}: compute at {flops / 1e12:.0f} TFLOP/s, PCIe at "
            f"{p.PCIE_BYTES_PER_S / 1e9:.0f} GB/s each way, {p.OFFLOAD_OVERLAP:.0%} of compute hides the gradient "
            f"copies, the host optimizer at {p.HOST_OPTIMIZER_BYTES_PER_S / 1e9:.3g} GB/s "
            f"(python -m benchmarks.device_check measures each)"]


def host_parameter_suggestion(shape: ModelShape, request: PlanRequest) -> str | None:
    """For one process under strategy none that does not fit: what fsdp over that process (parameters in host
    RAM where the lever table allows offload) would need, if it fits."""
    from fulltune.planning.search import fits_budget, staged_search

    if request.strategy != "none" or request.num_processes != 1 or request.device != "cuda":
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
