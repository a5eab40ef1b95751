"""Rerun after a crash, the way it happens: the whole `fulltune run` process group is killed with SIGKILL
mid-training (a preempted node, `kill -9 -PGID`), then the same command runs again. It must not wait on
the dead run's stage lock, must resume from the newest step checkpoint, and must end with weights bitwise
equal to a run that was never interrupted."""

from __future__ import annotations

import json
import time

import pytest

from pipelines_fixture import tiny_pipeline
from runs import ONE_PROCESS, assert_same_weights, finish, fulltune_run, kill_run, saved_model, trainers_of, \
    wait_for_checkpoint

pytestmark = pytest.mark.slow


def test_killed_run_resumes_from_its_newest_checkpoint_and_matches_an_uninterrupted_run(tmp_path, shared_run):
    # The shared one-process run (micro 2 × accumulation 4, a checkpoint every 2 steps) is the uninterrupted
    # one: the 13th micro-batch is the first of step 4, so when this run stops there, step-2 is the newest.
    uninterrupted = shared_run(**ONE_PROCESS)
    killed = tmp_path / "killed"
    killed.mkdir()
    pipelines = tiny_pipeline(killed, **ONE_PROCESS)
    log = killed / "run.log"
    started = time.monotonic()
    run = fulltune_run(pipelines, log, FULLTUNE_TEST_FAULT="stall_micro_step:13")
    wait_for_checkpoint(run, killed / "work", log, step=2)
    assert trainers_of(run.pid), "training runs in a child process"
    # The trainer has its own session, out of reach of the kill: it ends itself with its launcher.
    alive = kill_run(run, timeout_s=30)
    assert not alive, alive
    assert list((killed / "work" / "locks").glob("*.lock")), "the killed run left its stage lock behind"
    assert not list((killed / "work" / "runs").glob("*/model"))

    killed_after = time.monotonic() - started
    output = finish(fulltune_run(pipelines, log), log)
    rerun_seconds = time.monotonic() - started - killed_after
    assert "removed the stale lock" in output
    assert "resumed from step 2" in output, output[-4000:]
    (result,) = (killed / "work" / "runs").glob("*/result.json")
    assert json.loads(result.read_text())["resumed_from_step"] == 2
    assert "registered tiny-model version 1" in output

    assert_same_weights(saved_model(killed / "work"), saved_model(uninterrupted.finish() / "work"))
    print(f"killed after {killed_after:.0f} s; the rerun took {rerun_seconds:.0f} s")
