"""Resident memory of a CPU training process, phase by phase, against the plan's whole-process estimate.

On a CPU device `budget.memory` is RAM, and the whole training process has to fit in it: not only the
steady training step the memory model walks, but loading the weights, the first optimizer step (where the
optimizer allocates its states), a checkpoint save and the final export. This script runs those phases in
one fresh process with the trainer's own functions (`fulltune.runtime.train.setup`, `train_step`,
`save_checkpoint`, `finish`, logging into an MLflow run as a flow's training does) and records the
process's resident set size:

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
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import cpu_rss  # the assets and jobs of the RSS benchmark

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20
# The frontier case of the memory levers on CPU: a 76M-parameter Llama planned under `budget.memory: 1GiB`
# (effective batch 4, seq 128): pure bf16 + Adafactor + optimizer step in backward + 11 of 12 layers
# checkpointed. The 6.5M cases are the same family with 4 layers and hidden 384, for quick checks.
CASES = {
    "llama-76m-frontier": cpu_rss.Case("llama-76m-frontier", "llama", 768, 12, 12, 512, 128, 4, intermediate=2048,
                                       kv_heads=4, tied=True, gradient_checkpointing=11, mixed_precision="bf16",
                                       optimizer="adafactor", pure_bf16=True, optimizer_in_backward=True),
    "llama-76m-fp32-adafactor": cpu_rss.Case("llama-76m-fp32-adafactor", "llama", 768, 12, 12, 512, 128, 4,
                                             intermediate=2048, kv_heads=4, tied=True, gradient_checkpointing=11,
                                             optimizer="adafactor", optimizer_in_backward=True),
    "llama-76m-amp-adafactor": cpu_rss.Case("llama-76m-amp-adafactor", "llama", 768, 12, 12, 512, 128, 4,
                                            intermediate=2048, kv_heads=4, tied=True, gradient_checkpointing=11,
                                            mixed_precision="bf16", optimizer="adafactor", optimizer_in_backward=True),
    "llama-6m-frontier": cpu_rss.Case("llama-6m-frontier", "llama", 384, 4, 6, 512, 128, 4, intermediate=1024,
                                       kv_heads=2, tied=True, gradient_checkpointing=3, mixed_precision="bf16",
                                       optimizer="adafactor", pure_bf16=True, optimizer_in_backward=True),
    "llama-6m-fp32": cpu_rss.Case("llama-6m-fp32", "llama", 384, 4, 6, 512, 128, 4, intermediate=1024,
                                   kv_heads=2, tied=True),
}
# The phases in the order the process runs them (two steps: the checkpoint after the first).
PHASES = ("imports", "set-up", "load", "optimizer and prepare", "first optimizer step", "checkpoint save",
          "training step", "final export")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(job_file: str) -> int:
    """Run the job's phases in this process; print one JSON line of per-phase peak RSS."""
    peaks: dict[str, int] = {}
    hwm: dict[str, int] = {}
    current = ["imports"]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss = _rss()
            phase = current[0]
            if rss > peaks.get(phase, 0):
                peaks[phase] = rss
            stop.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def enter(phase: str) -> None:
        hwm[current[0]] = _hwm()
        peaks[current[0]] = max(peaks.get(current[0], 0), _rss())
        current[0] = phase

    from fulltune.runtime import train
    from fulltune.runtime.launch import TrainJob

    # What the trainer imports, MLflow's client and system-metrics monitor included (its sink imports them).
    import mlflow  # noqa: F401
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # noqa: F401

    job = TrainJob.from_json(Path(job_file).read_text())
    if os.environ.get("FULLTUNE_DEFAULT_MALLOC") != "1":
        from fulltune.runtime import allocator

        allocator.return_large_blocks()  # as `python -m fulltune.runtime.train` does on CPU
    # Mark the phases inside `setup` by wrapping the two functions it calls for the model and the optimizer.
    load, build = train.load_model_with_levers, train.build_optimizer

    def load_marked(*args: Any, **kwargs: Any) -> Any:
        enter("load")
        return load(*args, **kwargs)

    def build_marked(*args: Any, **kwargs: Any) -> Any:
        enter("optimizer and prepare")
        return build(*args, **kwargs)

    train.load_model_with_levers, train.build_optimizer = load_marked, build_marked
    enter("set-up")
    run = train.setup(job)
    state, saved, resumed_from = train.resume(run)
    metrics = train.TrainMetrics(run, saved)
    with metrics.running(state.step):
        for phase in ("first optimizer step", "training step"):
            enter(phase)
            rows = run.schedule.step_rows(state.step)
            outcome = train.train_step(run, rows, state.step + 1)
            state.step += 1
            metrics.record_step(rows, outcome)
            metrics.log_interval(state.step)
            if phase == "first optimizer step":
                enter("checkpoint save")
                train.save_checkpoint(run, state, metrics.state_dict())
    enter("final export")
    train.finish(run, state, metrics, resumed_from)
    enter("done")
    stop.set()
    sampler.join()
    print(json.dumps({"sampled": {p: peaks.get(p, 0) for p in PHASES}, "hwm_after": {p: hwm.get(p, 0) for p in PHASES}}))
    return 0


def measure(case: cpu_rss.Case, root: Path, omp_threads: int = 1) -> dict[str, Any]:
    """The case's assets, its job (2 steps, a checkpoint after the first, MLflow on) and its per-phase peaks."""
    model_dir, data, fraction = cpu_rss.build_assets(root, case, steps=2)
    job = cpu_rss.make_job(case, model_dir, data, root / "run", cpu_rss.mlflow_run(root), steps=2)
    job = job.replace(checkpoint_every_steps=1)
    job_file = root / "job.json"
    job_file.write_text(job.to_json())
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(omp_threads))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "benchmarks.process_memory", "--child", str(job_file)],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{case.name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    measured["seconds"] = round(time.perf_counter() - started, 1)
    measured["target_fraction"] = fraction
    return measured


def estimated_phases(case: cpu_rss.Case, target_fraction: float) -> dict[str, Any]:
    from fulltune.memory import estimate_memory

    estimate = estimate_memory(cpu_rss.model_config(case), cpu_rss.settings_of(case, target_fraction))
    return {"device_bytes": estimate.device_bytes, "step_device_bytes": estimate.step_device_bytes,
            "phases": dict(estimate.phases), "peak_phase": estimate.process_peak_phase}


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
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--case", nargs="+", default=["llama-6m-frontier"], choices=sorted(CASES))
    parser.add_argument("--omp-threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the measured and estimated phases here")
    parser.add_argument("--from-json", type=Path, help="estimate against the measurements in this file (no runs)")
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child)
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
