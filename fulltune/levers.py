"""The memory levers: one record each (`Lever`), and the one table of rules for combining them. `fulltune validate`,
`fulltune plan`, the planner's search, the step-time model, the plan's reasons, the train job and the trainer all
read it.

A lever is a key of the pipeline's `train:` section (true, false or `auto`). Its record (fulltune/lever_record.py)
holds everything the engine says and does about it beside the bytes it moves (those are the memory model's,
fulltune/memory/): the field's description, the keys that say how it runs (`Option`) and what its `auto` reads of
the machine (`Condition`) — the spec's, `Settings`' and `PlanRequest`'s fields, the request's copy from the spec,
the settings' from the request and the job's planned keys are made from them (`spec_fields`, `lever_fields`,
`request_fields`, `options_of`, `TRAIN_KEYS`) —, the plan's sentence and other lines, the step time it adds (`cost`;
a lever that adds none says so with `NoAddedTime`), whether it is slow, why pipeline stages refuse it, what it
makes of a model it cannot convert, and the runtime function that applies it to the model
(fulltune/runtime/checkpointing.py `apply_model_levers` runs them for the trainer and the memory trace alike).
tests/test_lever_table.py fails for a lever without a cost or a sentence.

Each rule of `RULES` names the YAML fields it reads and says why the combination cannot train; a combination that
breaks no rule trains (`tests/test_lever_table.py` enumerates levers × optimizer × strategy and proves it both
ways). A rule sees a field as `None` while it is still `auto`: it then holds only if no choice the planner could
make would satisfy it — the planner, which fills the `auto` fields, keeps only candidates that break no rule.

    lever                  what it does                                           what it needs
    chunked_loss           head + cross-entropy in tiles, recomputed in backward  not tensor parallel (the
                                                                                  head's weight is split)
    pure_bf16              bf16 weights and gradients, compensated updates        bf16 (or fp32) autocast; a
                                                                                  GPU with bf16 on CUDA
    optimizer_in_backward  each parameter steps as its gradient completes        accumulation 1, one process
                                                                                  or FSDP (not DDP), not with
                                                                                  offload_optimizer or tensor
                                                                                  parallel
    offload_activations    checkpointed layers' saved inputs wait in host RAM    checkpointed layers; not
                                                                                  FSDP on cuda (unmeasured)
    offload_optimizer      masters, gradients and states in host RAM              one process, or FSDP on
                                                                                  cuda (CPUOffloadPolicy)
    float8                 the decoder linears' matmuls in float8 (torchao)       torchao; bf16 or fp32; not
                           (a step-time lever: `auto` is decided by the GPU,      tensor parallel or pipeline
                           never by memory)                                       stages; not CPU autocast

Context parallel (`distributed.context_parallel` > 1) runs every lever over fsdp or ddp, not beside tensor parallel
or pipeline stages (its record's `not_beside`, fulltune/degrees.py: `_degree_rules`).

Pipeline stages (`distributed.pipeline_parallel` > 1, fulltune/runtime/pipeline_parallel.py) run the chunked
loss and pure bf16, not the step in backward or the offloads (each record's `pipeline_refusal`), nor fp16's grad
scaler nor background checkpoint writes (`train.checkpoint_async`); 1F1B needs a micro-batch per stage. Data
parallel beside them (num_processes = pipeline_parallel × dp, strategy fsdp or ddp over each stage's dp processes)
trains, except with the chunked loss.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fulltune import degrees
from fulltune.degrees import degree_fields
from fulltune.errors import ConfigError
from fulltune.lever_record import Condition, Elsewhere, Lever, NoAddedTime, Option  # noqa: F401
from fulltune.optimizers import (COMPENSATIONS, OPTIMIZER_TABLE, OPTIMIZERS_BY_NAME, STOCHASTIC_NEEDS,
                                  compensation_of)


# ---------------------------------------------------------------------------------------------------
# The levers, one record each


def _pure_bf16_sentence(s: Any) -> str:
    """What pure bf16 means for the chosen optimizer and compensation: whether small updates survive the
    rounding (what the compensation costs is `planning/reasons.py` `compensation_reasons`)."""
    if s.offload_optimizer and not s.dims.fsdp_enabled:
        return "pure bf16 weights and gradients on the device; the fp32 masters on the host keep small updates"
    compensation = compensation_of(s)
    if compensation == "none":
        why = ("train.compensation none" if s.compensation == "none"
               else f"{s.optimizer} offers no compensated update")
        return (f"pure bf16 weights and gradients; {why}, so updates below 1/256 of a weight are rounded away (as "
                "in torchtune's pure-bf16 recipes); set train.pure_bf16: false to keep fp32 weights")
    kept = {"kahan": "Kahan summation", "stochastic": "stochastic rounding"}[compensation]
    return f"pure bf16 weights and gradients (no fp32 master; {kept} keeps small updates)"


def _offload_optimizer_sentence(s: Any) -> str:
    if s.dims.fsdp_enabled:
        return ("FSDP's CPU offload (every rank's parameter, gradient and optimizer-state shards in host RAM, "
                "stepped there; only the gathered unit on the GPU)")
    return "fp32 masters, gradients and optimizer states in host RAM, updated on the host"


def _chunked_loss_seconds(s: Any, step: Any) -> float:
    """The head's logits computed once more in backward, per target (the chunks are recomputed)."""
    precision = "bf16" if s.pure_bf16 else s.mixed_precision
    return s.gradient_accumulation_steps * s.micro_batch_size * s.targets_per_row * step.head_forward / step.flops(
        precision)


