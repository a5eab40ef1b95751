"""A run trained sharded is evaluated sharded: the evaluate stage starts the training's processes (torchrun,
gloo on CPU), each holding FSDP2 shards of the model, and its metrics equal one process's evaluation of the
same model (loss to 1e-5 relative, exact match and the generated texts identical)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from fulltune.evaluation.evaluate import EvalOptions, ModelMetrics, evaluate_model

# 7 rows in two sources of 4 and 3, loss batch 3 → 3 batches (3+1, 3) over 2 ranks; generation batch 2 over the first
# 3 rows of each source → 3 batches: rank 1 runs one batch fewer of each and pads it (the forwards of every rank must
# match under FSDP).
PAIRS = [("12+35=", "47"), ("the cat ", "sat on the mat"), ("hello ", "world"), ("fine ", "tuning"),
         ("0123", "456789"), ("+-", "=*/"), ("the ", "mat")]


def _rows(tokenizer_dir: str) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    for prompt, completion in PAIRS:
        p, c = tokenizer(prompt)["input_ids"], tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id]
        rows.append({"input_ids": p + c, "labels": [-100] * len(p) + c, "position_ids": list(range(len(p + c))),
                     "prompt": prompt, "completion": completion})
    return rows


def assert_same_metrics(sharded: ModelMetrics | dict[str, float], single: ModelMetrics) -> None:
    """The sharded evaluation's metrics are the one-process evaluation's: loss to 1e-5 relative, exact match
    identical."""
    got = sharded.as_dict() if isinstance(sharded, ModelMetrics) else sharded
    want = single.as_dict()
    assert math.isclose(got["eval_loss"], want["eval_loss"], rel_tol=1e-5), (got, want)
    assert math.isclose(got["perplexity"], want["perplexity"], rel_tol=1e-5), (got, want)
    assert got.get("exact_match") == want.get("exact_match"), (got, want)


def test_two_sharded_processes_evaluate_like_one(tmp_path: Path) -> None:
    """Two candidates (the evaluate stage's base and fine-tuned) in one launch of 2 processes, one after the
    other: each one's metrics are its own one-process evaluation's."""
    from fulltune.evaluation.sharded import Candidate, evaluate_sharded_candidates
    from tests.tiny import make_model, make_tokenizer

    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    models = {"base": make_model(tmp_path / "base", tokenizer_dir),
              "fine_tuned": make_model(tmp_path / "tuned", tokenizer_dir, seed=1)}
    rows = _rows(tokenizer_dir)
    # Two data.eval sources: their metrics beside the totals (batches never span two sources).
    options = EvalOptions(batch_size=3, generate_examples=3, max_new_tokens=4, device="cpu", generation_batch_size=2,
                          sources=(("general", 4), ("domain", 3)))
    load = {"dtype": "fp32"}
    single = {name: evaluate_model(path, tokenizer_dir, rows, options, load_kwargs=load)
              for name, path in models.items()}
    lines: list[str] = []
    sharded = evaluate_sharded_candidates(
        [Candidate(name, path, tokenizer_dir, load) for name, path in models.items()], rows,
        replace(options, processes=2, work_dir=str(tmp_path / "evals")), progress=lines.append)

    assert "fine_tuned: evaluating sharded over 2 processes (FSDP2)" in lines
    assert single["base"].eval_loss != single["fine_tuned"].eval_loss
    for name, want in single.items():
        got = sharded[name]
        assert_same_metrics(got, want)
        assert got.eval_tokens == want.eval_tokens and got.target_bytes == want.target_bytes
        assert got.samples == want.samples and got.generated_examples == 6
        for source in ("general", "domain"):
            assert math.isclose(got.as_dict()[f"eval_loss/{source}"], want.as_dict()[f"eval_loss/{source}"],
                                rel_tol=1e-5)
            assert got.as_dict()[f"exact_match/{source}"] == want.as_dict()[f"exact_match/{source}"]
    assert list((tmp_path / "evals").iterdir()) == []  # the child's job and rows are removed


def check_fsdp_run_evaluation(workdir: Path, log: str) -> None:
    """For tests/test_fsdp_run.py: the 2-process FSDP run in `workdir` evaluated its fine-tuned model sharded over
    its 2 processes, and the metrics it logged to MLflow equal a one-process evaluation of the model it saved."""
    import json

    import mlflow
    import pyarrow.parquet as pq

    from fulltune.evaluation.harness import Benchmarks
    from fulltune.pipelines_file import get_pipeline, load_pipelines

    assert "fine_tuned: evaluating sharded over 2 processes (FSDP2)" in log
    spec = get_pipeline(load_pipelines(workdir.parent / "pipelines.yaml"), "tiny")
    (model_dir,) = workdir.glob("runs/*/model")
    # The eval rows beside the rows it trained on (the plan may have tokenized the data both ways to choose packing).
    train_file = json.loads((model_dir.parent / "JOB.json").read_text())["paths"]["train_file"]
    rows = pq.read_table(Path(train_file).with_name("eval.parquet")).to_pylist()
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    logged = {key.removeprefix("eval/fine_tuned."): value for key, value in run.data.metrics.items()
              if key.startswith("eval/fine_tuned.")}
    # The pipeline's evaluate.* (tests/pipelines_fixture.py: batch 8, 4 generated examples of 3 new tokens, and the
    # demo's lm-evaluation-harness task, tests/runs.py), which its plan keeps on this machine; fp32, as it trained.
    single = evaluate_model(str(model_dir), str(model_dir), rows, EvalOptions(8, 4, 3, "cpu"),
                            load_kwargs={"dtype": "fp32"}, benchmarks=Benchmarks.from_spec(spec, workdir.parent))
    assert_same_metrics(logged, single)
    assert logged["reversal_mc/acc"] == single.extra["reversal_mc/acc"]
