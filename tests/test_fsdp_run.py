"""`distributed.strategy: fsdp` with two CPU processes, through `fulltune run` as a user runs it: the run
trains like one process, evaluates sharded over its processes, and registers a normal Hugging Face
checkpoint. And FSDP over one process trains bit-exactly like `strategy: auto` (which keeps `none`). The
one-process and the two-process runs are `SharedRun`s: other files compare with them too.

A kill of the whole process tree of a sharded run is proved where it covers the most: FSDP 2 × TP 2
(tests/test_tensor_parallel.py) resumes bit-exactly from the same sharded checkpoints (each process's FSDP
shards, `sharding.save_sharded_state`), and an FSDP run stepping in backward resumes its optimizer states
(tests/test_fsdp_levers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines_fixture import tiny_pipeline
from runs import ONE, ONE_PROCESS, TWO_SHARDS, assert_same_weights, finish, fulltune_run, loss_history, saved_model
from test_sharded_eval import check_fsdp_run_evaluation

pytestmark = pytest.mark.slow


def test_two_fsdp_processes_train_like_one_and_evaluate_sharded(shared_run) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    single, sharded = shared_run(**ONE_PROCESS), shared_run(**TWO_SHARDS)
    clean, one = sharded.finish(), single.finish()
    log = (clean / "run.log").read_text()
    assert "registered tiny-model version 1" in log
    # What a person reads: no per-tensor bars of local weights, no system-metrics monitor chatter.
    for noise in ("Writing model shards", "Loading weights", "Started monitoring system metrics"):
        assert noise not in log + (one / "run.log").read_text(), noise
    # Evaluated sharded over the run's 2 processes, with one process's metrics.
    check_fsdp_run_evaluation(clean / "work", log)
    want = saved_model(clean / "work")

    # Two shards train like one process (fp32: only the order of the gradient sums differs).
    fsdp_losses, single_losses = loss_history(clean / "work"), loss_history(one / "work")
    assert len(fsdp_losses) == len(single_losses) == ONE["max_steps"]
    for a, b in zip(fsdp_losses, single_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (fsdp_losses, single_losses)
    reference = saved_model(one / "work")
    for name, tensor in want.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-3, atol=1e-4)

    # The final model is a normal Hugging Face checkpoint.
    (model_dir,) = (clean / "work").glob("runs/*/model")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_fsdp_over_one_process_trains_bit_exact_like_strategy_auto_which_chose_none(tmp_path: Path,
                                                                                   shared_run, prefect_server) -> None:
    """On CPU fsdp over one process (no offload: CPUOffloadPolicy needs an accelerator) holds the bytes of
    `none`, so `strategy: auto` keeps `none`; FSDP2 over the one process trains the same losses and weights."""
    plain = shared_run(**ONE_PROCESS)
    sharded = tmp_path / "fsdp"
    sharded.mkdir()
    finish(fulltune_run(tiny_pipeline(sharded, train=ONE, distributed={"strategy": "fsdp"}), sharded / "run.log",
                        prefect_server),
           sharded / "run.log")
    auto = plain.finish()
    jobs = {name: json.loads(next((d / "work").rglob("JOB.json")).read_text()) for name, d in
            (("auto", auto), ("fsdp", sharded))}
    assert jobs["auto"]["distributed"]["strategy"] == jobs["auto"]["plan"]["strategy"] == "none"
    assert jobs["fsdp"]["distributed"]["strategy"] == "fsdp" and jobs["fsdp"]["plan"]["num_processes"] == 1
    assert loss_history(sharded / "work") == loss_history(auto / "work")
    assert_same_weights(saved_model(sharded / "work"), saved_model(auto / "work"))
