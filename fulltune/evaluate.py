"""Held-out evaluation: loss, perplexity and exact match of greedy generations.

Every candidate (base model, fine-tuned model, current champion) is measured the same way on the same
tokenized eval rows, so the registry gate compares like with like. There is no fallback measurement:
if a candidate cannot be evaluated, the stage fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from fulltune.data import IGNORE_INDEX


@dataclass(frozen=True)
class ModelMetrics:
    eval_loss: float
    perplexity: float
    eval_tokens: int
    exact_match: float | None = None
    generated_examples: int = 0
    samples: tuple[tuple[str, str, str], ...] = ()  # (prompt, expected, generated) for the report

    def as_dict(self) -> dict[str, float]:
        values = {"eval_loss": self.eval_loss, "perplexity": self.perplexity}
        if self.exact_match is not None:
            values["exact_match"] = self.exact_match
        return values


@dataclass(frozen=True)
class EvalReport:
    """Metrics per candidate: `base`, `fine_tuned`, and `champion` when one was compared."""

    candidates: dict[str, ModelMetrics]
    num_examples: int
    champion_version: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def markdown(self) -> str:
        names = list(self.candidates)
        lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for metric in ("eval_loss", "perplexity", "exact_match"):
            cells = []
            for name in names:
                value = self.candidates[name].as_dict().get(metric)
                cells.append("—" if value is None else f"{value:.4f}")
            lines.append(f"| {metric} | " + " | ".join(cells) + " |")
        tuned = self.candidates.get("fine_tuned")
        if tuned and tuned.samples:
            lines += ["", "| prompt | expected | fine-tuned output |", "|---|---|---|"]
            lines += [f"| `{p!r}` | `{e!r}` | `{g!r}` |" for p, e, g in tuned.samples[:5]]
        return "\n".join(lines)


def read_eval_rows(eval_file: str, max_examples: int | None) -> list[dict[str, Any]]:
    table = pq.read_table(eval_file)
    if max_examples is not None:
        table = table.slice(0, max_examples)
    return table.to_pylist()


def evaluate_model(model_path: str, tokenizer_path: str, rows: list[dict[str, Any]], *, batch_size: int,
                   generate_examples: int, max_new_tokens: int, device: str, load_kwargs: dict[str, Any]) -> ModelMetrics:
    """Token-weighted mean loss over every labelled token, perplexity = exp(loss), and exact match."""
    import torch

    from fulltune.data import collate
    from fulltune.loss import TargetHead, Targets
    from fulltune.models import load_model, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path, revision=load_kwargs.get("revision"),
                               trust_remote_code=load_kwargs.get("trust_remote_code", False),
                               token=load_kwargs.get("token"))
    model = load_model(model_path, **load_kwargs).to(device).eval()
    head = TargetHead(model)  # the loss as training computes it: logits only where there is a target
    total_loss = torch.zeros((), dtype=torch.float64)
    total_tokens = 0
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            batch = collate(rows[start:start + batch_size], tokenizer.pad_token_id)
            targets = Targets.from_labels(batch.pop("labels"))
            inputs = {name: tensor.to(device) for name, tensor in batch.items()}
            total_loss += head.loss_sum(model, inputs, targets.to(device)).double().cpu()
            total_tokens += len(targets)
    head.remove()
    if total_tokens == 0:
        raise ValueError("the eval set has no labelled tokens")
    eval_loss = float(total_loss) / total_tokens
    exact, samples, generated = None, (), 0
    if generate_examples > 0 and rows and rows[0].get("completion") is not None:
        exact, samples = _exact_match(model, tokenizer, rows[:generate_examples], max_new_tokens, device, batch_size)
        generated = min(generate_examples, len(rows))
    return ModelMetrics(eval_loss, math.exp(min(eval_loss, 700.0)), total_tokens, exact, generated, samples)


def _exact_match(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int, device: str,
                 batch_size: int) -> tuple[float, tuple[tuple[str, str, str], ...]]:
    """Greedy generation from the prompt tokens (the unlabelled prefix of each row)."""
    import torch

    hits, samples = 0, []
    pad = tokenizer.pad_token_id
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [_prompt_ids(row) for row in chunk]
        width = max(len(p) for p in prompts)
        # Left padding so every prompt ends where generation starts.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            output = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        for row, sequence in zip(chunk, output[:, width:].tolist()):
            text = tokenizer.decode(sequence, skip_special_tokens=True).strip()
            expected = str(row["completion"]).strip()
            hits += int(text == expected)
            samples.append((str(row.get("prompt", "")), expected, text))
    return hits / len(rows), tuple(samples)


def _prompt_ids(row: dict[str, Any]) -> list[int]:
    labels = row["labels"]
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    return list(row["input_ids"][:first])