def _offload_optimizer_seconds(s: Any, step: Any) -> float:
    """Under FSDP, its CPU offload's exposed copies and host step (`StepCosts.fsdp_offload`); on one process,
    each micro-batch's gradients to the host, the fp32 masters back once per step, and the host optimizer."""
    if s.dims.fsdp_enabled:
        terms = step.fsdp_offload()
        return terms["exposed_pcie_s"] + terms["host_step_s"]
    weight = 2 if s.pure_bf16 else 4
    P = step.num_params
    pcie = (s.gradient_accumulation_steps * weight * P + 4 * P) / step.pcie_bytes_per_s
    return pcie + step.host_optimizer_seconds()


def _offload_activations_seconds(s: Any, step: Any) -> float:
    """Each checkpointed layer's input to the host in the forward and back for its recompute, per micro-batch."""
    k = min(s.gradient_checkpointing, step.num_layers)
    stream = 2 if s.pure_bf16 else 4
    return (s.gradient_accumulation_steps * 2 * k * stream * s.micro_batch_size * s.seq_len * step.hidden
            / step.pcie_bytes_per_s)


def _float8_auto(request: Any) -> bool:
    """`float8: auto`: on where it is a step-time lever: a GPU with float8 tensor cores (compute capability ≥ 8.9),
    a compiled step (eager, torchao's casts cost more than the float8 matmuls save: pytorch/ao#685) and torchao
    installed; never on a CPU."""
    return request.device == "cuda" and request.float8_supported and request.compile and _torchao_installed()


def _torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


FLOAT8_CAPABILITY = (8, 9)  # the first CUDA compute capability with float8 tensor cores (Ada; Hopper is 9.0)


