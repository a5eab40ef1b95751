"""Scheduled retraining on new data whose tokenizer is retrained: the champion keeps its alias.

A pipeline whose tokenizer is trained on its data (as the demo's is) gets a new vocabulary when the data
gains new words. The champion must then be measured on the eval examples tokenized with its own
tokenizer, and the two models compared on a quantity that does not depend on the tokenization.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from pipelines_fixture import TINY_LLAMA

pytestmark = pytest.mark.slow


def write_data(path: Path, n: int, *, word: str = "add", seed: int = 0) -> None:
    """`n` small additions written as `<word> 1 2=` → `3`."""
    rng = random.Random(seed)
    with open(path, "a") as handle:
        for _ in range(n):
            a, b = rng.randint(0, 2), rng.randint(0, 2)
            handle.write(json.dumps({"prompt": f"{word} {a} {b}=", "completion": str(a + b)}) + "\n")


def retrain_pipeline(root: Path) -> Path:
    """A tiny pipeline whose tokenizer is trained on `data.train`, like the demo's, with a fixed eval file.

    `train_more.jsonl` adds examples with a more frequent new word: its tokenizer learns those merges
    first, so the eval prompts' `add` gets other (and larger) ids than the champion's tokenizer gives it.
    """
    write_data(root / "eval.jsonl", 24, seed=1)
    write_data(root / "train.jsonl", 96)
    write_data(root / "train_more.jsonl", 96, seed=2)
    write_data(root / "train_more.jsonl", 192, word="plus", seed=3)
    body = {
        "model": {
            "from_config": dict(TINY_LLAMA),
            "tokenizer": {"vocab_size": 300},
        },
        "data": {"train": "train.jsonl", "eval": "eval.jsonl", "format": "prompt_completion", "max_length": 16},
        "budget": {"device": "cpu", "memory": "auto"},
        "train": {"effective_batch_size": 8, "learning_rate": 1e-2, "max_steps": 40, "checkpoint_every_steps": 40,
                  "log_every_steps": 10, "mixed_precision": "no", "warmup_ratio": 0.0},
        "evaluate": {"max_generate_examples": 4, "max_new_tokens": 3, "batch_size": 16},
        "register": {"model_name": "retrain-model", "require_better_than_base": False},
    }
    path = root / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"workdir": "work", "pipelines": {"tiny": body}}, sort_keys=False))
    return path


def run(path: Path, **overrides):
    from flows.pipeline import Overrides, finetune_pipeline

    return finetune_pipeline(pipeline="tiny", overrides=Overrides(extra=overrides) if overrides else None,
                             pipelines_file=str(path))


def test_retraining_with_a_new_vocabulary_keeps_the_better_champion(tmp_path, prefect_server):
    from mlflow.tracking import MlflowClient

    from fulltune.tracking import registry

    pipelines = retrain_pipeline(tmp_path)
    first = run(pipelines)
    assert first.version == "1" and "champion" in first.aliases

    # More data with new words: the retrained tokenizer has ids the champion's embedding does not have.
    second = run(pipelines, **{"data.train": "train_more.jsonl", "train.max_steps": 1, "train.learning_rate": 1e-6})
    assert second.stages["tokenize"] == "ran" and second.stages["evaluate"] == "ran"
    assert second.version == "2" and second.aliases == ("challenger",) and not second.promoted
    assert registry.current_champion("retrain-model").version == "1"
    assert "tokenizer" in second.gate

    tags = MlflowClient().get_model_version("retrain-model", "2").tags
    assert tags["fulltune.comparison"] == "per_byte"
    assert "tokenizer" in tags["fulltune.comparison_reason"]
    reports = list((tmp_path / "work" / "evals").glob("*/report.md"))
    assert any("per byte" in report.read_text() for report in reports)
