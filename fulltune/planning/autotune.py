"""Autotune: run the planner's top candidates for a few steps on the real device before the run commits.

The planner ranks the settings that fit by an analytic step-time model (`planning.step_time.step_seconds`),
whose constants no device at hand has checked. Autotune measures instead:

    candidates  the planned settings and the planner's next-fastest alternatives that fit
                (`budget.autotune.candidates`; levers included where the planner chose them)
    measure     each in its own child process through the real launch path (`launch.run_training` of a
                `TrainJob` built by `launch.job_from_pipeline`, the trainer's own `train_step`), on the real
                tokenized data, into a scratch output directory: `warmup_steps` untimed optimizer steps,
                then `steps` timed ones; a probe in the child (`StepProbe`, through the trainer's hook
                points) records when each step starts and the peak memory (CUDA: `max_memory_reserved`;
                CPU: the process's resident high-water mark), and ends the child before any export
    choose      the fastest candidate whose measured peak fits the usable budget; one that runs out of
                memory, exceeds the budget, fails or times out is recorded and skipped, never fatal;
                when none fits the analytic plan stands
    remember    every measurement under `<workdir>/autotune/measurements/`, keyed by the hardware (device
                name and count, driver and torch versions), the model's shape and the settings (which hold
                the sequence shape), so a scheduled retraining on the same machine does not tune again
    calibrate   the measured / analytic step-time ratios of a device kind, per kind of step (precision,
                optimizer, levers), scale the planner's `step_seconds` for later plans on that kind of
                device (`calibrated`), with or without tuning

`budget.autotune` is `auto` by default: the run tunes only where the predicted training time is at
least `AUTO_RATIO` times the predicted tuning time (tuning then costs at most 5% of the run) and more
than one candidate fits. The whole tuning is capped at `max_seconds` of wall time.

The budget stage runs it (fulltune/stages/budget.py `plan_and_tune`), and measures the two layouts of
`data.packing: auto` with it under `budget.autotune: true`; the report (table, picture, MLflow) is
fulltune/planning/autotune_report.py.

This module never imports Prefect; the trainer's child never imports it (its probe is `fulltune.runtime.faults.StepProbe`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fulltune.memory.units import format_seconds
from fulltune.runtime.faults import PROBE_ENV

if TYPE_CHECKING:
    from fulltune.runtime.launch import TrainJob
    from fulltune.memory.shapes import ModelShape
    from fulltune.memory.types import Settings
    from fulltune.planning.inputs import BudgetDecision, ResolvedPipeline

AUTOTUNE_DIR = "autotune"  # under the workdir: measurements/, scratch/, pictures
CACHE_VERSION = 1  # bump when what a measurement means changes: older ones are ignored

# Defaults of `budget.autotune` (fulltune/spec.py `AutotuneSpec` holds the same numbers):
# 3 candidates: the plan and its two nearest alternatives, where the analytic ranking is least sure;
# 1 warm-up step: the first step allocates the optimizer states and warms the allocator and kernels;
# 3 timed steps: their median survives one step disturbed by another job on shared cores;
# 600 s: tuning a model with 3–16 s steps finishes within ten minutes.
DEFAULT_CANDIDATES, DEFAULT_STEPS, DEFAULT_WARMUP_STEPS, DEFAULT_MAX_SECONDS = 3, 3, 1, 600.0
# `auto` tunes when the predicted training time is at least this many times the predicted tuning time.
AUTO_RATIO = 20.0
# What one child costs besides its steps (interpreter, torch, transformers, accelerate, the model): 12–14 s
# measured for a tiny model on the 2-core development VM (benchmarks/autotune.py, under load); assumed
# more on a GPU (CUDA context, kernels).
CHILD_START_SECONDS = {"cpu": 12.0, "cuda": 30.0}
# A candidate is not started with less than this left of max_seconds.
MIN_CANDIDATE_SECONDS = 5.0
# Measured ratios kept per kind of step (the newest), so the factor follows the machine as it changes.
CALIBRATION_WINDOW = 20

Outcome = Literal["fits", "over budget", "oom", "failed", "timeout"]


# ---------------------------------------------------------------------------------------------------
# Options: `budget.autotune` as the engine reads it


@dataclass(frozen=True)
class Options:
    """`budget.autotune` resolved: whether to tune (`on`, `off`, `auto`) and how much."""

    mode: Literal["on", "off", "auto"] = "auto"
    candidates: int = DEFAULT_CANDIDATES
    steps: int = DEFAULT_STEPS
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    max_seconds: float = DEFAULT_MAX_SECONDS


def options(value: Any) -> Options:
    """`budget.autotune` (`true`, `false`, `auto` or an `AutotuneSpec` mapping) as Options."""
    if value is True:
        return Options(mode="on")
    if value is False:
        return Options(mode="off")
    if value == "auto" or value is None:
        return Options()
    enabled = getattr(value, "enabled", True)
    mode = "auto" if enabled == "auto" else ("on" if enabled else "off")
    return Options(mode=mode, candidates=value.candidates, steps=value.steps, warmup_steps=value.warmup_steps,
                   max_seconds=float(value.max_seconds))


# ---------------------------------------------------------------------------------------------------
# The child's side: a probe at the trainer's hook points


# ---------------------------------------------------------------------------------------------------
# Hardware, cache keys and calibration


def hardware(device: str) -> dict[str, Any]:
    """What a measurement's speed depends on besides the step: device name and count, driver and torch."""
    import torch

    info: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if device == "cuda" and torch.cuda.is_available():
        info.update(name=torch.cuda.get_device_name(0), count=torch.cuda.device_count(), cuda=torch.version.cuda,
                    driver=_nvidia_driver())
    else:
        info.update(_cpu_info())
    return info


