"""The memory levers under `distributed.strategy: fsdp` on two CPU processes (gloo): `chunked_loss` and
`optimizer_in_backward` train like the same FSDP run without them, and a run with them, through `fulltune run`,
that is killed after a checkpoint resumes with its optimizer states.

Two runs, 8 rows per optimizer step each: FSDP without levers (micro 2 × accumulation 2: the `SharedRun`
`runs.TWO_SHARDS`, which test_fsdp_run compares with too), and a pipeline with the chunked head stepping in backward
(micro 4, accumulation 1: the step in backward takes one micro-batch). The lever table (tests/test_lever_table.py)
trains each lever alone under FSDP as well. Clipping is out of reach: stepping in backward clips each parameter on
its own, the others the global norm, so only an unclipped run is the same update. fp32, so only the order of
floating-point sums differs: measured at most 8e-8 relative on the losses; asserted at 1e-5. A chunked head that
lost positions, or lost optimizer states on resume (Adam's moments restarted), would move the losses by percents.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines_fixture import tiny_pipeline
from runs import FSDP, SHARDED, TWO_SHARDS, finish, fulltune_run, kill_run, loss_history, wait_for_checkpoint

pytestmark = pytest.mark.slow

LEVERS = {**FSDP, "chunked_loss": True, "optimizer_in_backward": True, "micro_batch_size": 4,
          "gradient_accumulation_steps": 1}


def test_chunked_loss_and_optimizer_in_backward_under_fsdp_train_like_fsdp_without_them(tmp_path: Path,
                                                                                        shared_run,
                                                                                        prefect_server) -> None:
    without_levers = shared_run(**TWO_SHARDS)
    with_levers = tmp_path / "levers"
    with_levers.mkdir()
    log, pipelines = with_levers / "run.log", tiny_pipeline(with_levers, train=LEVERS, distributed=SHARDED)

    # The run with the levers is killed once step 2 is checkpointed (it stalls in step 3), then rerun.
    run = fulltune_run(pipelines, log, prefect_server, FULLTUNE_TEST_FAULT="stall_micro_step:3")
    wait_for_checkpoint(run, with_levers / "work", log, step=2)
    assert not kill_run(run)
    output = finish(fulltune_run(pipelines, log, prefect_server), log)
    assert "resumed from step 2" in output, output[-4000:]
    assert "registered tiny-model version 1" in output, output[-4000:]

    plain = loss_history(without_levers.finish() / "work")
    assert len(plain) == FSDP["max_steps"] and plain[-1] < plain[0]
    losses = loss_history(with_levers / "work")
    assert losses == pytest.approx(plain, rel=1e-5), (losses, plain)
