"""Held-out evaluation: the eval loss is the token-weighted mean over every labelled token, and a champion
with another tokenizer is measured on its own tokens and compared per byte of target text."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fulltune.errors import ConfigError
from fulltune.evaluation.champion import champion_rows, measure_champion, tokenize_records
from fulltune.evaluation.evaluate import (NOT_COMPARED, PER_BYTE, REFUSED, SAME_TOKENS, EvalOptions, EvalReport,
                                          ModelMetrics, evaluate_model)
from fulltune.tracking.gates import decide_promotion
from fulltune.models import load_tokenizer
from fulltune.spec import DataSpec
from tests.tiny import make_model, make_tokenizer


def test_eval_loss_is_the_mean_over_labelled_tokens_and_generation_still_works(tmp_path: Path) -> None:
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    model_dir = make_model(tmp_path / "model", tokenizer_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    for prompt, completion in [("12+35=", "47"), ("the cat ", "sat on the mat"), ("hello ", "world")]:
        p, c = tokenizer(prompt)["input_ids"], tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id]
        rows.append({"input_ids": p + c, "labels": [-100] * len(p) + c, "position_ids": list(range(len(p + c))),
                     "prompt": prompt, "completion": completion})

    metrics = evaluate_model(model_dir, tokenizer_dir, rows, EvalOptions(batch_size=2, generate_examples=3,
                             max_new_tokens=4, device="cpu"), load_kwargs={})

    # Reference: full logits, one row at a time (no padding), position t predicting label t + 1.
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            total += float(F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum"))
            tokens += int((labels != -100).sum())
    assert metrics.eval_tokens == tokens == sum(len(r["labels"]) - r["labels"].count(-100) for r in rows)
    assert math.isclose(metrics.eval_loss, total / tokens, rel_tol=1e-5)
    assert math.isclose(metrics.perplexity, math.exp(total / tokens), rel_tol=1e-5)
    assert metrics.generated_examples == 3 and metrics.exact_match is not None
    # Generation sees the whole (b, s, V) logits again: the same greedy text as the plain model.
    prompt = torch.tensor([tokenizer("hello ")["input_ids"]])
    plain = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                           do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert metrics.samples[2][2] == tokenizer.decode(plain[0, prompt.shape[1]:], skip_special_tokens=True).strip()


# ---------------------------------------------------------------------------------------------------
# The champion with another tokenizer (retraining on new data retrains a tokenizer trained on the data)


DATA = DataSpec(train="unused.jsonl", format="prompt_completion", max_length=16)


def additions(n: int, word: str, seed: int) -> list[dict[str, str]]:
    import random

    rng = random.Random(seed)
    pairs = [(rng.randint(0, 2), rng.randint(0, 2)) for _ in range(n)]
    return [{"prompt": f"{word} {a} {b}=", "completion": str(a + b)} for a, b in pairs]


def trained_tokenizer(directory: Path, records: list[dict[str, str]]) -> str:
    """The byte-level BPE the pipeline trains on its data (`model.tokenizer: {vocab_size: N}`)."""
    from fulltune.spec import TrainTokenizer
    from fulltune.data.tokenizer import build_tokenizer

    texts = [text for record in records for text in (record["prompt"], record["completion"])]
    build_tokenizer(texts, TrainTokenizer(vocab_size=300)).save_pretrained(directory)
    return str(directory)


def train_briefly(model_dir: str, records: list[dict[str, str]], steps: int) -> None:
    """A few AdamW steps on the records, as the champion's pipeline trained it; saved in place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fulltune.data import collate

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = tokenize_records(records, tokenizer, DATA)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for step in range(steps):
        batch = collate([rows[i] for i in torch.randint(len(rows), (16,)).tolist()], tokenizer.pad_token_id)
        model(**batch, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)


