"""Memory of full-parameter training: estimate, trace, measure and plan to fit a budget.

- `estimate_memory(config, settings)`: analytic peak of one optimizer step (pure arithmetic).
- `plan_memory(config, request)`: pick micro-batch / checkpointing / precision / optimizer to fit.
- `resolve_budget(...)`: `budget:` as numbers on this machine (a `Budget`), once per run.
- `simulate_memory` / `measure_memory`: the same step traced under FakeTensorMode or run for real.

Importing this package does not import torch; the functions that need it import it when called.
"""

from fulltune.memory.budget import Budget, resolve_budget, usable_bytes
from fulltune.memory.checkpointing import apply_gradient_checkpointing
from fulltune.memory.estimate import estimate_memory, flops_per_token, num_parameters
from fulltune.memory.planner import configured_settings, plan_memory, replan_after_oom, step_seconds
from fulltune.memory.report import format_plan_table, render_breakdown_png
from fulltune.memory.trace import measure_memory, simulate_memory
from fulltune.memory.types import MemoryEstimate, MemoryPlan, PlanRequest, Settings
from fulltune.memory.units import format_bytes, parse_bytes

__all__ = [
    "Budget",
    "MemoryEstimate",
    "MemoryPlan",
    "PlanRequest",
    "Settings",
    "apply_gradient_checkpointing",
    "configured_settings",
    "estimate_memory",
    "flops_per_token",
    "format_bytes",
    "format_plan_table",
    "measure_memory",
    "num_parameters",
    "parse_bytes",
    "plan_memory",
    "render_breakdown_png",
    "replan_after_oom",
    "resolve_budget",
    "simulate_memory",
    "step_seconds",
    "usable_bytes",
]
