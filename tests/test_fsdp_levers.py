"""The memory levers under `distributed.strategy: fsdp`, through `fulltune run` on two CPU processes (gloo):
`chunked_loss` and `optimizer_in_backward` train like the same FSDP run without them, and a run stepping in
backward that is killed after a checkpoint resumes with its optimizer states.

Three runs, 8 rows per optimizer step each: FSDP without levers (micro 2 × accumulation 2: the `SharedRun`
`runs.TWO_SHARDS`, which test_fsdp_run compares with too), with the chunked head (the same split), and stepping
in backward (micro 4, accumulation 1: the lever takes one micro-batch). Clipping is out of reach: stepping in
backward clips each parameter on its own, the others the global norm, so only an unclipped run is the same
update. fp32, so only the order of floating-point sums
differs: measured at most 8e-8 relative on the losses; asserted at 1e-5. Lost optimizer states on resume
(Adam's moments restarted) would move the losses by percents.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines_fixture import tiny_pipeline
from runs import FSDP, SHARDED, TWO_SHARDS, finish, fulltune_run, kill_run, loss_history, wait_for_checkpoint

pytestmark = pytest.mark.slow

RUNS = {
    "chunked_loss": {**FSDP, "chunked_loss": True},
    "optimizer_in_backward": {**FSDP, "optimizer_in_backward": True, "micro_batch_size": 4,
                              "gradient_accumulation_steps": 1},
}


def test_chunked_loss_and_optimizer_in_backward_under_fsdp_train_like_fsdp_without_them(tmp_path: Path,
                                                                                        shared_run,
                                                                                        prefect_server) -> None:
    without_levers = shared_run(**TWO_SHARDS)
    runs, logs = {}, {}
    for name, train in RUNS.items():
        (tmp_path / name).mkdir()
        logs[name] = tmp_path / name / "run.log"
        pipelines = tiny_pipeline(tmp_path / name, train=train, distributed=SHARDED)
        fault = {"FULLTUNE_TEST_FAULT": "stall_micro_step:3"} if name == "optimizer_in_backward" else {}
        runs[name] = fulltune_run(pipelines, logs[name], prefect_server, **fault)

    # The run stepping in backward is killed once step 2 is checkpointed (it stalls in step 3), then rerun.
    in_backward = tmp_path / "optimizer_in_backward"
    wait_for_checkpoint(runs["optimizer_in_backward"], in_backward / "work", logs["optimizer_in_backward"], step=2)
    assert not kill_run(runs["optimizer_in_backward"])
    pipelines = in_backward / "pipelines.yaml"
    runs["optimizer_in_backward"] = fulltune_run(pipelines, logs["optimizer_in_backward"], prefect_server)
    outputs = {name: finish(run, logs[name]) for name, run in runs.items()}
    assert "resumed from step 2" in outputs["optimizer_in_backward"], outputs["optimizer_in_backward"][-4000:]
    for name, output in outputs.items():
        assert "registered tiny-model version 1" in output, (name, output[-4000:])

    plain = loss_history(without_levers.finish() / "work")
    assert len(plain) == FSDP["max_steps"] and plain[-1] < plain[0]
    for name in ("chunked_loss", "optimizer_in_backward"):
        losses = loss_history(tmp_path / name / "work")
        assert losses == pytest.approx(plain, rel=1e-5), (name, losses, plain)
