"""Held-out data as a user grows it: one CSV file, then three sources of three formats, then one renamed. Each
source is evaluated on its own (its first `max_examples` rows, its own generations, its own metric names, in the
characters MLflow accepts), only evaluation re-runs, and the names follow the files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pipelines_fixture import tiny_pipeline
from runs import finish, fulltune_run

pytestmark = pytest.mark.slow

# The team's metric returns a key MLflow refuses as it is: it is reported as digits/digits_strict.
TEAM_METRICS = "def digits(completions, references):\n    return {'digits (strict)': 1.0}\n"
# The constant metric never beats the base model: the first version is not promoted.
GATE = {"metric": "digits/digits_strict", "mode": "max"}
HELD_OUT = "held-out (v2).csv"  # reported as held-out_v2
THREE = [{"path": "chat.jsonl", "format": "chat"}, HELD_OUT, {"path": "notes.txt", "format": "text"}]


def _pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """Additions whose sums are written with two digits ("07"): a CSV reader that infers numbers breaks them."""
    rng = random.Random(seed)
    return [(f"{a}+{b}=", str(a + b).zfill(2)) for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n))]


def _pipeline(root: Path, evals, gates: list[dict]) -> Path:
    return tiny_pipeline(root, data={"train": "train.csv", "eval": evals, "max_length": 32},
                         evaluate={"max_examples": 3, "max_generate_examples": 2,
                                   "metrics": {"digits": "reported_metrics:digits"}},
                         register={"promote_if": gates, "require_better_than_base": True})


def _flow(path: Path):
    from flows.pipeline import finetune_pipeline

    return finetune_pipeline(pipeline="tiny", pipelines_file=str(path))


@pytest.fixture(scope="module")
def grown(tmp_path_factory, prefect_server) -> dict:
    """`fulltune run` with one held-out CSV file; then (the flow, in this process) the three sources; then with
    the text source's file renamed."""
    root = tmp_path_factory.mktemp("eval-sources")
    (root / "train.csv").write_text("prompt,completion\n" + "".join(f"{p},{c}\n" for p, c in _pairs(96, 0)))
    (root / HELD_OUT).write_text("prompt,completion\n" + "".join(f"{p},{c}\n" for p, c in _pairs(8, 1)))
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": p}, {"role": "assistant", "content": c}]}) + "\n" for p, c in _pairs(5, 2)))
    (root / "notes.txt").write_text("".join(f"{p}{c}\n" for p, c in _pairs(6, 3)))
    (root / "reported_metrics.py").write_text(TEAM_METRICS)
    path = _pipeline(root, HELD_OUT, [GATE])
    log = finish(fulltune_run(path, root / "first.log", prefect_server), root / "first.log")
    three = _flow(_pipeline(root, THREE, [GATE, {"metric": "exact_match/held-out_v2", "max_regression": 1.0}]))
    (root / "notes.txt").rename(root / "general.txt")
    renamed = _flow(_pipeline(root, [*THREE[:2], {"path": "general.txt", "format": "text"}],
                              [GATE, {"metric": "eval_loss/general", "max_regression": 100.0}]))
    return {"log": log, "three": three, "renamed": renamed}


def test_a_csv_of_digit_strings_trains_and_an_unpromoted_version_is_loaded_by_its_number(grown):
    log = grown["log"]
    assert "registered tiny-model version 1, aliases: challenger (digits/digits_strict 1 does not beat" in log
    assert "load_model('models:/tiny-model/1')" in log and "@champion" not in log


def test_each_source_is_evaluated_on_its_own_first_rows_with_its_own_generations(grown):
    first, three = grown["three"], grown["three"].evaluation["fine_tuned"]
    # A second and third held-out file re-evaluate; the training (and its version) stays.
    assert first.stages["fine-tune"] == "cached" and first.stages["evaluate"] == "ran" and first.version == "1"
    for source in ("chat", "held-out_v2", "notes"):
        assert f"eval_loss/{source}" in three and f"bits_per_byte/{source}" in three
    # Only the prompt/completion source has completions to generate for, though it is not the first source.
    assert "exact_match/held-out_v2" in three and "exact_match/chat" not in three and "exact_match/notes" not in three
    assert three["exact_match"] == three["exact_match/held-out_v2"]
    assert three["digits/digits_strict"] == 1.0
    # max_examples keeps the first 3 rows of each source: the CSV source's loss is what it was alone (the first
    # run's summary line, to its 4 decimals).
    line = next(line for line in grown["log"].splitlines() if line.startswith("  eval_loss: "))
    assert three["eval_loss/held-out_v2"] == pytest.approx(float(line.split("fine_tuned ")[1]), abs=1e-4)


def test_a_renamed_source_is_evaluated_again_under_its_new_name(grown):
    renamed = grown["renamed"]
    assert renamed.stages["fine-tune"] == "cached" and renamed.stages["evaluate"] == "ran"
    tuned = renamed.evaluation["fine_tuned"]
    assert "eval_loss/general" in tuned and not any(name.endswith("/notes") for name in tuned)
    assert tuned["eval_loss/general"] == grown["three"].evaluation["fine_tuned"]["eval_loss/notes"]
