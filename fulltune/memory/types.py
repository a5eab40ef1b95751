"""Typed inputs and results of the memory model and the planner."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, get_args

from fulltune import degrees, spec
from fulltune.degrees import ParallelDims, degree_fields
from fulltune.levers import LEVERS, OPTIONS, lever_fields  # the levers (in the order the planner tries them), options
from fulltune.memory.errors import MemoryConfigError
from fulltune.optimizers import compensation_of

# The choices are the spec's (fulltune/spec.py), defined once there.
MIXED_PRECISIONS = get_args(spec.MixedPrecision)
OPTIMIZERS = get_args(spec.Optimizer)
ATTN_IMPLEMENTATIONS = get_args(spec.AttnImplementation)
DEVICES = get_args(spec.Device)
# What a step runs under; a request may also leave it to the planner ("auto": planning/strategy.py).
STRATEGIES = tuple(s for s in get_args(spec.Strategy) if s != "auto")
BREAKDOWN_KEYS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "activations",
    "logits",
    "temporary",
    "runtime_overhead",
)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise MemoryConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_options(settings: Any) -> None:
    """Each lever's options (fulltune/levers.py `Option`) against their choices."""
    for option in OPTIONS:
        _check_choice(option.name, getattr(settings, option.name), option.choices)