# In the order the planner tries them: cheapest in step time first.
TABLE: tuple[Lever, ...] = (
    Lever("float8",
          description="float8 training (torchao's convert_to_float8_training): the decoder layers' linears run their "
                      "matmuls on float8 tensor cores with dynamic scales (train.float8_recipe); the output head, "
                      "the embeddings and any linear whose dimensions are not multiples of 16 stay in their "
                      "precision, and the plan names them. `auto`: on for a GPU with float8 tensor cores (compute "
                      "capability ≥ 8.9) when the step is compiled (train.compile) and torchao is installed "
                      "(pip install 'fulltune[lowbit]'); never on a CPU, never to save memory.",
          sentence=lambda s: f"float8 matmuls in the decoder layers' linears ({s.float8_recipe} scales; the output "
                             "head stays in its precision)",
          cost=Elsewhere("fulltune.memory.float8:step_seconds"),
          pipeline_refusal="pipeline stages are not measured with float8 linears",
          apply="fulltune.runtime.float8:convert_linears", auto=_float8_auto,
          options=(Option("float8_recipe", ("tensorwise", "rowwise"), "tensorwise",
                          "How float8's matmuls scale their operands (torchao's recipes): `tensorwise`, one scale "
                          "per tensor (the fastest; under FSDP on GPUs the weights are gathered in float8); "
                          "`rowwise`, one per row (closer to bf16's accuracy, slower)."),),
          conditions=(  # what `auto` reads: the GPU's float8 tensor cores (its capability), a compiled step
              Condition("float8_supported", lambda train, budget: (budget.capability or (0, 0)) >= FLOAT8_CAPABILITY),
              Condition("compile", lambda train, budget: train.compile)),
          for_model=Elsewhere("fulltune.memory.float8:for_model"),
          reasons=Elsewhere("fulltune.memory.float8:reasons"), started=" with float8 matmuls ({float8_recipe})",
          layer_terms=Elsewhere("fulltune.memory.float8:layer_terms"),
          gathered_numel=Elsewhere("fulltune.memory.float8:gathered_numel")),
    Lever("chunked_loss",
          description="Compute the output head and cross-entropy in chunks of target positions and vocabulary, "
                      "recomputed in backward: no whole (targets × vocabulary) fp32 tensor.",
          sentence=lambda s: "chunked loss (no whole targets × vocabulary logits)",
          cost=_chunked_loss_seconds),
    Lever("pure_bf16",
          description="bf16 weights and gradients with no fp32 master copy (2 + 2 B/param instead of 4 + 4); "
                      "updates are Kahan-compensated (adamw) or stochastically rounded (adamw_4bit) so small "
                      "ones are not lost (train.compensation). `auto`: the planner turns it on when memory "
                      "requires it.",
          sentence=_pure_bf16_sentence,
          cost=NoAddedTime("it changes the optimizer's own pass (fulltune/planning/step_time.py step_seconds: "
                           "half the traffic, plus the Kahan buffer's)"),
          apply="fulltune.runtime.optim:to_bf16",
          options=(Option(
              "compensation", ("auto", *COMPENSATIONS), "auto",
              "How pure_bf16's bf16 weights keep updates smaller than their rounding step: "
              + "; ".join(f"`{name}`: {what}" for name, what in COMPENSATIONS.items())
              + ". `auto`: the optimizer's own ("
              + ", ".join(f"{r.name} {r.default_compensation}" for r in OPTIMIZER_TABLE)
              + "). The plan says which one runs and what it costs.",
              off_refusal="train.compensation is how pure_bf16's bf16 weights keep small updates, and "
                          "train.pure_bf16 is false; set pure_bf16 true (or auto), or compensation auto"),)),
    Lever("optimizer_in_backward",
          description="Step each parameter as soon as its gradient is complete in backward and free the "
                      "gradient (at most one parameter's gradient alive). Needs gradient_accumulation_steps 1: "
                      "the effective batch is kept with a larger (checkpointed) micro-batch. Clipping uses the "
                      "norm of the previous step's gradients.",
          sentence=lambda s: ("optimizer step in backward (one parameter's gradient at a time; each gradient "
                              "clipped on its own)"),
          cost=NoAddedTime("the same update on the device, earlier in the step"),
          pipeline_refusal="the schedule runs every micro-batch's backward before the step"),
    Lever("offload_activations",
          description="Move the saved inputs of checkpointed layers to host RAM until backward needs them.",
          sentence=lambda s: "checkpointed layer inputs in host RAM",
          cost=_offload_activations_seconds, slow=True,
          pipeline_refusal="the stages keep the schedule's in-flight activations on the device",
          apply="fulltune.runtime.offload:offload_checkpointed_inputs"),
    Lever("offload_optimizer",
          description="Keep fp32 master weights, gradients and optimizer states in host RAM and update on the "
                      "host; the device keeps only the weights. Costs host RAM (budget.host_memory) and step time.",
          sentence=_offload_optimizer_sentence,
          cost=_offload_optimizer_seconds, slow=True,
          pipeline_refusal="each stage steps its own optimizer on the device"),
)
BY_NAME: dict[str, Lever] = {lever.name: lever for lever in TABLE}
LEVERS = tuple(BY_NAME)
# The order the `train:` section lists them (the YAML schema, the Prefect form) and `Settings` and `PlanRequest`
# declare them: the order they were added in. A new lever goes last.
FIELD_ORDER = ("pure_bf16", "optimizer_in_backward", "offload_optimizer", "offload_activations", "chunked_loss",
               "float8")
assert sorted(FIELD_ORDER) == sorted(LEVERS), "FIELD_ORDER names every lever of TABLE once"
# What a pipeline stage does not run, and why: each is a rule of the table below.
PIPELINE_REFUSED_LEVERS = {lever.name: lever.pipeline_refusal for lever in TABLE if lever.pipeline_refusal}
SLOW_LEVERS = tuple(lever.name for lever in TABLE if lever.slow)
# The levers' options and conditions, in FIELD_ORDER: the fields made beside the levers' own.
OPTIONS: tuple[Option, ...] = tuple(option for name in FIELD_ORDER for option in BY_NAME[name].options)
CONDITIONS: tuple[Condition, ...] = tuple(condition for name in FIELD_ORDER for condition in BY_NAME[name].conditions)
# The levers with terms of their own in a decoder layer's counts and in FSDP's gathered weights (fulltune/memory/).
LAYER_LEVERS = tuple(lever for lever in TABLE if lever.layer_terms)
GATHER_LEVERS = tuple(lever for lever in TABLE if lever.gathered_numel)
# The `train:` keys the records declare: what the plan decides for the job (fulltune/runtime/launch.py).
TRAIN_KEYS = (*LEVERS, *(option.name for option in OPTIONS))


