"""Peak resident memory of real CPU training runs against the memory plan's estimate.

On a CPU device the memory budget is RAM, and what must fit is the whole training process: the
Python interpreter, torch, transformers, accelerate and MLflow as imported, the model as loaded, one
training step's tensors, the checkpoints and the final save. The estimate (`estimate_memory`) counts
the step's tensors (`peak_bytes`) and adds a runtime overhead for the rest (`device_bytes`); this
script measures the rest.

For each configuration below (tiny to ~150M parameters, Llama and GPT-2 shapes built from configs,
fp32 and bf16 autocast, with and without gradient checkpointing, micro-batch 1–8, sequence 128–512)
it runs the real trainer the way fulltune does: a `TrainJob` given to `fulltune.runtime.launch.run_training`,
which starts `python -m fulltune.runtime.train` as a child process. Each run is started from a fresh wrapper
process (`measuring.measure`; the models, rows and jobs are measuring/memory_runs.py's), whose
`getrusage(RUSAGE_CHILDREN).ru_maxrss` is then exactly the trainer's peak resident set size (the wrapper
itself imports neither torch nor transformers and is not counted). A run is short but complete: 3 optimizer
steps (steady state from the second: optimizer states exist), a checkpoint after step 2, the final model save,
and metrics logged into an MLflow run as a flow's training does.

The runtime overhead is then RSS − peak_bytes; it is fitted as `constant + fraction · peak_bytes` with
the estimate never below the measured RSS, and the fraction chosen so that the largest over-estimate is
smallest. The constant is checked against the import footprint measured on its own.

Usage:
    python -m benchmarks.cpu_rss --json cpu_rss.json              # all configurations (~30 min, 2 cores)
    python -m benchmarks.cpu_rss --quick                          # the three smallest (~3 min)
    python -m benchmarks.cpu_rss --only llama-7m-fp32 --json cpu_rss.json   # re-measure one, keep the rest
    python -m benchmarks.cpu_rss --no-mlflow                      # the trainer without an MLflow run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from measuring import measure
from measuring.memory_runs import Case, build_assets, make_job, mlflow_run, model_config, settings_of

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20
# The requirement the fit is held to: the estimate's device_bytes within this of the measured peak RSS.
TOLERANCE = 0.15


CASES = (
    Case("tiny-fp32", "llama", 32, 2, 4, 64, 128, 2, intermediate=64, kv_heads=2),
    Case("llama-7m-fp32", "llama", 256, 4, 4, 8192, 256, 4, intermediate=688, kv_heads=2),
    Case("llama-7m-bf16-ckpt", "llama", 256, 4, 4, 8192, 256, 4, intermediate=688, kv_heads=2,
         gradient_checkpointing=4, mixed_precision="bf16"),
    Case("llama-40m-fp32-mb8", "llama", 512, 8, 8, 16384, 256, 8, intermediate=1376, kv_heads=4),
    Case("llama-40m-fp32-ckpt-acc2", "llama", 512, 8, 8, 16384, 512, 2, intermediate=1376, kv_heads=4,
         gradient_accumulation_steps=2, gradient_checkpointing=8),
    Case("llama-40m-bf16", "llama", 512, 8, 8, 16384, 512, 2, intermediate=1376, kv_heads=4,
         mixed_precision="bf16"),  # ~9 min: bf16 autocast is slow on CPUs without AMX
    Case("gpt2-124m-fp32-mb1", "gpt2", 768, 12, 12, 50257, 128, 1),
    Case("gpt2-124m-bf16-ckpt", "gpt2", 768, 12, 12, 50257, 128, 1, gradient_checkpointing=12,
         mixed_precision="bf16"),
    Case("llama-150m-fp32-ckpt8", "llama", 768, 16, 12, 32000, 512, 4, intermediate=2048, kv_heads=4,
         gradient_checkpointing=8),
)
QUICK = ("tiny-fp32", "llama-7m-fp32", "llama-7m-bf16-ckpt")


def import_footprint(mlflow: bool) -> int:
    """Peak RSS of a process that only imports what the trainer imports (and MLflow's client and monitor)."""
    code = ("import fulltune.runtime.train\n"
            + ("import mlflow\nfrom mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor\n"
               "from mlflow.tracking import MlflowClient\n" if mlflow else "")
            + "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              check=True).stdout.split()[-1])


# ---------------------------------------------------------------------------------------------------
# Fitting the runtime overhead


def fit_overhead(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """`constant + fraction · peak_bytes` ≥ RSS − peak_bytes for every row, with the largest over-estimate
    (device_bytes / RSS − 1) as small as it can be; the constant rounded up to a whole MiB.

    A grid over the fraction (0 to 50% in 0.5% steps); for each, the smallest constant that keeps every
    row's estimate at or above its RSS.
    """
    best: dict[str, Any] | None = None
    for step in range(0, 101):
        fraction = step / 200
        need = max(r["peak_rss_bytes"] - (1 + fraction) * r["peak_bytes"] for r in rows)
        constant = int(-(-need // MIB)) * MIB
        worst = max((constant + (1 + fraction) * r["peak_bytes"]) / r["peak_rss_bytes"] - 1 for r in rows)
        if best is None or worst < best["max_over"] - 1e-9:
            best = {"constant_bytes": constant, "fraction": fraction, "max_over": worst}
    assert best is not None
    best["within_tolerance"] = best["max_over"] <= tolerance
    return best


def apply_overhead(row: dict[str, Any], constant: int, fraction: float) -> int:
    return int(row["peak_bytes"] + constant + fraction * row["peak_bytes"])


# ---------------------------------------------------------------------------------------------------


def run_case(case: Case, root: Path, use_mlflow: bool, omp_threads: int | None) -> dict[str, Any]:
    from fulltune.memory import estimate_memory

    work = root / case.name
    model_dir, data, fraction = build_assets(work, case)
    settings = settings_of(case, fraction)
    estimate = estimate_memory(model_config(case), settings)
    job = make_job(case, model_dir, data, work / "run", mlflow_run(root) if use_mlflow else None)
    measured = measure.training_memory("child", job, omp_threads)  # the trainer's peak RSS, from a fresh wrapper
    from fulltune.memory import num_parameters

    return {
        "case": case.name, **asdict(case), "params": num_parameters(model_config(case)),
        "target_fraction": round(fraction, 4),
        "peak_bytes": estimate.peak_bytes, "device_bytes": estimate.device_bytes, "peak_phase": estimate.peak_phase,
        **measured,
    }


def table(rows: list[dict[str, Any]], constant: int, fraction: float) -> str:
    head = ("| configuration | params | est. tensors | set-up RSS | peak RSS | RSS − tensors | today's estimate "
            "| vs RSS | fitted estimate | vs RSS |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        fitted = apply_overhead(r, constant, fraction)
        lines.append(
            f"| {r['case']} | {r['params'] / 1e6:.1f}M | {r['peak_bytes'] / MIB:.0f} MiB | "
            f"{r['setup_rss_bytes'] / MIB:.0f} MiB | {r['peak_rss_bytes'] / MIB:.0f} MiB | "
            f"{(r['peak_rss_bytes'] - r['peak_bytes']) / MIB:.0f} MiB | {r['device_bytes'] / MIB:.0f} MiB | "
            f"{r['device_bytes'] / r['peak_rss_bytes'] - 1:+.1%} | {fitted / MIB:.0f} MiB | "
            f"{fitted / r['peak_rss_bytes'] - 1:+.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--only", nargs="+", help="these configurations by name")
    parser.add_argument("--no-mlflow", action="store_true", help="train without an MLflow run")
    parser.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of the trainer (default 1)")
    parser.add_argument("--json", type=Path, help="write the rows and the fit here after every run; rows of "
                        "configurations in the file that are not measured again are kept and fitted too")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cases = [c for c in CASES if (not args.quick or c.name in QUICK) and (not args.only or c.name in args.only)]
    use_mlflow = not args.no_mlflow
    footprint = import_footprint(use_mlflow)
    rows = _earlier_rows(args.json, {c.name for c in cases})
    with tempfile.TemporaryDirectory(prefix="fulltune-cpu-rss-") as tmp:
        for case in cases:
            row = run_case(case, Path(tmp), use_mlflow, args.omp_threads)
            rows.append(row)
            print(f"{case.name}: peak RSS {row['peak_rss_bytes'] / MIB:.0f} MiB, estimated tensors "
                  f"{row['peak_bytes'] / MIB:.0f} MiB, device {row['device_bytes'] / MIB:.0f} MiB "
                  f"({row['seconds']} s)", file=sys.stderr, flush=True)
            if args.json:
                _write(args.json, rows, footprint, use_mlflow, args.omp_threads)
    order = [c.name for c in CASES]
    rows.sort(key=lambda r: order.index(r["case"]) if r["case"] in order else len(order))
    fit = fit_overhead(rows)
    print(table(rows, fit["constant_bytes"], fit["fraction"]))
    print(f"\nimport footprint (torch, transformers, accelerate, fulltune{', mlflow' if use_mlflow else ''}): "
          f"{footprint / MIB:.0f} MiB")
    print(f"fitted CPU runtime overhead: {fit['constant_bytes'] / MIB:.0f} MiB + {fit['fraction']:.1%} of the "
          f"tensor peak; largest over-estimate {fit['max_over']:.1%} (never under); "
          f"{'within' if fit['within_tolerance'] else 'NOT within'} {TOLERANCE:.0%}")
    if args.json:
        _write(args.json, rows, footprint, use_mlflow, args.omp_threads)
    return 0


def _earlier_rows(path: Path | None, measuring: set[str]) -> list[dict[str, Any]]:
    if path is None or not path.is_file():
        return []
    return [r for r in json.loads(path.read_text())["rows"] if r["case"] not in measuring]


def _write(path: Path, rows: list[dict[str, Any]], footprint: int, use_mlflow: bool, omp_threads: int) -> None:
    """The rows so far and their fit, rewritten whole (a killed run keeps what it measured)."""
    payload = {"rows": rows, "fit": fit_overhead(rows), "import_footprint_bytes": footprint, "mlflow": use_mlflow,
               "omp_threads": omp_threads}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
