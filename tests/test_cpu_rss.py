"""What the plan says fits on CPU, fits: a run planned under `budget.memory` stays under it in peak RSS.

On a CPU device the budget is RAM, and the whole training process must fit in it: interpreter and
libraries, the loaded model, the step's tensors, checkpoints and the final save. Each test plans a small
model under an explicit budget (`plan_memory`, device cpu), trains the chosen settings for a few steps
through `run_training` (the child process a flow starts, logging into an MLflow run), and measures the
child's peak resident set size (measuring/measure.py: a fresh wrapper process's RUSAGE_CHILDREN).

The budget is set below what the configured settings (the whole batch in one micro-batch, nothing
recomputed) are estimated to need and above the smallest step, so the planner has to choose; the run
must then stay under the budget, and the estimate of the chosen settings must be within 15% of the
measured peak.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fulltune.memory.process import CPU_LIBRARY_PAGES_SPREAD
from measuring import measure

from measuring import memory_runs

TOLERANCE = 0.15


# The model shape and sequence length; the effective batch is the case's micro-batch.
CASES = {
    "llama": memory_runs.Case("llama", "llama", 256, 4, 4, 8192, 256, 8, intermediate=688, kv_heads=2),
    "gpt2": memory_runs.Case("gpt2", "gpt2", 256, 4, 4, 8192, 128, 8),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_planned_run_stays_under_the_budget_and_near_the_estimate(name: str, tmp_path: Path) -> None:
    from dataclasses import replace

    from fulltune.memory import PlanRequest, Settings, estimate_memory
    from fulltune.planning import plan_memory

    shape = CASES[name]
    effective_batch = shape.micro_batch_size
    config = memory_runs.model_config(shape)
    model_dir, data, fraction = memory_runs.build_assets(tmp_path / "assets", shape)
    request = PlanRequest(effective_batch_size=effective_batch, seq_len=shape.seq_len, mixed_precision="no",
                          optimizer="adamw", device="cpu", attention_mask=True, target_fraction=fraction)
    # Usable budget halfway between the configured settings and the smallest step (micro-batch 1, every
    # layer recomputed): the configured settings do not fit, smaller ones do, whatever the overhead constants.
    configured = plan_memory(config, request).configured_estimate.device_bytes
    smallest = estimate_memory(config, Settings(1, shape.seq_len, effective_batch, shape.layers, device="cpu",
                                                attention_mask=True, target_fraction=fraction)).device_bytes
    budget = int((configured + smallest) / 2 / (1 - request.headroom))
    plan = plan_memory(config, replace(request, budget_bytes=budget))
    assert plan.fits, plan.reasons
    chosen = plan.settings
    assert (chosen.micro_batch_size, chosen.gradient_checkpointing) != (effective_batch, 0)  # the planner chose

    case = replace(shape, micro_batch_size=chosen.micro_batch_size,
                   gradient_accumulation_steps=chosen.gradient_accumulation_steps,
                   gradient_checkpointing=chosen.gradient_checkpointing, mixed_precision=chosen.mixed_precision,
                   optimizer=chosen.optimizer)
    job = memory_runs.make_job(case, model_dir, data, tmp_path / "run", memory_runs.mlflow_run(tmp_path))
    peak_rss = measure.training_memory("child", job)["peak_rss_bytes"]

    estimate = plan.plan_estimate.device_bytes
    mib = 2**20
    numbers = (f"budget {budget / mib:.0f} MiB, peak RSS {peak_rss / mib:.0f} MiB, estimate {estimate / mib:.0f} MiB "
               f"(tensors {plan.plan_estimate.peak_bytes / mib:.0f} MiB) for {chosen.choices()}")
    assert peak_rss <= budget, numbers
    # Within 15%, beyond what the libraries' resident file pages vary between installations (estimate.py).
    assert abs(estimate - peak_rss) <= TOLERANCE * peak_rss + CPU_LIBRARY_PAGES_SPREAD, numbers
