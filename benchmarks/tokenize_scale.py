"""Time and peak memory of the tokenize stage against the tokenizer's own batch encode and `datasets.map`.

Synthetic prompt/completion records (words of a fixed 3,000-word vocabulary; prompts of 10–40 words,
completions of 5–20) at each `--records` size, a byte-level BPE tokenizer of 2,048 tokens
(`fulltune.data.tokenizer.build_tokenizer`). Each measurement runs in a fresh child process; its time is
taken inside the child after the imports (a stage runs in a worker that has them), its peak RSS is the
largest process of the child's tree (`getrusage(RUSAGE_CHILDREN)`: workers included):

- `encode`: the texts read into lists first (not timed), then `tokenizer(prompts)` and
  `tokenizer(completions)`, one process, TOKENIZERS_PARALLELISM=false: the time to beat;
- `stage`: `fulltune.data.tokenize_dataset` (read, format, tokenize, hold out, pack, write), packing on,
  max_length 512, `data.num_workers` as given (`auto`: every core);
- `datasets-map`: `datasets.load_dataset("json")` and `map(num_proc=…)` with the same formatting (prompt
  and completion tokenized apart, bos + prompt + completion + eos, the prompt masked), kept in memory.

With `--baseline DIR` (a checkout of another commit) the stage of that checkout is measured too, as mode
`stage@baseline`, interleaved with the others: before/after on the same load.

Measurements of one size are interleaved (encode, stage, datasets-map, encode, …) and the median of
`--repeats` is reported, so a shared machine's load falls on all alike.

Usage:
    python benchmarks/tokenize_scale.py --records 8000 32000 128000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = {
    "encode": (
        "import json, time; from transformers import AutoTokenizer; tok = AutoTokenizer.from_pretrained({tok!r}); "
        "rows = [json.loads(line) for line in open({data!r})]; p = [r['prompt'] for r in rows]; "
        "c = [r['completion'] for r in rows]; t = time.perf_counter(); "
        "n = sum(map(len, tok(p, add_special_tokens=False)['input_ids'])) + "
        "sum(map(len, tok(c, add_special_tokens=False)['input_ids'])); print('RESULT', time.perf_counter() - t, n)"
    ),
    "stage": (
        "import time, shutil, datasets, pyarrow.parquet; from transformers import AutoTokenizer; "
        "import fulltune.data.store, fulltune.models; "
        "from fulltune.data import tokenize_dataset; from fulltune.spec import DataSpec; "
        "shutil.rmtree({work!r}, ignore_errors=True); t = time.perf_counter(); "
        "d = tokenize_dataset(DataSpec(train={data!r}, format='prompt_completion', max_length=512, packing=True, "
        "num_workers={workers!r}), {tok!r}, {work!r}, 0); print('RESULT', time.perf_counter() - t, d.train_tokens)"
    ),
    "datasets-map": (
        "import time, shutil, datasets; from transformers import AutoTokenizer; datasets.disable_progress_bars(); "
        "tok = AutoTokenizer.from_pretrained({tok!r}); shutil.rmtree({work!r}, ignore_errors=True); "
        "t = time.perf_counter()\n"
        "def encode(batch):\n"
        "    p = tok(batch['prompt'], add_special_tokens=False)['input_ids']\n"
        "    c = tok(batch['completion'], add_special_tokens=False)['input_ids']\n"
        "    ids = [[tok.bos_token_id] + a + b + [tok.eos_token_id] for a, b in zip(p, c)]\n"
        "    labels = [[-100] * (1 + len(a)) + b + [tok.eos_token_id] for a, b in zip(p, c)]\n"
        "    return {{'input_ids': [x[:512] for x in ids], 'labels': [x[:512] for x in labels]}}\n"
        "ds = datasets.load_dataset('json', data_files={data!r}, split='train', cache_dir={work!r})\n"
        "out = ds.map(encode, batched=True, num_proc={procs}, remove_columns=ds.column_names, keep_in_memory=True)\n"
        "print('RESULT', time.perf_counter() - t, sum(len(x) for x in out['input_ids']))"
    ),
}


def write_records(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    with open(path, "w") as handle:
        for _ in range(n):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(10, 40)))
            completion = " ".join(rng.choice(words) for _ in range(rng.randint(5, 20)))
            handle.write(json.dumps({"prompt": prompt + "?", "completion": completion}) + "\n")


def make_tokenizer(directory: Path) -> None:
    from fulltune.spec import TrainTokenizer
    from fulltune.data.tokenizer import build_tokenizer

    sample = directory.parent / "sample.jsonl"
    write_records(sample, 3000, seed=1)
    texts = (json.loads(line)[key] for line in open(sample) for key in ("prompt", "completion"))
    build_tokenizer(texts, TrainTokenizer(vocab_size=2048)).save_pretrained(directory)


def measure(name: str, root: Path = ROOT, **fields: object) -> tuple[float, int, float]:
    """(seconds, tokens, peak RSS in MiB of the largest process) of one measurement in a fresh child that
    imports `root`'s fulltune."""
    code = CHILD[name].format(**fields)
    wrapper = ("import resource, subprocess, sys; "
               f"out = subprocess.run([sys.executable, '-c', {code!r}], check=True, capture_output=True, text=True); "
               "print(out.stdout.strip().splitlines()[-1], resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", wrapper], check=True, capture_output=True, text=True, cwd=root, env=env)
    _, seconds, tokens, rss_kib = out.stdout.split()[-4:]
    return float(seconds), int(tokens), int(rss_kib) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[8000, 32000, 128000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="auto", help="data.num_workers of the stage")
    parser.add_argument("--modes", nargs="+", default=list(CHILD), choices=list(CHILD))
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit: its stage is measured too")
    args = parser.parse_args()
    modes = args.modes + (["stage@baseline"] if args.baseline else [])
    workers = args.workers if args.workers == "auto" else int(args.workers)
    procs = len(os.sched_getaffinity(0)) if workers == "auto" else workers
    print(f"{procs} CPUs for the stage's workers and datasets.map(num_proc={procs}); medians of {args.repeats}")
    print("| records | tokens | mode | seconds (median) | × encode | peak RSS MiB (largest process) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="fulltune-tokenize-scale-") as tmp:
        root = Path(tmp)
        tok = root / "tok"
        make_tokenizer(tok)
        for n in args.records:
            data = root / f"train-{n}.jsonl"
            write_records(data, n)
            runs: dict[str, list[tuple[float, int, float]]] = {mode: [] for mode in modes}
            for _ in range(args.repeats):
                for mode in modes:
                    name, _, other = mode.partition("@")
                    runs[mode].append(measure(name, args.baseline.resolve() if other else ROOT, tok=str(tok),
                                              data=str(data), work=str(root / "work"), workers=workers, procs=procs))
            encode = statistics.median(r[0] for r in runs["encode"]) if "encode" in runs else None
            for mode, results in runs.items():
                seconds = statistics.median(r[0] for r in results)
                ratio = f"{seconds / encode:.2f}" if encode else "—"
                if encode:  # each run against the encode run beside it: steadier on a loaded machine
                    pairs = sorted(r[0] / e[0] for r, e in zip(results, runs["encode"]))
                    ratio += f" (paired median {statistics.median(pairs):.2f})"
                print(f"| {n:,} | {results[0][1]:,} | {mode} | {seconds:.2f} | {ratio} | "
                      f"{max(r[2] for r in results):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
