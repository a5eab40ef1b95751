"""`distributed.strategy: auto`: the planner chooses how the processes hold the model.

For one process the choices are `none` (parameters on the device) and `fsdp` over that one process, which with
`train.offload_optimizer` is FSDP2's CPU offload: parameters, gradients and optimizer states in pinned host RAM,
each unit brought to the GPU for its forward and backward (fulltune/runtime/sharding.py). For several processes
they are `ddp` and `fsdp`. Each strategy gets the planner's whole search (levers, micro-batch, checkpointing,
tensor-parallel degrees); the fastest candidate that fits wins, as for `tensor_parallel: auto`. Where two tie
(fsdp over one process without offload holds what `none` holds and takes as long), the first choice, the
strategy without sharding, stays. What a plan says of the choice is `reasons.strategy_reasons`.
"""

from __future__ import annotations

from dataclasses import replace

from fulltune.memory.types import PlanRequest


def choices(strategy: str, num_processes: int) -> tuple[str, ...]:
    """The strategies `strategy` (auto or fixed) may be for that many processes, the unsharded one first."""
    if strategy != "auto":  # the YAML value as given: auto is the one that offers a choice
        return (strategy,)
    return ("none", "fsdp") if num_processes == 1 else ("ddp", "fsdp")


def strategy_choices(request: PlanRequest) -> tuple[str, ...]:
    """The strategies `auto` may choose for the request's processes, the unsharded one first. One process on a CPU
    device weighs `none` only: fsdp over it holds and takes what `none` does there (FSDP2's CPU offload needs an
    accelerator), so it could only tie, and the plan would list each of its settings twice."""
    if request.dims.auto_strategy and request.num_processes == 1 and request.device == "cpu":
        return ("none",)
    return choices(request.strategy, request.num_processes)


def naive_strategy(request: PlanRequest) -> PlanRequest:
    """The request with strategy auto at its naive default (what the configured settings are estimated under):
    the first of `strategy_choices`."""
    return replace(request, strategy=strategy_choices(request)[0]) if request.dims.auto_strategy else request


def host_parameters(settings: object) -> bool:
    """The parameters live in host RAM: FSDP2's CPU offload over one process on a GPU."""
    s = settings
    return (s.dims.fsdp_enabled and s.offload_optimizer and s.num_processes == 1  # type: ignore[attr-defined]
            and s.device == "cuda")  # type: ignore[attr-defined]
