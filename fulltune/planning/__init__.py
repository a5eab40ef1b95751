"""Planning a run to fit its budget: the search over settings with its step-time model, the FakeTensor trace
of the trainer's step, the out-of-memory replan, and autotune's measurements.

- `plan_memory(config, request)`: pick micro-batch / checkpointing / precision / optimizer / levers to fit.
- `configured_settings(...)`: the settings a pipeline names, with `auto` resolved.
- `simulate_memory` / `measure_memory`: the trainer's step traced under FakeTensorMode or run for real.
- `replan_after_oom(...)`: the next plan after a measured out-of-memory.

Importing this package does not import torch; the functions that need it import it when called.
"""

from fulltune.planning.planner import configured_settings, plan_memory, replan_after_oom
from fulltune.planning.step_time import step_seconds
from fulltune.planning.trace import measure_memory, simulate_memory

__all__ = ["configured_settings", "measure_memory", "plan_memory", "replan_after_oom", "simulate_memory", "step_seconds"]
