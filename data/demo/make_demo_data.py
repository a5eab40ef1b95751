"""Write the demo dataset: reversing a string of digits, as prompt/completion pairs.

    {"prompt": "reverse 48213=", "completion": "31284"}

A tiny Llama (data/demo/model_config.json: 2 layers, hidden 64, ~91k parameters) trained from scratch
learns it in a few hundred optimizer steps on CPU, and greedy exact match on held-out strings climbs
from 0 to about 1. The trained tokenizer splits digits one by one, so every answer is spelled with the
same ten digit tokens and a held-out string can only be answered by having learned to reverse.

Measured with a plain torch loop over this repo's tokenizer, tokenize_dataset and collate (packed rows
of 64 tokens, 32 rows per step, AdamW lr 3e-3, 5% warmup then cosine; exact match on held-out strings):
step 50: 0.00, step 100: 0.22-0.38, step 150: 0.97-0.98, step 300: 1.00 (seeds 0 and 1).
Two-digit addition ("12+35=" → "47"), the first candidate, reached only 0.06 in the same 300 steps.

Strings are 3 to 6 digits long, all distinct; train and eval share none. Fixed seed: running this
script again rewrites identical files.

    python data/demo/make_demo_data.py            # writes data/demo/train.jsonl and eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 1234
NUM_TRAIN = 2000
NUM_EVAL = 200
MIN_DIGITS, MAX_DIGITS = 3, 6


def make_examples(
    seed: int = SEED, num_train: int = NUM_TRAIN, num_eval: int = NUM_EVAL
) -> tuple[list[dict], list[dict]]:
    """Disjoint train/eval lists of {"prompt": "reverse <digits>=", "completion": "<digits reversed>"}."""
    rng = random.Random(seed)
    seen: set[str] = set()
    examples = []
    while len(examples) < num_train + num_eval:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS)))
        if digits in seen:
            continue
        seen.add(digits)
        examples.append({"prompt": f"reverse {digits}=", "completion": digits[::-1]})
    return examples[:num_train], examples[num_train:]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="output directory")
    args = parser.parse_args()
    train, evaluation = make_examples()
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "eval.jsonl", evaluation)
    print(f"wrote {len(train)} train and {len(evaluation)} eval examples to {args.out}")


if __name__ == "__main__":
    main()
