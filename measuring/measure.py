"""A training run's resident memory, measured: the one harness of the memory benchmarks and memory tests.

On a CPU device the budget is RAM, and what must fit is the whole training process. Two ways to measure it,
each in a fresh process so that nothing else is counted:

- `child`: a wrapper process runs the job through `launch.run_training` (the child process a flow starts) and
  samples its children every 20 ms: the trainer's resident set per phase (set-up, steps, a checkpoint, the
  final save), with `ranks` each training rank's Rss and Pss (torchrun itself left out); then its
  `getrusage(RUSAGE_CHILDREN)`, the finished trainer's high-water mark. The wrapper imports neither torch nor
  transformers and is not counted.
- `phases`: the trainer's own functions (`fulltune.runtime.train`) run in the measured process, one phase at a
  time as `fulltune.memory.process` names them, a sampler reading /proc/self/statm every 5 ms and the
  kernel's high-water mark (VmHWM) after each phase.

    python -m measuring.measure child|ranks|phases JOB.json    # one JSON line on stdout

Runs of several processes under torchrun (gloo, CPU) hand their ranks' results back through
`torchrun_results` and `send_to_driver` (measuring/rank_memory.py's ranks, the benchmarks' workers).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from fulltune.runtime.launch import TrainJob, run_training  # imports neither torch nor transformers

ROOT = Path(__file__).resolve().parents[1]  # the repository root: where `fulltune` and `measuring` are imported from
TORCHRUN_TIMEOUT_S = 900  # a whole torchrun; a hung collective ends there instead of holding the machine
KINDS = ("child", "ranks", "phases")
# The phases `phases` measures, in the order the process runs them (two steps: the checkpoint after the first).
PHASES = ("imports", "set-up", "load", "optimizer and prepare", "first optimizer step", "checkpoint save",
          "training step", "final export")
TRAINER_PHASES = ("setup", "steps", "checkpoint", "final")  # what `child` tells apart from the trainer's files
# Loads this file by its path and runs its main: the fulltune it measures is the one on PYTHONPATH.
BOOTSTRAP = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('fulltune_measure', "
             "sys.argv[1]); module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
             "sys.exit(module.main(sys.argv[2:]))")


def resident_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water_bytes() -> int:
    """This process's resident high-water mark (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_and_pss(pid: int) -> dict[str, int]:
    """{"rss", "pss"} of process `pid` in bytes, from /proc/<pid>/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key.lower()] = int(rest.split()[0]) * 1024
    return out


class Sampler:
    """Calls `sample()` every `interval` seconds on a daemon thread, between `start()` and `stop()`."""

    def __init__(self, sample: Callable[[], None], interval: float) -> None:
        self.sample, self.interval = sample, interval
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.interval)

    def start(self) -> Sampler:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def peak_during(work: Callable[[], Any], interval: float = 0.002) -> tuple[int, int]:
    """(this process's RSS before `work()`, its largest RSS while it ran), sampled every `interval` seconds."""
    before, peak = resident_bytes(), [0]

    def sample() -> None:
        peak[0] = max(peak[0], resident_bytes())

    sampler = Sampler(sample, interval).start()
    try:
        work()
    finally:
        sampler.stop()
    return before, max(peak[0], resident_bytes())


# ---------------------------------------------------------------------------------------------------
# Several processes under torchrun


def send_to_driver(measured: dict[str, Any], out: Path) -> None:
    """Every rank's `measured`, written to `out` by rank 0 (in rank order); ends the process group."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, measured)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))
    dist.destroy_process_group()


def torchrun_results(arguments: list[str], processes: int, out: Path, timeout_s: float = TORCHRUN_TIMEOUT_S,
                     what: str = "torchrun") -> list[dict[str, Any]]:
    """`torchrun --standalone --nproc_per_node processes *arguments` from the repository root, one OpenMP thread
    per rank: what every rank sent to `out` (`send_to_driver`), in rank order.

    Raises:
        RuntimeError: no result came back, with torchrun's output.
        subprocess.TimeoutExpired: past `timeout_s`.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               *arguments]
    returncode, output = _run(command, timeout_s)
    if returncode != 0 and not out.exists():
        # gloo sometimes aborts a rank at exit on this VM ("terminate called without an active
        # exception") before the result is written: one more try.
        returncode, output = _run(command, timeout_s)
    if not out.exists():
        raise RuntimeError(f"{what}: torchrun exited {returncode}\n{output[-6000:]}")
    return json.loads(out.read_text())


