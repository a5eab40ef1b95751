"""MLflow registry: versions, tags, the champion gate, and loading `@champion` in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fulltune.tracking import gates, registry
from fulltune.tracking.gates import GateDecision, decide_promotion
from fulltune.spec import PromoteIf

from tiny import make_model, make_tokenizer


def test_gate_promotes_first_model_and_only_improvements():
    assert decide_promotion({"eval_loss": 1.0}, None, {"eval_loss": 2.0}, "eval_loss", "min", 0.0, True).promote
    assert decide_promotion({"eval_loss": 1.0}, {"eval_loss": 1.2}, None, "eval_loss", "min", 0.1, True).promote
    assert not decide_promotion({"eval_loss": 1.15}, {"eval_loss": 1.2}, None, "eval_loss", "min", 0.1, True).promote
    assert not decide_promotion({"eval_loss": 1.2}, {"eval_loss": 1.2}, None, "eval_loss", "min", 0.0, True).promote
    assert decide_promotion({"exact_match": 0.6}, {"exact_match": 0.5}, None, "exact_match", "max", 0.05, True).promote


def test_gate_never_promotes_a_model_worse_than_its_base():
    decision = decide_promotion({"eval_loss": 3.0}, None, {"eval_loss": 2.0}, "eval_loss", "min", 0.0, True)
    assert not decision.promote
    assert "base model" in decision.reason
    # The version's label names the setting that refused it, not register.promote_if.
    assert decision.rules == "`register.require_better_than_base`"
    assert decide_promotion({"eval_loss": 1.0}, None, {"eval_loss": 2.0}, "eval_loss", "min", 0.0,
                            True).rules == "`register.promote_if`"


def test_a_registration_names_its_outcome_and_what_loads_it():
    from fulltune.tracking.registry import Registration

    first = Registration("m", "1", ("challenger",), False, "does not beat the base model", "run")
    assert first.outcome() == "v1 · not promoted" and first.model_uri() == "models:/m/1", "no champion to load"
    champion = Registration("m", "3", ("challenger", "champion"), True, "no champion yet", "run")
    assert champion.outcome() == "v3 · champion" and champion.model_uri() == "models:/m@champion"
    assert champion.outcome(cached=True) == "v3 · nothing new registered"
    assert registry.run_name("demo", first.outcome()) == "demo · v1 · not promoted"


def test_gate_keeps_a_champion_that_could_not_be_compared():
    # evaluate.compare_champion: false, or no comparable measurement: a better-looking model stays challenger.
    decision = decide_promotion({"eval_loss": 0.1}, None, {"eval_loss": 2.0}, "eval_loss", "min", 0.0, True,
                                keep_champion="evaluate.compare_champion is false")
    assert not decision.promote
    assert decision.reason == "the champion keeps its alias: evaluate.compare_champion is false"
    assert "evaluate.compare_champion" in decision.rules


def test_gate_refuses_non_finite_metric():
    assert not decide_promotion({"eval_loss": float("nan")}, None, None, "eval_loss", "min", 0.0, True).promote


NAN = float("nan")
GOOD = {"eval_loss": 1.0, "fmt": 0.9}


def _gate(**kwargs):
    return PromoteIf(**kwargs)


@pytest.mark.parametrize("side, values", [
    ("new model", {"candidate": {"eval_loss": NAN, "fmt": 0.9}}),
    ("new model", {"candidate": {"fmt": 0.9}}),
    ("champion", {"champion": {"eval_loss": NAN, "fmt": 0.5}}),
    ("champion", {"champion": {"fmt": 0.5}}),
    ("base model", {"base": {"eval_loss": NAN, "fmt": 0.5}}),
    ("base model", {"base": {"fmt": 0.5}}),
])
def test_gate_fails_a_condition_on_a_nan_or_missing_value_on_either_side(side, values):
    # The metric form (must beat the champion, and the base model).
    scores = {"candidate": GOOD, "champion": {"eval_loss": 2.0, "fmt": 0.5}, "base": {"eval_loss": 3.0, "fmt": 0.5},
              **values}
    decision = gates.decide_gates(scores["candidate"], scores["champion"], scores["base"],
                                     [_gate(metric="eval_loss")], True)
    assert not decision.promote
    tag = gates.gate_tags(decision)["fulltune.gate.eval_loss"]
    assert tag.startswith("failed: ") and side in tag and ("missing" in tag or "not finite" in tag)


@pytest.mark.parametrize("side, champion, base", [
    ("champion", {"fmt": NAN}, {"fmt": 0.5}),
    ("champion", {"eval_loss": 2.0}, {"fmt": 0.5}),
    ("base model", None, {"fmt": NAN}),
    ("base model", None, {"eval_loss": 3.0}),
])
def test_a_guard_holds_against_no_nan_or_missing_reference(side, champion, base):
    # `fmt 0 within max_regression 0.0 of the base model's nan` used to promote.
    decision = gates.decide_gates({"eval_loss": 1.0, "fmt": 0.0}, champion, base,
                                     [_gate(metric="fmt", mode="max", max_regression=0.0)], True)
    assert not decision.promote
    tag = gates.gate_tags(decision)["fulltune.gate.fmt"]
    assert tag.startswith("failed: ") and side in tag and "max_regression 0.0" in tag


@pytest.mark.parametrize("champion", [{"eval_loss": 2.0, "fmt": NAN}, {"eval_loss": 2.0}])
def test_a_list_of_conditions_fails_on_the_one_with_a_nan_or_missing_value(champion):
    conditions = [_gate(metric="eval_loss"), _gate(metric="fmt", mode="max", max_regression=0.1)]
    decision = gates.decide_gates({"eval_loss": 1.0, "fmt": 0.5}, champion, {"eval_loss": 3.0, "fmt": 0.5},
                                  conditions, True)
    assert not decision.promote
    tags = gates.gate_tags(decision)
    assert tags["fulltune.gate.eval_loss"].startswith("passed: ")
    assert tags["fulltune.gate.fmt"].startswith("failed: fmt 0.5: the champion's fmt is")
    assert tags["fulltune.gate"] == tags["fulltune.gate.fmt"].removeprefix("failed: ")


def test_a_guard_with_finite_values_on_both_sides_still_passes():
    decision = gates.decide_gates({"eval_loss": 1.0, "fmt": 0.45}, {"eval_loss": 2.0, "fmt": 0.5}, None,
                                     [_gate(metric="eval_loss"), _gate(metric="fmt", mode="max", max_regression=0.1)],
                                     True)
    assert decision.promote


def test_secrets_never_reach_params():
    flat = registry.flatten({"model": {"token": "hf_abc", "token_env": "HF_TOKEN", "name": "x"},
                             "uri": "postgresql://user:hunter2@db:5432/mlflow"})
    assert "model.token" not in flat
    assert flat["model.token_env"] == "HF_TOKEN"
    assert "hunter2" not in flat["uri"] and "user:***@db" in flat["uri"]


@pytest.mark.slow
def test_register_aliases_and_load_champion_in_fresh_process(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = registry.configure(tmp_path)
    tok = make_tokenizer(tmp_path / "tok")
    good = make_model(tmp_path / "good", tok, seed=0)
    worse = make_model(tmp_path / "worse", tok, seed=1)

    run = registry.start_pipeline_run("p", {"a": 1}, {}, tmp_path)
    first = registry.register_model(good, "tiny", run, {registry.TAG_TRAIN_KEY: "k1"}, {"eval_loss": 1.0},
                                    GateDecision(True, "no champion yet"))
    assert first.version == "1" and set(first.aliases) == {"challenger", "champion"}
    champion = registry.current_champion("tiny")
    assert champion.version == "1" and champion.train_key == "k1" and champion.metrics["eval_loss"] == 1.0

    decision = decide_promotion({"eval_loss": 1.5}, champion.metrics, None, "eval_loss", "min", 0.0, True)
    second = registry.register_model(worse, "tiny", run, {registry.TAG_TRAIN_KEY: "k2"}, {"eval_loss": 1.5},
                                     decision)
    assert second.version == "2" and second.aliases == ("challenger",)
    assert registry.current_champion("tiny").version == "1"
    assert registry.version_exists("tiny", "2", "k2") and not registry.version_exists("tiny", "2", "k1")

    script = ("import mlflow; p = mlflow.transformers.load_model('models:/tiny@champion'); "
              "out = p('12+35=', max_new_tokens=4, do_sample=False); print('GENERATED', type(out[0]['generated_text']))")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "GENERATED <class 'str'>" in done.stdout


def test_a_new_workdir_store_is_a_copy_of_the_machines_empty_one_and_opens_like_one_mlflow_made(tmp_path,
                                                                                                monkeypatch):
    """A new workdir's SQLite store starts from the empty store this MLflow version made once on the machine
    (not from its schema migrations again); MLflow opens it as its own, and a store already there is kept."""
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("FULLTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "cache" / "mlflow-store" / mlflow.__version__ / "mlflow.db"
    registry.configure(tmp_path / "first")
    assert empty.exists() and (tmp_path / "first" / "mlflow.db").exists()
    made = empty.stat().st_mtime_ns

    registry.configure(tmp_path / "second")
    experiment_id = registry.experiment_id("tiny", tmp_path / "second")
    client = MlflowClient()
    run = client.create_run(experiment_id)
    client.log_metric(run.info.run_id, "loss", 1.5)
    client.create_registered_model("tiny-model")
    default = client.get_experiment("0")
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "mlruns" / "0")
    assert empty.stat().st_mtime_ns == made  # read, not made again
    assert sorted(p.name for p in (tmp_path / "second").iterdir()) == ["mlflow.db"]  # no partial copy left

    registry.configure(tmp_path / "second")  # an existing store is never replaced
    assert MlflowClient().get_run(run.info.run_id).data.metrics == {"loss": 1.5}


def test_the_summary_loads_the_version_it_registered_where_it_holds_no_champion_alias():
    from fulltune.tracking.summary import PipelineSummary

    def load_line(aliases: tuple[str, ...]) -> str:
        summary = PipelineSummary("p", {}, "", {}, {}, "m", "1", aliases, "champion" in aliases, "", "sqlite:///x", "r")
        return summary.lines()[-1]

    assert "load_model('models:/m@champion')" in load_line(("challenger", "champion"))
    # A first version that was not promoted: there is no champion alias to load.
    assert "load_model('models:/m/1')" in load_line(("challenger",))
