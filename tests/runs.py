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
from pipelines_fixture import TINY_LLAMA

# The runs several files compare with (`SharedRun`): 8 rows per optimizer step however they are split — one
# process × micro 2 × accumulation 4, or two data-parallel processes × micro 2 × accumulation 2; the step
# schedule (which rows make step N) is the same for all. Clipping is out of reach (stepping in backward clips
# each parameter on its own, the others the global norm: only unclipped runs are the same update) and the
# loss is logged every step.
ONE = {"effective_batch_size": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 6,
       "checkpoint_every_steps": 2, "keep_checkpoints": 3, "max_grad_norm": 1.0e6, "log_every_steps": 1,
       "chunked_loss": False, "optimizer_in_backward": False}
FSDP = {**ONE, "gradient_accumulation_steps": 2}
SHARDED = {"strategy": "fsdp", "num_processes": 2}
# One process under `strategy: auto` (which keeps `none` on CPU), and FSDP over two processes.
ONE_PROCESS = {"train": ONE, "distributed": {"strategy": "auto"}}
# Its evaluate stage sharded over the two processes like its training (`processes: auto` would take one: the tiny
# model fits), so that the sharded evaluation runs through `fulltune run` (tests/test_fsdp_run.py), the demo's
# lm-evaluation-harness task included.
DEMO_TASK = {"tasks": [str(ROOT / "data" / "demo" / "reversal_mc.yaml")], "limit": 8}
TWO_SHARDS = {"train": FSDP, "distributed": SHARDED, "evaluate": {"processes": 2, "lm_eval": DEMO_TASK}}
# One process on the tiny model with its own output head (pipeline stages do not split a tied one), clipped
# to a global norm of 1 (the tiny model's gradients are above it): what pipeline stages compare with.
UNTIED = {"from_config": {**TINY_LLAMA, "tie_word_embeddings": False}, "tokenizer": {"vocab_size": 96}}
ONE_PROCESS_UNTIED = {"model": UNTIED, "train": {**ONE, "max_grad_norm": 1.0}, "distributed": {"strategy": "auto"}}