def started(settings: Any) -> str:
    """What the trainer's first line says of the levers `settings` (a train job's plan) turns on: their records'
    `started`, in `TABLE`'s order."""
    return "".join(lever.started.format(**vars(settings)) for lever in TABLE
                   if lever.started and getattr(settings, lever.name))


def decided(request: Any) -> dict[str, bool | None]:
    """A plan request's levers (name → True / False / None: auto) with the `auto` of each lever whose record says
    what it means (`Lever.auto`) decided: what the planner's search starts from."""
    return {name: BY_NAME[name].auto(request) if value is None and BY_NAME[name].auto else value
            for name, value in request.levers().items()}


def spec_fields() -> dict[str, Any]:
    """The spec's `train:` fields of the records (`pydantic.create_model` field definitions), in `FIELD_ORDER`:
    each lever `auto`, true or false, `auto` by default; then each lever's options, one of their choices."""
    from typing import Literal, Union

    from pydantic import Field

    return {**{name: (Union[Literal["auto"], bool], Field("auto", description=BY_NAME[name].description))
               for name in FIELD_ORDER},
            **{option.name: (Literal[option.choices], Field(option.default, description=option.description))
               for option in OPTIONS}}


def off_refusals(train: Any) -> list[str]:
    """What the spec refuses in its `train:` section `train`: an option set while its lever is false
    (`Option.off_refusal`)."""
    return [option.off_refusal for lever in TABLE for option in lever.options
            if option.off_refusal and getattr(train, option.name) != option.default
            and getattr(train, lever.name) is False]


def lever_fields(annotation: str, default: Any, after: str, conditions: bool = False) -> Callable[[type], type]:
    """A class decorator, under `@dataclass`: one field per lever (`FIELD_ORDER`) typed `annotation` with
    `default`, then one `str` per option with its default and, with `conditions`, one `bool` per condition, False;
    inserted after the class's field `after` (so the fields after it keep their defaults' order)."""
    fields = [(name, annotation, default) for name in FIELD_ORDER]
    fields += [(option.name, "str", option.default) for option in OPTIONS]
    fields += [(condition.name, "bool", False) for condition in CONDITIONS] if conditions else []

    def add(cls: type) -> type:
        items = list(cls.__dict__["__annotations__"].items())
        at = [name for name, _ in items].index(after) + 1
        cls.__annotations__ = dict(items[:at] + [(name, kind) for name, kind, _ in fields] + items[at:])
        for name, _, value in fields:
            setattr(cls, name, value)
        return cls

    return add


def request_fields(train: Any, budget: Any) -> dict[str, Any]:
    """`PlanRequest`'s fields of the records, from the spec's `train:` section and the resolved budget
    (`fulltune.memory.budget.Budget`): each lever True, False or None (auto), each option as set, each condition
    as read."""
    return {**{name: None if getattr(train, name) == "auto" else bool(getattr(train, name)) for name in LEVERS},
            **{option.name: getattr(train, option.name) for option in OPTIONS},
            **{condition.name: condition.read(train, budget) for condition in CONDITIONS}}


def options_of(settings: Any) -> dict[str, str]:
    """The options of a plan request or settings, name → value: what planned settings copy from the request."""
    return {option.name: getattr(settings, option.name) for option in OPTIONS}


# ---------------------------------------------------------------------------------------------------
# The rules