def _cpu_info() -> dict[str, Any]:
    """This machine's CPU as `hardware` describes it: model name, the cores this process may use, machine."""
    import platform

    return {"name": _cpu_name(), "count": len(os.sched_getaffinity(0)), "machine": platform.machine()}


def device_kind(info: dict[str, Any]) -> str:
    """The calibration's unit: one kind of device in one count, e.g. `cuda NVIDIA H200 ×1`."""
    return f"{info['device']} {info['name']} ×{info['count']}"


def _cpu_name() -> str:
    import platform

    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str | None:
    with contextlib.suppress(OSError, IndexError):
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ..."
        words = Path("/proc/driver/nvidia/version").read_text().split()
        return next(w for w in words if w[:1].isdigit() and "." in w)
    return None


def step_kind(settings: Settings) -> str:
    """The kind of step a calibration factor is kept for: precision, optimizer and the levers on.

    These change the step's speed in ways the analytic model guesses at (bf16 without bf16 units, 8-bit
    optimizers' kernels, the levers' copies); micro-batch and checkpointing it counts in FLOPs.
    """
    levers = "+".join(name for name, on in settings.levers().items() if on) or "no levers"
    return f"{settings.mixed_precision}, {settings.optimizer}, {levers}"


def _shape_dict(shape: ModelShape) -> dict[str, Any]:
    return asdict(shape)


def _shape_from(data: dict[str, Any]) -> ModelShape:
    from fulltune.memory.shapes import ModelShape

    tuples = {"layer_params", "other_params"}
    return ModelShape(**{k: tuple(tuple(s) for s in v) if k in tuples else v for k, v in data.items()})


def measurement_key(info: dict[str, Any], shape: ModelShape, settings: Settings, opts: Options) -> str:
    """The measurement's cache key: the machine, the model's shape, the settings (with every lever option,
    `train.float8_recipe` too, which `Settings.to_dict` does not record) and the steps timed."""
    from fulltune.levers import options_of
    from fulltune.storage import hash_json

    return hash_json({"version": CACHE_VERSION, "hardware": info, "shape": _shape_dict(shape),
                      "settings": settings.to_dict() | options_of(settings), "steps": opts.steps,
                      "warmup_steps": opts.warmup_steps})[:32]


def _measurements_dir(workdir: str | Path) -> Path:
    return Path(workdir) / AUTOTUNE_DIR / "measurements"


