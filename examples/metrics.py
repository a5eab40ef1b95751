"""A team's own evaluation metrics for `evaluate.metrics` (see examples/README.md).

Each function gets the greedy completions the evaluate stage generated (`evaluate.max_generate_examples`
of the held-out prompts, `evaluate.max_new_tokens` each, special tokens removed, stripped) and the
expected completions, two lists of str of the same length, and returns a number, or a mapping of numbers
that become `<name>/<key>`. Every candidate (base, fine-tuned, champion) is scored with the same function
on its own generations, so `register.promote_if` can gate on the result:

    evaluate:
      metrics:
        exact_match_ci: examples.metrics:exact_match_ci
        json: examples.metrics:json_validity           # → json/valid and json/keys_match
        answer_format: examples.metrics:answer_format
    register:
      promote_if:
        - {metric: eval_loss}
        - {metric: json/valid, mode: max, max_regression: 0.0}   # a guard: never less valid JSON

`module:function` is imported with the pipelines file's directory first on `sys.path`, so this file is
`examples.metrics` for a pipelines.yaml at the repository root. A function that raises, or returns
something that is not a number, stops the evaluation with a message naming `evaluate.metrics.<name>`.
"""

from __future__ import annotations

import json
import re


def exact_match_ci(completions: list[str], references: list[str]) -> float:
    """Exact match ignoring case and runs of whitespace."""

    def norm(text: str) -> str:
        return " ".join(text.lower().split())

    return _mean(norm(c) == norm(r) for c, r in zip(completions, references))


def json_validity(completions: list[str], references: list[str]) -> dict[str, float]:
    """`valid`: the share of completions that parse as JSON; `keys_match`: the share that parse to an
    object with the same keys as the reference object."""
    valid, keys = [], []
    for completion, reference in zip(completions, references):
        parsed, expected = _json(completion), _json(reference)
        valid.append(parsed is not None)
        keys.append(isinstance(parsed, dict) and isinstance(expected, dict) and parsed.keys() == expected.keys())
    return {"valid": _mean(valid), "keys_match": _mean(keys)}


# An answer a parser downstream accepts: digits only (the demo's reversals); change to your format.
ANSWER = re.compile(r"^\d+$")


def answer_format(completions: list[str], references: list[str]) -> float:
    """The share of completions a downstream parser would accept (ANSWER), right or wrong."""
    return _mean(bool(ANSWER.match(c)) for c in completions)


def _json(text: str) -> object | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _mean(values) -> float:
    values = list(values)
    return sum(map(bool, values)) / len(values) if values else 0.0
