"""`fulltune run` as a user starts it, in its own process group, and what a test reads of it afterwards:
the log, the step checkpoints it leaves, the trainers it starts, the saved weights and the loss history."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT


def fulltune_run(pipelines: Path, log: Path, **env: str) -> subprocess.Popen:
    """`fulltune run tiny` as a terminal starts it: a process group of its own, output into `log`."""
    # The temporary Prefect server gets 20 s to start by default: too little on a busy 2-core machine.
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                   "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300", **env}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "fulltune.cli", "run", "tiny", "-f", str(pipelines)],
                                cwd=pipelines.parent, env=environment, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(run: subprocess.Popen, log: Path) -> str:
    """Wait for `run` to succeed; its log."""
    assert run.wait(timeout=900) == 0, log.read_text()[-4000:]
    return log.read_text()


def wait_for_checkpoint(run: subprocess.Popen, workdir: Path, log: Path, step: int = 2,
                        timeout_s: float = 600) -> None:
    """Block until `run` has published step checkpoint `step` under `workdir`; fail if it ends first."""
    deadline = time.monotonic() + timeout_s
    while not list((workdir / "runs").glob(f"*/checkpoints/step-{step}")):
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


def trainers_of(pid: int) -> list:
    """The training processes (`fulltune.runtime.train`, or torchrun running it) below process `pid`."""
    import psutil

    return [p for p in psutil.Process(pid).children(recursive=True) if "fulltune.runtime.train" in " ".join(p.cmdline())]


def kill_run(run: subprocess.Popen, timeout_s: float = 60) -> list:
    """SIGKILL the whole process group of `run` (a preempted node, `kill -9 -PGID`); the trainers still
    alive `timeout_s` later. The trainers have a session of their own, out of reach of the kill: they must
    end themselves with their launcher."""
    import psutil

    trainers = trainers_of(run.pid)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    _, alive = psutil.wait_procs(trainers, timeout=timeout_s)
    return alive


def saved_model(workdir: Path) -> dict:
    """The tensors of the run's exported model."""
    from safetensors.torch import load_file

    (model,) = workdir.glob("runs/*/model/model.safetensors")
    return load_file(str(model))


def loss_history(workdir: Path) -> list[float]:
    """The run's mean token loss per optimizer step (result.json)."""
    (result,) = workdir.glob("runs/*/result.json")
    return [loss for _, loss in json.loads(result.read_text())["loss_history"]]