def _read_measurement(workdir: str | Path, key: str) -> dict[str, Any] | None:
    try:
        entry = json.loads((_measurements_dir(workdir) / f"{key}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return entry if isinstance(entry, dict) and entry.get("version") == CACHE_VERSION else None


def _write_measurement(workdir: str | Path, key: str, entry: dict[str, Any]) -> None:
    from fulltune.storage import atomic_write_text

    atomic_write_text(_measurements_dir(workdir) / f"{key}.json", json.dumps(entry, indent=1))


def analytic_step_seconds(shape: ModelShape, settings: Settings) -> float:
    """The planner's step time without any calibration."""
    from fulltune.planning import step_time

    token = step_time.STEP_TIME_CORRECTION.set(None)
    try:
        return step_time.step_seconds(shape, settings)
    finally:
        step_time.STEP_TIME_CORRECTION.reset(token)


def calibration(workdir: str | Path, kind: str) -> dict[str, float]:
    """Step-time correction factors for device kind `kind`: step kind → median of measured / analytic
    seconds over its newest CALIBRATION_WINDOW measurements, and "*" → the median over all of them
    (used for step kinds not measured yet). Empty when nothing was measured on this kind of device.

    The analytic seconds are recomputed from each measurement's model shape and settings, so the factors
    always correct the step-time model as it is now.
    """
    from fulltune.memory.types import Settings

    by_kind: dict[str, list[tuple[str, float]]] = {}
    directory = _measurements_dir(workdir)
    for file in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            entry = json.loads(file.read_text())
            if entry.get("version") != CACHE_VERSION or entry.get("device_kind") != kind:
                continue
            if entry.get("status") != "measured" or not entry.get("step_seconds"):
                continue
            settings = Settings(**entry["settings"])
            analytic = analytic_step_seconds(_shape_from(entry["shape"]), settings)
        except (OSError, ValueError, TypeError, KeyError):
            continue  # a damaged or foreign file calibrates nothing
        if analytic > 0:
            by_kind.setdefault(step_kind(settings), []).append((entry.get("measured_at", ""),
                                                                entry["step_seconds"] / analytic))
    factors = {}
    every = []
    for name, ratios in by_kind.items():
        newest = [r for _, r in sorted(ratios)[-CALIBRATION_WINDOW:]]
        factors[name] = statistics.median(newest)
        every += newest
    if every:
        factors["*"] = statistics.median(every)
    return factors


@contextlib.contextmanager
def calibrated(workdir: str | Path, device: str) -> Iterator[dict[str, float]]:
    """Within the block the planner's `step_seconds` reads this device kind's measured corrections
    (`calibration`); yields the factors (empty: the analytic model as it is)."""
    from fulltune.planning import step_time

    factors = calibration(workdir, device_kind(hardware(device)))
    correction = None
    if factors:
        def correction(settings: Settings) -> float:
            return factors.get(step_kind(settings), factors["*"])
    token = step_time.STEP_TIME_CORRECTION.set(correction)
    try:
        yield factors
    finally:
        step_time.STEP_TIME_CORRECTION.reset(token)


def calibration_key(workdir: str | Path, device: str) -> dict[str, Any]:
    """What the budget stage's cache key sees of the machine and its calibration: the device kind and
    the factors, rounded (a new measurement that moves a factor by under 1% does not replan)."""
    # Every run computes this, cached reruns too: a CPU's kind is read without importing torch (seconds).
    kind = device_kind({"device": device, **_cpu_info()}) if device == "cpu" else device_kind(hardware(device))
    # The kind itself too: with no measurements yet every machine's factors are the same (none), and a
    # choice tuned on two cores must not be reused on one.
    return {"device_kind": kind, **{k: round(v, 2) for k, v in calibration(workdir, kind).items()}}


# ---------------------------------------------------------------------------------------------------
# Candidates and one measurement


@dataclass
class Trial:
    """One candidate: what the planner predicted and what the device measured."""

    settings: Settings
    predicted_step_seconds: float | None  # the planner's ranking (calibrated where measurements exist)
    analytic_step_seconds: float  # the step-time model without calibration
    outcome: Outcome = "failed"
    measured_step_seconds: float | None = None
    measured_peak_bytes: int | None = None
    tokens_per_second: float | None = None
    detail: str = ""
    cached: bool = False
    seconds: float = 0.0  # wall time this candidate cost now (0 when cached)

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings.choices(), "predicted_step_seconds": _rounded(self.predicted_step_seconds),
                "analytic_step_seconds": _rounded(self.analytic_step_seconds),
                "measured_step_seconds": _rounded(self.measured_step_seconds),
                "measured_peak_bytes": self.measured_peak_bytes,
                "tokens_per_second": _rounded(self.tokens_per_second), "outcome": self.outcome,
                "detail": self.detail, "cached": self.cached, "seconds": round(self.seconds, 2)}


def _rounded(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")


def planned_settings(decision: BudgetDecision) -> Settings:
    """The settings a budget decision planned, as `Settings`."""
    from fulltune.memory.types import Settings

    return decision.settings if isinstance(decision.settings, Settings) else Settings(**decision.settings)


def candidates(decision: BudgetDecision, count: int) -> list[tuple[Settings, float | None]]:
    """The planned settings and the planner's next-fastest alternatives that fit, fastest first: at most
    `count` (the plan keeps four alternatives that fit)."""
    chosen = planned_settings(decision)
    out = [(chosen, decision.plan["plan"].get("estimated_step_seconds"))]
    for alternative in decision.plan.get("alternatives", []):
        if len(out) >= count:
            break
        # The planner lists fitting alternatives as "slower: …" and the rest as "does not fit: …".
        if not str(alternative.get("rejected_because", "")).startswith("slower"):
            continue
        settings = replace(chosen, **{name: alternative[name] for name in chosen.choices()})
        if all(settings != s for s, _ in out):
            out.append((settings, alternative.get("estimated_step_seconds")))
    return out


@dataclass(frozen=True)
class _Measured:
    status: Literal["measured", "oom", "failed", "timeout"]
    step_seconds: float | None = None
    peak_bytes: int | None = None
    tokens_per_second: float | None = None
    detail: str = ""
    cpu_step_seconds: float | None = None  # the child's CPU time per timed step (median)


def measure(job: TrainJob, opts: Options, timeout: float, step_tokens: list[int]) -> _Measured:
    """Run `job` in a child through `launch.run_training` for `opts.warmup_steps` + `opts.steps` optimizer
    steps into its (scratch) output directory, which is removed afterwards; `step_tokens` are the
    non-padding tokens of the timed steps."""
    import shutil

    from fulltune.runtime import launch
    from fulltune.errors import UserError

    stop_at = opts.warmup_steps + opts.steps + 1
    output_dir = Path(job.paths.output_dir)
    job = job.replace(max_steps=stop_at, checkpoint_every_steps=0, log_every_steps=stop_at)
    output_dir.mkdir(parents=True, exist_ok=True)
    probe = {"dir": str(output_dir), "stop_at": stop_at, "deadline": time.time() + timeout}
    tail: deque[str] = deque(maxlen=12)
    try:
        try:
            launch.run_training(job, on_output=tail.append, env={PROBE_ENV: json.dumps(probe)})
        except launch.OutOfMemory as exc:
            return _Measured("oom", peak_bytes=exc.observed_peak_bytes, detail=str(exc))
        except UserError as exc:
            return _Measured("failed", detail=" ".join(str(exc).split())[:300])
        except RuntimeError as exc:
            records = _probe_records(output_dir)
            if not (records and all(r["done"] for r in records)):
                if any(r["timed_out"] for r in records):
                    return _Measured("timeout", detail=f"stopped after {format_seconds(timeout)}")
                if "code -9" in str(exc):  # SIGKILL not sent by the probe: the kernel's out-of-memory killer
                    return _Measured("oom", peak_bytes=max((r["peak_bytes"] or 0 for r in records), default=None),
                                     detail="killed (SIGKILL: out of memory)")
                return _Measured("failed", detail=(tail[-1] if tail else str(exc))[:300])
        records = _probe_records(output_dir)
        main = next((r for r in records if r["rank"] == 0), None)
        starts = main["step_starts"] if main else []
        durations = [b - a for a, b in zip(starts, starts[1:])][opts.warmup_steps:]
        if len(durations) < opts.steps:
            return _Measured("failed", detail=f"the child ran {len(durations)} of {opts.steps} timed steps")
        peak = max(r["peak_bytes"] or 0 for r in records)
        tokens_per_second = throughput(step_tokens, durations)
        cpu = main.get("cpu_starts") or []
        cpu_durations = [b - a for a, b in zip(cpu, cpu[1:])][opts.warmup_steps:]
        return _Measured("measured", statistics.median(durations), peak, tokens_per_second,
                         cpu_step_seconds=statistics.median(cpu_durations) if cpu_durations else None)
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)


def throughput(step_tokens: list[int], durations: list[float]) -> float | None:
    """Tokens per second from the same statistic as the step time the table shows beside it: the median
    step's tokens over the median step's seconds (a mean here would not match the median step)."""
    if not step_tokens or not durations or statistics.median(durations) <= 0:
        return None
    return statistics.median(step_tokens) / statistics.median(durations)


def _probe_records(output_dir: Path) -> list[dict[str, Any]]:
    records = []
    for file in sorted(output_dir.glob("probe-*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            records.append(json.loads(file.read_text()))
    return records


def _step_tokens(train_file: str, rows_per_step: int, seed: int, first: int, count: int) -> list[int]:
    """Non-padding tokens of optimizer steps first … first + count − 1 (0-based), as the trainer orders them."""
    from fulltune.data.batching import StepSchedule, TokenizedRows

    rows = TokenizedRows(train_file)
    schedule = StepSchedule(rows.lengths, rows_per_step, seed)
    if schedule.per_epoch == 0:
        return []
    return [int(rows.lengths[schedule.step_rows(step)].sum()) for step in range(first, first + count)]


# ---------------------------------------------------------------------------------------------------
# Tuning


@dataclass
class Tuning:
    """The outcome of one tuning: every candidate, the choice (index into `trials`, None: none fits) and
    the wall time it took."""

    trials: list[Trial]
    chosen: int | None
    seconds: float
    opts: Options
    device_kind: str
    budget_bytes: int | None
    usable_bytes: int | None
    reason: str
    picture: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"ran": True, "candidates": [t.to_dict() for t in self.trials], "chosen": self.chosen,
                "seconds": round(self.seconds, 2), "max_seconds": self.opts.max_seconds, "steps": self.opts.steps,
                "warmup_steps": self.opts.warmup_steps, "device_kind": self.device_kind,
                "budget_bytes": self.budget_bytes, "usable_bytes": self.usable_bytes, "reason": self.reason,
                "picture": self.picture}


def tune(p: ResolvedPipeline, decision: BudgetDecision, data: Any, tokenizer: str, opts: Options,
         on_progress: Any = None) -> Tuning:
    """Measure the candidates of `decision` on this machine and choose the fastest that fits.

    Cached measurements (same hardware, model shape and settings) are reused; the others run one at a
    time, each with what is left of `opts.max_seconds` shared as `_time_for` says. Never raises for a candidate:
    an out-of-memory, a failure or a timeout is recorded in its Trial.
    """
    from fulltune.runtime import launch
    from fulltune.memory.shapes import model_shape
    from fulltune.models import prepare_base_model, read_model_config

    started = time.monotonic()
    device = planned_settings(decision).device
    info = hardware(device)
    kind = device_kind(info)
    shape = model_shape(read_model_config(p.spec.model, decision.vocab_size))
    usable, budget = decision.plan.get("usable_bytes"), decision.plan.get("budget_bytes")
    trials = [Trial(s, predicted, analytic_step_seconds(shape, s))
              for s, predicted in candidates(decision, opts.candidates)]
    first = trials[0].settings
    rows_per_step = first.micro_batch_size * first.gradient_accumulation_steps * first.num_processes
    step_tokens = _step_tokens(data.train_rows_file, rows_per_step, p.spec.train.seed, opts.warmup_steps, opts.steps)
    base_model: str | None = None
    scratch = Path(p.workdir) / AUTOTUNE_DIR / "scratch"
    pending = []
    for trial in trials:
        cached = _read_measurement(p.workdir, measurement_key(info, shape, trial.settings, opts))
        if cached is not None:
            _fill(trial, cached, usable, cached_entry=True)
        else:
            pending.append(trial)
    for n, trial in enumerate(pending):
        left = opts.max_seconds - (time.monotonic() - started)
        if left < MIN_CANDIDATE_SECONDS:
            trial.outcome, trial.detail = "timeout", f"not run: the tuning's {format_seconds(opts.max_seconds)} were spent"
            continue
        if base_model is None:
            base_model = prepare_base_model(p.spec.model, tokenizer, p.workdir, p.spec.train.seed)
        job = launch.job_from_pipeline(p.spec, trial.settings, model_path=base_model, tokenizer_path=tokenizer,
                                       train_file=data.train_rows_file,
                                       output_dir=str(scratch / f"{os.getpid()}-{time.time_ns()}"))
        if on_progress is not None:
            on_progress(f"autotune: measuring {describe(trial.settings)}")
        t0 = time.monotonic()
        result = measure(job, opts, _time_for(trial, opts, device, left, len(pending) - n), step_tokens)
        trial.seconds = time.monotonic() - t0
        entry = {"version": CACHE_VERSION, "hardware": info, "device_kind": kind, "shape": _shape_dict(shape),
                 "settings": trial.settings.to_dict(), "steps": opts.steps, "warmup_steps": opts.warmup_steps,
                 "status": result.status, "step_seconds": result.step_seconds, "peak_bytes": result.peak_bytes,
                 "tokens_per_second": result.tokens_per_second, "detail": result.detail,
                 "cpu_step_seconds": result.cpu_step_seconds,
                 "analytic_step_seconds": trial.analytic_step_seconds,
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _fill(trial, entry, usable)
        if result.status in ("measured", "oom"):  # a failure or a timeout may not repeat: measure again next time
            _write_measurement(p.workdir, measurement_key(info, shape, trial.settings, opts), entry)
    chosen, reason = _choice(trials)
    return Tuning(trials, chosen, time.monotonic() - started, opts, kind, budget, usable, reason)


def _time_for(trial: Trial, opts: Options, device: str, left: float, remaining: int) -> float:
    """The seconds candidate `trial` may run: an even share of what is left, or as much as it is expected
    to need (a child's start plus its steps, twice over) when that is more and left: time a candidate
    does not use flows to the next ones, and none is cut off at a share it could never finish in."""
    step = trial.predicted_step_seconds or trial.analytic_step_seconds or 0.0
    expected = 2 * (CHILD_START_SECONDS.get(device, CHILD_START_SECONDS["cuda"]) + (opts.warmup_steps + opts.steps)
                    * step)
    return max(left / remaining, min(left, expected))


def _choice(trials: list[Trial]) -> tuple[int | None, str]:
    """(the candidate chosen, why). One beats the plan only by beating its measured step time; the plan
    gives way unmeasured only when it was measured not to fit (out of memory, over the budget)."""
    plan = trials[0]
    if plan.outcome in ("timeout", "failed"):
        return None, (f"the planned settings were not measured ({plan.outcome}), so no candidate can be shown "
                      "faster: the analytic plan stands")
    fitting = [i for i, t in enumerate(trials) if t.outcome == "fits"]
    chosen = min(fitting, key=lambda i: trials[i].measured_step_seconds) if fitting else None
    if chosen is None:
        reason = "no candidate was measured to fit: the analytic plan stands"
    elif chosen == 0:
        reason = "the planned settings measured fastest among those that fit"
    else:
        t0, tc = trials[0], trials[chosen]
        planned = format_seconds(t0.measured_step_seconds) if t0.measured_step_seconds else t0.outcome
        reason = (f"candidate {chosen} measured fastest among those that fit: "
                  f"{format_seconds(tc.measured_step_seconds, 's/step')} against the planned settings' {planned}")
    return chosen, reason


def _fill(trial: Trial, entry: dict[str, Any], usable: int | None, cached_entry: bool = False) -> None:
    status = entry["status"]
    trial.measured_step_seconds = entry.get("step_seconds")
    trial.measured_peak_bytes = entry.get("peak_bytes")
    trial.tokens_per_second = entry.get("tokens_per_second")
    trial.detail = entry.get("detail", "")
    trial.cached = cached_entry
    if status == "measured":
        over = usable is not None and (trial.measured_peak_bytes or 0) > usable
        trial.outcome = "over budget" if over else "fits"
        if over:
            from fulltune.memory.units import format_bytes

            trial.detail = f"peak {format_bytes(trial.measured_peak_bytes)} > {format_bytes(usable)} usable"
    else:
        trial.outcome = status


# ---------------------------------------------------------------------------------------------------
# In words


def describe(settings: Settings) -> str:
    """`micro 2×4, ckpt 1, bf16, adafactor, pure_bf16`: a candidate in one short line."""
    parts = [f"micro {settings.micro_batch_size}×{settings.gradient_accumulation_steps}",
             f"ckpt {settings.gradient_checkpointing}",
             "fp32" if settings.mixed_precision == "no" else settings.mixed_precision, settings.optimizer]
    parts += [name for name, on in settings.levers().items() if on]
    return ", ".join(parts)
