"""The memory model of full-parameter training: pure arithmetic over a model's shape and the settings.

- `estimate_memory(config, settings)`: the analytic peak of one optimizer step and of the whole process.
- `resolve_budget(...)`: `budget:` as numbers on this machine (a `Budget`), once per run.
- `flops_per_token`, `num_parameters`: the FLOP and parameter counts the planner's step time uses.

Planning (the search, the trace, the OOM replan) is `fulltune.planning`; the runtime pieces the trainer runs
are `fulltune.runtime`. Importing this package does not import torch.
"""

from fulltune.memory.budget import Budget, resolve_budget, usable_bytes
from fulltune.memory.estimate import estimate_memory, flops_per_token, num_parameters
from fulltune.memory.report import format_plan_table, render_breakdown_png
from fulltune.memory.types import MemoryEstimate, MemoryPlan, PlanRequest, Settings
from fulltune.memory.units import format_bytes, parse_bytes

__all__ = [
    "Budget",
    "MemoryEstimate",
    "MemoryPlan",
    "PlanRequest",
    "Settings",
    "estimate_memory",
    "flops_per_token",
    "format_bytes",
    "format_plan_table",
    "num_parameters",
    "parse_bytes",
    "render_breakdown_png",
    "resolve_budget",
    "usable_bytes",
]
