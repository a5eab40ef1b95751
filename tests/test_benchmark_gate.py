"""Gating the champion on benchmarks, through `fulltune run`, offline: local lm-evaluation-harness
multiple-choice tasks and a metric function run for base, fine-tuned and champion; a version that wins
on loss but regresses a guard task stays challenger, with the reason in its tags."""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from pipelines_fixture import tiny_pipeline

pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.slow, pytest.mark.server]

LETTERS = "qxzjkvwy"


def write_task(directory: Path, name: str, answer_is_digits: bool, n: int = 24, seed: int = 7) -> Path:
    """A 4-way multiple-choice task on held-out additions: `format_mc` asks for the sum among strings of
    letters (a model that learned the data's format picks digits), `letters_mc` asks the opposite, so
    training makes it worse — the guard task."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        digits = str(a + b)
        letters = ["".join(rng.choice(LETTERS) for _ in digits) for _ in range(3)]
        if answer_is_digits:
            choices, answer = [digits, *letters], digits
        else:
            choices = [letters[0], *("".join(rng.choice("0123456789") for _ in digits) for _ in range(3))]
            answer = letters[0]
        rng.shuffle(choices)
        rows.append({"prompt": f"{a}+{b}=", "choices": choices, "label": choices.index(answer)})
    (directory / "tasks").mkdir(exist_ok=True)
    (directory / "tasks" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": f"{name}.jsonl"}},
              "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{prompt}}",
              "doc_to_choice": "{{choices}}", "doc_to_target": "label", "target_delimiter": "",
              "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    path = directory / "tasks" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run(path: Path, *overrides: str) -> str:
    """`fulltune run tiny -f PATH --set ...`; returns what it printed."""
    from fulltune.cli import main

    args = ["run", "tiny", "-f", str(path)]
    for item in overrides:
        args += ["--set", item]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    assert code == 0, out.getvalue()[-3000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prefect_server):
    """Version 1: one step at a negligible learning rate, the base model in all but name (champion: there
    is none yet, and the guard holds against the base). Version 2: trained, so it wins on loss, picks
    digits on format_mc and regresses on letters_mc."""
    root = tmp_path_factory.mktemp("benchmarks")
    write_task(root, "format_mc", answer_is_digits=True)
    write_task(root, "letters_mc", answer_is_digits=False)
    shutil.copytree(ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("*.pyc", "__pycache__"))
    path = tiny_pipeline(
        root, train={"max_steps": 12},
        evaluate={"lm_eval": {"tasks": ["tasks/format_mc.yaml", "tasks/letters_mc.yaml"], "limit": 24},
                  "metrics": {"answer_format": "examples.metrics:answer_format"}},
        register={"promote_if": [{"metric": "eval_loss"},
                                 {"metric": "letters_mc/acc", "mode": "max", "max_regression": 0.1}]})
    first = run(path, "train.max_steps=1", "train.learning_rate=1e-9")
    second = run(path)
    return root, first, second


def versions(root: Path) -> dict[str, object]:
    from mlflow.tracking import MlflowClient

    from fulltune.tracking import registry

    registry.configure(root / "work")
    client = MlflowClient()
    return {str(v.version): client.get_model_version("tiny-model", str(v.version))
            for v in client.search_model_versions("name='tiny-model'")}


def report(root: Path, version) -> dict[str, dict[str, float]]:
    """The evaluation's metrics MLflow logged for the run that registered `version` (`eval/<candidate>.<metric>`), by
    candidate."""
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient().get_run(version.run_id).data.metrics
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if key.startswith("eval/"):
            candidate, _, name = key.removeprefix("eval/").partition(".")
            out.setdefault(candidate, {})[name] = value
    return out


def test_the_task_accuracy_is_reported_for_base_and_fine_tuned_and_registered(runs):
    root, _, second = runs
    found = versions(root)
    assert sorted(found) == ["1", "2"]
    logged = report(root, found["2"])
    base, tuned = logged["base"], logged["fine_tuned"]
    assert tuned["format_mc/acc"] > base["format_mc/acc"]
    assert {"format_mc/acc", "letters_mc/acc", "answer_format"} <= set(base) & set(tuned) & set(logged["champion"])
    tags = found["2"].tags
    assert float(tags["metric.format_mc/acc"]) == pytest.approx(tuned["format_mc/acc"], abs=1e-5)
    assert float(tags["metric.answer_format"]) == pytest.approx(tuned["answer_format"], abs=1e-5)
    # The run summary shows the benchmark rows; the evaluation report has them beside the loss.
    assert "format_mc/acc: base" in second and "letters_mc/acc: base" in second
    (report_file,) = {p for p in (root / "work" / "evals").glob("*/report.md")
                      if "Champion version" in p.read_text()}
    assert "| format_mc/acc |" in report_file.read_text()


def test_a_version_that_wins_on_loss_but_regresses_a_guard_stays_challenger(runs):
    root, _, _ = runs
    found = versions(root)
    assert found["1"].aliases == ["champion"] and found["2"].aliases == ["challenger"]
    logged = report(root, found["2"])
    tuned, champion = logged["fine_tuned"], logged["champion"]
    assert tuned["eval_loss"] < champion["eval_loss"], "the new version wins on loss"
    assert tuned["letters_mc/acc"] < champion["letters_mc/acc"] - 0.1, "and regresses on the guard task"
    tags = found["2"].tags
    assert tags["fulltune.gate.eval_loss"].startswith("passed: eval_loss")
    assert tags["fulltune.gate.letters_mc/acc"].startswith("failed: letters_mc/acc")
    assert "more than max_regression 0.1" in tags["fulltune.gate"]
    assert "beats the champion" not in tags["fulltune.gate"]


def test_the_version_description_says_what_was_trained_on_what_and_how_it_compared(runs):
    root, _, _ = runs
    found = versions(root)
    first, second = found["1"].description, found["2"].description
    assert "promoted to champion" in first and "stays challenger" in second
    for text in (first, second):
        assert "Pipeline `tiny`" in text and "train.jsonl" in text and "micro_batch_size=" in text
        assert "| metric | base | fine_tuned" in text and "| format_mc/acc |" in text
    assert "12 optimizer steps" in second and "champion v1" in second
    assert "letters_mc/acc" in second and "max_regression" in second
