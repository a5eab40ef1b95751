"""Autotune: `fulltune plan --autotune` measures the planner's top candidates in real training children,
chooses the fastest that fits, never fails because a candidate does, and does not tune twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import ROOT
from pipelines_fixture import tiny_pipeline

OUTCOMES = {"fits", "over budget", "oom", "failed", "timeout"}
TWO_QUICK = {"candidates": 2, "steps": 2}


def plan_cli(path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "fulltune.cli", "plan", "tiny", "-f", str(path), *args],
                          cwd=path.parent, env=full_env, capture_output=True, text=True, timeout=600)


def measurement_files(path: Path) -> list[Path]:
    return sorted((path.parent / "work" / "autotune" / "measurements").glob("*.json"))


@pytest.mark.slow
def test_plan_autotune_measures_each_candidate_and_a_second_plan_reuses_the_measurements(tmp_path):
    path = tiny_pipeline(tmp_path, data={"packing": False}, budget={"autotune": TWO_QUICK})
    result = plan_cli(path, "--autotune", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    tuned = json.loads(result.stdout)["autotune"]
    assert tuned["ran"] and len(tuned["candidates"]) == 2
    assert 0 < tuned["seconds"] <= tuned["max_seconds"]
    for candidate in tuned["candidates"]:
        assert candidate["outcome"] in OUTCOMES
        settings = candidate["settings"]
        assert settings["micro_batch_size"] * settings["gradient_accumulation_steps"] == 4  # the effective batch
        assert candidate["predicted_step_seconds"] > 0 and not candidate["cached"]
    fitting = [i for i, c in enumerate(tuned["candidates"]) if c["outcome"] == "fits"]
    assert fitting, tuned  # a tiny model on an idle-sized CPU budget
    for i in fitting:
        c = tuned["candidates"][i]
        assert c["measured_step_seconds"] > 0 and c["tokens_per_second"] > 0
        # the child's resident high-water mark: at least the interpreter with torch, within the budget
        assert 100 * 2**20 < c["measured_peak_bytes"] <= tuned["usable_bytes"]
    assert tuned["chosen"] == min(fitting, key=lambda i: tuned["candidates"][i]["measured_step_seconds"])
    assert Path(tuned["picture"]).read_bytes().startswith(b"\x89PNG")
    files = measurement_files(path)
    assert len(files) == 2
    mtimes = [f.stat().st_mtime_ns for f in files]

    # The same machine, model and settings: nothing runs again, and the choice is the same.
    again = plan_cli(path, "--autotune")
    assert again.returncode == 0, again.stderr[-3000:]
    table = again.stdout[again.stdout.index("autotune on cpu"):]
    assert "predicted" in table and "measured" in table
    assert table.count("(cached)") == 2 and "← chosen" in table
    assert measurement_files(path) == files
    assert [f.stat().st_mtime_ns for f in files] == mtimes  # no candidate was measured again


@pytest.mark.slow
def test_a_candidate_out_of_memory_is_recorded_and_the_analytic_plan_stands(tmp_path):
    path = tiny_pipeline(tmp_path, data={"packing": False}, budget={"autotune": {"candidates": 1, "steps": 1}})
    result = plan_cli(path, "--autotune", "--json", env={"FULLTUNE_TEST_FAULT": "oom:2"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert [c["outcome"] for c in out["autotune"]["candidates"]] == ["oom"]
    assert out["autotune"]["chosen"] is None and "analytic plan stands" in out["autotune"]["reason"]
    analytic = json.loads(plan_cli(path, "--json", "--set", "budget.autotune=false").stdout)
    assert out["plan"] == analytic["plan"]


# --- the choice, the time cap and the cache without training children ---------------------------------


@pytest.fixture()
def tiny(tmp_path):
    """The tiny pipeline, tokenized, with its budget decision (no tuning yet)."""
    from fulltune.planning import autotune
    from fulltune.stages import budget as budget_stage
    from fulltune.stages import resolve_pipeline

    path = tiny_pipeline(tmp_path, data={"packing": False}, budget={"autotune": {"candidates": 3, "steps": 2}})
    p = resolve_pipeline(str(path), "tiny")
    data, tokenizer = budget_stage.tokenized(p)
    decision = budget_stage.plan_and_tune(p, data, tokenizer, force=False)
    return p, data, tokenizer, decision


def test_the_fastest_candidate_within_the_budget_is_chosen_and_failures_are_recorded(tiny, monkeypatch):
    from fulltune.planning import autotune, autotune_report

    p, data, tokenizer, decision = tiny
    usable = decision.plan["usable_bytes"]
    # candidate 0 fits, 1 is faster but over the budget, 2 fails: 0 is chosen, nothing raises.
    results = iter([autotune._Measured("measured", 0.5, usable // 2, 100.0),
                    autotune._Measured("measured", 0.1, usable + 1, 500.0),
                    autotune._Measured("failed", detail="no such kernel")])
    monkeypatch.setattr(autotune, "measure", lambda *args: next(results))
    tuning = autotune.tune(p, decision, data, tokenizer, autotune.options(p.spec.budget.autotune))
    assert [t.outcome for t in tuning.trials] == ["fits", "over budget", "failed"]
    assert tuning.chosen == 0
    # measured candidates are kept, a failure is measured again next time
    assert len(list((Path(p.workdir) / "autotune" / "measurements").glob("*.json"))) == 2
    assert "no such kernel" in autotune_report.format_table(tuning)


def test_the_tuning_stops_at_max_seconds(tiny, monkeypatch):
    from fulltune.planning import autotune

    p, data, tokenizer, decision = tiny
    monkeypatch.setattr(autotune, "measure", lambda *args: pytest.fail("no candidate may start"))
    opts = replace(autotune.options(p.spec.budget.autotune), max_seconds=1.0)
    tuning = autotune.tune(p, decision, data, tokenizer, opts)
    assert {t.outcome for t in tuning.trials} == {"timeout"} and tuning.chosen is None


def test_a_candidate_beats_the_plan_only_by_beating_its_measured_time(tiny, monkeypatch):
    from fulltune.planning import autotune

    p, data, tokenizer, decision = tiny
    usable = decision.plan["usable_bytes"]
    # The plan ran out of time (never measured); candidate 1 fits: nothing shows it is faster than the plan.
    results = iter([autotune._Measured("timeout", detail="stopped after 4 s"),
                    autotune._Measured("measured", 0.2, usable // 2, 100.0),
                    autotune._Measured("measured", 0.3, usable // 2, 80.0)])
    monkeypatch.setattr(autotune, "measure", lambda *args: next(results))
    tuning = autotune.tune(p, decision, data, tokenizer, autotune.options(p.spec.budget.autotune))
    assert tuning.chosen is None and "the planned settings were not measured (timeout)" in tuning.reason


def test_time_a_candidate_does_not_use_flows_to_the_next_and_none_gets_less_than_it_needs(tiny, monkeypatch):
    from fulltune.planning import autotune

    p, data, tokenizer, decision = tiny
    given = []

    def quick(job, opts, timeout, step_tokens):
        given.append(timeout)
        return autotune._Measured("failed", detail="quick")

    monkeypatch.setattr(autotune, "measure", quick)
    opts = replace(autotune.options(p.spec.budget.autotune), max_seconds=24.0)
    autotune.tune(p, decision, data, tokenizer, opts)
    # A CPU child needs ~12 s to start: each candidate may use it, not an even third (8 s) of 24 s.
    assert len(given) == 3 and all(t > 12 for t in given), given


def test_durations_and_throughput_read_as_measured(tiny, monkeypatch):
    from fulltune.planning import autotune, autotune_report

    p, data, tokenizer, decision = tiny
    monkeypatch.setattr(autotune, "measure", lambda *args: pytest.fail("no candidate may start"))
    tuning = autotune.tune(p, decision, data, tokenizer,
                           replace(autotune.options(p.spec.budget.autotune), max_seconds=0.5))
    table = autotune_report.format_table(tuning)
    assert "of at most 0.5 s" in table and "the tuning's 0.5 s were spent" in table, table
    # tokens/s is the median step's tokens over the median step's time, like the step time beside it
    assert autotune.throughput([100, 100, 400], [1.0, 1.0, 10.0]) == 100.0


def test_the_budget_key_carries_the_hardware_the_tuning_measured(tiny, monkeypatch):
    from fulltune.planning import autotune
    from fulltune.stages import TOKENIZE, budget
    from fulltune.stages.runner import Inputs, key_of
    from fulltune.stages.tokenize import Tokenized

    p, data, tokenizer, _ = tiny
    keys = {}
    for cores in (2, 1):
        monkeypatch.setattr(autotune, "_cpu_info", lambda: {"name": "cpu", "count": cores, "machine": "x86_64"})
        keys[cores] = key_of(budget.STAGE, Inputs(p, records={TOKENIZE: Tokenized(data, tokenizer)}))
    assert keys[1] != keys[2]


def test_measured_step_times_calibrate_the_ranking_for_their_kind_of_step(tmp_path):
    from fulltune.planning import autotune
    from fulltune.memory import Settings
    from fulltune.planning import planner
    from fulltune.memory.shapes import model_shape
    from fulltune.models import config_from_spec
    from pipelines_fixture import TINY_LLAMA

    shape = model_shape(config_from_spec(dict(TINY_LLAMA), 96))
    info = autotune.hardware("cpu")
    fp32 = Settings(micro_batch_size=4, seq_len=16, device="cpu")
    bf16 = replace(fp32, mixed_precision="bf16")
    for settings, ratio in ((fp32, 2.0), (bf16, 8.0)):
        entry = {"version": autotune.CACHE_VERSION, "device_kind": autotune.device_kind(info), "status": "measured",
                 "shape": autotune._shape_dict(shape), "settings": settings.to_dict(),
                 "step_seconds": ratio * autotune.analytic_step_seconds(shape, settings)}
        autotune._write_measurement(tmp_path, autotune.measurement_key(info, shape, settings, autotune.Options()),
                                    entry)
    unmeasured = replace(fp32, optimizer="adafactor")
    with autotune.calibrated(tmp_path, "cpu") as factors:
        assert factors[autotune.step_kind(fp32)] == pytest.approx(2.0)
        for settings, factor in ((fp32, 2.0), (bf16, 8.0), (unmeasured, 5.0)):  # unmeasured: the median
            assert planner.step_seconds(shape, settings) == pytest.approx(
                factor * autotune.analytic_step_seconds(shape, settings))
    assert planner.step_seconds(shape, bf16) == pytest.approx(autotune.analytic_step_seconds(shape, bf16))


def test_a_measurement_is_kept_per_float8_recipe():
    """`train.float8_recipe` is not among the settings `Settings.to_dict` records, yet rowwise scales run another
    step than tensorwise ones: their measurements are kept apart."""
    from fulltune.planning import autotune
    from fulltune.memory import Settings
    from fulltune.memory.shapes import model_shape
    from fulltune.models import config_from_spec
    from pipelines_fixture import TINY_LLAMA

    shape = model_shape(config_from_spec(dict(TINY_LLAMA), 96))
    info = autotune.hardware("cpu")
    tensorwise = Settings(micro_batch_size=4, seq_len=16, device="cpu", mixed_precision="bf16", float8=True)
    rowwise = replace(tensorwise, float8_recipe="rowwise")
    keys = {autotune.measurement_key(info, shape, s, autotune.Options()) for s in (tensorwise, rowwise)}
    assert len(keys) == 2


# --- the YAML --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, mode", [(True, "on"), (False, "off"), ("auto", "auto"),
                                         ({"steps": 2, "max_seconds": 60}, "on"), ({"enabled": "auto"}, "auto")])
def test_budget_autotune_takes_a_switch_or_a_mapping(tmp_path, value, mode):
    from fulltune.planning import autotune
    from fulltune.stages import resolve_pipeline

    p = resolve_pipeline(str(tiny_pipeline(tmp_path, budget={"autotune": value})), "tiny")
    assert autotune.options(p.spec.budget.autotune).mode == mode


def test_a_bad_autotune_mapping_names_its_field(tmp_path, capsys):
    from fulltune.cli import main

    path = tiny_pipeline(tmp_path, budget={"autotune": {"candidates": 0, "step": 2}})
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pipelines.tiny.budget.autotune.candidates: must be >= 1" in err
    assert "pipelines.tiny.budget.autotune.step: unknown key" in err
    # only those two: not the switch forms the mapping is not ("should be a valid boolean", "'auto'")
    assert "2 problem(s)" in err and "Input should be" not in err, err


# --- data.packing: auto ----------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [True, False])
def test_an_explicit_packing_is_obeyed(tmp_path, packing):
    from fulltune.planning import autotune
    from fulltune.stages import budget as budget_stage
    from fulltune.stages import resolve_pipeline

    p = resolve_pipeline(str(tiny_pipeline(tmp_path, data={"packing": packing})), "tiny")
    assert budget_stage.tokenized(p)[0].packing is packing


def test_packing_auto_keeps_one_example_per_row_when_examples_fill_the_row(tmp_path):
    from fulltune.planning import autotune
    from fulltune.stages import budget as budget_stage
    from fulltune.stages import resolve_pipeline

    # max_length 8: the examples (≈ 6 tokens) take more than half a row, so no two would share one.
    p = resolve_pipeline(str(tiny_pipeline(tmp_path, data={"max_length": 8})), "tiny")
    data, _ = budget_stage.tokenized(p)
    assert data.packing is False


def test_packing_auto_packs_short_examples_when_that_is_predicted_faster(tmp_path):
    from fulltune.planning import autotune
    from fulltune.stages import budget as budget_stage
    from fulltune.stages import resolve_pipeline

    # max_length 64 holds ~9 examples per row: far fewer, fuller steps per epoch.
    p = resolve_pipeline(str(tiny_pipeline(tmp_path, data={"max_length": 64})), "tiny")
    from fulltune.data.tokenizer import prepare_tokenizer

    pack, why = budget_stage.choose_packing(p, prepare_tokenizer(p.spec.model, p.spec.data, p.workdir))
    assert pack is True and "predicted epoch" in why
    assert budget_stage.tokenized(p)[0].packing is True
