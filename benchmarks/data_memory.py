"""Training processes' memory against the size of the training data: train.arrow mapped, or Parquet read whole.

The rows are written by the tokenize stage's own writer (`fulltune.data.store._write_rows`: train.parquet
and train.arrow) from synthetic documents of 16–64 tokens packed into rows of ROWS_SEQ_LEN, and trained through
the real training child (`fulltune.runtime.launch.run_training`) of a tiny Llama (measuring/memory_runs.py
`TINY`) for STEPS optimizer steps, from a fresh wrapper process (`measuring.measure`'s `ranks`). The
wrapper samples every 20 ms each
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
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from measuring import measure
from measuring.memory_runs import ROWS_STEPS as STEPS, build_tiny_model, rows_job, write_train_files

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


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
        return [measure.rss_and_pss(proc.pid) for proc in procs]
    finally:
        for proc in procs:
            proc.communicate("")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2_000_000, 8_000_000, 32_000_000])
    parser.add_argument("--ranks", type=int, default=2, help="training processes (DDP over gloo)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", nargs="+", default=["arrow", "parquet"], choices=["arrow", "parquet"])
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose trainer reads train.parquet")
    parser.add_argument("--epoch", action="store_true", help="read every row without training (see above)")
    args = parser.parse_args(argv)
    if args.epoch:
        return _epoch_main(args)
    print(f"{args.ranks} training ranks, tiny Llama, {STEPS} steps; medians of {args.repeats}; MiB")
    print("| tokens | train.arrow MiB | read | rank RSS | rank PSS | Σ ranks' PSS | max RSS (kernel) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="fulltune-data-memory-") as tmp:
        root = Path(tmp)
        model_dir = build_tiny_model(root)
        for tokens in args.tokens:
            files = write_train_files(root / f"data-{tokens}", tokens)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.files}
            for repeat in range(args.repeats):
                for name in args.files:
                    job = rows_job(model_dir, files[name], root / f"run-{tokens}-{name}-{repeat}", args.ranks)
                    code = ROOT if name == "arrow" else args.code
                    runs[name].append(measure.training_memory("ranks", job, code=code))
            for name, results in runs.items():
                def median(f: Any) -> float:
                    return statistics.median(f(r) for r in results) / MIB
                print(f"| {tokens:,} | {files['arrow'].stat().st_size / MIB:,.0f} | {name} | "
                      f"{median(lambda r: max(p['rss'] for p in r['ranks'])):,.0f} | "
                      f"{median(lambda r: max(p['pss'] for p in r['ranks'])):,.0f} | "
                      f"{median(lambda r: sum(p['pss'] for p in r['ranks'])):,.0f} | "
                      f"{median(lambda r: r['ru_maxrss_bytes']):,.0f} |", flush=True)
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
