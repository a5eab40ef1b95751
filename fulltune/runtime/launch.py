"""Run the training loop in a child process and turn its outcome into a result or an error.

Training always runs in a child: a retry starts with a clean device, an OOM cannot poison
the flow process, and one process, several processes and several GPUs are the same code path.

    run_training(job)
      ├─ output_dir/model/ + result.json present → return the saved TrainResult (nothing runs)
      ├─ write output_dir/JOB.json (and output_dir/accelerate.yaml for accelerate launch)
      ├─ one process:          python -m fulltune.runtime.train JOB.json
      │  several on CPU, fsdp: torchrun --standalone --nproc_per_node N -m fulltune.runtime.train JOB.json
      │  ddp on CUDA:          accelerate launch --config_file accelerate.yaml -m fulltune.runtime.train JOB.json
      └─ exit 0 → TrainResult; 2 → UserError (the child's message); 3 → OutOfMemory; else RuntimeError

    run_sharded_evaluation(EVAL_JOB.json, N)   the evaluate stage's candidate of a sharded run, the same way:
      torchrun --standalone --nproc_per_node N -m fulltune.evaluation.sharded EVAL_JOB.json → eval-result.json

The child runs in its own session and ends itself when this process is gone (LAUNCHER_ENV), so a
killed flow leaves no orphan training on.

This module imports neither torch nor accelerate, so the flow can build jobs without them.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, create_model, model_validator

from fulltune import errors, spec
from fulltune.degrees import PLANNED, ParallelDims
from fulltune.errors import ConfigError, DataError, TrainingError, UserError
from fulltune import levers
from fulltune.memory.types import Settings
from fulltune.pipelines_file import format_errors
from fulltune.spec import Strict
# One test of "has that process ended" for locks, temp dirs and the launcher; re-exported for the trainer.
from fulltune.storage import atomic_write_text, process_gone, process_identity  # noqa: F401

# Files the child leaves in output_dir.
JOB_FILE = "JOB.json"
ACCELERATE_CONFIG_FILE = "accelerate.yaml"
RESULT_FILE = "result.json"
MODEL_DIR = "model"
ERROR_FILE = "error.json"  # {"type": "TrainingError", "message": "..."}: exit code 2
OOM_FILE = "oom.json"  # {"peak_bytes": int}: exit code 3
PROGRESS_FILE = "progress.json"  # {"step", "total_steps", "loss"}: rewritten every log interval
# The launching process's identity (JSON of process_identity()): the child ends itself when it is gone.
LAUNCHER_ENV = "FULLTUNE_LAUNCHER"


# ---------------------------------------------------------------------------------------------------
# The job: the resolved spec sections and the plan, typed, written to JOB.json by one function


class JobPaths(Strict):
    """Where the child reads and writes; absolute paths (a hub id for a hub model or tokenizer)."""

    model_path: str  # the checkpoint the child loads: the prepared base model, not model.name_or_path
    tokenizer_path: str
    # train.arrow (memory-mapped) or Parquet: input_ids, labels (-100 = no loss), position_ids (restart per document)
    train_file: str
    output_dir: str  # runs/<train-key>/: checkpoints/step-N/, model/, result.json


class Tracking(Strict):
    """Where the run reports beside output_dir: the child writes metrics.jsonl and progress.json, the launcher
    forwards the metrics into this existing MLflow run (fulltune/runtime/run_tracking.py)."""

    mlflow_tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    progress_artifact_id: str | None = None  # the flow's Prefect artifact; the child only writes progress.json


# The train.* keys the memory plan resolves: the plan (fulltune.memory.Settings) holds what it chose for
# each, and effective_batch_size is its micro_batch_size × gradient_accumulation_steps × processes. The job's
# train section leaves them out, so the child cannot read an `auto` where the plan's choice belongs.
PLANNED_TRAIN_KEYS = ("effective_batch_size", "micro_batch_size", "gradient_accumulation_steps",
                      "gradient_checkpointing", "mixed_precision", "optimizer", *levers.TRAIN_KEYS)
TrainOptions = create_model(
    "TrainOptions", __base__=Strict, __module__=__name__,
    __doc__="The pipeline's `train:` section without PLANNED_TRAIN_KEYS: the optimisation the plan does not decide.",
    **{name: (info.annotation, info) for name, info in spec.TrainSpec.model_fields.items()
       if name not in PLANNED_TRAIN_KEYS})
# The distributed.* keys the memory plan resolves (`auto` becomes a degree, fulltune/degrees.py `PLANNED`): the
# plan's are the job's one copy of them, read through `TrainJob.dims`.
PLANNED_DISTRIBUTED_KEYS = PLANNED
DistributedOptions = create_model(
    "DistributedOptions", __base__=Strict, __module__=__name__,
    __doc__="The pipeline's `distributed:` section without PLANNED_DISTRIBUTED_KEYS: how the processes start.",
    **{name: (info.annotation, info) for name, info in spec.DistributedSpec.model_fields.items()
       if name not in (*PLANNED_DISTRIBUTED_KEYS, "strategy")},
    # A job's strategy is the one its plan trains with (job_from_pipeline replaces auto): one process by default.
    strategy=(spec.Strategy, Field("none", description="The strategy the plan trains with.")))
# Settings the plan echoes from the spec (it planned for them): the spec sections are their source, and a job
# whose plan disagrees is refused.
PLAN_ECHOES = {"attn_implementation": "model", "strategy": "distributed", "num_processes": "distributed",
               "pipeline_parallel": "distributed", "pipeline_schedule": "distributed", "checkpoint_async": "train"}
# Settings that describe what the plan assumed about the data; the child does not read them.
PLAN_ONLY_SETTINGS = ("seq_len", "attention_mask", "document_length", "target_fraction")


class TrainJob(Strict):
    """Everything the child needs: `python -m fulltune.runtime.train JOB.json`.

    Where the child reads each thing, one place each:
    - `plan` (fulltune.memory.Settings, what the memory plan chose): micro_batch_size,
      gradient_accumulation_steps, gradient_checkpointing (layers), mixed_precision, optimizer, device and the
      memory levers. It is the only source of these: the train section does not have them (PLANNED_TRAIN_KEYS).
    - `train` (TrainOptions, the rest of the pipeline's `train:`): learning rate, schedule, clipping, steps,
      seed, checkpoints, logging, compile, non-finite tolerance.
    - `model` (the pipeline's `model:`): trust_remote_code, allow_pickle_weights, attn_implementation,
      revision, token_env; the weights come from `paths.model_path`.
    - `distributed` (DistributedOptions, the pipeline's `distributed:` without PLANNED_DISTRIBUTED_KEYS):
      strategy, num_processes, num_machines.
    - `dims` (fulltune.degrees.ParallelDims): the data-parallel × tensor-parallel degrees, from the processes
      and the plan's tensor_parallel (the degree the plan chose for `auto`).
    - `paths`, `tracking`: set per run by whoever runs the job.
    The plan echoes attn_implementation, strategy, num_processes and the pipeline stages (PLAN_ECHOES); they must
    agree with the spec sections. JOB.json is `to_json()`, read back by `from_json()`.
    """

    paths: JobPaths
    model: spec.ModelSpec
    train: TrainOptions  # type: ignore[valid-type]
    distributed: DistributedOptions  # type: ignore[valid-type]
    plan: Settings
    tracking: Tracking = Field(default_factory=Tracking)

    @model_validator(mode="after")
    def _plan_echoes_the_spec(self) -> TrainJob:
        for name, section in PLAN_ECHOES.items():
            planned, declared = getattr(self.plan, name), getattr(getattr(self, section), name)
            if planned != declared:
                raise ValueError(f"plan.{name} is {planned!r} but {section}.{name} is {declared!r}: the plan was "
                                 "made for other settings")
        return self

    @property
    def dims(self) -> ParallelDims:
        """How the job's processes split the work; the plan checked the degrees against the processes."""
        return self.plan.dims  # its processes, strategy and stages are the spec's (`PLAN_ECHOES`)

    def to_json(self) -> str:
        """JOB.json: one object per section, indented for a person to read."""
        return self.model_dump_json(indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainJob:
        """The job `to_json` wrote. ConfigError naming JOB.json on anything else: unknown or missing keys
        (a JOB.json of another fulltune version), invalid values."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{JOB_FILE}: not JSON ({exc})") from None
        return _validated(data, f"{JOB_FILE} (written by a different fulltune version?)")

    def replace(self, **changes: Any) -> TrainJob:
        """This job with fields changed by name, each in the section that declares it (the plan and the spec
        section alike for PLAN_ECHOES), validated again. For tests and benchmarks; TypeError on unknown names."""
        data = self.model_dump()
        for name, value in changes.items():
            owners = [section for section in JOB_SECTIONS if name in _section_fields(section)]
            if not owners:
                raise TypeError(f"TrainJob has no field {name!r}")
            for section in owners:
                data[section][name] = value
        return _validated(data, "train job")


JOB_SECTIONS = tuple(TrainJob.model_fields)  # paths, model, train, distributed, plan, tracking


def _section_fields(section: str) -> tuple[str, ...]:
    kind = TrainJob.model_fields[section].annotation
    return tuple(f.name for f in dataclass_fields(kind)) if kind is Settings else tuple(kind.model_fields)


def _validated(data: Any, where: str) -> TrainJob:
    try:
        return TrainJob.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{where}: " + "; ".join(format_errors(exc, ""))) from None


def job_from_pipeline(pipeline: spec.PipelineSpec, plan: Settings, *, model_path: str, tokenizer_path: str,
                      train_file: str, output_dir: str, mlflow_tracking_uri: str | None = None,
                      mlflow_run_id: str | None = None) -> TrainJob:
    """The TrainJob for a resolved pipeline spec (`model`, `train`, `distributed`) and the settings its memory
    plan chose; ConfigError when the plan was made for another strategy, process count or attention.
    The tensor-parallel degree is the plan's (for `distributed.tensor_parallel: auto`, the one it chose), and so
    are the strategy for `distributed.strategy: auto` and the stages for `distributed.pipeline_parallel: auto`."""
    distributed = pipeline.distributed.model_dump(exclude=set(PLANNED_DISTRIBUTED_KEYS))
    if distributed["strategy"] == "auto":
        distributed["strategy"] = plan.strategy
    if distributed["pipeline_parallel"] == "auto":  # the stages the plan chose (1: data parallel or one process)
        distributed["pipeline_parallel"] = plan.pipeline_parallel
    return _validated({
        "paths": JobPaths(model_path=model_path, tokenizer_path=tokenizer_path, train_file=train_file,
                          output_dir=output_dir),
        "model": pipeline.model, "train": pipeline.train.model_dump(exclude=set(PLANNED_TRAIN_KEYS)),
        "distributed": distributed, "plan": plan,
        "tracking": Tracking(mlflow_tracking_uri=mlflow_tracking_uri, mlflow_run_id=mlflow_run_id),
    }, "train job")


def job_with(model_path: str, train_file: str, output_dir: str, tokenizer_path: str | None = None,
             **fields: Any) -> TrainJob:
    """A job for a local checkpoint with the spec's defaults, a plan of micro-batch 1 on one CPU process,
    and `fields` changed as TrainJob.replace does. For tests and benchmarks; pipelines use job_from_pipeline."""
    paths = JobPaths(model_path=model_path, tokenizer_path=tokenizer_path or model_path, train_file=train_file,
                     output_dir=output_dir)
    # seq_len is what the plan assumed about the rows; the child does not read it (PLAN_ONLY_SETTINGS).
    job = TrainJob(paths=paths, model=spec.ModelSpec(name_or_path=model_path), train=TrainOptions(),
                   distributed=DistributedOptions(), plan=Settings(micro_batch_size=1, seq_len=1))
    return job.replace(**fields)


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports; saved as output_dir/result.json."""

    model_dir: str
    steps: int
    epochs: float
    train_loss: float  # mean token loss of the last step that trained
    tokens: int  # non-padding tokens trained on, all processes, whole run
    tokens_per_second: float  # over the optimizer steps this process ran (a resumed run counts its own part)
    seconds: float  # wall time of those steps
    peak_memory_bytes: int | None  # torch.cuda.max_memory_allocated on CUDA; None on CPU
    nonfinite_steps: int  # optimizer steps skipped because the loss or gradient norm was not finite
    resumed_from_step: int | None
    loss_history: list[list[float]] = field(default_factory=list)  # [step, its mean token loss], every step that trained
    # Each process's step peak beside its estimate, when measured (fulltune/runtime/step_memory.py): rank, stage,
    # measured_bytes, estimated_bytes, error (+ when the estimate is above).
    rank_peaks: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainResult:
        return cls(**json.loads(text))


class OutOfMemory(RuntimeError):
    """The device ran out of memory; `observed_peak_bytes` lets the flow re-plan with a smaller budget.

    Not a UserError: the plan, not the user, was wrong, and the flow can fix it.
    """

    def __init__(self, observed_peak_bytes: int | None, message: str = "") -> None:
        self.observed_peak_bytes = observed_peak_bytes
        peak = f"{observed_peak_bytes / 2**30:.2f} GiB" if observed_peak_bytes else "unknown"
        super().__init__(message or f"training ran out of device memory (observed peak {peak})")


# What an out-of-memory replan may change while the checkpoints stay valid: the data position is the
# optimizer step, and which rows a step holds depends on the effective batch only (batching.StepSchedule);
# weights, optimizer and schedule state do not depend on how a step is split into micro-batches, which
# layers recompute their activations, or whether bf16 autocast runs (the weights stay fp32). The plan's
# assumptions about the data (PLAN_ONLY_SETTINGS) are not read by the child.
RESUMABLE_CHANGES = frozenset({"plan.micro_batch_size", "plan.gradient_accumulation_steps",
                               "plan.gradient_checkpointing", "plan.mixed_precision", "paths.output_dir",
                               "plan.checkpoint_async", "train.checkpoint_async",  # the same files either way
                               *(f"plan.{name}" for name in PLAN_ONLY_SETTINGS)})


def _fields_by_path(job: TrainJob) -> dict[str, Any]:
    """`section.field` → value, e.g. "plan.optimizer" → "adamw"."""
    return {f"{section}.{name}": value for section, values in job.model_dump(mode="json").items()
            for name, value in values.items()}


def resume_conflict(checkpointed: TrainJob, job: TrainJob) -> str | None:
    """Why `job` cannot resume from checkpoints that `checkpointed` wrote; None when it can.

    It can when only RESUMABLE_CHANGES differ and the effective batch (micro × accumulation) is the same.
    It cannot when the effective batch changed (another step schedule and step count), when fp16 was
    switched on or off (only fp16 checkpoints hold the grad scaler's state), or when any other field
    changed, e.g. the optimizer, whose state another optimizer cannot load: such a job starts at step 0.
    """
    before, after = checkpointed.plan, job.plan
    rows_before = before.micro_batch_size * before.gradient_accumulation_steps
    rows_after = after.micro_batch_size * after.gradient_accumulation_steps
    if rows_before != rows_after:
        return f"the effective batch per process changed from {rows_before} to {rows_after} rows"
    if (before.mixed_precision == "fp16") != (after.mixed_precision == "fp16"):
        return (f"mixed_precision changed from {before.mixed_precision} to {after.mixed_precision} "
                "(the fp16 grad scaler's state is in fp16 checkpoints only)")
    old, new = _fields_by_path(checkpointed), _fields_by_path(job)
    changed = [name for name in new if name not in RESUMABLE_CHANGES and old.get(name) != new[name]]
    if changed:
        detail = (f"{before.optimizer} → {after.optimizer}: the optimizer state cannot be loaded"
                  if "plan.optimizer" in changed else "the checkpoints were written for other settings")
        return f"{', '.join(changed)} changed ({detail})"
    return None


def validate_job(job: TrainJob) -> None:
    """Check what the sections cannot check alone, before any process starts; ConfigError listing every
    problem at once. Each section's own values (ranges, choices, lever combinations) were checked when
    the job was built or read."""
    plan, distributed = job.plan, job.distributed
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    problems += levers.problems(levers.from_settings(plan))  # the lever table (fulltune/levers.py)
    need(plan.device != "cpu" or distributed.num_machines == 1, "training on CPU runs on one machine")
    if problems:
        raise ConfigError("train job: " + "; ".join(problems))
    if not Path(job.paths.train_file).is_file():
        raise DataError(f"{job.paths.train_file}: tokenized training data not found (re-run the tokenize stage)")


def completed_result(output_dir: str | Path) -> TrainResult | None:
    """The saved result when the run already finished: model/ (renamed into place whole) and result.json."""
    output_dir = Path(output_dir)
    model_dir, result_file = output_dir / MODEL_DIR, output_dir / RESULT_FILE
    if not ((model_dir / "config.json").is_file() and result_file.is_file()):
        return None
    try:
        return TrainResult.from_json(result_file.read_text())
    except (json.JSONDecodeError, TypeError):
        return None


def generate_accelerate_config(job: TrainJob) -> dict[str, Any]:
    """The `accelerate launch --config_file` contents for a multi-process CUDA run of `job`.

    Several machines read the rendezvous address from MASTER_ADDR / MASTER_PORT and this machine's rank
    from MACHINE_RANK (each machine runs its own `accelerate launch`).
    """
    plan, distributed = job.plan, job.distributed
    distributed_type = {"ddp": "MULTI_GPU", "fsdp": "FSDP"}.get(distributed.strategy, "NO")
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "mixed_precision": plan.mixed_precision,
        "num_processes": distributed.num_processes,
        "num_machines": distributed.num_machines,
        "machine_rank": int(os.environ.get("MACHINE_RANK", "0")),
        "main_training_function": "main",
        "use_cpu": plan.device == "cpu",
        "gpu_ids": "all",
        "rdzv_backend": "static",
        "same_network": True,
        "downcast_bf16": "no",
        "debug": False,
    }
    if distributed.num_machines > 1:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ConfigError(f"distributed.num_machines > 1: set {' and '.join(missing)} on every machine")
        config["main_process_ip"] = os.environ["MASTER_ADDR"]
        config["main_process_port"] = int(os.environ["MASTER_PORT"])
    if job.dims.fsdp_enabled:
        # FSDP2, one unit per transformer block (accelerate falls back to the model's `_no_split_modules`);
        # sharded checkpoints keep save_state cheap; activation recompute stays with fulltune (k of L layers).
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_offload_params": False,
            "fsdp_activation_checkpointing": False,
        }
    return config


def training_command(job: TrainJob, job_file: Path) -> list[str]:
    """The command line that runs the child (see the module docstring)."""
    distributed, dims = job.distributed, job.dims
    if dims.world_size == 1 and dims.alone:
        return [sys.executable, "-m", "fulltune.runtime.train", str(job_file)]
    if not dims.alone:
        from fulltune.runtime.rendezvous import launch_command

        # several machines: c10d
        command = launch_command(job_file, distributed.num_processes, distributed.num_machines)
        if command is not None:
            return command
    if job.plan.device == "cpu" or dims.fsdp_enabled or dims.pp_enabled:
        # FSDP shards the model itself (fulltune/runtime/sharding.py) on CPU and CUDA alike; pipeline stages
        # are built by the trainer (fulltune/runtime/pipeline_parallel.py).
        # `accelerate launch --cpu --num_processes 2` ran a single process (accelerate 1.x);
        # torchrun gives Accelerate a MULTI_CPU (gloo) run.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={distributed.num_processes}", "--module", "fulltune.runtime.train", str(job_file)]
    config_file = job_file.parent / ACCELERATE_CONFIG_FILE
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
            "--module", "fulltune.runtime.train", str(job_file)]


def run_training(job: TrainJob, on_output: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None) -> TrainResult:
    """Train in a child process; resume from the newest checkpoint when an earlier attempt was killed.

    `on_output` receives each line the child prints (default: this process's stderr); `env` adds
    variables to the child's environment (autotune's step probe).

    Raises:
        UserError: the child stopped for a reason the user must fix (exit code 2), e.g. TrainingError.
        OutOfMemory: the device ran out of memory (exit code 3); the flow can re-plan.
        RuntimeError: the child crashed or was killed; a retry resumes from the latest checkpoint.
    """
    import yaml

    from fulltune.runtime.run_tracking import Forwarded

    output_dir = Path(job.paths.output_dir)
    with Forwarded(job.tracking.mlflow_tracking_uri, job.tracking.mlflow_run_id, output_dir) as tracking:
        result = _train_in_child(job, output_dir, on_output, env)
        _draw_loss_curve(result, output_dir, tracking)
    return result


def _train_in_child(job: TrainJob, output_dir: Path, on_output: Callable[[str], None] | None,
                    env: dict[str, str] | None) -> TrainResult:
    done = completed_result(output_dir)
    if done is not None:  # even if the tokenized data it came from was cleaned up since
        return done
    validate_job(job)
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in (ERROR_FILE, OOM_FILE):
        (output_dir / stale).unlink(missing_ok=True)
    job_file = output_dir / JOB_FILE
    atomic_write_text(job_file, job.to_json())
    if job.plan.device == "cuda" and job.dims.ddp_enabled:
        atomic_write_text(output_dir / ACCELERATE_CONFIG_FILE, yaml.safe_dump(generate_accelerate_config(job)))

    code, tail = run_child(training_command(job, job_file), on_output, env)
    return _outcome(output_dir, code, tail)


def _draw_loss_curve(result: TrainResult, output_dir: Path, tracking: Any) -> None:
    """loss_curve.png from the result's history, unless an earlier launch drew it; attached to the MLflow run."""
    from fulltune.runtime.run_tracking import LOSS_CURVE_FILE, save_loss_curve

    curve = output_dir / LOSS_CURVE_FILE
    if not curve.is_file() and result.loss_history:
        save_loss_curve(result.loss_history, curve)
    tracking.attach(curve)


# The children `run_child` is waiting on (training, a sharded evaluation): what an interrupt of this process stops.
_RUNNING: set[subprocess.Popen] = set()


def stop_children() -> None:
    """SIGKILL the process group of every child `run_child` is still waiting on. For Ctrl-C that reached this
    process in another thread than the one waiting: that thread then reads the end of the child's output and
    returns, instead of keeping the process alive beside a child that waits for it to end."""
    for child in list(_RUNNING):
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_child(command: list[str], on_output: Callable[[str], None] | None = None,
              env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """Run `command` (training or a sharded evaluation) in its own session, its output line by line to
    `on_output` (default: this process's stderr); (its exit code, its last 40 lines). The child watches this
    process (LAUNCHER_ENV) and ends with it; an interrupted wait kills its whole process group."""
    env = dict(os.environ, **(env or {}), PYTHONUNBUFFERED="1")
    # The child has its own session (below), so killing this process's group does not reach it; it
    # watches this process instead and ends with it, leaving no orphan to write checkpoints a rerun uses.
    env[LAUNCHER_ENV] = json.dumps(process_identity())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The child imports fulltune from this checkout even where the package is not installed.
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))

    write = on_output or (lambda line: print(line, file=sys.stderr, flush=True))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    # Own session: an interrupted flow stops the whole process group (torchrun and its workers).
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1, env=env, start_new_session=True)
    _RUNNING.add(child)
    try:
        assert child.stdout is not None
        for line in child.stdout:  # text mode turns tqdm's carriage returns into lines too
            line = line.rstrip("\n")
            if line.strip():
                tail.append(line)
                write(line)
        code = child.wait()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        _RUNNING.discard(child)
    return code, list(tail)