@dataclass(frozen=True)
@degree_fields("int | None", after="num_processes")
class Combination:
    """What the rules read, from a pipeline spec, a plan request, planned settings or a train job.

    `None` means "auto": not decided yet (a lever, the optimizer, accumulation, precision, checkpointing,
    the device, a parallel degree, the strategy). `bf16_supported` is None unless the device is a known GPU.
    After `num_processes`, one field per parallel degree (fulltune/degrees.py `DEGREES`): None while auto, which
    the planner checks for every degree it tries.
    """

    levers: Mapping[str, bool | None]
    strategy: str | None = "none"
    num_processes: int = 1
    pipeline_schedule: str = "1f1b"
    optimizer: str | None = "adamw"
    gradient_accumulation_steps: int | None = None
    # The accumulation a fixed `train.micro_batch_size` leaves while gradient_accumulation_steps is auto
    # (effective batch ÷ (micro-batch × data-parallel processes)); None when that is not fixed yet.
    implied_accumulation: int | None = None
    mixed_precision: str | None = None
    gradient_checkpointing: bool | int | None = None
    device: str | None = None
    bf16_supported: bool | None = None
    compensation: str | None = None  # None: auto, the optimizer's default
    checkpoint_async: bool = False

    def on(self, lever: str) -> bool:
        """The lever is turned on (not auto, not off)."""
        return self.levers.get(lever) is True

    @property
    def fixed_not_fsdp(self) -> bool:
        """The strategy is fixed and is not fsdp (auto may still choose fsdp)."""
        return self.strategy is not None and self.strategy != "fsdp"

    @property
    def pipelined(self) -> bool:
        """Pipeline stages are fixed above 1 (auto may still choose 1)."""
        return self.degree_on("pipeline_parallel")

    @property
    def tensor_parallel_on(self) -> bool:
        """Tensor parallel is fixed above 1 (auto may still choose 1)."""
        return self.degree_on("tensor_parallel")

    def degree_on(self, name: str) -> bool:
        """The degree `name` is fixed above 1 (auto may still choose 1)."""
        value = getattr(self, name)
        return value is not None and value > 1


@dataclass(frozen=True)
class Rule:
    """A combination that cannot train: `broken(c)` is true for it; `fields` are the YAML keys it names.
    `installed`: the rule is about what this machine has installed, which the memory model, estimating for
    any machine, does not ask."""

    fields: tuple[str, ...]
    broken: Callable[[Combination], bool]
    why: str
    installed: bool = False

    def message(self) -> str:
        return f"{' with '.join(self.fields)}: {self.why}"


def _no_checkpointing(c: Combination) -> bool:
    return c.gradient_checkpointing is False or c.gradient_checkpointing == 0


def _optimizer_rules(refusal: str, fields: tuple[str, ...], where: Callable[[Combination], bool]) -> tuple[Rule, ...]:
    """A rule per distinct `refusal` text (an `OptimizerRecord` field) of the optimizers: broken where `where`
    holds and the optimizer is one of those giving that text."""
    names: dict[str, list[str]] = {}
    for record in OPTIMIZER_TABLE:
        why = getattr(record, refusal)
        if why:
            names.setdefault(why, []).append(record.name)
    return tuple(Rule(fields, lambda c, refused=tuple(refused): where(c) and c.optimizer in refused, why)
                 for why, refused in names.items())


def _requirement_rules() -> tuple[Rule, ...]:
    """What an optimizer needs installed (its record's `requires`), refused on a machine without it."""
    return tuple(Rule(("train.optimizer",), lambda c, name=record.name: c.optimizer == name
                      and not OPTIMIZERS_BY_NAME[name].installed(), record.requires[1], installed=True)
                 for record in OPTIMIZER_TABLE if record.requires)


def _compensation_rules() -> tuple[Rule, ...]:
    """`train.compensation`: what the optimizer offers pure bf16 weights (its record's `compensations`), not
    beside fp32 masters on the host, and stochastic rounding only with torchao installed. (A compensation named
    with `pure_bf16: false` is the spec's own check.)"""
    return (
        *(Rule(("train.compensation", "train.optimizer"),
               lambda c, r=record: c.optimizer == r.name and c.on("pure_bf16") and c.compensation is not None
               and c.compensation not in r.compensations,
               f"{record.name} offers {' or '.join(record.compensations)} with pure bf16 weights; set compensation "
               "to one of them or auto")
          for record in OPTIMIZER_TABLE),
        Rule(("train.compensation", "train.offload_optimizer"),
             lambda c: c.compensation not in (None, "none") and c.on("offload_optimizer") and c.fixed_not_fsdp,
             "the offloaded optimizer steps fp32 masters in host RAM, which keep every update: there is nothing to "
             "compensate; set compensation auto or none, or use strategy fsdp (FSDP's CPU offload steps the bf16 "
             "shards)"),
        Rule(("train.compensation",), lambda c: c.compensation == "stochastic"
             and importlib.util.find_spec(STOCHASTIC_NEEDS[0]) is None, STOCHASTIC_NEEDS[1], installed=True),
    )