def test_champion_with_another_tokenizer_is_measured_on_its_own_tokens_and_keeps_its_alias(tmp_path: Path) -> None:
    from fulltune.models import load_tokenizer

    old_data = additions(96, "add", seed=0)
    # New data with a more frequent new word: the retrained tokenizer gives `add` another, larger id.
    new_data = additions(96, "add", seed=2) + additions(192, "plus", seed=3)
    champion = make_model(tmp_path / "champion", trained_tokenizer(tmp_path / "old-tok", old_data))
    train_briefly(champion, old_data, steps=60)
    challenger = make_model(tmp_path / "challenger", trained_tokenizer(tmp_path / "new-tok", new_data), seed=1)
    new_tokenizer = load_tokenizer(challenger)
    assert len(new_tokenizer) > len(load_tokenizer(champion))

    rows = tokenize_records(additions(24, "add", seed=1), new_tokenizer, DATA)  # eval.parquet of the new run
    options = {"options": EvalOptions(8, 4, 3, "cpu"), "load_kwargs": {}}
    with pytest.raises(ConfigError, match="token embeddings"):  # what used to be an IndexError
        evaluate_model(champion, champion, rows, **options)

    tuned = evaluate_model(challenger, challenger, rows, **options)
    result = measure_champion(rows, tuned, new_tokenizer, champion, DATA, "1", max_examples=None, **options)
    assert result.kind == PER_BYTE and "tokenizer" in result.reason
    assert result.own.eval_tokens == tuned.eval_tokens == 48  # one digit + eos per example, in both tokenizers
    assert result.own.target_bytes == tuned.target_bytes == 24
    assert math.isclose(result.gate.bits_per_byte, result.own.bits_per_byte, rel_tol=1e-9)
    assert result.gate.eval_loss < tuned.eval_loss

    decision = decide_promotion(tuned.as_dict(), result.gate.as_dict(), None, "eval_loss", "min", 0.0, False)
    assert not decision.promote
    report = EvalReport({"fine_tuned": tuned, "champion": result.gate}, len(rows), "1", comparison=result.kind,
                        comparison_reason=result.reason, champion_own_tokens=result.own)
    assert "loss per byte" in report.markdown() and "champion (own tokenizer)" in report.markdown()


def test_same_tokenizer_is_compared_per_token_on_the_same_rows(tmp_path: Path) -> None:
    from fulltune.models import load_tokenizer

    tokenizer = load_tokenizer(make_tokenizer(tmp_path / "tok"))
    again = load_tokenizer(make_tokenizer(tmp_path / "tok-copy"))
    rows = tokenize_records(additions(6, "add", seed=0), tokenizer, DATA)
    plan = champion_rows(rows, tokenizer, again, DATA, None, "3")
    assert plan.kind == SAME_TOKENS and plan.rows is rows


def test_held_out_text_examples_with_another_tokenizer_refuse_the_comparison(tmp_path: Path) -> None:
    from fulltune.models import load_tokenizer

    ours = load_tokenizer(make_tokenizer(tmp_path / "ours", vocab_size=270))
    theirs = load_tokenizer(make_tokenizer(tmp_path / "theirs", vocab_size=300))
    text = DataSpec(train="unused.jsonl", format="text", max_length=16)
    plan = champion_rows([{"input_ids": [1, 5], "labels": [-100, 5]}], ours, theirs, text, None, "2")
    assert plan.kind == REFUSED and plan.rows is None and "data.eval" in plan.reason
    report = EvalReport({}, 1, "2", comparison=plan.kind, comparison_reason=plan.reason)
    assert report.keeps_champion and "refused" in report.markdown()


def test_compare_champion_false_keeps_the_champion(tmp_path: Path) -> None:
    from fulltune.stages import resolve_pipeline
    from pipelines_fixture import tiny_pipeline
    from fulltune.evaluation.champion import Champion, compare_with_champion

    p = resolve_pipeline(str(tiny_pipeline(tmp_path, evaluate={"compare_champion": False})), "tiny", None)
    better = {"fine_tuned": ModelMetrics(0.1, math.exp(0.1), 10, target_bytes=20)}
    report = compare_with_champion(p.spec, [{}], better, Champion("tiny-model", "4", "models:/tiny-model/4", "k"),
                                   model_dir="unused", workdir=p.workdir, options={}, load={})
    assert report.comparison == NOT_COMPARED and report.keeps_champion and "compare_champion" in report.markdown()
    decision = decide_promotion(better["fine_tuned"].as_dict(), None, None, "eval_loss", "min", 0.0, False,
                                keep_champion=report.comparison_reason)
    assert not decision.promote and "keeps its alias" in decision.reason


# ---------------------------------------------------------------------------------------------------
# The team's metric functions, run on each model's generations


METRICS = '''
import sys
import time

import numpy as np


def count(completions, references):
    return np.int64(len(completions))


def parts(completions, references):
    return {"n": np.float32(1.5), "k": np.int32(2)}


def leaves(completions, references):
    sys.exit(3)


def hangs(completions, references):
    time.sleep(60)
'''


def _evaluate_with(tmp_path: Path, metrics: dict[str, str], lines: list[str], timeout: float = 600.0) -> ModelMetrics:
    """evaluate_model of a tiny model with `metrics` (functions of the module above); its progress lines
    go to `lines`."""
    from fulltune.evaluation.harness import Benchmarks

    _team_metrics(tmp_path, [])
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    model_dir = make_model(tmp_path / "model", tokenizer_dir)
    rows = tokenize_records([{"prompt": "1+2=", "completion": "3"}, {"prompt": "2+2=", "completion": "4"}],
                            load_tokenizer(tokenizer_dir), DATA)
    benchmarks = Benchmarks((), None, None, 2, tuple((k, f"team_metrics:{v}") for k, v in metrics.items()),
                            str(tmp_path), timeout)
    return evaluate_model(model_dir, tokenizer_dir, rows, EvalOptions(2, 2, 2, "cpu"), load_kwargs={},
                          benchmarks=benchmarks, progress=lines.append, name="fine_tuned")


