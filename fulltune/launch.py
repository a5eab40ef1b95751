"""Run the training loop in a child process and turn its outcome into a result or an error.

Training always runs in a child: a retry starts with a clean device, an OOM cannot poison
the flow process, and one process, several processes and several GPUs are the same code path.

    run_training(job)
      ├─ output_dir/model/ + result.json present → return the saved TrainResult (nothing runs)
      ├─ write output_dir/JOB.json (and output_dir/accelerate.yaml for accelerate launch)
      ├─ one process:          python -m fulltune.train JOB.json
      │  several on CPU:       torchrun --standalone --nproc_per_node N -m fulltune.train JOB.json
      │  ddp/fsdp/deepspeed:   accelerate launch --config_file accelerate.yaml -m fulltune.train JOB.json
      └─ exit 0 → TrainResult; 2 → UserError (the child's message); 3 → OutOfMemory; else RuntimeError

The child runs in its own session and ends itself when this process is gone (LAUNCHER_ENV), so a
killed flow leaves no orphan training on.

This module imports neither torch nor accelerate, so the flow can build jobs without them.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, get_args

from fulltune import errors, spec
from fulltune.errors import ConfigError, DataError, TrainingError, UserError
from fulltune.storage import atomic_write_text

# The choices are the spec's, defined once there.
MIXED_PRECISIONS = get_args(spec.MixedPrecision)
OPTIMIZERS = get_args(spec.Optimizer)
LR_SCHEDULERS = get_args(spec.LrScheduler)
STRATEGIES = get_args(spec.Strategy)
DEVICES = get_args(spec.Device)

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


@dataclass(frozen=True)
class TrainJob:
    """Everything the child needs, written as JSON by the flow: `python -m fulltune.train JOB.json`.

    The settings are the ones the memory plan chose (no `auto` left). Paths are absolute.
    """

    model_path: str
    tokenizer_path: str
    train_file: str  # train.parquet: input_ids, labels (-100 = no loss), position_ids (restart per document)
    output_dir: str  # runs/<train-key>/: checkpoints/step-N/, model/, result.json
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False
    attn_implementation: str = "sdpa"
    revision: str | None = None
    token_env: str | None = None  # name of the environment variable holding a Hub token, never the token
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: int = 0  # transformer layers recomputed in backward, 0..L (more than L means all)
    mixed_precision: str = "no"
    optimizer: str = "adamw"
    learning_rate: float = 2e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    lr_scheduler: str = "cosine"
    max_grad_norm: float = 1.0
    num_epochs: float = 1.0
    max_steps: int | None = None  # overrides num_epochs
    seed: int = 0
    checkpoint_every_steps: int = 50  # 0: never
    keep_checkpoints: int = 2
    log_every_steps: int = 10
    compile: bool = False
    max_nonfinite_steps: int = 5
    # Memory levers (fulltune/optim.py, fulltune/offload.py, fulltune/loss.py), as the plan chose them.
    pure_bf16: bool = False
    optimizer_in_backward: bool = False
    offload_optimizer: bool = False
    offload_activations: bool = False
    chunked_loss: bool = False
    strategy: str = "none"
    num_processes: int = 1  # in total, over all machines
    num_machines: int = 1
    device: str = "cpu"
    mlflow_tracking_uri: str | None = None
    mlflow_run_id: str | None = None  # metrics are logged into this existing run
    progress_artifact_id: str | None = None  # the flow's Prefect artifact; the child only writes progress.json

    def to_json(self) -> str:
        """JOB.json: one key per field, indented and sorted, for a person to read."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainJob:
        """The job `to_json` wrote; ConfigError on keys this version does not know."""
        data = json.loads(text)
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"{JOB_FILE}: unknown keys {unknown} (written by a different fulltune version?)")
        return cls(**data)


# Where each TrainJob field comes from, each field listed once; `job_from_pipeline` applies the table.
# The resolved pipeline's sections (fulltune/spec.py), by section:
JOB_FIELDS_FROM_SPEC = {
    "model": ("trust_remote_code", "allow_pickle_weights", "attn_implementation", "revision", "token_env"),
    "train": ("learning_rate", "weight_decay", "warmup_ratio", "lr_scheduler", "max_grad_norm", "num_epochs",
              "max_steps", "seed", "checkpoint_every_steps", "keep_checkpoints", "log_every_steps", "compile",
              "max_nonfinite_steps"),
    "distributed": ("strategy", "num_processes", "num_machines"),
}
# The memory levers the plan may turn on (fulltune/optim.py, fulltune/offload.py, fulltune/loss.py).
LEVERS = ("pure_bf16", "optimizer_in_backward", "offload_optimizer", "offload_activations", "chunked_loss")
# The planner's settings (BudgetDecision.settings, fulltune.memory.Settings as a dict) the job takes.
JOB_FIELDS_FROM_SETTINGS = ("micro_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
                            "mixed_precision", "optimizer", "device", *LEVERS)