def _float8_rules() -> tuple[Rule, ...]:
    """`train.float8`: torchao installed; bf16 or fp32 compute (not fp16's grad scaler); not with tensor parallel;
    on a CPU device not under one process's bf16 autocast, which torchao's float8 linear does not follow."""
    return (
        Rule(("train.float8",), lambda c: c.on("float8") and not _torchao_installed(),
             "float8 training needs torchao: pip install 'fulltune[lowbit]'", installed=True),
        Rule(("train.float8", "train.mixed_precision"), lambda c: c.on("float8") and c.mixed_precision == "fp16",
             "torchao's float8 training runs beside bf16 or fp32, not fp16's loss scaling; set mixed_precision to "
             "bf16, no or auto"),
        Rule(("train.float8", "distributed.tensor_parallel"), lambda c: c.on("float8") and c.tensor_parallel_on,
             "tensor parallel's plan splits the linears with DTensor styles that torchao's float8 linear needs its "
             "own of (Float8ColwiseParallel, Float8RowwiseParallel), which fulltune does not apply; set "
             "tensor_parallel to 1 or float8 to false"),
        # torchao's Float8Linear reads CUDA's autocast state (torch.is_autocast_enabled()): under CPU autocast it
        # keeps fp32 inputs and outputs, a step neither the memory model nor a GPU runs.
        Rule(("train.float8", "train.mixed_precision", "budget.device"),
             lambda c: c.on("float8") and c.device == "cpu" and c.mixed_precision == "bf16" and not c.on("pure_bf16")
             and c.fixed_not_fsdp,
             "on a CPU device torchao's float8 linear does not follow bf16 autocast (it reads CUDA's), so it "
             "would run fp32 around its matmuls; use pure_bf16, mixed_precision no, or strategy fsdp (bf16 weights "
             "without autocast) there"),
    )


def _stepped_by_hooks(lever: str, where: str, fsdp: str) -> Rule:
    """A lever that steps from gradient hooks, refused where several processes average their gradients
    outside FSDP (DDP): the hooks would run before the average."""
    return Rule((f"train.{lever}", where), lambda c: c.on(lever) and c.num_processes > 1 and c.fixed_not_fsdp,
                "under DDP its gradient hooks run before the gradients are averaged over processes; train on one "
                f"process, or {fsdp}")


def _pipeline_rules() -> tuple[Rule, ...]:
    """The pipeline stages' rules: the levers they do not run, fp16, the chunked loss and the low-bit updates
    beside data parallel, 1F1B's micro-batches."""
    def refuses(lever: str) -> Callable[[Combination], bool]:
        return lambda c: c.pipelined and c.on(lever)

    return (
        *(Rule((f"train.{lever}", "distributed.pipeline_parallel"), refuses(lever),
               f"{why}; set pipeline_parallel to 1 or turn {lever} off")
          for lever, why in PIPELINE_REFUSED_LEVERS.items()),
        Rule(("train.mixed_precision", "distributed.pipeline_parallel"),
             lambda c: c.pipelined and c.mixed_precision == "fp16",
             "pipeline stages have no grad scaler across stages; set mixed_precision to bf16, no or auto"),
        # Data parallel beside the stages (FSDP2 shards or DDP replicas of a stage): the head's weight is a
        # DTensor there, which the chunked head's tiles do not read (it runs outside the module's forward).
        Rule(("train.chunked_loss", "distributed.strategy", "distributed.pipeline_parallel"),
             lambda c: c.pipelined and c.on("chunked_loss") and c.strategy in ("fsdp", "ddp")
             and c.num_processes > c.pipeline_parallel,
             "the chunked head reads the output head's weight outside its module, and with data parallel beside "
             "the stages that weight is a shard (FSDP) or a replicated DTensor (DDP); turn chunked_loss off (or "
             "auto), or set num_processes to pipeline_parallel"),
        *_optimizer_rules("replicated_refusal", ("train.optimizer", "distributed.strategy",
                                                 "distributed.pipeline_parallel"),
                          lambda c: c.pipelined and c.strategy == "ddp" and c.num_processes > c.pipeline_parallel),
        Rule(("train.checkpoint_async", "distributed.pipeline_parallel"),
             lambda c: c.pipelined and c.checkpoint_async,
             "pipeline stages write their checkpoints synchronously (their states are not staged for a background "
             "write); set checkpoint_async to false or pipeline_parallel to 1"),
        Rule(("train.gradient_accumulation_steps", "distributed.pipeline_schedule"),
             lambda c: c.pipelined and c.pipeline_schedule == "1f1b"
             and c.gradient_accumulation_steps is not None and c.gradient_accumulation_steps < c.pipeline_parallel,
             "1F1B needs at least as many micro-batches as stages (gradient_accumulation_steps ≥ "
             "pipeline_parallel); raise it, or use pipeline_schedule gpipe"),
        Rule(("train.micro_batch_size", "distributed.pipeline_schedule"),
             lambda c: c.pipelined and c.pipeline_schedule == "1f1b"
             and c.implied_accumulation is not None and c.implied_accumulation < c.pipeline_parallel,
             "1F1B needs at least as many micro-batches per step as stages, and effective_batch_size ÷ "
             "(micro_batch_size × data-parallel processes) leaves fewer; lower micro_batch_size (or set it to auto), "
             "or use pipeline_schedule gpipe"),
    )


