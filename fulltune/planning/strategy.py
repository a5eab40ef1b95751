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
from typing import TYPE_CHECKING

from fulltune.memory.types import PlanRequest
from fulltune.memory.units import format_bytes

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
            others.append(f"{name} {verdict} ({c.seconds:.3g} s/step)")
        else:
            others.append(f"{name} does not fit ({format_bytes(c.expected_bytes)} ± {format_bytes(c.uncertainty.bytes)})")
    out = [f"strategy {s.strategy} (distributed.strategy auto): {chosen.seconds:.3g} s/step"
           + ("; " + "; ".join(others) if others else "")]
    if host_parameters(s):
        none = best.get("none")
        need = f"; strategy none needs {format_bytes(none.expected_bytes)}" if none is not None else ""
        out.append(f"parameters in host RAM (FSDP2 CPU offload over one GPU): device "
                   f"{format_bytes(chosen.expected_bytes)}, host {format_bytes(chosen.estimate.host_bytes)}{need}")
        out.append(step_terms(shape, s))
    return out


def step_terms(shape: ModelShape, settings: object) -> str:
    """The step-time terms of parameters in host RAM, each constant named as the assumption it is."""
    from fulltune.planning import step_time as p

    t = p.fsdp_offload_terms(shape, settings)  # type: ignore[arg-type]
    return (f"step-time terms (assumed, not measured): compute {t['compute_s']:.3g} s at "
            f"{p.FLOPS[('cuda', settings.mixed_precision)] / 1e12:.0f} TFLOP/s; PCIe {t['pcie_s']:.3g} s "  # type: ignore[attr-defined]
            f"({format_bytes(int(t['pcie_bytes']))}: weights in for forward and backward, gradients out, per "
            f"micro-batch, at {p.PCIE_BYTES_PER_S / 1e9:.0f} GB/s), of which {t['exposed_pcie_s']:.3g} s not "
            f"hidden behind compute ({p.OFFLOAD_OVERLAP:.0%} overlap); host optimizer step {t['host_step_s']:.3g} s "
            f"at {p.HOST_OPTIMIZER_BYTES_PER_S / 1e9:.3g} GB/s")


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
            f"{best.seconds:.3g} s/step")