@dataclass(frozen=True)
@lever_fields("bool", False, after="target_fraction")
@degree_fields("int", after="num_processes")
class Settings:
    """One concrete way to run a training step; everything that decides its memory.

    Attributes:
        micro_batch_size: sequences per forward pass, per process.
        seq_len: tokens per sequence (the tokenized `max_length`).
        gradient_accumulation_steps: micro-batches per optimizer step. Above 1 the gradients stay
            allocated through every forward and backward pass of the step.
        gradient_checkpointing: number of decoder layers (counted from the first) whose activations
            are recomputed in backward instead of kept; 0 = off, `num_hidden_layers` = all.
        mixed_precision: `no` (fp32), `bf16` or `fp16` autocast as Accelerate runs it: weights,
            gradients and optimizer states stay fp32; autocast keeps 16-bit copies of the weights
            and 16-bit activations for the forward and backward pass. Accelerate ignores `fp16` on
            CPU, so it is counted as `no` there.
        optimizer: the name of a record of fulltune/optimizers.py (`adamw`, `adamw_8bit`, ...).
        attn_implementation: `sdpa` (fused attention) or `eager` (keeps the s×s score matrices).
        device: `cpu` or `cuda`; decides the attention kernel and the runtime overhead.
        strategy: how parameters, gradients and optimizer states are split over processes.
        num_processes: processes (GPUs) taking part; the estimate is per process.
        pipeline_schedule: the pipeline stages' schedule (fulltune/runtime/pipeline_parallel.py); the step's
            micro-batches flow through them.
        attention_mask: True when the model receives an explicit (b, 1, s, s) attention mask: padded
            batches, or packed rows under attention that needs one (eager, a sliding window shorter than
            the row). A mask makes SDPA keep it per layer and repeat grouped key/value heads; without one
            (a causal row with no padding, packed rows under `sdpa`'s document attention) neither happens.
        document_length: packed rows whose documents attend alone (fulltune/attention.py): tokens of the
            document an average token belongs to, Σ length² / Σ length over the rows' documents (the attention
            FLOPs per token, fulltune/memory/flops.py); 0 for rows of one document each (then seq_len).
        target_fraction: share of the positions that can have a target (all but each row's last)
            that do. The trainer runs the output head only at those positions (`fulltune.runtime.loss`),
            so the logits are (t, V) with t = micro_batch_size · round(target_fraction ·
            (seq_len - 1)). 1.0, the default, is the most any batch can have.

    After `num_processes`, one int per parallel degree (fulltune/degrees.py `DEGREES`, made by `degree_fields`:
    tensor parallel, pipeline stages, context parallel); the data-parallel degree is what is left of num_processes.

    Then one bool per memory lever and one string per lever's option (fulltune/levers.py, made from its record by
    `lever_fields`; `pure_bf16`: bf16 weights and gradients, no fp32 master, activations bf16 whatever
    `mixed_precision` says).

    `checkpoint_async`: step checkpoints are copied to host RAM at the step boundary and written while training
    goes on (`fulltune.runtime.async_checkpoints`): the copy is counted in the checkpoint phase and the host RAM
    (`fulltune.memory.process.checkpoint_staging_bytes`).
    """

    micro_batch_size: int
    seq_len: int
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: int = 0
    mixed_precision: str = "no"
    optimizer: str = "adamw"
    attn_implementation: str = "sdpa"
    device: str = "cpu"
    strategy: str = "none"
    num_processes: int = 1
    pipeline_schedule: str = "1f1b"
    attention_mask: bool = True
    document_length: int = 0
    target_fraction: float = 1.0
    checkpoint_async: bool = False

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "seq_len", "gradient_accumulation_steps", "num_processes",
                     *degrees.BY_NAME):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemoryConfigError(f"{name} must be an integer >= 1; got {value!r}")
        if isinstance(self.gradient_checkpointing, bool) or not isinstance(self.gradient_checkpointing, int):
            raise MemoryConfigError(
                f"gradient_checkpointing must be a number of layers (int >= 0); got {self.gradient_checkpointing!r}"
            )
        if self.gradient_checkpointing < 0:
            raise MemoryConfigError(f"gradient_checkpointing must be >= 0; got {self.gradient_checkpointing}")
        if not 0.0 <= self.target_fraction <= 1.0:
            raise MemoryConfigError(f"target_fraction must be between 0 and 1; got {self.target_fraction!r}")
        if isinstance(self.document_length, bool) or not isinstance(self.document_length, int) \
                or not 0 <= self.document_length <= self.seq_len:
            raise MemoryConfigError(f"document_length must be an integer from 0 to seq_len; got {self.document_length!r}")
        _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_options(self)
        _check_choice("attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        _check_choice("device", self.device, DEVICES)
        _check_choice("strategy", self.strategy, STRATEGIES)
        # The field's own check, before the degrees are built from it (`dims`: the layout).
        if self.strategy == "none" and self.num_processes != self.pipeline_parallel:
            raise MemoryConfigError("num_processes > 1 needs a strategy (ddp or fsdp) or pipeline stages")
        self.dims  # DegreesError unless they divide
        _check_levers(self)

    @property
    def dims(self) -> ParallelDims:
        """The parallel degrees the step runs with: num_processes as data parallel × the degrees, the
        data-parallel processes held as `strategy` says."""
        return degrees.dims_of(self, self.strategy)

    def levers(self) -> dict[str, bool]:
        """The memory levers, name → on."""
        return {name: getattr(self, name) for name in LEVERS}

    @property
    def attended_length(self) -> int:
        """Keys each query is computed against, on average (the attention FLOPs per token ÷ 12·L·a·d): its
        document's length where documents attend alone, else the whole row (a dense mask computes every pair)."""
        return self.document_length if self.document_length and not self.attention_mask else self.seq_len

    @property
    def targets_per_row(self) -> int:
        """Positions with a target in a row of the micro-batch, at most: the output head's rows are
        micro_batch_size × this (`fulltune.runtime.loss`)."""
        return round(self.target_fraction * (self.seq_len - 1))

    def choices(self) -> dict[str, Any]:
        """The fields the planner chooses, as `plan --json` and the alternatives report them."""
        return {name: getattr(self, name) for name in CHOSEN} | self.levers()

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in RECORDED} | self.levers()


