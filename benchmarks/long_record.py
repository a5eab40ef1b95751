"""Time and peak memory of the tokenize stage and of tokenizer training on a file with one huge record.

A JSON-lines file of 8 ordinary prompt/completion records and one whose prompt is `--megabytes` MB of
text on a single line (a scraped page, a log pasted into a field). Each measurement runs in a fresh child
process, whose peak resident set size is read with `getrusage(RUSAGE_CHILDREN)`:

- `tokenize`: `fulltune.data.tokenize_dataset` with the repository's test BPE tokenizer, max_length 64;
- `train-tokenizer`: `fulltune.data.tokenizer.train_tokenizer` (`model.tokenizer: {vocab_size: 96}`).

Usage:
    python -m benchmarks.long_record --megabytes 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = {
    "tokenize": (
        "from pathlib import Path; from tiny import make_tokenizer; "
        "from fulltune.data import tokenize_dataset; from fulltune.spec import DataSpec; "
        "tok = make_tokenizer(Path({root!r}) / 'tok'); "
        "tokenize_dataset(DataSpec(train={data!r}, format='prompt_completion', max_length=64), tok, {root!r} + '/w', 0)"
    ),
    "train-tokenizer": (
        "from fulltune.spec import DataSpec, TrainTokenizer; from fulltune.data.tokenizer import train_tokenizer; "
        "train_tokenizer(DataSpec(train={data!r}, format='prompt_completion', max_length=64), "
        "TrainTokenizer(vocab_size=96), {root!r} + '/wt')"
    ),
}


def measure(name: str, data: Path, root: Path) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of one measurement in a fresh child process."""
    code = CHILD[name].format(root=str(root), data=str(data))
    wrapper = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
               f"subprocess.run([sys.executable, '-c', {code!r}], check=True); "
               "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}  # this checkout, tests/tiny.py
    out = subprocess.run([sys.executable, "-c", wrapper], check=True, capture_output=True, text=True, cwd=ROOT, env=env)
    seconds, rss_kib = out.stdout.split()[-2:]
    return float(seconds), int(rss_kib) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=200, help="size of the huge record")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fulltune-long-record-") as tmp:
        root = Path(tmp)
        data = root / "train.jsonl"
        with open(data, "w") as handle:
            for _ in range(8):
                handle.write(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
            handle.write(json.dumps({"prompt": "hello world " * (args.megabytes * 2**20 // 12), "completion": "x"}))
            handle.write("\n")
        print(f"{'measurement':18s} {'seconds':>8s} {'peak RSS':>9s}   ({args.megabytes} MB record)")
        for name in CHILD:
            seconds, gib = measure(name, data, root)
            print(f"{name:18s} {seconds:8.1f} {gib:7.2f} GiB")


if __name__ == "__main__":
    main()
