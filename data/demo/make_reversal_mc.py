"""Write the demo's multiple-choice benchmark: which string is the reversal? (an lm-evaluation-harness task)

    {"prompt": "reverse 48213=", "choices": ["31248", "31284", "48213", "13284"], "label": 1}

The questions are the first held-out strings of data/demo/eval.jsonl (never trained on); the three
wrong choices use the same digits in another order (the string unreversed, a rotation, a swap), so only
a model that learned to reverse picks the right one, and every choice is as many tokens long as the
answer (the demo tokenizer spells digits one by one), so accuracy compares like with like.
`reversal_mc.yaml` is the task: the harness scores each choice by its log-likelihood after the prompt.

    python data/demo/make_reversal_mc.py      # rewrites data/demo/reversal_mc.jsonl (fixed seed)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 1234
NUM_QUESTIONS = 100


def distractors(digits: str) -> list[str]:
    """Wrong answers made of the same digits, in a fixed order of preference."""
    answer = digits[::-1]
    candidates = [digits, answer[1:] + answer[0], answer[-1] + answer[:-1], answer[1] + answer[0] + answer[2:],
                  answer[:-2] + answer[-1] + answer[-2], "".join(sorted(digits)), "".join(sorted(digits, reverse=True))]
    return [c for c in dict.fromkeys(candidates) if c != answer]


def make_questions(records: list[dict], num: int = NUM_QUESTIONS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    questions = []
    for record in records:
        digits = record["prompt"].removeprefix("reverse ").removesuffix("=")
        wrong = distractors(digits)
        if len(wrong) < 3:
            continue  # e.g. "000": too few distinct orders of its digits
        choices = [digits[::-1], *wrong[:3]]
        rng.shuffle(choices)
        questions.append({"prompt": record["prompt"], "choices": choices, "label": choices.index(digits[::-1])})
        if len(questions) == num:
            break
    return questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "reversal_mc.jsonl")
    args = parser.parse_args()
    records = [json.loads(line) for line in (HERE / "eval.jsonl").read_text().splitlines()]
    questions = make_questions(records)
    args.out.write_text("".join(json.dumps(q) + "\n" for q in questions))
    print(f"wrote {len(questions)} questions to {args.out}")


if __name__ == "__main__":
    main()
