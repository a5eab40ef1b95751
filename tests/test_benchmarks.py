"""Benchmarks a team gates on, without training: `fulltune validate` names every unknown metric, missing
task and broken metric function; gates of several conditions and guards decide as documented; metric
functions score completions; the evaluation's memory terms are the bytes transformers allocates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fulltune.cli import main
from fulltune.tracking.gates import decide_gates
from fulltune.spec import PromoteIf

from conftest import ROOT
from pipelines_fixture import tiny_pipeline

TASK = {"task": "sums", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "sums.jsonl"}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{prompt}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}


def pipeline_with(tmp_path: Path, evaluate: dict, promote_if) -> Path:
    (tmp_path / "sums.yaml").write_text(yaml.safe_dump(TASK))
    (tmp_path / "sums.jsonl").write_text('{"prompt": "1+1=", "choices": ["2", "x"], "label": 0}\n')
    (tmp_path / "team.py").write_text("def digits(completions, references):\n"
                                      "    return {'share': sum(c.isdigit() for c in completions) / len(completions)}\n")
    return tiny_pipeline(tmp_path, evaluate=evaluate, register={"promote_if": promote_if})


def validate(path: Path, capsys) -> tuple[int, str]:
    code = main(["validate", str(path)])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def test_validate_knows_builtin_task_and_custom_metrics(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    path = pipeline_with(tmp_path, {"lm_eval": {"tasks": ["sums.yaml"], "limit": 4}, "metrics": ["team:digits"]},
                         [{"metric": "eval_loss", "min_delta": 0.01}, {"metric": "sums/acc", "mode": "max"},
                          {"metric": "digits/share", "mode": "max", "max_regression": 0.05},
                          {"metric": "exact_match", "max_regression": 0.0}])
    code, out = validate(path, capsys)
    assert code == 0, out


def test_validate_names_the_field_of_every_unknown_metric_and_missing_task(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    path = pipeline_with(tmp_path, {"lm_eval": {"tasks": ["sums.yaml", "gone.yaml"]},
                                    "metrics": {"digits": "team:digits", "broken": "no_such_module:f"}},
                         [{"metric": "sums/accuracy", "mode": "max"}, {"metric": "bleu", "mode": "max"},
                          {"metric": "sums/acc", "mode": "min"}])
    code, out = validate(path, capsys)
    assert code == 2
    assert "pipelines.tiny.evaluate.lm_eval.tasks[1]: task YAML not found" in out
    assert "pipelines.tiny.evaluate.metrics.broken: cannot import 'no_such_module'" in out
    assert "pipelines.tiny.register.promote_if[0].metric: task sums reports acc; no 'accuracy'" in out
    assert "pipelines.tiny.register.promote_if[1].metric: unknown metric 'bleu'; known: eval_loss" in out
    assert "sums/acc" in out.split("promote_if[1].metric")[1]
    assert "pipelines.tiny.register.promote_if[2].mode: sums/acc improves in mode 'max'" in out
    assert "Traceback" not in out


def test_a_metric_of_no_configured_task_is_a_validate_error(tmp_path, capsys):
    path = tiny_pipeline(tmp_path, register={"promote_if": {"metric": "hellaswag/acc", "mode": "max"}})
    code, out = validate(path, capsys)
    assert code == 2 and "pipelines.tiny.register.promote_if[0].metric: unknown metric 'hellaswag/acc'" in out


def test_a_gate_may_name_a_metric_of_one_eval_source_and_validate_knows_the_sources(tmp_path, capsys):
    for name in ("general.jsonl", "domain.jsonl"):
        (tmp_path / name).write_text('{"prompt": "1+1=", "completion": "2"}\n')
    guard = {"metric": "eval_loss/general", "max_regression": 0.0}
    path = tiny_pipeline(tmp_path, data={"eval": ["general.jsonl", {"path": "domain.jsonl"}]},
                         register={"promote_if": [{"metric": "eval_loss/domain", "min_delta": 0.01}, guard]})
    code, out = validate(path, capsys)
    assert code == 0, out
    path = tiny_pipeline(tmp_path, data={"eval": ["general.jsonl", "domain.jsonl"]},
                         register={"promote_if": [{"metric": "eval_loss"}, {"metric": "exact_match/medical"}]})
    code, out = validate(path, capsys)
    assert code == 2 and ("pipelines.tiny.register.promote_if[1].metric: no data.eval source 'medical' to report "
                          "exact_match of (the data.eval sources are general, domain)") in out, out
    # The gate guards one source: the general set must not regress while the total improves.
    conditions = gates({"metric": "eval_loss"}, guard)
    champion = {"eval_loss": 1.0, "eval_loss/general": 0.8}
    assert PromoteIf(**guard).mode == "min"
    regressed = decide_gates({"eval_loss": 0.9, "eval_loss/general": 0.85}, champion, None, conditions, False)
    assert not regressed.promote and "eval_loss/general" in regressed.reason
    assert decide_gates({"eval_loss": 0.9, "eval_loss/general": 0.8}, champion, None, conditions, False).promote


def test_lm_eval_tasks_without_the_extra_installed_exit_2_saying_what_to_install(tmp_path):
    # A package named lm_eval that fails to import stands for the extra not being installed.
    fake = tmp_path / "site" / "lm_eval"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'lm_eval'\")\n")
    path = pipeline_with(tmp_path, {"lm_eval": {"tasks": ["sums.yaml"]}}, {"metric": "eval_loss"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    result = subprocess.run([sys.executable, "-m", "fulltune.cli", "validate", str(path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "pipelines.tiny.evaluate.lm_eval: lm-evaluation-harness is not installed" in result.stderr
    assert "pip install 'fulltune[eval]'" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------------
# The gate


def gates(*items: dict) -> list[PromoteIf]:
    return [PromoteIf(**item) for item in items]


def test_every_condition_must_hold_each_with_its_own_mode_and_min_delta():
    conditions = gates({"metric": "eval_loss", "min_delta": 0.05}, {"metric": "task/acc", "mode": "max",
                                                                     "min_delta": 0.02})
    champion = {"eval_loss": 1.0, "task/acc": 0.50}
    assert decide_gates({"eval_loss": 0.9, "task/acc": 0.53}, champion, None, conditions, False).promote
    decision = decide_gates({"eval_loss": 0.9, "task/acc": 0.51}, champion, None, conditions, False)
    assert not decision.promote
    assert [c.passed for c in decision.checks] == [True, False]
    assert decision.reason == "task/acc 0.51 does not beat the champion's 0.5 by 0.02"


def test_a_guard_allows_a_bounded_regression_and_needs_no_improvement():
    conditions = gates({"metric": "eval_loss"}, {"metric": "general/acc", "mode": "max", "max_regression": 0.02})
    champion, base = {"eval_loss": 1.0, "general/acc": 0.60}, {"eval_loss": 2.0, "general/acc": 0.70}
    within = decide_gates({"eval_loss": 0.9, "general/acc": 0.59}, champion, base, conditions, True)
    assert within.promote and "within max_regression 0.02 of the champion's 0.6" in within.reason
    beyond = decide_gates({"eval_loss": 0.9, "general/acc": 0.55}, champion, base, conditions, True)
    assert not beyond.promote and "regresses from the champion's 0.6 by 0.05" in beyond.reason
    # With no champion yet the guard holds against the base model: fine-tuning may not erase what it knew.
    forgot = decide_gates({"eval_loss": 0.9, "general/acc": 0.60}, None, base, conditions, True)
    assert not forgot.promote and "the base model's 0.7" in forgot.reason


def test_a_metric_the_evaluation_did_not_produce_never_promotes():
    decision = decide_gates({"eval_loss": 0.5}, None, None, gates({"metric": "task/acc", "mode": "max"}), False)
    assert not decision.promote and "task/acc of the new model is missing" in decision.reason


def test_gate_tags_hold_each_condition_and_the_decision():
    from fulltune.tracking.gates import gate_tags

    decision = decide_gates({"eval_loss": 0.9, "t/acc": 0.2}, {"eval_loss": 1.0, "t/acc": 0.5}, None,
                            gates({"metric": "eval_loss"}, {"metric": "t/acc", "mode": "max", "max_regression": 0.1}),
                            False)
    tags = gate_tags(decision)
    assert tags["fulltune.gate"] == decision.reason
    assert tags["fulltune.gate.eval_loss"].startswith("passed: ")
    assert tags["fulltune.gate.t/acc"].startswith("failed: t/acc 0.2 regresses")


# ---------------------------------------------------------------------------------------------------
# Metric functions and the harness's results


def test_metric_functions_score_completions_and_name_mapping_keys(tmp_path):
    from fulltune.evaluation.harness import custom_metrics

    values = custom_metrics({"ci": "examples.metrics:exact_match_ci", "json": "examples.metrics:json_validity"},
                            ROOT, ["  Paris ", '{"a": 1}', "{bad"], ["paris", '{"a": 2}', '{"b": 1}'])
    assert values == {"ci": pytest.approx(1 / 3), "json/valid": pytest.approx(1 / 3),
                      "json/keys_match": pytest.approx(1 / 3)}


def test_a_metric_function_returning_text_is_a_user_error(tmp_path):
    from fulltune.errors import ConfigError
    from fulltune.evaluation.harness import custom_metrics

    (tmp_path / "bad_metric.py").write_text("def score(c, r):\n    return 'high'\n")
    with pytest.raises(ConfigError, match=r"evaluate.metrics.score: bad_metric:score returned 'high'"):
        custom_metrics({"score": "bad_metric:score"}, tmp_path, ["a"], ["a"])


def test_harness_results_become_task_slash_metric():
    from fulltune.evaluation.harness import harness_metrics

    results = {"results": {"mc": {"alias": "mc", "acc,none": 0.5, "acc_stderr,none": "N/A", "acc_norm,none": 0.25},
                           "gsm": {"exact_match,strict-match": 0.1, "exact_match_stderr,strict-match": 0.01}}}
    assert harness_metrics(results) == {"mc/acc": 0.5, "mc/acc_norm": 0.25, "gsm/exact_match_strict-match": 0.1}


# ---------------------------------------------------------------------------------------------------
# Evaluation memory


def test_kv_cache_and_harness_logit_terms_are_what_transformers_allocates():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fulltune.memory.evaluation import eval_memory
    from fulltune.memory.shapes import model_shape

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    batch, prompt, new = 3, 10, 5
    ids = torch.randint(3, 96, (batch, prompt))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        logits = model(input_ids=ids).logits
    cache = out.past_key_values
    cached = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    # The cache holds every position but the last generated one (it is never fed back).
    memory = eval_memory(model_shape(config), weight_bytes=4, batches=(batch, batch, batch), seq_len=prompt,
                         max_new_tokens=new, harness_seq_len=prompt)
    kv_term = 2 * 2 * batch * (prompt + new) * 2 * 8 * 4
    assert cached == kv_term * (prompt + new - 1) // (prompt + new)
    assert memory.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    assert memory.harness >= 2 * logits.nbytes and memory.generation >= kv_term
    assert memory.peak_bytes == memory.weights + max(memory.loss, memory.generation, memory.harness)


def test_the_demo_task_is_reproducible_validates_and_asks_for_the_reversal(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    import json

    subprocess.run([sys.executable, str(ROOT / "data/demo/make_reversal_mc.py"), "--out", str(tmp_path / "mc.jsonl")],
                   check=True, capture_output=True)
    assert (tmp_path / "mc.jsonl").read_bytes() == (ROOT / "data/demo/reversal_mc.jsonl").read_bytes()
    questions = [json.loads(line) for line in (tmp_path / "mc.jsonl").read_text().splitlines()]
    held_out = {json.loads(line)["prompt"] for line in (ROOT / "data/demo/eval.jsonl").read_text().splitlines()}
    for q in questions:
        digits = q["prompt"].removeprefix("reverse ").removesuffix("=")
        assert q["prompt"] in held_out and q["choices"][q["label"]] == digits[::-1]
        assert len(set(q["choices"])) == 4 and {len(c) for c in q["choices"]} == {len(digits)}
    code, out = validate(ROOT / "pipelines.yaml", capsys)
    assert code == 0, out