# Planner settings the job ignores on purpose: they describe what the plan assumed (seq_len, attention_mask,
# target_fraction) or echo a spec field the job reads from the spec (attn_implementation, strategy,
# num_processes). Any other key is ignored too; tests/test_job.py fails when Settings grows one that is in
# neither list, so that a new planner setting is wired into the job rather than lost.
PLAN_ONLY_SETTINGS = ("seq_len", "attention_mask", "target_fraction", "attn_implementation", "strategy",
                      "num_processes")
# Set by whoever runs the job, per run.
JOB_FIELDS_PER_RUN = ("model_path", "tokenizer_path", "train_file", "output_dir", "mlflow_tracking_uri",
                      "mlflow_run_id", "progress_artifact_id")


def job_from_pipeline(spec: Any, settings: Mapping[str, Any], *, model_path: str, tokenizer_path: str,
                      train_file: str, output_dir: str, mlflow_tracking_uri: str | None = None,
                      mlflow_run_id: str | None = None) -> TrainJob:
    """The TrainJob for a resolved pipeline spec (`spec.model`, `spec.train`, `spec.distributed`) and the
    settings its memory plan chose; see JOB_FIELDS_FROM_SPEC and JOB_FIELDS_FROM_SETTINGS.

    Levers missing from `settings` (a plan made before they existed) are off.
    """
    values: dict[str, Any] = {name: getattr(getattr(spec, section), name)
                              for section, names in JOB_FIELDS_FROM_SPEC.items() for name in names}
    values.update({name: bool(settings.get(name, False)) if name in LEVERS else settings[name]
                   for name in JOB_FIELDS_FROM_SETTINGS})
    return TrainJob(model_path=model_path, tokenizer_path=tokenizer_path, train_file=train_file,
                    output_dir=output_dir, mlflow_tracking_uri=mlflow_tracking_uri, mlflow_run_id=mlflow_run_id,
                    **values)


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports; saved as output_dir/result.json."""

    model_dir: str
    steps: int
    epochs: float
    train_loss: float  # mean token loss of the last log interval
    tokens: int  # non-padding tokens trained on, all processes, whole run
    tokens_per_second: float  # over the optimizer steps this process ran (a resumed run counts its own part)
    seconds: float  # wall time of those steps
    peak_memory_bytes: int | None  # torch.cuda.max_memory_allocated on CUDA; None on CPU
    nonfinite_steps: int  # optimizer steps skipped because the loss or gradient norm was not finite
    resumed_from_step: int | None
    loss_history: list[list[float]] = field(default_factory=list)  # [step, mean loss of the log interval]

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
# layers recompute their activations, or whether bf16 autocast runs (the weights stay fp32).
RESUMABLE_CHANGES = frozenset({"micro_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
                               "mixed_precision", "output_dir"})


def resume_conflict(checkpointed: TrainJob, job: TrainJob) -> str | None:
    """Why `job` cannot resume from checkpoints that `checkpointed` wrote; None when it can.

    It can when only RESUMABLE_CHANGES differ and the effective batch (micro × accumulation) is the same.
    It cannot when the effective batch changed (another step schedule and step count), when fp16 was
    switched on or off (only fp16 checkpoints hold the grad scaler's state), or when any other field
    changed, e.g. the optimizer, whose state another optimizer cannot load: such a job starts at step 0.
    """
    before = checkpointed.micro_batch_size * checkpointed.gradient_accumulation_steps
    after = job.micro_batch_size * job.gradient_accumulation_steps
    if before != after:
        return f"the effective batch per process changed from {before} to {after} rows"
    if (checkpointed.mixed_precision == "fp16") != (job.mixed_precision == "fp16"):
        return (f"mixed_precision changed from {checkpointed.mixed_precision} to {job.mixed_precision} "
                "(the fp16 grad scaler's state is in fp16 checkpoints only)")
    changed = [f.name for f in fields(TrainJob)
               if f.name not in RESUMABLE_CHANGES and getattr(checkpointed, f.name) != getattr(job, f.name)]
    if changed:
        detail = (f"{checkpointed.optimizer} → {job.optimizer}: the optimizer state cannot be loaded"
                  if "optimizer" in changed else "the checkpoints were written for other settings")
        return f"{', '.join(changed)} changed ({detail})"
    return None


def _host() -> str:
    """This host, and its PID namespace where there is one: containers that share a hostname and a
    workdir volume do not see each other's processes, so their pids must not be compared."""
    try:
        return f"{socket.gethostname()}/pidns-{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return socket.gethostname()


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """This process (or `pid`) as {"host", "pid", "started"}: enough to tell later whether it still runs.
    The start time tells a reused pid from the original."""
    import psutil

    process = psutil.Process(pid)
    return {"host": _host(), "pid": process.pid, "started": process.create_time()}


def process_gone(identity: Any) -> bool:
    """Whether the process `identity` (from process_identity) has ended: no such pid, a zombie, or a
    pid reused by a later process. False when it cannot be told (another host, a malformed record), so
    only a provably dead process is ever treated as gone."""
    import psutil

    try:
        if identity["host"] != _host():
            return False
        process = psutil.Process(int(identity["pid"]))
        # psutil derives the start time from the boot time, which may drift by under a second.
        return process.status() == psutil.STATUS_ZOMBIE or abs(process.create_time() - float(identity["started"])) > 1.0
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def validate_job(job: TrainJob) -> None:
    """Check the settings before any process starts; raises ConfigError listing every problem at once."""
    problems = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(job.micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {job.micro_batch_size}")
    need(job.gradient_accumulation_steps >= 1,
         f"gradient_accumulation_steps must be >= 1, got {job.gradient_accumulation_steps}")
    need(job.gradient_checkpointing >= 0, f"gradient_checkpointing must be >= 0 layers, got {job.gradient_checkpointing}")
    need(job.mixed_precision in MIXED_PRECISIONS,
         f"mixed_precision must be one of {MIXED_PRECISIONS}, got {job.mixed_precision!r}")
    need(job.optimizer in OPTIMIZERS, f"optimizer must be one of {OPTIMIZERS}, got {job.optimizer!r}")
    need(job.lr_scheduler in LR_SCHEDULERS,
         f"lr_scheduler must be one of {LR_SCHEDULERS}, got {job.lr_scheduler!r}")
    need(job.learning_rate > 0, f"learning_rate must be > 0, got {job.learning_rate}")
    need(0 <= job.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {job.warmup_ratio}")
    need(job.max_grad_norm > 0, f"max_grad_norm must be > 0, got {job.max_grad_norm}")
    need(job.max_steps is not None or job.num_epochs > 0, "set num_epochs > 0 or max_steps")
    need(job.max_steps is None or job.max_steps >= 1, f"max_steps must be >= 1, got {job.max_steps}")
    need(job.checkpoint_every_steps >= 0, f"checkpoint_every_steps must be >= 0, got {job.checkpoint_every_steps}")
    need(job.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {job.keep_checkpoints}")
    need(job.log_every_steps >= 1, f"log_every_steps must be >= 1, got {job.log_every_steps}")
    need(job.max_nonfinite_steps >= 1, f"max_nonfinite_steps must be >= 1, got {job.max_nonfinite_steps}")
    need(job.device in DEVICES, f"device must be one of {DEVICES}, got {job.device!r}")
    need(job.strategy in STRATEGIES, f"strategy must be one of {STRATEGIES}, got {job.strategy!r}")
    need(job.num_processes >= 1 and job.num_machines >= 1, "num_processes and num_machines must be >= 1")
    need(job.strategy != "none" or job.num_processes == 1,
         "num_processes > 1 needs a strategy (ddp, fsdp, deepspeed_zero2, deepspeed_zero3)")
    if job.device == "cpu":
        need(job.mixed_precision != "fp16", "mixed_precision fp16 needs a CUDA device; use bf16 or no on CPU")
        need(job.strategy in ("none", "ddp", "fsdp"), f"strategy {job.strategy} needs CUDA devices; use ddp or fsdp on CPU")
        need(job.num_machines == 1, "training on CPU runs on one machine")
    need(job.strategy != "fsdp" or job.mixed_precision != "fp16",
         "strategy fsdp trains in bf16 or fp32: set mixed_precision to bf16 or no")
    # The gradient-hook levers see a gradient before data parallelism averages it (fulltune/optim.py).
    hooks = [name for name in ("optimizer_in_backward", "offload_optimizer") if getattr(job, name)]
    need(not hooks or job.num_processes == 1, f"{' and '.join(hooks)} train on one process; set "
         f"distributed.num_processes 1 or turn {' and '.join(hooks)} off")
    need(not (job.optimizer_in_backward and job.offload_optimizer),
         "optimizer_in_backward and offload_optimizer: choose one (offloading already frees device gradients in backward)")
    need(not job.pure_bf16 or job.mixed_precision != "fp16", "pure_bf16 keeps bf16 weights: use mixed_precision bf16 or no")
    need(not (job.chunked_loss and job.strategy == "fsdp"),
         "chunked_loss reads the output head's weight in backward, which FSDP has resharded by then: turn "
         "chunked_loss off with strategy fsdp")
    if problems:
        raise ConfigError("train job: " + "; ".join(problems))
    if not Path(job.train_file).is_file():
        raise DataError(f"{job.train_file}: tokenized training data not found (re-run the tokenize stage)")


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
    distributed_type = {"ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed_zero2": "DEEPSPEED",
                        "deepspeed_zero3": "DEEPSPEED"}.get(job.strategy, "NO")
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "mixed_precision": job.mixed_precision,
        "num_processes": job.num_processes,
        "num_machines": job.num_machines,
        "machine_rank": int(os.environ.get("MACHINE_RANK", "0")),
        "main_training_function": "main",
        "use_cpu": job.device == "cpu",
        "gpu_ids": "all",
        "rdzv_backend": "static",
        "same_network": True,
        "downcast_bf16": "no",
        "debug": False,
    }
    if job.num_machines > 1:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ConfigError(f"distributed.num_machines > 1: set {' and '.join(missing)} on every machine")
        config["main_process_ip"] = os.environ["MASTER_ADDR"]
        config["main_process_port"] = int(os.environ["MASTER_PORT"])
    if job.strategy == "fsdp":
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
    elif job.strategy.startswith("deepspeed"):
        stage = 3 if job.strategy == "deepspeed_zero3" else 2
        config["deepspeed_config"] = {
            "zero_stage": stage,
            "gradient_accumulation_steps": job.gradient_accumulation_steps,
            "gradient_clipping": job.max_grad_norm,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": stage == 3,
            "zero3_save_16bit_model": stage == 3,
        }
    return config


def training_command(job: TrainJob, job_file: Path) -> list[str]:
    """The command line that runs the child (see the module docstring)."""
    if job.num_processes == 1 and job.strategy == "none":
        return [sys.executable, "-m", "fulltune.train", str(job_file)]
    if job.strategy in ("ddp", "fsdp"):
        from fulltune.rendezvous import launch_command

        command = launch_command(job_file, job.num_processes, job.num_machines)  # several machines: c10d
        if command is not None:
            return command
    if job.device == "cpu" or job.strategy == "fsdp":
        # FSDP shards the model itself (fulltune/sharding.py) on CPU and CUDA alike.
        # `accelerate launch --cpu --num_processes 2` ran a single process (accelerate 1.x);
        # torchrun gives Accelerate a MULTI_CPU (gloo) run.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={job.num_processes}", "--module", "fulltune.train", str(job_file)]
    config_file = job_file.parent / ACCELERATE_CONFIG_FILE
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
            "--module", "fulltune.train", str(job_file)]


def run_training(job: TrainJob, on_output: Callable[[str], None] | None = None) -> TrainResult:
    """Train in a child process; resume from the newest checkpoint when an earlier attempt was killed.

    `on_output` receives each line the child prints (default: this process's stderr).

    Raises:
        UserError: the child stopped for a reason the user must fix (exit code 2), e.g. TrainingError.
        OutOfMemory: the device ran out of memory (exit code 3); the flow can re-plan.
        RuntimeError: the child crashed or was killed; a retry resumes from the latest checkpoint.
    """
    import yaml

    output_dir = Path(job.output_dir)
    done = completed_result(output_dir)
    if done is not None:  # even if the tokenized data it came from was cleaned up since
        return done
    validate_job(job)
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in (ERROR_FILE, OOM_FILE):
        (output_dir / stale).unlink(missing_ok=True)
    job_file = output_dir / JOB_FILE
    atomic_write_text(job_file, job.to_json())
    if job.device == "cuda" and job.strategy not in ("none", "fsdp"):
        atomic_write_text(output_dir / ACCELERATE_CONFIG_FILE, yaml.safe_dump(generate_accelerate_config(job)))

    env = dict(os.environ, PYTHONUNBUFFERED="1")
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
    child = subprocess.Popen(training_command(job, job_file), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1, env=env, start_new_session=True)
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
    return _outcome(output_dir, code, list(tail))


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
    oom_file, error_file = output_dir / OOM_FILE, output_dir / ERROR_FILE
    if oom_file.is_file():
        raise OutOfMemory(json.loads(oom_file.read_text()).get("peak_bytes"))
    if error_file.is_file():
        error = json.loads(error_file.read_text())
        cls = getattr(errors, error.get("type", ""), TrainingError)
        cls = cls if isinstance(cls, type) and issubclass(cls, UserError) else TrainingError
        raise cls(error["message"])
    if code == 2:
        raise TrainingError(tail[-1] if tail else "training stopped with a user error")
    if code == 3:
        raise OutOfMemory(None)
    last = "\n".join(tail[-15:])
    raise RuntimeError(f"training process exited with code {code} (a retry resumes from the latest checkpoint)\n{last}")
