"""Per-rank peak memory of a tensor-parallel (and FSDP × TP) training step, measured, against the plan.

Each configuration: torchrun starts 2 or 4 CPU processes (gloo) that split a `from_config` Llama with
`fulltune.parallel.ParallelPlan` (the TP plan per block with sequence-parallel norms, then FSDP2 over the
data-parallel processes) and run two optimizer steps through the trainer's step (`fulltune/step.py`: the
TargetHead loss, backward, global-norm clip, fused AdamW, zero_grad) under torch's FSDPMemTracker in every
rank, as `benchmarks/sharded_memory.py` does for FSDP alone. The peak is compared with what the planner
estimates today for the same settings (`estimate_memory(..., Settings(strategy="fsdp", num_processes=N,
tensor_parallel=T))`), which does not model tensor parallel yet: it counts the run as FSDP over all N
processes. The error column therefore says how far that stand-in is from a TP rank, not how good a TP
model is.

Usage:
    python benchmarks/tensor_parallel_memory.py                 # table on stdout (~30 s per case on 2 cores)
    python benchmarks/tensor_parallel_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from sharded_memory import BASE, STEPS, _category  # noqa: E402  (the FSDP benchmark's model and categories)

TIED = {**BASE, "tie_word_embeddings": True}


@dataclass(frozen=True)
class Case:
    name: str
    config: dict
    processes: int
    tensor_parallel: int
    settings: dict = field(default_factory=dict)


def _grid() -> list[Case]:
    """TP 2 on 2 processes and FSDP 2 × TP 2 on 4, fp32 and the bf16 policy, untied and tied, micro-batch 2."""
    cases = []
    for processes in (2, 4):
        for precision in ("no", "bf16"):
            for tied, config in (("untied", BASE), ("tied", TIED)):
                layout = "tp2" if processes == 2 else "fsdp2xtp2"
                cases.append(Case(f"{layout}-{'fp32' if precision == 'no' else 'bf16'}-{tied}", config, processes, 2,
                                  {"micro_batch_size": 2, "seq_len": 128, "mixed_precision": precision}))
    return cases


CASES = _grid()


def settings_of(case: Case):
    from fulltune.memory import Settings

    return Settings(strategy="fsdp", num_processes=case.processes, tensor_parallel=case.tensor_parallel,
                    device="cpu", **case.settings)


def measure_rank(case: Case) -> dict:
    """STEPS optimizer steps of `case` in this rank under FSDPMemTracker; its peak and breakdown."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fulltune import sharding
    from fulltune.loss import TargetHead
    from fulltune.memory.trace import make_batch
    from fulltune.parallel import ParallelPlan
    from fulltune.step import LocalAccelerator, OptimizerStep, StepParts, run_step

    settings = settings_of(case)
    sharding.init_process_group("cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**case.config), attn_implementation="sdpa")
    model.train()
    head = TargetHead(model)
    ParallelPlan(case.processes // case.tensor_parallel, case.tensor_parallel).apply(
        model, "cpu", settings.mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tracker = FSDPMemTracker(model, optimizer)
    accelerator = LocalAccelerator("cpu", "no", 1)
    parts = StepParts(accelerator, model, head, optimizer, OptimizerStep(accelerator, model, optimizer, None, 1.0),
                      1, before_micro_batch=tracker.reset_mod_stats)
    targets = settings.micro_batch_size * settings.targets_per_row
    with tracker:
        for step in range(1, STEPS + 1):
            run_step(parts, [make_batch(model.config.vocab_size, settings, "cpu")], step, targets)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    breakdown: dict[str, int] = {}
    for key, value in snapshot.items():
        if key != "Total":
            name = _category(getattr(key, "value", str(key)))
            breakdown[name] = breakdown.get(name, 0) + int(value)
    return {"peak_bytes": int(snapshot["Total"]), "breakdown": breakdown}


def worker(case_name: str, out: Path) -> None:
    import torch.distributed as dist

    case = next(c for c in CASES if c.name == case_name)
    measured = measure_rank(case)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, measured)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_case(case: Case) -> dict:
    from transformers import LlamaConfig

    from fulltune.memory import estimate_memory

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.processes}",
                   __file__, "--worker", case.name, "--out", str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError(f"{case.name}: torchrun failed\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        ranks = json.loads(out.read_text())
    estimate = estimate_memory(LlamaConfig(**case.config), settings_of(case))
    return {"case": case.name, "processes": case.processes, "tensor_parallel": case.tensor_parallel,
            "settings": settings_of(case).to_dict(), "estimate_peak_bytes": estimate.peak_bytes,
            "ranks": [{"rank": i, "measured_peak_bytes": r["peak_bytes"], "measured_breakdown": r["breakdown"],
                       "error": estimate.peak_bytes / r["peak_bytes"] - 1} for i, r in enumerate(ranks)]}


def table(results: list[dict]) -> str:
    mib = 2**20
    lines = ["| case | processes | measured per rank (MiB) | plan today (FSDP over all, MiB) | its error |",
             "|---|---|---|---|---|"]
    for r in results:
        peaks = sorted({rank["measured_peak_bytes"] for rank in r["ranks"]})
        measured = " / ".join(f"{p / mib:.2f}" for p in peaks) + (" (all)" if len(peaks) == 1 else "")
        worst = max(r["ranks"], key=lambda rank: abs(rank["error"]))["error"]
        lines.append(f"| {r['case']} | {r['processes']} | {measured} | {r['estimate_peak_bytes'] / mib:.2f} | "
                     f"{worst:+.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[c.name for c in CASES], help="default: all")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.out)
        return 0
    results = []
    for case in CASES:
        if not args.case or case.name in args.case:
            results.append(run_case(case))
            print(table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