def _run(command: list[str], timeout_s: float) -> tuple[int, str]:
    """(exit status, stdout + stderr) of `command` run from the repository root. Past `timeout_s`, torchrun
    gets SIGTERM (it stops its ranks before it exits) and subprocess.TimeoutExpired is raised: no second try."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()
            process.communicate()
            raise
    return process.returncode, output


# ---------------------------------------------------------------------------------------------------
# In a fresh process


def training_memory(kind: str, job: TrainJob, omp_threads: int | None = 1,
                    code: Path | None = None) -> dict[str, Any]:
    """Measure `job` in a fresh process (`kind`: child, ranks or phases; see the module's docstring) with
    `code`'s fulltune (default: this one); what `main` prints, and the seconds it took.

    Raises:
        RuntimeError: the run failed, with the end of its output.
    """
    job_file = Path(job.paths.output_dir).with_suffix(".job.json")
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(job.to_json())
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", BOOTSTRAP, str(Path(__file__).resolve()), kind, str(job_file)],
                          cwd=code or ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"training {job.paths.output_dir} failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def child_memory(job: TrainJob, ranks: bool = False) -> dict[str, Any]:
    """Run `job` through `run_training` from this (fresh) process, sampling its children; returns
    {"peak_rss_bytes", "ru_maxrss_bytes", "setup_rss_bytes", "sampled_rss_bytes" (per phase)}, and with
    `ranks` "ranks": each training rank's peak {"rss", "pss"}, largest first."""
    import psutil

    out = Path(job.paths.output_dir)
    samples: dict[str, int] = dict.fromkeys(TRAINER_PHASES, 0)
    peaks: dict[int, dict[str, int]] = {}
    loop_started = threading.Event()

    def phase() -> str:
        """Where the trainer is, from what it has written: set-up, steps, a checkpoint, the final save."""
        if not loop_started.is_set():
            return "setup"
        if (out / "model").exists() or any(out.glob(".tmp-*")):
            return "final"
        checkpoints = out / "checkpoints"
        if checkpoints.is_dir() and any(p.name.startswith(".tmp-") for p in checkpoints.iterdir()):
            return "checkpoint"
        return "steps"

    def sample() -> None:
        for child in psutil.Process().children(recursive=True):
            try:
                now = phase()
                samples[now] = max(samples[now], child.memory_info().rss)
                if ranks:
                    command = " ".join(child.cmdline())
                    if "fulltune.runtime.train" in command and "torch.distributed.run" not in command:
                        seen = peaks.setdefault(child.pid, {"rss": 0, "pss": 0})
                        for key, value in rss_and_pss(child.pid).items():
                            seen[key] = max(seen[key], value)
            except (psutil.Error, OSError, ValueError):
                pass

    def on_output(line: str) -> None:
        if line.startswith("fulltune train:"):
            loop_started.set()  # the trainer prints this line just before its first step

    sampler = Sampler(sample, 0.02).start()
    try:
        run_training(job, on_output=on_output)
    finally:
        sampler.stop()
    # The kernel's high-water mark (kilobytes on Linux). It is updated when memory is unmapped, not when
    # glibc hands pages back with madvise, so a peak released that way can be missed: the sampled RSS
    # (every 20 ms) is the other lower bound, and the peak is the larger of the two.
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    result: dict[str, Any] = {"peak_rss_bytes": max(maxrss, *samples.values()), "ru_maxrss_bytes": maxrss,
                              "setup_rss_bytes": samples["setup"], "sampled_rss_bytes": samples}
    if ranks:
        result["ranks"] = sorted(peaks.values(), key=lambda p: -p["rss"])
    return result


def training_phases(job: TrainJob) -> dict[str, Any]:
    """Train `job` (two steps, a checkpoint after the first) in this (fresh) process on the trainer's own
    functions; returns {"sampled": each phase's peak RSS, "hwm_after": VmHWM at its end}."""
    peaks: dict[str, int] = {}
    hwm: dict[str, int] = {}
    current = ["imports"]

    def sample() -> None:
        peaks[current[0]] = max(peaks.get(current[0], 0), resident_bytes())

    def enter(phase: str) -> None:
        hwm[current[0]] = high_water_bytes()
        peaks[current[0]] = max(peaks.get(current[0], 0), resident_bytes())
        current[0] = phase

    sampler = Sampler(sample, 0.005).start()
    from fulltune.runtime import train  # what the trainer imports (MLflow is the launcher's: run_tracking.py)

    if os.environ.get("FULLTUNE_DEFAULT_MALLOC") != "1":
        from fulltune.runtime import allocator

        allocator.return_large_blocks()  # as `python -m fulltune.runtime.train` does on CPU
    _mark_setup_phases(train, enter)
    enter("set-up")
    _train_two_steps(train, job, enter)
    enter("done")
    sampler.stop()
    return {"sampled": {p: peaks.get(p, 0) for p in PHASES}, "hwm_after": {p: hwm.get(p, 0) for p in PHASES}}


def _mark_setup_phases(train: Any, enter: Callable[[str], None]) -> None:
    """Mark the phases inside `train.setup` by wrapping the two functions it calls for the model and the optimizer."""
    load, build = train.load_model_with_levers, train.build_optimizer

    def load_marked(*args: Any, **kwargs: Any) -> Any:
        enter("load")
        return load(*args, **kwargs)

    def build_marked(*args: Any, **kwargs: Any) -> Any:
        enter("optimizer and prepare")
        return build(*args, **kwargs)

    train.load_model_with_levers, train.build_optimizer = load_marked, build_marked


def _train_two_steps(train: Any, job: TrainJob, enter: Callable[[str], None]) -> None:
    """The trainer's loop for two steps, a checkpoint after the first, then the export."""
    from fulltune.runtime.step_checkpoints import resume, save_checkpoint
    from fulltune.runtime.train_metrics import TrainMetrics

    run = train.setup(job)
    state, saved, resumed_from = resume(run)
    metrics = TrainMetrics(run, saved)
    with metrics.running(state.step):
        for phase in ("first optimizer step", "training step"):
            enter(phase)
            rows = run.schedule.step_rows(state.step)
            outcome = train.train_step(run, rows, state.step + 1)
            state.step += 1
            metrics.record_step(rows, outcome)
            metrics.log_interval(state.step)
            if phase == "first optimizer step":
                enter("checkpoint save")
                save_checkpoint(run, state, metrics.state_dict())
    enter("final export")
    train.finish(run, state, metrics, resumed_from)


def main(argv: list[str] | None = None) -> int:
    """`python -m measuring.measure child|ranks|phases JOB.json`: one JSON line of what was measured."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in KINDS:
        print(f"usage: python -m measuring.measure {'|'.join(KINDS)} JOB.json", file=sys.stderr)
        return 2
    kind, job = args[0], TrainJob.from_json(Path(args[1]).read_text())
    result = training_phases(job) if kind == "phases" else child_memory(job, ranks=kind == "ranks")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
