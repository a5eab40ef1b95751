"""A tiny pipeline in a temp directory: learnable data, a 2-layer Llama, a trained BPE tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml


def write_addition_data(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            handle.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")
    return path


# The 2-layer Llama every end-to-end test trains.
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": True}


def tiny_pipeline(tmp_path: Path, **sections) -> Path:
    """Write `pipelines.yaml` with one pipeline `tiny`; keyword sections override the defaults."""
    write_addition_data(tmp_path / "train.jsonl", 96)
    body = {
        "model": {
            "from_config": dict(TINY_LLAMA),
            "tokenizer": {"vocab_size": 96},
        },
        "data": {"train": "train.jsonl", "format": "prompt_completion", "max_length": 16, "eval_split": 0.25},
        "budget": {"device": "cpu", "memory": "auto"},
        "train": {"effective_batch_size": 4, "learning_rate": 3e-3, "max_steps": 6, "checkpoint_every_steps": 3,
                  "log_every_steps": 2, "mixed_precision": "no", "warmup_ratio": 0.0},
        "evaluate": {"max_generate_examples": 4, "max_new_tokens": 3, "batch_size": 8},
        "register": {"model_name": "tiny-model", "require_better_than_base": False},
    }
    for name, values in sections.items():
        body[name] = {**body.get(name, {}), **values}
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"workdir": "work", "pipelines": {"tiny": body}}, sort_keys=False))
    return path


def evaluate_key(p, trained_key: str, data_fingerprint: str, champion_version: str | None) -> str:
    """The evaluate stage's cache key of pipeline `p` (a ResolvedPipeline) after stand-ins for the stages before
    it: weights `trained_key`, data `data_fingerprint`, no planned evaluation, the champion's version."""
    from types import SimpleNamespace

    from fulltune.stages import FINE_TUNE, MEMORY_BUDGET, TOKENIZE, evaluate
    from fulltune.stages.runner import Inputs, key_of

    records = {TOKENIZE: SimpleNamespace(data=SimpleNamespace(fingerprint=data_fingerprint)),
               MEMORY_BUDGET: SimpleNamespace(plan={}), FINE_TUNE: SimpleNamespace(key=trained_key)}
    champion = SimpleNamespace(version=champion_version) if champion_version is not None else None
    return key_of(evaluate.STAGE, Inputs(p, records=records, champion=champion))
