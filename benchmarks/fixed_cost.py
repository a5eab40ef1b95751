"""Fixed cost: where the time of `fulltune run demo` goes when there is (almost) nothing to do, beside
what Prefect and transformers cost on their own.

    python -m benchmarks.fixed_cost              # the demo at 300 steps, 3 runs of each (~15 min on 2 idle cores)
    python -m benchmarks.fixed_cost --steps 60   # shorter training, same fixed costs
    git worktree add /tmp/fulltune-base REV      # an earlier commit, then its runs beside this checkout's:
    python -m benchmarks.fixed_cost --steps 20 --baseline /tmp/fulltune-base

Measured, each in fresh processes, median over `--runs` (the first fulltune run of each round uses a
new workdir; the cached reruns use it after):

    bare_flow       a Prefect flow of five no-op tasks, Prefect's own temporary server (the floor of
                    "a Prefect flow on a laptop")
    bare_trainer    transformers' Trainer on the demo's model config and tokenized rows, same steps,
                    batch and learning rate; its train() time and its whole process
    server_start    fulltune's temporary Prefect server (flows/server.py), from start to /health
    imports         `import flows.pipeline` (Prefect, the flow and its tasks) in a fresh interpreter
    first_run       `fulltune run demo` in a new workdir; its training seconds (result.json)
    cached_rerun    the same command again (`--reruns` times): every stage cached. Split by the timestamps
                    of its own log: start (process start to "Beginning flow run": validation, imports,
                    server start, MLflow's start-up, overlapped), each stage (the previous line to the
                    stage's "Finished in state"), the MLflow run and summary, and shutdown (the flow's
                    last line to process exit)

With `--baseline DIR` (a checkout of an earlier commit, run with the same interpreter and packages), its
first run and cached reruns run in its own workdir, in turn with this checkout's in every round, so that
both see the same machine; the tables then have a column for each.

Wall time on a shared machine moves with other processes' load; each process's CPU time (user + system,
children included) is printed beside it. The first demo's goal is ≤ 2 × its training time + the server
start; the cached rerun's ≤ 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
       "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "1"}
for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
    ENV.pop(name, None)

BARE_FLOW = '''
from prefect import flow, task

@task
def noop(i: int) -> int:
    return i

@flow
def five_noops() -> list[int]:
    return [noop(i) for i in range(5)]

five_noops()
'''

BARE_TRAINER = '''
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

workdir, steps = sys.argv[1], int(sys.argv[2])
(train,) = __import__("glob").glob(f"{workdir}/tokenized/*/train.parquet")
(tokenizer_dir,) = __import__("glob").glob(f"{workdir}/tokenizers/*")
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
config = LlamaConfig(**{**json.load(open("data/demo/model_config.json")), "vocab_size": len(tokenizer)})
torch.manual_seed(0)
model = LlamaForCausalLM(config)
rows = Dataset.from_parquet(train).select_columns(["input_ids", "labels"])

def collate(batch):
    longest = max(len(row["input_ids"]) for row in batch)
    pad = lambda values, fill: values + [fill] * (longest - len(values))
    return {"input_ids": torch.tensor([pad(r["input_ids"], tokenizer.pad_token_id or 0) for r in batch]),
            "labels": torch.tensor([pad(r["labels"], -100) for r in batch]),
            "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in batch])}

args = TrainingArguments(output_dir=f"{workdir}/bare-trainer", max_steps=steps, per_device_train_batch_size=32,
                         learning_rate=3e-3, warmup_steps=max(1, steps // 20), logging_steps=50, save_strategy="no",
                         report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
started = time.perf_counter()
trainer.train()
print(json.dumps({"train_seconds": time.perf_counter() - started}))
'''

LOG_TIME = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \| \w+ +\| (.*)$")


def timed(command: list[str], cwd: Path | str = REPO, env: dict | None = None) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process and its children, output) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    done = subprocess.run(command, cwd=cwd, env=env or ENV, capture_output=True, text=True)
    wall = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(f"{command} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return wall, cpu, done.stdout + done.stderr


def fulltune_run(workdir: Path, steps: int, repo: Path = REPO) -> tuple[float, float, str, float]:
    """`fulltune run demo` of the checkout `repo` in `workdir`: (wall, CPU, output, start time)."""
    started = time.time()
    wall, cpu, output = timed([sys.executable, "-m", "fulltune.cli", "run", "demo",
                               "--set", f"train.max_steps={steps}"], cwd=repo,
                              env={**ENV, "PYTHONPATH": str(repo), "FULLTUNE_WORKDIR": str(workdir)})
    return wall, cpu, output, started


def split_cached_rerun(output: str, started: float, wall: float) -> dict[str, float]:
    """Seconds between the rerun's own log lines: start, each stage, MLflow run + summary, shutdown."""
    day = datetime.fromtimestamp(started).date()
    events: list[tuple[float, str]] = []
    for line in output.splitlines():
        match = LOG_TIME.match(line)
        if match:
            clock = datetime.strptime(f"{day} {match[1]}", "%Y-%m-%d %H:%M:%S.%f").timestamp()
            events.append((clock, match[2]))
    begin = next(t for t, text in events if "Beginning flow run" in text)
    parts = {"start": begin - started}
    previous = begin
    for t, text in events:
        stage = re.match(r"Task run '(.+)-[0-9a-f]{3}' - Finished in state", text)
        if stage:
            parts[stage[1]] = t - previous
            previous = t
    end = max(t for t, text in events if text.startswith("Flow run") and "Finished in state" in text)
    parts["mlflow run + summary"] = end - previous
    parts["shutdown"] = started + wall - end
    return parts


