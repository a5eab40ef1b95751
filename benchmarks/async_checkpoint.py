"""What a checkpoint costs the step, written synchronously and in the background (`train.checkpoint_async`),
through the trainer's own functions.

    python -m benchmarks.async_checkpoint                  # 3 runs of each on a 34M Llama (~5 min on 2 busy cores)
    python -m benchmarks.async_checkpoint --runs 5 --json async_checkpoint.json

A Llama of hidden 512, 8 layers, vocabulary 8192 (33.6M parameters; fp32 weights and AdamW: a 403 MB checkpoint),
one packed row of 64 tokens per step, 8 steps with a checkpoint after steps 2, 4 and 6. Each run is a fresh
process running the trainer's stages (`train.setup`, `resume`, `train_step`, `save_checkpoint`, `finish`, as
fulltune/runtime/measure.py's `phases` does), so what is timed is the loop's own wall time: each step, and at a
checkpoint step the time `save_checkpoint` holds the loop (synchronously: the whole write, the manifest read back
and the fsync; in the background: the copy of the weights and optimizer states and the step boundary's small
files), then the final export's wait for the last write. The two modes alternate run by run so that the load of a
shared machine falls on both alike. Reported per mode, medians over every run: the checkpoint's hold on the loop,
the step after a checkpoint (on a CPU the background write competes with it for the cores), any other step, and
the final wait.
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
from pathlib import Path

from benchmarks.train_throughput import Size, prepare_inputs

SIZE = Size(hidden=512, intermediate=1376, layers=8, heads=8, kv_heads=8, vocab=8192, tokenizer_vocab=1024,
            max_length=64, examples=400, micro_batch_size=1, gradient_accumulation_steps=1, steps=8,
            precision="no")
EVERY = 2  # a checkpoint after steps 2, 4 and 6 (none at the last step: the model is exported)


def worker(job_file: Path) -> dict:
    """One run of the trainer's loop in this process: the seconds of each step, of each checkpoint's hold on the
    loop and of the final wait for the writes."""
    from fulltune.runtime import train
    from fulltune.runtime.launch import TrainJob
    from fulltune.runtime.step_checkpoints import resume, save_checkpoint, wait_for_checkpoint_writes
    from fulltune.runtime.train_metrics import TrainMetrics

    job = TrainJob.from_json(job_file.read_text())
    run = train.setup(job)
    state, saved, _ = resume(run)
    metrics = TrainMetrics(run, saved)
    steps, saves = [], []
    with metrics.running(state.step):
        while state.step < run.total_steps:
            rows = run.schedule.step_rows(state.step)
            started = time.perf_counter()
            outcome = train.train_step(run, rows, state.step + 1)
            state.step += 1
            metrics.record_step(rows, outcome)
            metrics.log_interval(state.step)  # the loss read back: the step is done
            steps.append(time.perf_counter() - started)
            if state.step % EVERY == 0 and state.step < run.total_steps:
                started = time.perf_counter()
                save_checkpoint(run, state, metrics.state_dict())
                saves.append(time.perf_counter() - started)
    started = time.perf_counter()
    wait_for_checkpoint_writes(run)
    return {"steps": steps, "saves": saves, "final_wait": time.perf_counter() - started}


def timed_run(inputs: dict, out: Path, checkpoint_async: bool) -> dict:
    """A fresh process running `worker` on the benchmark's job."""
    from fulltune.runtime import launch

    job = launch.job_with(inputs["model"], inputs["packed"].train_file, str(out),
                          micro_batch_size=SIZE.micro_batch_size, gradient_accumulation_steps=1, max_steps=SIZE.steps,
                          checkpoint_every_steps=EVERY, keep_checkpoints=2, log_every_steps=1, learning_rate=1e-4,
                          warmup_ratio=0.0, seq_len=SIZE.max_length, checkpoint_async=checkpoint_async)
    out.mkdir(parents=True)
    job_file = out / launch.JOB_FILE
    job_file.write_text(job.to_json())
    # One thread: on a shared machine OpenMP's hand-offs between busy cores stall each op (tests/test_train.py).
    done = subprocess.run([sys.executable, "-m", "benchmarks.async_checkpoint", "--worker", str(job_file)],
                          check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode")
    parser.add_argument("--workdir", type=Path, default=None, help="where the model, data and runs go (a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fulltune-async-ckpt-", dir=Path.cwd()))
    inputs = prepare_inputs(SIZE, workdir / "inputs")
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for index in range(args.runs):
        for mode in runs:
            timed = timed_run(inputs, workdir / f"{mode}-{index}", mode == "async")
            runs[mode].append(timed)
            print(f"run {index} {mode}: steps " + " ".join(f"{s:.2f}" for s in timed["steps"]) + "; checkpoints "
                  + " ".join(f"{s:.2f}" for s in timed["saves"]) + f"; final wait {timed['final_wait']:.2f}",
                  file=sys.stderr, flush=True)
    after = {k for k in range(EVERY, SIZE.steps, EVERY)}  # 0-based index of the step after a checkpoint
    rows = {mode: {
        "checkpoint_hold_s": statistics.median(s for r in done for s in r["saves"]),
        "step_after_checkpoint_s": statistics.median(r["steps"][k] for r in done for k in sorted(after)),
        "other_step_s": statistics.median(r["steps"][k] for r in done for k in range(1, SIZE.steps) if k not in after),
        "final_wait_s": statistics.median(r["final_wait"] for r in done),
        "runs": done} for mode, done in runs.items()}
    print(f"{'mode':6} {'checkpoint holds the loop':>26} {'step after it':>14} {'other steps':>12} {'final wait':>11}")
    for mode, row in rows.items():
        print(f"{mode:6} {row['checkpoint_hold_s']:>25.2f}s {row['step_after_checkpoint_s']:>13.2f}s "
              f"{row['other_step_s']:>11.2f}s {row['final_wait_s']:>10.2f}s")
    if args.json:
        args.json.write_text(json.dumps({"size": SIZE.__dict__, "every": EVERY, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
