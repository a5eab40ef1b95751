"""Training processes' memory against the size of the training data: train.arrow mapped, or Parquet read whole.

The rows are written by the tokenize stage's own writer (`fulltune.data.store._write_rows`: train.parquet
and train.arrow) from synthetic documents of 16–64 tokens packed into rows of SEQ_LEN, and trained through
the real training child (`fulltune.runtime.launch.run_training`) of a tiny Llama (benchmarks/cpu_rss.py
`tiny-fp32`) for STEPS optimizer steps, from a fresh wrapper process. The wrapper samples every 20 ms each
training rank's `/proc/<pid>/smaps_rollup`: `Rss` (every page the rank has mapped, shared or not) and `Pss`
(each shared page divided among the processes that map it: the ranks of one machine share train.arrow's
pages in the page cache); one rank's peak RSS is also the kernel's high-water mark
(`getrusage(RUSAGE_CHILDREN)`, what tests/test_data_memory.py asserts on).

- `arrow`: the job reads train.arrow (what the fine-tune stage passes): memory-mapped, a row read when it is
  trained on;
- `parquet`: the job reads train.parquet: every rank holds all of it in memory (as before train.arrow);
  `--code DIR` runs the trainer of another checkout (e.g. `git worktree add /tmp/before <commit>`) on it.

Measurements of one size are interleaved (arrow, parquet, arrow, …) and medians of `--repeats` reported.

A short run touches few rows. `--epoch` measures instead what an epoch leaves behind, without training:
`--ranks` processes each open the rows as the trainer does (`TokenizedRows`) and read their share of
every row (rank r every r-th row, as the step schedule's micro-batches spread them), then hold still
while their `smaps_rollup` is read.

Usage:
    python -m benchmarks.data_memory --tokens 2000000 8000000 32000000 --ranks 2 --repeats 3
    python -m benchmarks.data_memory --tokens 12000000 --ranks 2 --repeats 3 --epoch
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
SEQ_LEN = 128
STEPS = 2


def write_train_files(root: Path, tokens: int, seq_len: int = SEQ_LEN, vocab: int = 64,
                      seed: int = 0) -> dict[str, Path]:
    """train.parquet and train.arrow of about `tokens` tokens, as the tokenize stage writes them (packed rows
    of at most `seq_len`; documents of 16–64 tokens, the first token of each without a label)."""
    import numpy as np
    import pyarrow as pa

    from fulltune.data.store import _write_rows

    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 65, size=max(1, tokens // 40))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(2, vocab, size=int(offsets[-1]), dtype=np.int32)
    labels = ids.copy()
    labels[offsets[:-1]] = -100
    examples = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                         "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels))})
    root.mkdir(parents=True, exist_ok=True)
    files = {"parquet": root / "train.parquet", "arrow": root / "train.arrow"}
    _write_rows(files["parquet"], examples, np.arange(len(lengths)), packing=True, max_length=seq_len,
                with_text=False, mapped=files["arrow"])
    return files


def build_model(root: Path) -> Path:
    """The tiny Llama of benchmarks/cpu_rss.py (`tiny-fp32`) and its tokenizer."""
    from benchmarks import cpu_rss

    model_dir = root / "model"
    if not model_dir.is_dir():
        cpu_rss.build_model(model_dir, cpu_rss.CASES[0])
    return model_dir


def make_job(model_dir: Path, train_file: Path, output_dir: Path, ranks: int = 1) -> Any:
    from fulltune.runtime.launch import job_with

    fields: dict[str, Any] = {"num_processes": ranks, "strategy": "ddp"} if ranks > 1 else {}
    return job_with(str(model_dir), str(train_file), str(output_dir), micro_batch_size=2, seq_len=SEQ_LEN,
                    learning_rate=1e-4, warmup_ratio=0.0, max_steps=STEPS, checkpoint_every_steps=0,
                    log_every_steps=1, **fields)


def measure(job: Any, code: Path = ROOT) -> dict[str, Any]:
    """Run `job` from a fresh wrapper process (`code`'s fulltune): {"ranks": [{"rss", "pss"} peak bytes per
    rank], "max_rss": the kernel's high-water mark of the largest child, "seconds"}."""
    job_file = Path(job.paths.output_dir).with_suffix(".job.json")
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(job.to_json())
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(code))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(job_file)], cwd=code,
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"training failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _rollup(pid: int) -> dict[str, int]:
    """Rss and Pss of `pid` in bytes, from /proc/<pid>/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key.lower()] = int(rest.split()[0]) * 1024
    return out


EPOCH_CHILD = (
    "import sys, numpy as np; from fulltune.data.batching import TokenizedRows; rows = TokenizedRows(sys.argv[1]); "
    "mine = np.arange(int(sys.argv[2]), len(rows), int(sys.argv[3])); "
    "n = sum(len(r['input_ids']) for i in range(0, len(mine), 64) for r in rows.rows(mine[i:i + 64])); "
    "print('read', flush=True); sys.stdin.read()"
)


def epoch_memory(train_file: Path, ranks: int, code: Path = ROOT) -> list[dict[str, int]]:
    """Rss and Pss of `ranks` processes that have each read their share of every row of `train_file`
    (`code`'s `TokenizedRows`), measured while all of them are alive."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(code))
    procs = [subprocess.Popen([sys.executable, "-c", EPOCH_CHILD, str(train_file), str(rank), str(ranks)], cwd=code,
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for rank in range(ranks)]
    try:
        for proc in procs:
            if proc.stdout is None or proc.stdout.readline().strip() != "read":
                raise RuntimeError(f"reading {train_file} failed")
        return [_rollup(proc.pid) for proc in procs]
    finally:
        for proc in procs:
            proc.communicate("")


def _child(job_file: str) -> int:
    """The wrapper: run the job, sampling its training ranks (not torchrun), then print their peaks."""
    import resource

    import psutil

    from fulltune.runtime.launch import TrainJob, run_training

    peaks: dict[int, dict[str, int]] = {}
    stop = threading.Event()

    def sample() -> None:
        me = psutil.Process()
        while not stop.is_set():
            for child in me.children(recursive=True):
                try:
                    command = " ".join(child.cmdline())
                    if "fulltune.runtime.train" not in command or "torch.distributed.run" in command:
                        continue
                    now = _rollup(child.pid)
                except (psutil.Error, OSError, ValueError):
                    continue
                seen = peaks.setdefault(child.pid, {"rss": 0, "pss": 0})
                for key in seen:
                    seen[key] = max(seen[key], now.get(key, 0))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run_training(TrainJob.from_json(Path(job_file).read_text()))
    finally:
        stop.set()
        sampler.join()
    max_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({"ranks": sorted(peaks.values(), key=lambda p: -p["rss"]), "max_rss": max_rss}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2_000_000, 8_000_000, 32_000_000])
    parser.add_argument("--ranks", type=int, default=2, help="training processes (DDP over gloo)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", nargs="+", default=["arrow", "parquet"], choices=["arrow", "parquet"])
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose trainer reads train.parquet")
    parser.add_argument("--epoch", action="store_true", help="read every row without training (see above)")
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child)
    if args.epoch:
        return _epoch_main(args)
    print(f"{args.ranks} training ranks, tiny Llama, {STEPS} steps; medians of {args.repeats}; MiB")
    print("| tokens | train.arrow MiB | read | rank RSS | rank PSS | Σ ranks' PSS | max RSS (kernel) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="fulltune-data-memory-") as tmp:
        root = Path(tmp)
        model_dir = build_model(root)
        for tokens in args.tokens:
            files = write_train_files(root / f"data-{tokens}", tokens)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.files}
            for repeat in range(args.repeats):
                for name in args.files:
                    job = make_job(model_dir, files[name], root / f"run-{tokens}-{name}-{repeat}", args.ranks)
                    runs[name].append(measure(job, ROOT if name == "arrow" else args.code))
            for name, results in runs.items():
                def median(f: Any) -> float:
                    return statistics.median(f(r) for r in results) / MIB
                print(f"| {tokens:,} | {files['arrow'].stat().st_size / MIB:,.0f} | {name} | "
                      f"{median(lambda r: max(p['rss'] for p in r['ranks'])):,.0f} | "
                      f"{median(lambda r: max(p['pss'] for p in r['ranks'])):,.0f} | "
                      f"{median(lambda r: sum(p['pss'] for p in r['ranks'])):,.0f} | "
                      f"{median(lambda r: r['max_rss']):,.0f} |", flush=True)
    return 0


def _epoch_main(args: argparse.Namespace) -> int:
    print(f"{args.ranks} processes, each its share of every row; medians of {args.repeats}; MiB")
    print("| tokens | train.arrow MiB | read | rank RSS | rank PSS | Σ ranks' PSS |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="fulltune-data-memory-") as tmp:
        for tokens in args.tokens:
            files = write_train_files(Path(tmp) / f"data-{tokens}", tokens)
            runs: dict[str, list[list[dict[str, int]]]] = {name: [] for name in args.files}
            for _ in range(args.repeats):
                for name in args.files:
                    runs[name].append(epoch_memory(files[name], args.ranks, ROOT if name == "arrow" else args.code))
            for name, results in runs.items():
                def median(f: Any) -> float:
                    return statistics.median(f(r) for r in results) / MIB
                print(f"| {tokens:,} | {files['arrow'].stat().st_size / MIB:,.0f} | {name} | "
                      f"{median(lambda r: max(p['rss'] for p in r)):,.0f} | "
                      f"{median(lambda r: max(p['pss'] for p in r)):,.0f} | "
                      f"{median(lambda r: sum(p['pss'] for p in r)):,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
