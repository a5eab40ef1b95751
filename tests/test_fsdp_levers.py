"""The memory levers under `distributed.strategy: fsdp` on two CPU processes (gloo): `chunked_loss` and
`optimizer_in_backward` train like the same FSDP run without them, and a run stepping in backward, through `fulltune
run`, that is killed after a checkpoint resumes with its optimizer states.

Three runs, 8 rows per optimizer step each: FSDP without levers (micro 2 × accumulation 2: the `SharedRun`
`runs.TWO_SHARDS`, which test_fsdp_run compares with too), its train job again with the chunked head (the same
split, through the launcher's training command: `runs.rerun_job`), and a pipeline stepping in backward (micro 4,
accumulation 1: the lever takes one micro-batch). Clipping is out of reach: stepping in backward clips each
parameter on its own, the others the global norm, so only an unclipped run is the same update. fp32, so only the
order of floating-point sums differs: measured at most 8e-8 relative on the losses; asserted at 1e-5. Lost optimizer
states on resume (Adam's moments restarted) would move the losses by percents.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines_fixture import tiny_pipeline
from runs import (FSDP, SHARDED, TWO_SHARDS, finish, fulltune_run, kill_run, loss_history, rerun_job,
                  wait_for_checkpoint)

pytestmark = pytest.mark.slow

IN_BACKWARD = {**FSDP, "optimizer_in_backward": True, "micro_batch_size": 4, "gradient_accumulation_steps": 1}


def test_chunked_loss_and_optimizer_in_backward_under_fsdp_train_like_fsdp_without_them(tmp_path: Path,
                                                                                        shared_run,
                                                                                        prefect_server) -> None:
    without_levers = shared_run(**TWO_SHARDS)
    in_backward = tmp_path / "optimizer_in_backward"
    in_backward.mkdir()
    log, pipelines = in_backward / "run.log", tiny_pipeline(in_backward, train=IN_BACKWARD, distributed=SHARDED)

    # The run stepping in backward is killed once step 2 is checkpointed (it stalls in step 3), then rerun.
    run = fulltune_run(pipelines, log, prefect_server, FULLTUNE_TEST_FAULT="stall_micro_step:3")
    wait_for_checkpoint(run, in_backward / "work", log, step=2)
    assert not kill_run(run)
    output = finish(fulltune_run(pipelines, log, prefect_server), log)
    assert "resumed from step 2" in output, output[-4000:]
    assert "registered tiny-model version 1" in output, output[-4000:]

    # The chunked head: the run without levers' own train job again, with the lever on.
    without = without_levers.finish() / "work"
    chunked = rerun_job(without, tmp_path / "chunked_loss", chunked_loss=True)

    plain = loss_history(without)
    assert len(plain) == FSDP["max_steps"] and plain[-1] < plain[0]
    for name, directory in (("chunked_loss", chunked), ("optimizer_in_backward", in_backward / "work")):
        losses = loss_history(directory)
        assert losses == pytest.approx(plain, rel=1e-5), (name, losses, plain)