def _degree_rules() -> tuple[Rule, ...]:
    """The degrees each degree's record says it is not combined with (fulltune/degrees.py `Degree.not_beside`):
    context parallel is built over data parallel alone (fsdp or ddp: its processes sum their gradients)."""
    return tuple(
        Rule((degree.key, other.key), lambda c, a=degree.name, b=other.name: c.degree_on(a) and c.degree_on(b),
             f"{degree.words} is not combined with {other.words} (not built); set one of them to 1")
        for degree in degrees.DEGREES for other in map(degrees.BY_NAME.get, degree.not_beside))


RULES: tuple[Rule, ...] = (
    Rule(("train.optimizer_in_backward", "train.gradient_accumulation_steps"),
         lambda c: c.on("optimizer_in_backward") and c.gradient_accumulation_steps not in (None, 1),
         "stepping in backward updates each parameter during the backward pass of the step's only micro-batch; "
         "set gradient_accumulation_steps to 1 (or auto: the effective batch is kept with a larger micro-batch)"),
    Rule(("train.optimizer_in_backward", "train.offload_optimizer"),
         lambda c: c.on("optimizer_in_backward") and c.on("offload_optimizer"),
         "choose one: offloading already frees the device's gradients in backward"),
    # Under FSDP2 the hooks run on each reduce-scattered shard (fulltune/runtime/optim.py InBackwardOptimizer).
    _stepped_by_hooks("optimizer_in_backward", "distributed.strategy",
                      "use strategy fsdp (which steps each parameter's shard once its gradient is reduced)"),
    Rule(("train.optimizer_in_backward", "distributed.tensor_parallel"),
         lambda c: c.on("optimizer_in_backward") and c.tensor_parallel_on,
         "stepping in backward is not combined with tensor parallel; set tensor_parallel to 1 or turn it off"),
    _stepped_by_hooks("offload_optimizer", "distributed.num_processes",
                      "use strategy fsdp on cuda (FSDP's CPU offload)"),
    # Under FSDP the lever is FSDP2's CPUOffloadPolicy (fulltune/runtime/sharding.py), which needs an accelerator.
    Rule(("train.offload_optimizer", "budget.device"),
         lambda c: c.on("offload_optimizer") and c.strategy == "fsdp" and c.device == "cpu",
         "with strategy fsdp it is FSDP's CPU offload, which needs CUDA devices (on a CPU device host RAM is "
         "the device memory: there is nothing to offload to); set budget.device to cuda or turn it off"),
    Rule(("train.offload_optimizer", "distributed.tensor_parallel"),
         lambda c: c.on("offload_optimizer") and c.tensor_parallel_on,
         "FSDP's CPU offload is not combined with tensor parallel; set tensor_parallel to 1 or turn it off"),
    Rule(("train.chunked_loss", "distributed.tensor_parallel"),
         lambda c: c.on("chunked_loss") and c.tensor_parallel_on,
         "tensor parallel splits the output head's weight over the vocabulary, and the chunked head reads whole "
         "vocabulary tiles of it; set tensor_parallel to 1 or turn chunked_loss off (or auto)"),
    Rule(("train.pure_bf16", "train.mixed_precision"),
         lambda c: c.on("pure_bf16") and c.mixed_precision == "fp16",
         "pure bf16 keeps bf16 weights; set mixed_precision to bf16, no or auto"),
    Rule(("train.pure_bf16", "budget.device"),
         lambda c: c.on("pure_bf16") and c.bf16_supported is False,
         "this GPU has no bf16 support; turn pure_bf16 off"),
    *_compensation_rules(),
    # Under FSDP2 a checkpointed layer's offloaded input comes back to the device for its recompute beside the
    # gathered unit: the memory model counts that (memory/walk.py), but no FSDP step with offloaded activations
    # has been measured on a GPU (on a CPU device nothing is offloaded, so none can be measured there).
    Rule(("train.offload_activations", "distributed.strategy", "budget.device"),
         lambda c: c.on("offload_activations") and c.strategy == "fsdp" and c.device == "cuda",
         "activation offload under FSDP on CUDA has never been measured against the memory model, so its plan "
         "could not be trusted; turn offload_activations off (or auto) or use strategy none"),
    Rule(("train.offload_activations", "train.gradient_checkpointing"),
         lambda c: c.on("offload_activations") and _no_checkpointing(c),
         "it moves the saved inputs of checkpointed layers to host RAM, and no layer is checkpointed; set "
         "gradient_checkpointing to auto, true or a number of layers"),
    Rule(("train.mixed_precision", "distributed.strategy"),
         lambda c: c.strategy == "fsdp" and c.mixed_precision == "fp16",
         "FSDP trains in bf16 or fp32; set mixed_precision to bf16, no or auto"),
    Rule(("train.mixed_precision", "budget.device"),
         lambda c: c.device == "cpu" and c.mixed_precision == "fp16",
         "fp16 needs a CUDA device; use bf16, no or auto on CPU"),
    *_requirement_rules(),
    *_float8_rules(),
    *_optimizer_rules("fsdp_refusal", ("train.optimizer", "distributed.strategy"), lambda c: c.strategy == "fsdp"),
    *_optimizer_rules("offload_refusal", ("train.optimizer", "train.offload_optimizer"),
                      lambda c: c.on("offload_optimizer")),
    *_pipeline_rules(),
    *_degree_rules(),
)


