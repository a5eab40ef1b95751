"""What the demo's lm-evaluation-harness task adds to the evaluate stage, per candidate, on CPU.

The demo model (data/demo/model_config.json, with the byte-level BPE tokenizer the tokenize stage trains
on the demo data) is evaluated as the evaluate stage does (`fulltune.evaluation.evaluate.evaluate_model` on the
demo's held-out rows, 64 greedy generations of 8 tokens), and the demo's `evaluate.lm_eval` is run on
the same loaded model (data/demo/reversal_mc.yaml, limit 50: 200 log-likelihood requests). The weights are
untrained: the time does not depend on them. Also measured: importing the harness (`lm_eval` and its
Hugging Face model class) in a fresh process, which the evaluate stage pays once per run.

Times are CPU seconds of the process (`time.process_time`, every thread), which a busy shared machine
inflates far less than wall time; on an idle machine with torch's threads busy, wall time is about
CPU time divided by the threads in use.

Usage:
    python -m benchmarks.eval_harness                # 3 repeats, prints a markdown table
    python -m benchmarks.eval_harness --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def demo_model(directory: Path) -> tuple[str, list[dict]]:
    """The untrained demo model and its trained tokenizer in `directory`, and the tokenized eval rows."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fulltune.evaluation.champion import tokenize_records
    from fulltune.pipelines_file import load_pipelines
    from fulltune.data.tokenizer import build_tokenizer

    spec = load_pipelines(ROOT / "pipelines.yaml").pipelines["demo"]
    train = [json.loads(line) for line in (ROOT / "data/demo/train.jsonl").read_text().splitlines()]
    tokenizer = build_tokenizer([t for r in train for t in (r["prompt"], r["completion"])], spec.model.tokenizer)
    config = AutoConfig.for_model(**json.loads((ROOT / "data/demo/model_config.json").read_text()))
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    records = [json.loads(line) for line in (ROOT / "data/demo/eval.jsonl").read_text().splitlines()]
    return str(directory), tokenize_records(records, tokenizer, spec.data)


def import_seconds() -> float:
    script = ("import time; t = time.process_time(); import lm_eval, lm_eval.tasks; "
              "from lm_eval.models.huggingface import HFLM; print(time.process_time() - t)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from fulltune.evaluation.evaluate import EvalOptions, evaluate_model
    from fulltune.evaluation.harness import Benchmarks
    from fulltune.pipelines_file import load_pipelines

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    spec = load_pipelines(ROOT / "pipelines.yaml").pipelines["demo"]
    benchmarks = Benchmarks.from_spec(spec, ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        model, rows = demo_model(Path(tmp))
        options = {"options": EvalOptions(spec.evaluate.batch_size, spec.evaluate.max_generate_examples,
                                          spec.evaluate.max_new_tokens, "cpu"), "load_kwargs": {}}
        from fulltune.models import load_model, load_tokenizer

        loaded, tokenizer = load_model(model).eval(), load_tokenizer(model)
        benchmarks.on_model(loaded, tokenizer, "cpu")  # warm: imports, the task's dataset cache
        timings: dict[str, list[float]] = {"evaluate": [], "harness": []}
        for _ in range(args.repeats):
            start = time.process_time()
            evaluate_model(model, model, rows, **options)
            timings["evaluate"].append(time.process_time() - start)
            start = time.process_time()
            metrics = benchmarks.on_model(loaded, tokenizer, "cpu")
            timings["harness"].append(time.process_time() - start)
        assert "reversal_mc/acc" in metrics
    imports = statistics.median(import_seconds() for _ in range(args.repeats))
    base = statistics.median(timings["evaluate"])
    added = statistics.median(timings["harness"])
    print("| what | CPU seconds |\n|---|---|")
    print(f"| evaluate one candidate: {len(rows)} rows + 64 generations | {base:.2f} |")
    print(f"| + reversal_mc (limit 50: 200 log-likelihood requests) | +{added:.2f} |")
    print(f"| import lm_eval + HFLM (once per run) | {imports:.2f} |")
    print(f"| the demo's evaluate stage: 2 candidates (first run) / 3 (with a champion) | +{2 * added + imports:.1f} / "
          f"+{3 * added + imports:.1f} |")


if __name__ == "__main__":
    main()
