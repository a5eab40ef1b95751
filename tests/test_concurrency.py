"""Two runs of the same pipeline at once: one trains, the other waits on the stage lock and reuses the
result; no cache entry, checkpoint or registry version is corrupted or duplicated. A stage lock whose
holder was killed is cleared; a live holder's lock is waited for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from conftest import ROOT
from pipelines_fixture import tiny_pipeline
from runs import with_prefect_api

HOLD_LOCK = """
import sys, time
from pathlib import Path
from tasks.common import StageLockManager
assert StageLockManager(Path(sys.argv[1])).acquire_lock("fulltune-fine-tune-abc", "holder-1")
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_holders_stage_lock_is_cleared_and_a_live_ones_is_respected(tmp_path):
    from tasks.common import StageLockManager, clear_stale_locks, locks_dir

    locks, key = locks_dir(str(tmp_path)), "fulltune-fine-tune-abc"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(locks)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline() == "held\n"
        manager = StageLockManager(locks)
        assert manager.is_locked(key)
        assert not manager.acquire_lock(key, "holder-2", acquire_timeout=1.0)
        assert clear_stale_locks(str(tmp_path)) == []
        # A run already waiting for the lock takes it once the holder is killed.
        taken = []
        waiter = threading.Thread(target=lambda: taken.append(manager.acquire_lock(key, "holder-2")), daemon=True)
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive()
    finally:
        holder.kill()
        holder.wait()
    waiter.join(timeout=30)
    assert taken == [True]
    record = json.loads((locks / f"{key}.lock").read_text())
    assert record["holder"] == "holder-2" and record["owner"]["pid"] == os.getpid()
    manager.release_lock(key, "holder-2")
    assert not list(locks.glob("*.lock")) and not list(locks.glob(".*.lock.*"))

    # The sweep at the start of a run removes a killed holder's lock.
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(locks)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline() == "held\n"
    holder.kill()
    holder.wait()
    assert clear_stale_locks(str(tmp_path)) == [locks / f"{key}.lock"]


def test_a_stepped_system_clock_makes_no_live_process_look_gone(tmp_path, monkeypatch):
    """NTP or a VM's clock steps the wall clock, and with it the boot time psutil derives start times from: a
    live run's stage lock stays its own (Ctrl-C then rolls back cleanly instead of failing with "No lock for
    transaction"), a launcher stays alive to its trainers, a live build directory is kept."""
    import psutil

    from fulltune.storage import process_gone, process_identity, remove_stale_temp_dirs, temp_dir_name
    from tasks.common import StageLockManager, locks_dir

    me, parent = process_identity(), process_identity(os.getppid())
    manager, key = StageLockManager(locks_dir(str(tmp_path))), "fulltune-fine-tune-abc"
    assert manager.acquire_lock(key, "holder-1", acquire_timeout=1.0)
    building = tmp_path / "tokenized" / temp_dir_name("0" * 64)
    building.mkdir(parents=True)
    booted = psutil.boot_time()
    for step in (-90.0, 3.0, 3600.0):
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda step=step: booted + step)
        assert abs(psutil.Process(os.getpid()).create_time() - me["started"]) >= 3.0  # the clock did step
        assert not process_gone(me) and not process_gone(parent)
        assert manager.is_locked(key) and manager.is_lock_holder(key, "holder-1")
        remove_stale_temp_dirs(building.parent)
        assert building.is_dir()
    manager.release_lock(key, "holder-1")
    # What the start in ticks still tells: a reused pid (another start), another boot.
    assert process_gone({**me, "ticks": me["ticks"] + 1}) and process_gone({**me, "boot": "another-boot"})


@pytest.mark.slow
def test_concurrent_runs_train_once_and_register_once(tmp_path, prefect_server):
    """Two runs of one pipeline at once, as a team's scheduler and a user start them against their Prefect server:
    the stage locks in the workdir make the second wait for the first and take its results."""
    path = tiny_pipeline(tmp_path, train={"max_steps": 8, "checkpoint_every_steps": 2})
    env = with_prefect_api({**os.environ, "PYTHONPATH": str(ROOT)}, prefect_server)
    runs = [subprocess.Popen([sys.executable, "-m", "fulltune.cli", "run", "tiny", "-f", str(path)], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=900)[0] for run in runs]
    for run, output in zip(runs, outputs):
        assert run.returncode == 0, output[-3000:]
    summaries = [output[output.rindex("pipeline tiny:"):] for output in outputs]
    assert all("registered tiny-model version 1" in s for s in summaries), summaries
    # The second run waited for the first one's lock and then found its finished model.
    losses = [line.split("(")[0].strip() for s in summaries for line in s.splitlines() if "train loss" in line]
    assert len(losses) == 2 and losses[0] == losses[1], losses

    work = tmp_path / "work"
    models = list((work / "runs").glob("*/model"))
    assert len(models) == 1 and (models[0] / "model.safetensors").is_file()
    assert not list(work.rglob(".tmp-*")), "no half-written output is left behind"
    assert not list((work / "locks").glob("*.lock"))

    from mlflow.tracking import MlflowClient

    from fulltune.tracking import registry

    registry.configure(work)
    assert [str(v.version) for v in MlflowClient().search_model_versions("name='tiny-model'")] == ["1"]