def problems(c: Combination, installed: bool = True) -> list[str]:
    """Every rule the combination breaks, each naming its fields and saying why; `installed=False` leaves out
    what depends on this machine's installed packages."""
    return [rule.message() for rule in RULES if (installed or not rule.installed) and rule.broken(c)]


def check(c: Combination, where: str = "", error: type[ConfigError] = ConfigError, installed: bool = True) -> None:
    """Raise `error` (a ConfigError) listing every broken rule, each prefixed with `where` (`pipelines.demo.`)."""
    found = problems(c, installed)
    if found:
        raise error("; ".join(f"{where}{problem}" for problem in found))


def from_spec(pipeline: object) -> Combination:
    """The combination a `spec.PipelineSpec` asks for: `auto` fields are None; the device only when the
    budget names it."""
    train, distributed, budget = pipeline.train, pipeline.distributed, pipeline.budget  # type: ignore[attr-defined]

    def auto(value: object) -> object:
        return None if value == "auto" else value

    return Combination(
        levers={name: auto(getattr(train, name)) for name in LEVERS},
        strategy=auto(distributed.strategy), num_processes=distributed.num_processes,  # type: ignore[arg-type]
        # A degree's auto is None: the planner checks every degree it tries against the table.
        **degrees.requested(distributed), optimizer=auto(train.optimizer),
        pipeline_schedule=distributed.pipeline_schedule,
        gradient_accumulation_steps=auto(train.gradient_accumulation_steps),
        implied_accumulation=_implied_accumulation(train, distributed),
        mixed_precision=auto(train.mixed_precision), gradient_checkpointing=auto(train.gradient_checkpointing),
        device=auto(budget.device), compensation=auto(train.compensation),  # type: ignore[arg-type]
        checkpoint_async=train.checkpoint_async)


def _implied_accumulation(train: object, distributed: object) -> int | None:
    """The gradient accumulation a fixed micro-batch leaves the planner while accumulation is auto (the batch
    rule, fulltune/degrees.py, makes it a whole number), else None."""
    micro, accumulation = train.micro_batch_size, train.gradient_accumulation_steps  # type: ignore[attr-defined]
    dp = distributed.dims.dp  # type: ignore[attr-defined]
    if micro == "auto" or accumulation != "auto" or dp is None:
        return None
    rows = micro * dp
    effective = train.effective_batch_size  # type: ignore[attr-defined]
    return effective // rows if effective % rows == 0 else None


def from_settings(settings: object, bf16_supported: bool | None = None) -> Combination:
    """The combination of planned (or requested) settings: a `memory.Settings` or `memory.PlanRequest`,
    whose levers map name → True / False (None: auto, in a request)."""
    s = settings
    return Combination(
        levers=s.levers(), num_processes=s.num_processes,  # type: ignore[attr-defined]
        strategy=None if s.strategy == "auto" else s.strategy,  # type: ignore[attr-defined]  # a request's auto
        **degrees.values(s),  # None: auto, in a request
        pipeline_schedule=getattr(s, "pipeline_schedule", "1f1b"),
        optimizer=s.optimizer, gradient_accumulation_steps=s.gradient_accumulation_steps,  # type: ignore[attr-defined]
        mixed_precision=s.mixed_precision, gradient_checkpointing=s.gradient_checkpointing,  # type: ignore[attr-defined]
        device=s.device, bf16_supported=bf16_supported,  # type: ignore[attr-defined]
        compensation=None if s.compensation == "auto" else s.compensation,  # type: ignore[attr-defined]
        checkpoint_async=s.checkpoint_async)  # type: ignore[attr-defined]