def server_start() -> float:
    script = ("from flows.server import TemporaryServer; s = TemporaryServer().start(); "
              "print('SECONDS', s.wait()); s.stop()")
    _, _, output = timed([sys.executable, "-c", script])
    return float(re.search(r"SECONDS ([\d.]+)", output)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="train.max_steps of the demo (default: its 300)")
    parser.add_argument("--reruns", type=int, default=1, help="cached reruns after each first run (default 1)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of an earlier commit: its first run and cached reruns, in turn with these")
    parser.add_argument("--logs", type=Path, default=None, help="keep what each fulltune run printed in this folder")
    args = parser.parse_args()
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)

    checkouts = {"this": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    rows: dict[str, list[tuple[float, float]]] = {}
    parts: dict[str, dict[str, list[float]]] = {name: {} for name in checkouts}
    training: dict[str, list[float]] = {name: [] for name in checkouts}
    trainer_train: list[float] = []

    def add(name: str, wall: float, cpu: float) -> None:
        rows.setdefault(name, []).append((wall, cpu))
        print(f"  {name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)

    def label(row: str, checkout: str) -> str:
        return row if checkout == "this" else f"{row} ({checkout})"

    def keep(output: str, round_: int, row: str) -> None:
        if args.logs:
            (args.logs / f"{round_ + 1}-{row.replace(' ', '_').replace('(', '').replace(')', '')}.log").write_text(output)

    with tempfile.TemporaryDirectory(prefix="fulltune-fixed-cost-") as scratch:
        flow_file = Path(scratch) / "bare_flow.py"
        flow_file.write_text(BARE_FLOW)
        trainer_file = Path(scratch) / "bare_trainer.py"
        trainer_file.write_text(BARE_TRAINER)
        for run in range(args.runs):
            print(f"round {run + 1} of {args.runs}", flush=True)
            add("bare_flow", *timed([sys.executable, str(flow_file)], cwd=scratch)[:2])
            add("imports", *timed([sys.executable, "-c", "import flows.pipeline"])[:2])
            seconds = server_start()
            rows.setdefault("server_start", []).append((seconds, float("nan")))
            print(f"  server_start: {seconds:.1f} s", flush=True)
            workdirs = {name: Path(scratch) / f"work-{name}-{run}" for name in checkouts}
            for name, repo in checkouts.items():
                wall, cpu, output, _ = fulltune_run(workdirs[name], args.steps, repo)
                add(label("first_run", name), wall, cpu)
                keep(output, run, label("first_run", name))
                (result,) = workdirs[name].glob("runs/*/result.json")
                training[name].append(json.loads(result.read_text())["seconds"])
            for _ in range(args.reruns):
                for name, repo in checkouts.items():  # in turn: both see the same load
                    wall, cpu, output, started = fulltune_run(workdirs[name], args.steps, repo)
                    assert "register cached" in output, output[-3000:]
                    add(label("cached_rerun", name), wall, cpu)
                    keep(output, run, label("cached_rerun", name))
                    for part, value in split_cached_rerun(output, started, wall).items():
                        parts[name].setdefault(part, []).append(value)
            wall, cpu, output = timed([sys.executable, str(trainer_file), str(workdirs["this"]), str(args.steps)])
            add("bare_trainer", wall, cpu)
            trainer_train.append(json.loads(re.search(r'^\{"train_seconds".*$', output, re.M)[0])["train_seconds"])

    median = statistics.median
    print(f"\nmedians over {args.runs} rounds (demo at {args.steps} steps, {args.reruns} cached rerun(s) a round)\n")
    print("| what | wall s | CPU s |\n|---|---:|---:|")
    for name, values in rows.items():
        cpu = median(c for _, c in values)
        print(f"| {name} | {median(w for w, _ in values):.1f} | {'' if cpu != cpu else f'{cpu:.1f}'} |")
    for name in checkouts:
        print(f"| {label('first_run', name)}: training (result.json) | {median(training[name]):.1f} | |")
    print(f"| bare_trainer: train() | {median(trainer_train):.1f} | |")
    print("\n| cached rerun, by its log | " + " | ".join(f"{name} wall s" for name in checkouts) + " |")
    print("|---|" + "---:|" * len(checkouts))
    for part in parts["this"]:
        print(f"| {part} | " + " | ".join(f"{median(parts[name][part]):.1f}" if part in parts[name] else ""
                                          for name in checkouts) + " |")
    server = median(w for w, _ in rows["server_start"])
    for name in checkouts:
        goal = 2 * median(training[name]) + server
        print(f"\n{name}: first run {median(w for w, _ in rows[label('first_run', name)]):.1f} s against "
              f"2 × training + server start = {goal:.1f} s; cached rerun "
              f"{median(w for w, _ in rows[label('cached_rerun', name)]):.1f} s against 10 s")


if __name__ == "__main__":
    main()
