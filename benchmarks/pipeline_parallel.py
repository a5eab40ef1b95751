"""Pipeline parallel on CPU: per-stage peak memory against `fulltune.memory.pipeline`, losses against one process.

For each case, torchrun starts one process per stage, or per stage and data-parallel replica in the `*-fsdp2`
and `*-ddp2` cases (2 stages × 2: each stage sharded with FSDP2 or replicated over its 2 processes; gloo, CPU, a
timeout on every collective and on the whole run; the ranks are `measuring.rank_memory`'s `pipeline`). Each builds the same `from_config`
Llama, keeps its stage (`fulltune.runtime.pipeline_parallel.PipelineRun`:
embedding + first layers / last layers + norm + head) and runs STEPS optimizer steps of M micro-batches
under torch.distributed.pipelining's 1F1B or GPipe schedule, with the trainer's loss (the head at the
target positions, Σ loss / the step's targets), global-norm clipping and optimizer. In every rank torch's
MemTracker records the peak of tracked tensor storage (the stage's weights, gradients, optimizer states,
activations, the schedule's receive buffers). That is compared with `estimate_pipeline(...).stages[rank]
.peak_bytes`, the tensor peak the planner adds its runtime overhead to.

The same steps run in one process (`fulltune.runtime.step.run_step` with M accumulated micro-batches, the
trainer's step) from the same initial weights on the same batches: the per-step losses must agree.

Measured: every tensor torch allocates on CPU. Not measured: the CPU process itself, gloo's own buffers,
CUDA. The step times are this machine's (2 processes on a shared 2-core VM), beside the step-time model's
prediction; only the ranking of the model is claimed elsewhere.

Usage:
    python -m benchmarks.pipeline_parallel                     # every case: JSON, table and summary
    python -m benchmarks.pipeline_parallel --case fp32-1f1b --json out.json
    python -m benchmarks.pipeline_parallel --frontier           # what plan advises for Llama-3-70B (no runs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from measuring.rank_memory import pipeline_against_estimate

STEPS = 3  # tracked: losses and peaks
TIMED_STEPS = 3  # then untracked (MemTracker intercepts every op in Python): step times
TIMEOUT_S = 240  # the whole torchrun; each collective times out after rank_memory.COLLECTIVE_TIMEOUT_S


@dataclass(frozen=True)
class Case:
    name: str
    settings: dict  # Settings fields: micro_batch_size (b), gradient_accumulation_steps (M), ...
    schedule: str = "1f1b"
    stages: int = 2
    config: dict = field(default_factory=dict)  # LlamaConfig keyword arguments over BASE
    data_parallel: str = "none"  # fsdp or ddp over each stage's `replicas` processes
    replicas: int = 1  # data-parallel replicas of the pipeline: stages × replicas ranks


BASE = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 256, "tie_word_embeddings": False}
SHAPE = {"micro_batch_size": 2, "seq_len": 128, "gradient_accumulation_steps": 4}

CASES = [
    Case("fp32-1f1b", SHAPE),
    Case("fp32-gpipe", SHAPE, "gpipe"),
    Case("bf16-1f1b", {**SHAPE, "mixed_precision": "bf16"}),
    Case("fp32-1f1b-ckpt2", {**SHAPE, "gradient_checkpointing": 2}),
    Case("bf16-gpipe-ckpt4", {**SHAPE, "mixed_precision": "bf16", "gradient_checkpointing": 4}, "gpipe"),
    Case("fp32-1f1b-m8-b1", {**SHAPE, "micro_batch_size": 1, "gradient_accumulation_steps": 8}),
    Case("fp32-1f1b-4stages", {**SHAPE, "gradient_accumulation_steps": 8}, stages=4),
    Case("fp32-1f1b-chunked", {**SHAPE, "chunked_loss": True}),
    Case("purebf16-1f1b", {**SHAPE, "mixed_precision": "bf16", "pure_bf16": True}),
    # Data parallel beside the stages: 2 stages × 2 replicas, every replica given the same rows (the memory is
    # what is compared; the step's targets are every replica's, so the loss is one process's).
    Case("fp32-1f1b-fsdp2", SHAPE, data_parallel="fsdp", replicas=2),
    Case("fp32-gpipe-fsdp2", SHAPE, "gpipe", data_parallel="fsdp", replicas=2),
    Case("bf16-1f1b-fsdp2", {**SHAPE, "mixed_precision": "bf16"}, data_parallel="fsdp", replicas=2),
    Case("fp32-1f1b-ckpt2-fsdp2", {**SHAPE, "gradient_checkpointing": 2}, data_parallel="fsdp", replicas=2),
    Case("fp32-1f1b-ddp2", SHAPE, data_parallel="ddp", replicas=2),
]


def settings_of(case: Case):
    from fulltune.memory import Settings

    return Settings(device="cpu", **case.settings)


def run_case(case: Case) -> dict:
    """`case`'s stages in torchrun ranks (`measuring.rank_memory`'s `pipeline`) against each stage's
    estimate and against the same steps in one process."""
    return {"case": case.name, **pipeline_against_estimate({**BASE, **case.config}, settings_of(case), case.schedule,
                                                           case.stages, STEPS, TIMED_STEPS, timeout_s=TIMEOUT_S,
                                                           data_parallel=case.data_parallel, replicas=case.replicas)}


def table(results: list[dict]) -> str:
    mib = 2**20
    lines = ["| case | schedule | stages × layers | b × M | stage | in flight | estimate MiB | measured MiB | error "
             "| peak during (estimate) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["settings"]
        for rank in r["ranks"]:
            lines.append(
                f"| {r['case']} | {r['schedule']} | {r['stages']} × {rank['layers'][1] - rank['layers'][0]} | "
                f"{s['micro_batch_size']} × {s['gradient_accumulation_steps']} | {rank['stage']} | "
                f"{rank['in_flight']} | {rank['estimate_peak_bytes'] / mib:.2f} | "
                f"{rank['measured_peak_bytes'] / mib:.2f} | {rank['error']:+.2%} | {rank['estimate_peak_phase']} |")
    return "\n".join(lines)


def loss_table(results: list[dict]) -> str:
    lines = ["| case | pipelined losses (steps 1–3) | one process | largest difference | bubble | "
             "pipelined step s predicted / measured | one process, measured |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['case']} | {', '.join(f'{x:.6f}' for x in r['losses'])} | "
                     f"{', '.join(f'{x:.6f}' for x in r['reference_losses'])} | {r['max_loss_difference']:.1e} | "
                     f"{r['bubble']:.0%} | {r['predicted_step_seconds']:.3f} / {r['measured_step_seconds']:.3f} | "
                     f"{r['one_process_step_seconds']:.3f} |")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    errors = sorted(abs(rank["error"]) for r in results for rank in r["ranks"])
    median = statistics.median(errors)
    worst = max(((r, rank) for r in results for rank in r["ranks"]), key=lambda p: abs(p[1]["error"]))
    loss = max(r["max_loss_difference"] for r in results)
    return (f"per-stage peak: median |error| {median:.2%}, worst {abs(worst[1]['error']):.2%} "
            f"({worst[0]['case']} stage {worst[1]['stage']}) over {len(errors)} stages of {len(results)} runs; "
            f"losses within {loss:.1e} of one process")


def frontier() -> str:
    """`fulltune plan`'s pipeline advice for Llama-3-70B (seq 4096 packed, effective batch 64, bf16, 1 TiB host RAM)
    on one GPU of 24 / 40 / 80 GiB, and what 8 stages (one 8-GPU machine) would need per GPU."""
    from dataclasses import replace

    from fulltune.memory import PlanRequest, format_bytes
    from fulltune.planning import plan_memory
    from fulltune.memory.pipeline import UNSUPPORTED_LEVERS
    from fulltune.planning.pipeline import estimate_pipeline
    from fulltune.memory.shapes import model_shape

    from benchmarks.frontier_plan import CLUSTER_HOST, GiB, config

    shape = model_shape(config("70B"))
    lines = ["| GPU | one GPU's plan | pipeline advice (fewest stages that fit, else the least memory) | "
             "8 stages × 32 micro-batches of 2, all layers checkpointed: worst stage |", "|---|---|---|---|"]
    for gib in (24, 40, 80):
        request = PlanRequest(effective_batch_size=64, seq_len=4096, device="cuda", bf16_supported=True,
                              budget_bytes=gib * GiB, attention_mask=False, host_memory_bytes=CLUSTER_HOST)
        plan = plan_memory(config("70B"), request)
        eight = replace(plan.settings, micro_batch_size=2, gradient_accumulation_steps=32, gradient_checkpointing=80,
                        **{name: False for name in UNSUPPORTED_LEVERS})
        worst = estimate_pipeline(shape, eight, 8, "1f1b").worst
        levers = "+".join(name for name, on in plan.settings.levers().items() if on) or "no levers"
        lines.append(f"| {gib} GiB | {'fits' if plan.fits else 'does not fit'} ({plan.settings.optimizer}, {levers}: "
                     f"{format_bytes(plan.expected_bytes)}) | {plan.pipeline_parallel['advice']} | "
                     f"stage {worst.stage}: {format_bytes(worst.device_bytes)} ({eight.optimizer}"
                     f"{', pure bf16' if eight.pure_bf16 else ''}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[c.name for c in CASES], help="default: all")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--frontier", action="store_true", help="only print the plan's advice for Llama-3-70B")
    args = parser.parse_args(argv)
    if args.frontier:
        print(frontier())
        return 0
    results = []
    for case in CASES:
        if not args.case or case.name in args.case:
            results.append(run_case(case))
            print(table(results[-1:]), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results))
    print()
    print(loss_table(results))
    print()
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