# The fields the planner chooses, and those `to_dict` records (in this order; the levers follow).
CHOSEN = ("micro_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "mixed_precision", "optimizer")
RECORDED = degrees.recorded((
    "micro_batch_size", "seq_len", "gradient_accumulation_steps", "gradient_checkpointing", "mixed_precision",
    "optimizer", "attn_implementation", "device", "strategy", "num_processes", "attention_mask", "document_length",
    "target_fraction", "compensation"))


def _check_levers(settings: Any) -> None:
    """The lever table's rules (fulltune/levers.py), which the trainer asserts too."""
    from fulltune import levers

    for name, value in settings.levers().items():
        if value is not None and not isinstance(value, bool):
            raise MemoryConfigError(f"{name} must be true, false or auto; got {value!r}")
    # The device's own rules (fp16 on a CPU) are the train job's: the memory model also estimates settings for
    # a device other than this one. A request for a GPU without bf16 may not fix pure bf16 on.
    bf16 = getattr(settings, "bf16_supported", None) if settings.device == "cuda" else None
    combination = replace(levers.from_settings(settings, bf16_supported=bf16), device=None)
    levers.check(combination, error=MemoryConfigError, installed=False)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one training process, per process: its steady optimizer step and its other phases.

    `peak_bytes` is the steady step's allocated tensor memory (what `torch.cuda.max_memory_allocated` or a
    storage tracker reports) and `peak_phase` where in the step it is; `step_device_bytes` adds what the
    device needs beyond tensors (CUDA context, allocator slack; on CPU the process). `breakdown` splits
    `step_device_bytes` as it stands at the step's peak: the first six entries sum to `peak_bytes`,
    `runtime_overhead` is the rest. `phases` are the device bytes of every phase of the process
    (`fulltune.memory.process`: load, first step, step, checkpoint save, final export, and the evaluate
    stage's own process); `device_bytes` is the largest of the training process's, in `process_peak_phase`:
    what must fit. `host_bytes` is the host RAM the
    offload levers need beyond the process (fulltune/runtime/optim.py `host_bytes` plus offloaded
    activations); on a CPU device host RAM is the device memory, so there it is inside `peak_bytes`.
    """

    peak_bytes: int
    device_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    notes: tuple[str, ...] = ()
    source: str = "estimate"
    host_bytes: int = 0
    step_device_bytes: int = 0
    phases: dict[str, int] = field(default_factory=dict)
    process_peak_phase: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": int(self.peak_bytes),
            "device_bytes": int(self.device_bytes),
            "breakdown": {key: int(self.breakdown.get(key, 0)) for key in BREAKDOWN_KEYS},
            "peak_phase": self.peak_phase,
            "host_bytes": int(self.host_bytes),
            "step_device_bytes": int(self.step_device_bytes or self.device_bytes),
            "phases": {key: int(value) for key, value in self.phases.items()},
            "process_peak_phase": self.process_peak_phase or "training step",
        }


@dataclass(frozen=True)
class EvalRequest:
    """The evaluate stage as `evaluate.*` configures it: the batches are upper bounds the plan may lower.

    `seq_len` is the longest eval row (data.max_length; 0: the training rows' length); `generate` whether exact
    match generates (`evaluate.max_generate_examples` > 0 on prompt/completion data); `harness_batch_size` the
    lm-evaluation-harness batch (None: no harness tasks), scored on requests of up to `harness_seq_len` tokens
    (0: `seq_len`); `precision` `trained` or `fp32`; `processes` as `evaluate.processes` (auto, 1 or the
    training's processes).
    """

    batch_size: int = 8
    seq_len: int = 0
    max_new_tokens: int = 32
    generate: bool = True
    harness_batch_size: int | None = None
    harness_seq_len: int = 0
    precision: str = "trained"
    processes: int | str = "auto"


@dataclass(frozen=True)
@lever_fields("bool | None", None, after="target_fraction", conditions=True)
@degree_fields("int | None", after="num_processes")
class PlanRequest:
    """What the user asked for; `None` in a field means "auto": the planner may choose it.

    `effective_batch_size` = micro_batch_size × gradient_accumulation_steps × num_processes and
    never changes. `budget_bytes` is per device; `None` plans nothing (the configured settings
    run as they are). The planner keeps `headroom` of the budget free for what no estimate sees
    (fragmentation, other processes). `target_fraction` bounds the positions with a target in any
    row (see `Settings`); the data stage knows it (the most loss terms in one row ÷ (seq_len - 1)).
    Each memory lever (`LEVERS`) is fixed (True/False) or auto (None): the planner turns auto levers on
    only when nothing fits without them, cheapest first. `host_memory_bytes` bounds the host RAM the
    offload levers may use (None: this machine's RAM).
    """

    effective_batch_size: int
    seq_len: int
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_checkpointing: bool | int | None = None
    mixed_precision: str | None = None
    optimizer: str | None = None
    attn_implementation: str = "sdpa"
    device: str = "cpu"
    budget_bytes: int | None = None
    headroom: float = 0.05
    strategy: str = "none"
    num_processes: int = 1
    # Here, one field per parallel degree (fulltune/degrees.py `DEGREES`, made by `degree_fields`); None: auto, the
    # planner chooses it (planning/search.py, the stages planning/pipeline.py).
    pipeline_schedule: str = "1f1b"
    bf16_supported: bool = False
    attention_mask: bool = True
    document_length: int = 0  # packed rows: Σ length² / Σ length of their documents (Settings.document_length)
    target_fraction: float = 1.0
    # Here, one field per memory lever (True, False or None: auto), per lever's option (as `Settings`) and per
    # condition a lever's auto reads (the machine's or the pipeline's facts), made from the records (`lever_fields`).
    checkpoint_async: bool = False  # train.checkpoint_async: the staged copy is counted, never chosen
    host_memory_bytes: int | None = None
    num_machines: int = 1  # the processes are spread evenly over them; host_memory_bytes is per machine
    # The evaluate stage (`evaluate.*`): planned beside training and part of `fits`; None: not planned.
    evaluation: EvalRequest | None = None
    # Where `host_memory_bytes` came from when it was not given: a line the plan shows (memory/budget.py).
    host_memory_assumed: str | None = None
    # How the request was read from the pipeline on this machine, lines the plan shows: `memory: auto` on CPU
    # shared by one machine's processes (memory/budget.py), a strategy left unset for the plan to choose.
    notes: tuple[str, ...] = ()

    def levers(self) -> dict[str, bool | None]:
        """The memory levers, name → True / False / None (auto)."""
        return {name: getattr(self, name) for name in LEVERS}

    @property
    def usable_bytes(self) -> int | None:
        """What the plan may fill, budget × (1 − headroom); None without a budget."""
        from fulltune.memory.budget import usable_bytes

        return None if self.budget_bytes is None else usable_bytes(self.budget_bytes, self.headroom)

    def __post_init__(self) -> None:
        _check_levers(self)
        if self.host_memory_bytes is not None and (isinstance(self.host_memory_bytes, bool)
                                                   or self.host_memory_bytes <= 0):
            raise MemoryConfigError(f"host_memory_bytes must be a positive number of bytes or None; "
                                    f"got {self.host_memory_bytes!r}")
        if not 0.0 <= self.target_fraction <= 1.0:
            raise MemoryConfigError(f"target_fraction must be between 0 and 1; got {self.target_fraction!r}")
        for name in ("effective_batch_size", "seq_len", "num_processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemoryConfigError(f"{name} must be an integer >= 1; got {value!r}")
        for name in ("micro_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise MemoryConfigError(f"{name} must be an integer >= 1 or None (auto); got {value!r}")
        # The processes of a tensor-parallel group share their rows: only the data-parallel ones split the batch
        # (with tensor_parallel auto, the planner checks it for each degree it tries).
        # (with pipeline_parallel auto, likewise for each number of stages).
        if self.pipeline_parallel is not None:
            self.dims.check_batch(self.effective_batch_size, self.micro_batch_size, self.gradient_accumulation_steps)
        _check_request_choices(self)

    @property
    def dims(self) -> ParallelDims:
        """The parallel degrees asked for: a degree None while it is auto (pipeline stages: as one stage until
        the planner chooses, `Degree.while_auto`)."""
        return degrees.dims_of(self, None if self.strategy == "auto" else self.strategy)  # the request's auto: None


def _check_request_choices(request: PlanRequest) -> None:
    """The request's fields that do not depend on the tensor-parallel degree."""
    gc = request.gradient_checkpointing
    if gc is not None and not isinstance(gc, bool) and (not isinstance(gc, int) or gc < 0):
        raise MemoryConfigError(f"gradient_checkpointing must be None, a bool or a layer count >= 0; got {gc!r}")
    if request.mixed_precision is not None:
        _check_choice("mixed_precision", request.mixed_precision, MIXED_PRECISIONS)
    if request.optimizer is not None:
        _check_choice("optimizer", request.optimizer, OPTIMIZERS)
    _check_options(request)
    _check_choice("attn_implementation", request.attn_implementation, ATTN_IMPLEMENTATIONS)
    _check_choice("device", request.device, DEVICES)
    _check_choice("strategy", request.strategy, (*STRATEGIES, "auto"))
    if request.budget_bytes is not None and (isinstance(request.budget_bytes, bool) or request.budget_bytes <= 0):
        raise MemoryConfigError(f"budget_bytes must be a positive number of bytes or None; got {request.budget_bytes!r}")
    if not 0.0 <= request.headroom < 1.0:
        raise MemoryConfigError(f"headroom must be in [0, 1); got {request.headroom}")


@dataclass(frozen=True)
class MemoryPlan:
    """The planner's answer: what runs, why, and what it will cost.

    `configured_estimate` is for the settings as configured (auto fields at their naive defaults, see
    `plan_memory`; `plan --json` calls it "estimate"); `settings`/`plan_estimate` is what the run will use. `uncertainty` is how far
    the planned step's peak may be from `expected_bytes` (see `fulltune.memory.uncertainty`).
    """

    device: str
    budget_bytes: int | None
    fits: bool
    configured_estimate: MemoryEstimate
    settings: Settings
    plan_estimate: MemoryEstimate
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    reasons: tuple[str, ...] = ()
    smallest_peak_bytes: int | None = None
    suggestions: tuple[str, ...] = ()
    usable_bytes: int | None = None
    estimated_step_seconds: float | None = None
    uncertainty: dict[str, Any] | None = None
    expected_bytes: int | None = None
    pipeline_parallel: dict[str, Any] | None = None  # what P pipeline stages would need (memory/pipeline.py)
    evaluation: dict[str, Any] | None = None  # the evaluate stage's plan (memory/evaluation.py EvalPlan.to_dict)
    data_host: dict[str, int] | None = None  # host RAM per machine for the training data (process.data_host_bytes)
    host_step: dict[str, Any] | None = None  # parameters in host RAM: the step's terms (planning/step_time.host_step)

    @property
    def spare_bytes(self) -> int | None:
        """Usable budget left beside the planned step's expected device bytes (negative: over)."""
        if self.usable_bytes is None or self.expected_bytes is None:
            return None
        return self.usable_bytes - self.expected_bytes

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "estimate": self.configured_estimate.to_dict(),
            "plan": {
                **s.choices(),
                "compensation": compensation_of(s),  # what pure bf16 weights run with ("none" without them)
                "seq_len": s.seq_len,
                "strategy": s.strategy,
                "num_processes": s.num_processes,
                # Each degree and the keys that say how it runs (pipeline_schedule), in `DEGREES`' order.
                **{key: getattr(s, key) for degree in degrees.DEGREES for key in (degree.name, *degree.beside)},
                "checkpoint_async": s.checkpoint_async,
                "estimated_step_seconds": self.estimated_step_seconds,
                "host_bytes": int(self.plan_estimate.host_bytes),
                "estimate": self.plan_estimate.to_dict(),
                "host_step": self.host_step,
            },
            "alternatives": [dict(a) for a in self.alternatives],
            "reasons": list(self.reasons),
            "smallest_peak_bytes": self.smallest_peak_bytes,
            "suggestions": list(self.suggestions),
            "pipeline_parallel": self.pipeline_parallel,
            "evaluation": self.evaluation,
            "data_host": self.data_host,
            # How sure the plan is: `bytes` either way around `expected_bytes` (the larger of estimate and
            # trace, as device bytes), what it rests on, and what is left of the usable budget.
            "uncertainty": {
                **(self.uncertainty or {}),
                "expected_bytes": self.expected_bytes,
                "spare_bytes": self.spare_bytes,
            },
        }
