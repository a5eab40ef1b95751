"""Step time of fp32, bf16 autocast and pure bf16 on this CPU, against the planner's step-time model.

Whether 16-bit compute pays on a CPU depends on the CPU: with bf16 matrix instructions (AVX512-BF16, AMX)
oneDNN runs bf16 GEMMs natively; without them every bf16 matmul and its backward convert to fp32 and back,
and the step is several times slower than fp32 (the development CPU of the planner-choice benchmark:
3.65×). The planner's step-time model (`fulltune.planning.step_time.step_seconds`) reads which kind of CPU it
runs on (`cpu_bf16_units`) and ranks by the ratio measured for that kind.

Each precision trains the same model on the same rows with the trainer's own functions
(`fulltune.runtime.train.setup`, `train_step`), one torch thread, in a fresh process: one warm-up step, then
`--steps` timed steps; the median is reported with the planner's predicted ratio to fp32.

Usage:
    python -m benchmarks.cpu_precision                       # a 6.5M Llama (hidden 384, 4 layers), ~2 min
    python -m benchmarks.cpu_precision --case llama-76m --steps 2   # the 76M frontier shape
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks import cpu_rss

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "llama-6m": cpu_rss.Case("llama-6m", "llama", 384, 4, 6, 512, 128, 4, intermediate=1024, kv_heads=2, tied=True,
                             optimizer="adafactor"),
    "llama-76m": cpu_rss.Case("llama-76m", "llama", 768, 12, 12, 512, 128, 4, intermediate=2048, kv_heads=4,
                              tied=True, optimizer="adafactor", gradient_checkpointing=11, optimizer_in_backward=True),
}
PRECISIONS = {
    "fp32": dict(mixed_precision="no"),
    "bf16 autocast": dict(mixed_precision="bf16"),
    "pure bf16": dict(mixed_precision="bf16", pure_bf16=True),
}


def _child(job_file: str, steps: int) -> int:
    import torch

    from fulltune.runtime import train
    from fulltune.runtime.launch import TrainJob

    torch.set_num_threads(1)
    job = TrainJob.from_json(Path(job_file).read_text())
    run = train.setup(job)
    times = []
    for step in range(steps + 1):
        rows = run.schedule.step_rows(step)
        started = time.perf_counter()
        train.train_step(run, rows, step + 1)
        times.append(time.perf_counter() - started)
    print(json.dumps({"seconds": times[1:]}))
    return 0


def measure(case: cpu_rss.Case, root: Path, steps: int) -> float:
    model_dir, data, _ = cpu_rss.build_assets(root, case, steps=steps + 1)
    job = cpu_rss.make_job(case, model_dir, data, root / "run", None, steps=steps + 1)
    job_file = root / f"{case.name}.job.json"
    job_file.write_text(job.to_json())
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_precision", "--child", str(job_file), str(steps)],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def predicted(case: cpu_rss.Case) -> float:
    from fulltune.planning import step_seconds
    from fulltune.memory.shapes import model_shape

    return step_seconds(model_shape(cpu_rss.model_config(case)), cpu_rss.settings_of(case, 1.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--case", default="llama-6m", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="measure every precision this many times, in turn")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child[0], int(args.child[1]))
    from fulltune.planning.step_time import cpu_bf16_units

    base = SHAPES[args.case]
    cases = {name: replace(base, name=f"{base.name}-{name.replace(' ', '-')}", **fields)
             for name, fields in PRECISIONS.items()}
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory(prefix="fulltune-cpu-precision-") as tmp:
        for _ in range(args.rounds):
            for name, case in cases.items():
                seconds[name].append(measure(case, Path(tmp) / case.name, args.steps))
    measured = {name: statistics.median(values) for name, values in seconds.items()}
    model = {name: predicted(case) for name, case in cases.items()}
    print(f"{args.case}, CPU bf16 units: {cpu_bf16_units()}; median of {args.rounds} runs × {args.steps} steps")
    print("| precision | measured s/step | vs fp32 | predicted s/step | predicted vs fp32 |")
    print("|---|---|---|---|---|")
    for name in cases:
        print(f"| {name} | {measured[name]:.3f} | {measured[name] / measured['fp32']:.2f}× | {model[name]:.3f} | "
              f"{model[name] / model['fp32']:.2f}× |")
    if args.json:
        args.json.write_text(json.dumps({"case": args.case, "bf16_units": cpu_bf16_units(), "runs": seconds,
                                         "measured": measured, "predicted": model}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