def fulltune_run(pipelines: Path, log: Path, api: str | None = None, **env: str) -> subprocess.Popen:
    """`fulltune run tiny` as a terminal starts it: a process group of its own, output into `log`. With `api`
    (the session's Prefect API, the `prefect_server` fixture) as `PREFECT_API_URL`, as a team with a Prefect
    server runs it; without, the run starts its own temporary server, as `make demo` does."""
    # The temporary Prefect server gets 20 s to start by default: too little on a busy 2-core machine.
    environment = with_prefect_api({**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300", **env}, api)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "fulltune.cli", "run", "tiny", "-f", str(pipelines)],
                                cwd=pipelines.parent, env=environment, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def with_prefect_api(environment: dict[str, str], api: str | None) -> dict[str, str]:
    """`environment` naming `api` as PREFECT_API_URL, or none (the run then starts its own temporary server)."""
    environment = {name: value for name, value in environment.items() if name != "PREFECT_API_URL"}
    return environment if api is None else {**environment, "PREFECT_API_URL": api}


def assert_rank_peaks_within(workdir: Path, stages: list[int], under: float = 0.03, over: float = 0.03) -> None:
    """Each process's step peak, measured by the run, against the plan's estimate for it (result.json): the
    estimate at most `under` below the measurement and `over` above it."""
    (result,) = workdir.glob("runs/*/result.json")
    peaks = json.loads(result.read_text())["rank_peaks"]
    assert [p["stage"] for p in peaks] == stages, peaks
    for p in peaks:
        assert -under <= p["estimated_bytes"] / p["measured_bytes"] - 1 <= over, peaks


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


def kill_at_checkpoint(pipelines: Path, log: Path, micro_step: int, step: int = 2, timeout_s: float = 600,
                       api: str | None = None, logged: int | None = None) -> None:
    """Run `pipelines`, stalled at micro-batch `micro_step` (the first of a step after checkpoint `step`); once
    checkpoint `step` is published (and, with `logged`, the loss of step `logged`: the steps before the stall),
    SIGKILL the whole process group and check that no trainer outlives it. The test then reruns the same command."""
    run = fulltune_run(pipelines, log, api, FULLTUNE_TEST_FAULT=f"stall_micro_step:{micro_step}")
    wait_for_checkpoint(run, pipelines.parent / "work", log, step=step, timeout_s=timeout_s)
    if logged is not None:
        deadline = time.monotonic() + timeout_s
        while logged not in logged_losses(pipelines.parent / "work"):
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
    alive = kill_run(run, timeout_s=60)
    assert not alive, alive


def logged_losses(directory: Path) -> dict[int, list[float]]:
    """Step → each loss the run's trainers logged for it (metrics.jsonl, appended by every attempt; the tests' runs
    log every step): a step trained again after a resume appears twice."""
    losses: dict[int, list[float]] = {}
    for line in _run_file(directory, "metrics.jsonl").read_text().splitlines():
        if line.endswith("}"):  # a line still being written is left for the next look
            record = json.loads(line)
            if "train_loss" in record["values"]:
                losses.setdefault(record["step"], []).append(record["values"]["train_loss"])
    return losses


def assert_steps_trained_again_alike(directory: Path, steps: list[int]) -> None:
    """Killed after logging `steps` (beyond its newest checkpoint) and rerun, the run trained each of them again
    from the restored state: each time to the same loss, bit for bit. The loss of each after the first shows the
    update the restored optimizer made (its moments, the learning rate's schedule): the weights, the optimizer's
    state, the data's order and the random state all came back as they were."""
    losses = logged_losses(directory)
    assert sorted(step for step, found in losses.items() if len(found) > 1) == steps, losses
    assert [losses[step][0] for step in steps] == [losses[step][1] for step in steps], losses


def assert_same_weights(got: dict, want: dict) -> None:
    """Two exported models hold the same tensors, bit for bit."""
    import torch

    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []


def _run_file(directory: Path, name: str) -> Path:
    """`name` of the one run under a `fulltune run` workdir (`runs/<key>/name`), or of a train job's output
    directory (`rerun_job`)."""
    if (directory / name).exists():
        return directory / name
    (found,) = directory.glob(f"runs/*/{name}")
    return found


def saved_model(directory: Path) -> dict:
    """The tensors of the run's exported model (a workdir, or a train job's output directory)."""
    from safetensors.torch import load_file

    return load_file(str(_run_file(directory, "model/model.safetensors")))


def loss_history(directory: Path) -> list[float]:
    """The run's mean token loss per optimizer step (result.json; a workdir, or a train job's output directory)."""
    return [loss for _, loss in json.loads(_run_file(directory, "result.json").read_text())["loss_history"]]


def rerun_job(directory: Path, output_dir: Path, **plan: object) -> Path:
    """The train job (JOB.json) of the run in `directory` (a `fulltune run` workdir, or a run's directory) again in
    `output_dir` (a fresh run: nothing to resume), through the command the launcher runs, without the pipeline's
    other stages; `plan` overrides the plan's fields (and the distributed fields it echoes). Returns `output_dir`."""
    from fulltune.runtime.launch import TrainJob, training_command

    data = json.loads(_run_file(directory, "JOB.json").read_text())
    data["paths"]["output_dir"] = str(output_dir)
    data["plan"].update(plan)
    data["distributed"].update({k: v for k, v in plan.items() if k in data["distributed"]})
    output_dir.mkdir(parents=True)
    job = TrainJob.from_json(json.dumps(data))
    (output_dir / "JOB.json").write_text(job.to_json())
    done = subprocess.run(training_command(job, output_dir / "JOB.json"), cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return output_dir


class SharedRun:
    """A `fulltune run` that several tests compare against, trained once per test session however many
    test files (and pytest-xdist workers) ask for it.

    The tiny pipeline of `sections` runs in `<session temp>/shared-runs/<hash of sections>/`. A file lock
    there lets one worker train it while the others wait for it instead of training a copy of their own; a
    `done` file marks a run that succeeded (one that failed is tried again by the next test that asks). The
    lock is released the moment the run ends, by a thread watching it, so two workers each waiting for the
    other's run cannot deadlock. `start` returns at once, so a test starts its own runs beside it; `finish`
    waits for it and returns its directory (read-only to tests).
    """

    def __init__(self, tmp_path_factory, api: str | None, **sections) -> None:
        import hashlib

        from filelock import FileLock

        base = tmp_path_factory.getbasetemp()
        root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # shared by the workers of a session
        digest = hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()[:16]
        self.directory = root / "shared-runs" / digest
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sections = sections
        self.api = api
        self.lock = FileLock(str(self.directory) + ".lock", thread_local=False)
        self.watcher = None

    @property
    def done(self) -> Path:
        return self.directory / "done"

    def start(self) -> SharedRun:
        from filelock import Timeout

        if self.done.exists():
            return self
        try:
            self.lock.acquire(timeout=0)
        except Timeout:  # another worker trains it; `finish` waits for that one
            return self
        self._start_holding_the_lock()
        return self

    def _start_holding_the_lock(self) -> None:
        import shutil
        import threading

        from pipelines_fixture import tiny_pipeline

        if self.done.exists():
            self.lock.release()
            return
        for stale in ("work", "run.log"):
            path = self.directory / stale
            if path.is_dir():
                shutil.rmtree(path)
        run = fulltune_run(tiny_pipeline(self.directory, **self.sections), self.directory / "run.log", self.api)

        def watch() -> None:
            try:
                if run.wait(timeout=900) == 0:
                    self.done.write_text("")
            finally:
                self.lock.release()

        self.watcher = threading.Thread(target=watch, daemon=True)
        self.watcher.start()

    def finish(self) -> Path:
        if self.watcher is None and not self.done.exists():
            self.lock.acquire(timeout=1800)  # released when the worker training it sees its run end
            self._start_holding_the_lock()
        self.close()
        log = self.directory / "run.log"
        assert self.done.exists(), log.read_text()[-4000:] if log.exists() else log
        return self.directory

    def close(self) -> None:
        """Wait for the run this test started, if any (at teardown too: a failed test leaves none behind)."""
        if self.watcher is not None:
            self.watcher.join()
            self.watcher = None