@pytest.mark.slow
def test_metric_functions_may_return_numpy_numbers_and_say_when_they_run(tmp_path: Path) -> None:
    lines: list[str] = []
    metrics = _evaluate_with(tmp_path, {"count": "count", "parts": "parts"}, lines)
    assert metrics.extra == {"count": 2.0, "parts/n": 1.5, "parts/k": 2.0}
    assert "fine_tuned: metric count (team_metrics:count) on 2 completions" in lines


def _team_metrics(tmp_path: Path, names: list[str]) -> dict[str, str]:
    (tmp_path / "team_metrics.py").write_text(METRICS)
    return {name: f"team_metrics:{name}" for name in names}


def test_a_metric_that_exits_is_a_user_error_naming_it(tmp_path: Path) -> None:
    from fulltune.evaluation.harness import custom_metrics

    with pytest.raises(ConfigError, match=r"^evaluate\.metrics\.leaves: team_metrics:leaves raised SystemExit: 3$"):
        custom_metrics(_team_metrics(tmp_path, ["leaves"]), tmp_path, ["a"], ["a"])


def test_a_metric_that_hangs_says_so_and_stops_at_its_time_limit(tmp_path: Path, monkeypatch) -> None:
    from fulltune.evaluation import harness

    monkeypatch.setattr(harness, "PROGRESS_SECONDS", 0.1)
    lines: list[str] = []
    with pytest.raises(ConfigError, match=r"evaluate\.metrics\.hangs: team_metrics:hangs ran longer than "
                                          r"evaluate\.metric_timeout \(0\.5 s\)"):
        harness.custom_metrics(_team_metrics(tmp_path, ["hangs"]), tmp_path, ["a"], ["a"], timeout=0.5,
                               progress=lines.append, label="fine_tuned")
    assert lines[0] == "fine_tuned: metric hangs (team_metrics:hangs) on 1 completions"
    assert any(line.startswith("fine_tuned: metric hangs still running after") for line in lines[1:]), lines


