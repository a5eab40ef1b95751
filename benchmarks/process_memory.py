"""Resident memory of a CPU training process, phase by phase, against the plan's whole-process estimate.

On a CPU device `budget.memory` is RAM, and the whole training process has to fit in it: not only the
steady training step the memory model walks, but loading the weights, the first optimizer step (where the
optimizer allocates its states), a checkpoint save and the final export. This script runs those phases in
one fresh process with the trainer's own functions (`fulltune.runtime.train.setup`, `train_step`,
`save_checkpoint`, `finish`, logging into an MLflow run as a flow's training does) and records the
process's resident set size (`measuring.measure`'s `phases`; the cases are measuring/memory_runs.py's):

- a sampler thread reads /proc/self/statm every 5 ms and keeps each phase's largest RSS;
- the kernel's high-water mark (VmHWM) after each phase bounds what the sampler may have missed.

Each phase's measured peak is printed beside the estimate's phase (`estimate_memory(...).phases`), so a
reader sees which phase sets the process's peak and how far the plan is from it.

Usage:
    python -m benchmarks.process_memory --case llama-76m-frontier       # the 76M Llama under 1 GiB (~10 min)
    python -m benchmarks.process_memory --case llama-6m-frontier       # same shape family, 4 layers (~1 min)
    python -m benchmarks.process_memory --case llama-6m-frontier --json phases.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from measuring.measure import PHASES
from measuring.memory_runs import PROCESS_CASES as CASES, estimated_phases, measure_phases as measure

MIB = 2**20


def table(name: str, measured: dict[str, Any], estimated: dict[str, Any]) -> str:
    peak = max(max(measured["sampled"].values()), max(measured["hwm_after"].values()))
    lines = [f"{name}: measured peak RSS {peak / MIB:.0f} MiB; whole-process estimate "
             f"{estimated['device_bytes'] / MIB:.0f} MiB (peak in {estimated['peak_phase']}); steady step "
             f"{estimated['step_device_bytes'] / MIB:.0f} MiB",
             "| phase | measured RSS (sampled) | VmHWM at its end | estimate | estimate vs RSS |", "|---|---|---|---|---|"]
    for phase in PHASES:
        rss = measured["sampled"][phase]
        est = estimated["phases"].get(phase)
        versus = f"{est / rss - 1:+.1%}" if est and rss else "-"
        lines.append(f"| {phase} | {rss / MIB:.0f} MiB | {measured['hwm_after'][phase] / MIB:.0f} MiB | "
                     f"{f'{est / MIB:.0f} MiB' if est else '-'} | {versus} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", nargs="+", default=["llama-6m-frontier"], choices=sorted(CASES))
    parser.add_argument("--omp-threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the measured and estimated phases here")
    parser.add_argument("--from-json", type=Path, help="estimate against the measurements in this file (no runs)")
    args = parser.parse_args(argv)
    earlier = json.loads(args.from_json.read_text()) if args.from_json else {}
    out = {}
    for name in args.case:
        if name in earlier:
            measured = earlier[name]["measured"]
        else:
            with tempfile.TemporaryDirectory(prefix="fulltune-process-memory-") as tmp:
                measured = measure(CASES[name], Path(tmp), args.omp_threads)
        out[name] = {"measured": measured}
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        try:
            estimated = estimated_phases(CASES[name], measured["target_fraction"])
        except AttributeError:
            print(name, json.dumps(measured), flush=True)
            continue
        out[name] = {"measured": measured, "estimated": estimated}
        print(table(name, measured, estimated), flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
