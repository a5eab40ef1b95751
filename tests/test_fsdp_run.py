"""`distributed.strategy: fsdp` with two CPU processes, through `fulltune run` as a user runs it: the run
trains like one process, survives a kill of its whole process tree bit-exactly, and registers a normal
Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines_fixture import tiny_pipeline
from runs import finish, fulltune_run, kill_run, loss_history, saved_model, wait_for_checkpoint
from test_sharded_eval import check_fsdp_run_evaluation

pytestmark = pytest.mark.slow

# 8 rows per optimizer step however they are split: 2 processes × micro 2 × accumulation 2, or one
# process × micro 2 × accumulation 4. The step schedule (which rows make step N) is the same for both.
ONE = {"effective_batch_size": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 6,
       "checkpoint_every_steps": 2, "keep_checkpoints": 3}
FSDP = {**ONE, "gradient_accumulation_steps": 2}
SHARDED = {"strategy": "fsdp", "num_processes": 2}


def test_two_fsdp_processes_train_like_one_and_resume_bit_exact_after_a_kill(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    one, clean, killed = (tmp_path / name for name in ("one", "clean", "killed"))
    for directory in (one, clean, killed):
        directory.mkdir()
    single = fulltune_run(tiny_pipeline(one, train=ONE), one / "run.log")
    uninterrupted = fulltune_run(tiny_pipeline(clean, train=FSDP, distributed=SHARDED), clean / "run.log")
    pipelines = tiny_pipeline(killed, train=FSDP, distributed=SHARDED)
    log = killed / "run.log"
    run = fulltune_run(pipelines, log, FULLTUNE_TEST_FAULT="stall_micro_step:7")
    wait_for_checkpoint(run, killed / "work", log, step=2)
    alive = kill_run(run, timeout_s=60)
    assert not alive, alive

    output = finish(fulltune_run(pipelines, log), log)
    assert "resumed from step 2" in output, output[-4000:]
    assert "registered tiny-model version 1" in output
    # Evaluated sharded over the run's 2 processes, with one process's metrics.
    check_fsdp_run_evaluation(clean / "work", finish(uninterrupted, clean / "run.log"))
    finish(single, one / "run.log")

    # Killed and rerun equals uninterrupted, tensor for tensor.
    got, want = saved_model(killed / "work"), saved_model(clean / "work")
    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []

    # Two shards train like one process (fp32: only the order of the gradient sums differs).
    sharded, single_losses = loss_history(clean / "work"), loss_history(one / "work")
    assert len(sharded) == len(single_losses)
    for a, b in zip(sharded, single_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (sharded, single_losses)
    reference = saved_model(one / "work")
    for name, tensor in want.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-3, atol=1e-4)

    # The final model is a normal Hugging Face checkpoint.
    (model_dir,) = (clean / "work").glob("runs/*/model")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_fsdp_over_one_process_trains_bit_exact_like_strategy_auto_which_chose_none(tmp_path: Path) -> None:
    """On CPU fsdp over one process (no offload: CPUOffloadPolicy needs an accelerator) holds the bytes of
    `none`, so `strategy: auto` keeps `none`; FSDP2 over the one process trains the same losses and weights."""
    import json

    import torch

    auto, sharded = tmp_path / "auto", tmp_path / "fsdp"
    for directory in (auto, sharded):
        directory.mkdir()
    plain = fulltune_run(tiny_pipeline(auto, train=ONE, distributed={"strategy": "auto"}), auto / "run.log")
    one_shard = fulltune_run(tiny_pipeline(sharded, train=ONE, distributed={"strategy": "fsdp"}),
                             sharded / "run.log")
    finish(plain, auto / "run.log")
    finish(one_shard, sharded / "run.log")
    jobs = {name: json.loads(next((d / "work").rglob("JOB.json")).read_text()) for name, d in
            (("auto", auto), ("fsdp", sharded))}
    assert jobs["auto"]["distributed"]["strategy"] == jobs["auto"]["plan"]["strategy"] == "none"
    assert jobs["fsdp"]["distributed"]["strategy"] == "fsdp" and jobs["fsdp"]["plan"]["num_processes"] == 1
    assert loss_history(sharded / "work") == loss_history(auto / "work")
    got, want = saved_model(sharded / "work"), saved_model(auto / "work")
    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []
