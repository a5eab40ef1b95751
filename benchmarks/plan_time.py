"""What `fulltune plan` costs for the frontier's models, and whether a change to the planner moved any plan.

Seventeen plans of `benchmarks/frontier_plan.py`'s shapes (Llama-3 1B–70B): one GPU of 24 and of 80 GiB, 8B and
70B on 8 × 80 GiB under FSDP and on 8 × 24 GiB under `strategy: auto` with 1 GiB of host RAM (nothing fits: the
search weighs everything), and 70B with its parameters in 1 TiB of host RAM. Prints the CPU seconds of the
planning (this process); `--out` keeps every plan (`to_dict`, reasons, suggestions) to compare two versions.

Usage:
    python -m benchmarks.plan_time --out /tmp/plans_new.json
    PYTHONPATH=/tmp/base python -m benchmarks.plan_time --out /tmp/plans_base.json   # the code before a change
    python -m benchmarks.plan_time --compare /tmp/plans_base.json /tmp/plans_new.json
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.frontier_plan import EVALUATION, HOST, SHAPES, config
from fulltune.memory import PlanRequest
from fulltune.planning import plan_memory

GiB = 2**30


def requests() -> dict[str, tuple[str, PlanRequest]]:
    """name: (shape, request)."""
    gpu = dict(device="cuda", bf16_supported=True, attention_mask=False, evaluation=EVALUATION)
    out = {}
    for gib in (24, 80):
        for name in SHAPES:
            out[f"{name} on 1×{gib} GiB"] = (name, PlanRequest(
                effective_batch_size=8, seq_len=2048, budget_bytes=gib * GiB, host_memory_bytes=HOST, **gpu))
    for name in ("8B", "70B"):
        out[f"{name} on 8×80 GiB FSDP"] = (name, PlanRequest(
            effective_batch_size=64, seq_len=4096, budget_bytes=80 * GiB, strategy="fsdp", num_processes=8,
            host_memory_bytes=1024 * GiB, **gpu))
        out[f"{name} on 8×24 GiB auto, 1 GiB host"] = (name, PlanRequest(
            effective_batch_size=64, seq_len=4096, budget_bytes=24 * GiB, strategy="auto", num_processes=8,
            host_memory_bytes=GiB, **gpu))
    out["70B on 1×80 GiB auto, 1 TiB host"] = ("70B", PlanRequest(effective_batch_size=64, seq_len=4096,
                                                                  budget_bytes=80 * GiB, strategy="auto",
                                                                  host_memory_bytes=1024 * GiB, **gpu))
    return out


def run() -> tuple[dict[str, str], float]:
    """(each plan as JSON, CPU seconds of all the planning)."""
    plans, started = {}, time.process_time()
    for name, (shape, request) in requests().items():
        plan = plan_memory(config(shape), request)
        plans[name] = json.dumps({"plan": plan.to_dict(), "reasons": list(plan.reasons),
                                  "suggestions": list(plan.suggestions)}, sort_keys=True, default=str)
    return plans, time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write every plan here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --out files")
    args = parser.parse_args()
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        same = [name for name in before if before[name] == after.get(name)]
        print(f"{len(same)} of {len(before)} plans identical"
              + "".join(f"\n  differs: {name}" for name in before if name not in same))
        return
    plans, seconds = run()
    print(f"{len(plans)} plans in {seconds:.1f} CPU-s")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(plans, handle, indent=0, sort_keys=True)


if __name__ == "__main__":
    main()