def watch_launcher() -> None:
    """SIGKILL this process once the process that launched it (named by LAUNCHER_ENV) is gone.

    The launcher starts its child in its own session, so killing `fulltune run`'s process group (a
    preempted node, `kill -9 -PGID`) or only the flow process (the OOM killer) does not reach the child.
    An orphan trainer would go on writing checkpoints into the directory a rerun resumes from. Under torchrun
    or accelerate launch every worker watches; the agent stops the others when one ends.
    """
    import threading
    import time

    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher:
        return
    identity = json.loads(launcher)

    def watch() -> None:
        while not process_gone(identity):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fulltune-launcher-watch", daemon=True).start()


# The sharded evaluation's child (fulltune/evaluation/sharded.py) and the result its rank 0 writes beside its job.
EVALUATION_MODULE = "fulltune.evaluation.sharded"
EVAL_RESULT_FILE = "eval-result.json"


def evaluation_command(job_file: Path, num_processes: int) -> list[str]:
    """torchrun over `num_processes` on this machine running the sharded evaluation of `job_file`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}",
            "--module", EVALUATION_MODULE, str(job_file)]


def run_sharded_evaluation(job_file: Path, num_processes: int, on_output: Callable[[str], None] | None = None,
                           env: dict[str, str] | None = None) -> dict[str, Any]:
    """Evaluate one candidate sharded over `num_processes` (the training's launch path: torchrun, gloo on CPU);
    the result rank 0 wrote. Raises the child's UserError (error.json), else RuntimeError (a retry runs again)."""
    output_dir = job_file.parent
    for stale in (ERROR_FILE, EVAL_RESULT_FILE):
        (output_dir / stale).unlink(missing_ok=True)
    code, tail = run_child(evaluation_command(job_file, num_processes), on_output, env)
    result_file = output_dir / EVAL_RESULT_FILE
    if code == 0 and result_file.is_file():
        return json.loads(result_file.read_text())
    _raise_user_error(output_dir)
    last = "\n".join(tail[-15:])
    raise RuntimeError(f"the sharded evaluation exited with code {code}\n{last}")


def _raise_user_error(output_dir: Path) -> None:
    """Raise the UserError a child recorded in error.json, if it did."""
    error_file = output_dir / ERROR_FILE
    if error_file.is_file():
        error = json.loads(error_file.read_text())
        cls = getattr(errors, error.get("type", ""), TrainingError)
        cls = cls if isinstance(cls, type) and issubclass(cls, UserError) else TrainingError
        raise cls(error["message"])


def _outcome(output_dir: Path, code: int, tail: list[str]) -> TrainResult:
    """Map the child's exit to a result or an exception.

    The marker files decide first: torchrun and accelerate launch report a failed worker as exit code 1,
    whatever code the worker itself returned.
    """
    if code == 0:
        result = completed_result(output_dir)
        if result is None:
            raise RuntimeError(f"training exited 0 but left no model and result in {output_dir}")
        return result
    oom_file = output_dir / OOM_FILE
    if oom_file.is_file():
        raise OutOfMemory(json.loads(oom_file.read_text()).get("peak_bytes"))
    _raise_user_error(output_dir)
    if code == 2:
        raise TrainingError(tail[-1] if tail else "training stopped with a user error")
    if code == 3:
        raise OutOfMemory(None)
    last = "\n".join(tail[-15:])
    raise RuntimeError(f"training process exited with code {code} (a retry resumes from the latest checkpoint)\n{last}")