def test_the_evaluate_key_sees_every_file_a_task_reads(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    import yaml

    from fulltune import stages

    from pipelines_fixture import evaluate_key, tiny_pipeline

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "rows.jsonl").write_text('{"q": "1+1=", "a": "2"}\n')
    (tasks / "utils.py").write_text("def process(dataset):\n    return dataset\n")
    (tasks / "base.yaml").write_text("output_type: generate_until\ntest_split: test\nprocess_docs: !function "
                                     "utils.process\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    (tasks / "sums.yaml").write_text(yaml.safe_dump({
        "include": "base.yaml", "task": "sums", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": "rows.jsonl"}},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}))
    path = tiny_pipeline(tmp_path, evaluate={"lm_eval": {"tasks": ["tasks/sums.yaml"]}},
                         register={"promote_if": {"metric": "eval_loss"}})

    def key() -> str:
        return evaluate_key(stages.resolve_pipeline(str(path), "tiny"), "trained", "data", None)

    keys = [key()]
    for name, text in [("base.yaml", "\ngeneration_kwargs: {until: ['\\n']}\n"),  # an included YAML
                       ("utils.py", "\ndef other(dataset):\n    return dataset\n"),  # a !function module
                       ("rows.jsonl", '{"q": "2+2=", "a": "4"}\n')]:  # the task's data
        with open(tasks / name, "a") as handle:
            handle.write(text)
        keys.append(key())
    assert len(set(keys)) == len(keys), "each edit re-evaluates"


def test_layer_offloaded_loading_measures_the_same_and_every_model_is_freed(tmp_path: Path, monkeypatch) -> None:
    """accelerate's big-model loading (`max_memory` smaller than the weights: the rest offloaded) gives the
    metrics of the model on one device, and no candidate outlives its evaluation."""
    import gc
    import weakref

    from fulltune import models
    from fulltune.models import Placement

    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    model_dir = make_model(tmp_path / "model", tokenizer_dir, hidden=64)
    tokenizer = models.load_tokenizer(tokenizer_dir)
    rows = tokenize_records(additions(12, "add", seed=1), tokenizer, DATA)
    loaded, device_maps = [], []
    load = models.load_model

    def tracked(*args, **kwargs):
        model = load(*args, **kwargs)
        loaded.append(weakref.ref(model))
        device_maps.append(getattr(model, "hf_device_map", None))
        return model

    monkeypatch.setattr(models, "load_model", tracked)
    options = EvalOptions(batch_size=4, generate_examples=6, max_new_tokens=3, device="cpu")
    whole = evaluate_model(model_dir, model_dir, rows, options, load_kwargs={"dtype": "fp32"})
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    placement = Placement("cpu", {"cpu": weights // 3}, str(tmp_path / "offload"))
    offloaded = evaluate_model(model_dir, model_dir, rows, replace(options, generation_batch_size=2),
                               load_kwargs={"dtype": "fp32", "placement": placement})
    assert device_maps[0] is None and "disk" in device_maps[1].values(), "the layers beyond max_memory offloaded"
    assert math.isclose(offloaded.eval_loss, whole.eval_loss, rel_tol=1e-5)
    assert offloaded.samples == whole.samples and offloaded.exact_match == whole.exact_match
    gc.disable()  # freed by evaluate_model itself, not by a collection that happens to run later
    try:
        assert len(loaded) == 2 and all(ref() is None for ref in loaded)
    finally:
        gc.enable()


def test_each_eval_source_is_reported_beside_the_total(tmp_path: Path) -> None:
    """data.eval as a list of sources: loss, perplexity, bits per byte and exact match of each source (its rows
    alone), beside the totals over every row."""
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    model_dir = make_model(tmp_path / "model", tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    general = tokenize_records(additions(3, "add", seed=1), tokenizer, DATA)
    domain = tokenize_records(additions(4, "plus", seed=2), tokenizer, DATA)
    options = EvalOptions(batch_size=2, generate_examples=5, max_new_tokens=2, device="cpu")
    both = evaluate_model(model_dir, tokenizer_dir, general + domain,
                          replace(options, sources=(("general", 3), ("domain", 4))), load_kwargs={})
    alone = {name: evaluate_model(model_dir, tokenizer_dir, rows, options, load_kwargs={})
             for name, rows in (("general", general), ("domain", domain))}
    values = both.as_dict()
    for name, metrics in alone.items():
        for metric in ("eval_loss", "perplexity", "bits_per_byte", "exact_match"):
            assert math.isclose(values[f"{metric}/{name}"], metrics.as_dict()[metric], rel_tol=1e-6), (name, metric)
    total = sum(m.eval_loss * m.eval_tokens for m in alone.values()) / sum(m.eval_tokens for m in alone.values())
    # Each source generates its own first 5 (all 3 and all 4), not the first 5 of the two together.
    assert math.isclose(both.eval_loss, total, rel_tol=1e-6) and both.generated_examples == 7
    assert both.samples == alone["general"].samples + alone["domain"].samples
    assert "eval_loss/general" in EvalReport({"fine_tuned": both}, 7).markdown()


def test_the_report_names_the_gate_metric_and_says_when_there_is_no_champion() -> None:
    from fulltune.spec import PromoteIf

    def metrics(loss: float, accuracy: float) -> ModelMetrics:
        return ModelMetrics(loss, math.exp(loss), 10, extra={"reversal_mc/acc": accuracy})

    first = EvalReport({"base": metrics(2.0, 0.25), "fine_tuned": metrics(1.0, 0.5)}, 8)
    text = first.markdown([PromoteIf(metric="reversal_mc/acc", mode="max")])
    assert "**The gate reads reversal_mc/acc** (`register.promote_if`, higher is better): base 0.2500, " \
           "fine-tuned 0.5000." in text
    assert "**No champion yet**" in text
    later = replace(first, candidates={**first.candidates, "champion": metrics(1.2, 0.75)}, champion_version="2",
                    comparison=SAME_TOKENS, comparison_reason="the same tokens")
    text = later.markdown()
    assert "No champion yet" not in text and "**Champion version 2, measured on the same tokens" in text


def test_each_source_generates_its_own_rows_with_a_completion(tmp_path: Path) -> None:
    """A text source first and a prompt/completion source after it: the text rows (no completion, as chat rows)
    are never generated for nor scored, the prompt/completion source's first rows are, and exact match is its
    own."""
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    model_dir = make_model(tmp_path / "model", tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    texts = tokenize_records([{"text": f"{a}+1={a + 1}"} for a in range(3)], tokenizer,
                             DATA.model_copy(update={"format": "text"}))
    pairs = tokenize_records(additions(4, "add", seed=1), tokenizer, DATA)
    options = EvalOptions(batch_size=2, generate_examples=2, max_new_tokens=2, device="cpu",
                          sources=(("texts", 3), ("pairs", 4)))
    both = evaluate_model(model_dir, tokenizer_dir, texts + pairs, options, load_kwargs={})
    assert both.generated_examples == 2 and [s[1] for s in both.samples] == [r["completion"] for r in pairs[:2]]
    values = both.as_dict()
    assert "exact_match/texts" not in values and "eval_loss/texts" in values
    assert values["exact_match/pairs"] == values["exact_match"] == both.exact_match
