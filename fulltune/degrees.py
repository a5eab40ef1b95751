"""The parallel degrees of a run: how its processes split the work (torchtitan's `ParallelDims`).

    world_size = dp × cp × tp × pp       distributed.num_processes
    tp  tensor parallel                  distributed.tensor_parallel (auto: None until the plan chooses)
    cp  context parallel                 distributed.context_parallel (auto: None until the plan chooses): each
                                         row's positions split over cp processes (fulltune/runtime/context_parallel.py)
    pp  pipeline stages                  distributed.pipeline_parallel (fulltune/runtime/pipeline_parallel.py)
    dp  data parallel                    the rest: processes that train on different rows, held as
                                         `strategy` says: FSDP2 shards over them (`dp_shard`), DDP
                                         replicates (`dp_replicate`), none is one process (or one a stage)

`strategy` is the one place a run's `distributed.strategy` is read as a layout (`fsdp_enabled`, `ddp_enabled`,
`dp_shard`, `dp_replicate`); every other module asks these properties, or the parallelism objects of
fulltune/memory/parallelism.py, never the string.

The mesh is ("pp", "dp", "cp", "tp") in that order, as torchtitan lays it out: global rank
r = stage · dp · cp · tp + data rank · cp · tp + cp rank · tp + tp rank (`stage`, `data_rank`, `cp_rank`). The cp
processes of a data rank train on the same rows; FSDP shards over dp × cp (`fsdp_shards`) and DDP replicates over
dp × cp (their gradients, each of a share of the rows' positions, are summed over both), as torchtitan does.

One frozen object, checked once where it is built, read everywhere the degrees matter: the spec's batch
rule (`distributed`, `train`), the memory plan (`memory.Settings.dims`, `memory.PlanRequest.dims`), the train
job (`launch.TrainJob.dims`) and the trainer's mesh (fulltune/runtime/parallel.py). `distributed.tensor_parallel:
auto` is read here only (`from_spec`); the planner chooses a degree, and everything after the plan sees a
number.

Each degree is also one record of `DEGREES` (`Degree`): the fields of the memory plan's `Settings` and `PlanRequest`
and of the lever table's `Combination` are made from the records (`degree_fields`), as the levers' are from theirs
(fulltune/levers.py), and so are the copies between them (`requested`, `values`, `dims_of`). A new degree is a
record here, a `ParallelDims` attribute, its YAML key (fulltune/spec.py) and its kind's object
(fulltune/memory/parallelism.py, with its runtime half in fulltune/runtime/parallelize.py).

Importing this module imports no torch: the planner and cached reruns read it; `mesh` imports torch when
called.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from fulltune.errors import ConfigError


@dataclass(frozen=True)
class Degree:
    """One parallel degree: the `distributed.<name>` key (an integer >= 1 or `auto`), the field of the memory plan's
    `Settings` and `PlanRequest` and of the lever table's `Combination` (None there while auto), the key of the plan
    and the train job, and `attr`, its `ParallelDims` attribute. Those fields, the request's copy from the spec, the
    settings' from the request, the degrees of each (`dims_of`), the job's planned keys, the plan's lines and the
    lever table's rules about it are made from these records.

    `words`: how a plan and a message name it. `while_auto`: what `ParallelDims` holds while it is auto (None: not
    known yet; pipeline stages count as one stage until the planner chooses). `beside`: the `distributed:` keys that
    say how it runs, which the plan lists after it. `recorded_after`: the key of `Settings.to_dict` it follows
    (None: not recorded there, nor in the plan's settings line). `always_listed`: the plan's alternatives name it at
    every degree (the others only above 1). `echoed`: the train job's `distributed:` section keeps it and the plan
    echoes it (else the plan's is the job's only copy: `planned`). `not_beside`: the degrees it is not combined
    with (not built), a rule of the lever table each."""

    name: str
    attr: str
    words: str
    while_auto: int | None = None
    beside: tuple[str, ...] = ()
    recorded_after: str | None = None
    always_listed: bool = False
    echoed: bool = False
    not_beside: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The YAML key: `distributed.<name>`."""
        return f"distributed.{self.name}"

    def on(self, dims: ParallelDims) -> bool:
        """Above 1 in `dims` (auto is not): its `ParallelDims.<attr>_enabled`."""
        return getattr(dims, f"{self.attr}_enabled")


# In the order `Settings`, `PlanRequest` and the plan list them: the order they were added in. A new degree goes last.
TENSOR = Degree("tensor_parallel", "tp", "tensor parallel", recorded_after="num_processes", always_listed=True)
PIPELINE = Degree("pipeline_parallel", "pp", "pipeline stages", while_auto=1, beside=("pipeline_schedule",),
                  echoed=True)
# Each row's positions split over its processes; the evaluate stage's held-out loss may split them too
# (memory/evaluation.py, evaluation/sharded.py), and its plan records that under this degree's name.
CONTEXT = Degree("context_parallel", "cp", "context parallel", recorded_after="compensation",
                 not_beside=("tensor_parallel", "pipeline_parallel"))
DEGREES: tuple[Degree, ...] = (TENSOR, PIPELINE, CONTEXT)
TENSOR_PARALLEL, CONTEXT_PARALLEL = TENSOR.key, CONTEXT.key  # what the messages below name
BY_NAME: dict[str, Degree] = {degree.name: degree for degree in DEGREES}
# Every degree 1: one process holds the whole model (with `num_processes` 1 and strategy none).
UNSPLIT: dict[str, int] = {degree.name: 1 for degree in DEGREES}
# The distributed.* keys the memory plan resolves (`auto` becomes a degree), whose only copy in a train job is its plan.
PLANNED: tuple[str, ...] = tuple(degree.name for degree in DEGREES if not degree.echoed)


def degree_fields(annotation: str, after: str) -> Callable[[type], type]:
    """A class decorator, under `@dataclass`: one field per degree (`DEGREES`) typed `annotation`, 1 by default,
    inserted after the class's field `after`."""

    def add(cls: type) -> type:
        items = list(cls.__dict__["__annotations__"].items())
        at = [name for name, _ in items].index(after) + 1
        cls.__annotations__ = dict(items[:at] + [(degree.name, annotation) for degree in DEGREES] + items[at:])
        for degree in DEGREES:
            setattr(cls, degree.name, 1)
        return cls

    return add


def values(record: Any) -> dict[str, int | None]:
    """The degree fields of `record` (a `Settings`, a `PlanRequest`), name → value: what is copied from one to
    the other."""
    return {degree.name: getattr(record, degree.name) for degree in DEGREES}


def requested(distributed: Any) -> dict[str, int | None]:
    """The degrees a `spec.DistributedSpec` asks for, name → value; `auto` is None (the planner chooses)."""
    return {degree.name: None if getattr(distributed, degree.name) == "auto" else getattr(distributed, degree.name)
            for degree in DEGREES}


def dims_of(record: Any, strategy: str | None) -> ParallelDims:
    """The `ParallelDims` of a record with a field per degree and `num_processes` (a `Settings`, a `PlanRequest`),
    its processes held as `strategy` says (None: auto); a degree still auto is its `while_auto`."""
    return ParallelDims(record.num_processes, strategy=strategy, **{
        degree.attr: degree.while_auto if getattr(record, degree.name) is None else getattr(record, degree.name)
        for degree in DEGREES})


def recorded(keys: tuple[str, ...]) -> tuple[str, ...]:
    """`keys` (those of `Settings.to_dict`) with each degree recorded there after the key its record names."""
    return tuple(name for key in keys
                 for name in (key, *(degree.name for degree in DEGREES if degree.recorded_after == key)))


class DegreesError(ConfigError, ValueError):
    """Degrees that do not split the processes, the batch or the model; the message names the field.
    A ValueError too, so that pydantic validators and the memory model's callers report it as theirs."""


STRATEGIES = ("none", "ddp", "fsdp")


@dataclass(frozen=True)
class ParallelDims:
    """`world_size` processes as dp × cp × tp × pp; `tp` None is `distributed.tensor_parallel: auto`, `cp` None
    `distributed.context_parallel: auto`, `strategy` None `distributed.strategy: auto` (until the plan chooses)."""

    world_size: int = 1
    tp: int | None = 1
    pp: int = 1
    strategy: str | None = "none"
    cp: int | None = 1

    def __post_init__(self) -> None:
        degrees = {"num_processes": self.world_size, "pipeline_parallel": self.pp}
        if self.tp is not None:
            degrees["tensor_parallel"] = self.tp
        if self.cp is not None:
            degrees["context_parallel"] = self.cp
        for name, value in degrees.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DegreesError(f"{name} must be an integer >= 1; got {value!r}")
        cp = self.cp is not None and self.cp > 1
        split = [f"tensor_parallel ({self.tp})"] if self.tp is not None and (
            self.tp > 1 or (self.pp == 1 and not cp)) else []
        split += [f"context_parallel ({self.cp})"] if cp else []
        split += [f"pipeline_parallel ({self.pp})"] if self.pp > 1 else []
        if self.world_size % ((self.tp or 1) * (self.cp or 1) * self.pp):
            raise DegreesError(f"num_processes ({self.world_size}) must be a multiple of {' × '.join(split)}")

    @classmethod
    def from_spec(cls, distributed: Any) -> ParallelDims:
        """The degrees a `spec.DistributedSpec` asks for; `tensor_parallel: auto` is `tp` None.
        `pipeline_parallel: auto` is read as its strictest batch rule before the plan chooses: every process a
        stage (`num_processes`) under strategy none, data parallel over them (1) otherwise."""
        tp, pp = distributed.tensor_parallel, distributed.pipeline_parallel
        cp = getattr(distributed, "context_parallel", 1)
        strategy = None if distributed.strategy == "auto" else distributed.strategy
        if pp == "auto":
            pp = distributed.num_processes if strategy == "none" else 1
        return cls(distributed.num_processes, None if tp == "auto" else tp, pp, strategy, None if cp == "auto" else cp)

    @property
    def dp(self) -> int | None:
        """Processes that train on different rows: the tensor-parallel and context-parallel processes of a group
        and the stages of a pipeline share theirs (None while tp or cp is auto)."""
        if self.tp is None or self.cp is None:
            return None
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 holds the model: sharded over the data-parallel processes (FSDP over one process too: its units
        gathered one at a time, and with the optimizer offload its shards in host RAM)."""
        return self.strategy == "fsdp"

    @property
    def ddp_enabled(self) -> bool:
        """DDP holds the model: a replica on every data-parallel process, gradients all-reduced."""
        return self.strategy == "ddp"

    @property
    def alone(self) -> bool:
        """Strategy none: a process holds its model alone (one process, or one a pipeline stage)."""
        return self.strategy == "none"

    @property
    def auto_strategy(self) -> bool:
        """`distributed.strategy: auto`: the plan chooses among `STRATEGIES`."""
        return self.strategy is None

    @property
    def tp_enabled(self) -> bool:
        return self.tp is not None and self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp is not None and self.cp > 1

    @property
    def fsdp_shards(self) -> int:
        """The processes FSDP2 shards over: dp × cp (torchtitan's `dp_shard_cp`); 1 without FSDP."""
        return self.dp_shard * (self.cp or 1)

    @property
    def dp_shard(self) -> int:
        """The processes FSDP2 shards weights, gradients and optimizer states over (1 without FSDP)."""
        return (self.dp or 1) if self.fsdp_enabled else 1

    @property
    def dp_replicate(self) -> int:
        """The processes DDP replicates the model over (1 without DDP)."""
        return (self.dp or 1) if self.ddp_enabled else 1

    def with_tp(self, tp: int) -> ParallelDims:
        """These degrees with tensor parallel `tp` (the degree the plan chose for auto)."""
        return replace(self, tp=tp)

    def with_cp(self, cp: int) -> ParallelDims:
        """These degrees with context parallel `cp` (the degree the plan chose for auto)."""
        return replace(self, cp=cp)

    def per_stage(self) -> ParallelDims:
        """The degrees of one pipeline stage: its dp × tp processes, no stages."""
        return replace(self, world_size=self.world_size // self.pp, pp=1)

    def per_machine(self, num_machines: int) -> int:
        """Processes on each of `num_machines` machines (the processes are spread evenly over them)."""
        return max(self.world_size // max(num_machines, 1), 1)

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global `rank`, which rows of a step it trains on: the "tp" and "cp" groups
        are consecutive ranks (`mesh`); the processes of a pipeline's stages share theirs."""
        return rank // (self.tp * self.cp) % self.dp

    def cp_rank(self, rank: int) -> int:
        """Which share of its rows' positions global `rank` keeps (`context_parallel.zigzag_order`)."""
        return rank // self.tp % self.cp

    def stage(self, rank: int) -> int:
        """The pipeline stage of global `rank`: "pp" is the mesh's outer dimension (`mesh`), so a stage is
        dp × cp × tp consecutive ranks and stage s of every data-parallel replica has the same data rank."""
        return rank // (self.dp * self.cp * self.tp)

    # -- the batch rule ---------------------------------------------------------------------------------

    def check_batch(self, effective: int, micro: int | None, accumulation: int | None) -> None:
        """DegreesError unless `micro` × `accumulation` × dp can make the effective batch (None fields are
        auto, left to the plan), naming the `train:` and `distributed:` YAML fields."""
        dp = self.dp
        if dp is None:
            return  # tensor_parallel auto: the plan keeps the batch for each degree it tries
        who = "distributed.num_processes" + ("" if self.tp == 1 else " / distributed.tensor_parallel") + (
            "" if self.cp == 1 else " / distributed.context_parallel") + (
            "" if self.pp == 1 else " / distributed.pipeline_parallel")
        if micro is not None and accumulation is not None and micro * accumulation * dp != effective:
            raise DegreesError(f"train.micro_batch_size ({micro}) × train.gradient_accumulation_steps "
                               f"({accumulation}) × {who} ({dp}) must equal train.effective_batch_size ({effective})")
        if effective % dp:
            raise DegreesError(f"train.effective_batch_size ({effective}) must be a multiple of {who} ({dp})")
        found = [f"train.{name} ({value}) must divide the per-process batch ({effective // dp})"
                 for name, value in (("micro_batch_size", micro), ("gradient_accumulation_steps", accumulation))
                 if value is not None and (effective // dp) % value]
        if found:
            raise DegreesError("; ".join(found))

    def per_process(self, effective: int) -> int:
        """Rows of an optimizer step that one data-parallel process trains on."""
        return effective // self.dp

    # -- the model split --------------------------------------------------------------------------------

    def split_problem(self, heads: Any, kv_heads: Any, intermediate: Any, layers: Any) -> str | None:
        """What tp and pp do not split evenly (None when they do): attention heads, key/value heads and MLP
        width over tp (each process computes whole heads and MLP columns), decoder layers over pp (one layer
        or more a stage)."""
        tp = self.tp or 1
        found = [f"{what} ({value})" for what, value in (("num_attention_heads", heads),
                                                         ("num_key_value_heads", kv_heads),
                                                         ("intermediate_size", intermediate))
                 if tp > 1 and (not isinstance(value, int) or value % tp)]
        if self.pp > 1 and (not isinstance(layers, int) or layers < self.pp):
            found.append(f"num_hidden_layers ({layers}, fewer than {self.pp} pipeline stages)")
        return f"{tp} does not divide the model's {', '.join(found)}" if found else None

    def check_split(self, config: Any, where: str = "") -> None:
        """DegreesError naming distributed.tensor_parallel (after `where`, e.g. `pipelines.demo.`) when the
        degrees do not split `config` (a transformers config) evenly (`split_problem`)."""
        heads = getattr(config, "num_attention_heads", None)
        problem = self.split_problem(heads, getattr(config, "num_key_value_heads", None) or heads,
                                     getattr(config, "intermediate_size", None),
                                     getattr(config, "num_hidden_layers", None))
        if problem:
            raise DegreesError(f"{where}{TENSOR_PARALLEL}: {problem}")

    def context_method(self, heads: int) -> str:
        """How the cp processes attend over the whole sequence: "ulysses" (all-to-all to head-sharded attention)
        where cp divides the attention heads, else "ring" (keys and values passed round the group; CUDA only)."""
        return "ulysses" if heads % (self.cp or 1) == 0 else "ring"

    def context_problem(self, heads: Any, device: str | None) -> str | None:
        """Why the cp processes cannot attend on `device` (None when they can, or the device is still auto):
        cp not dividing the heads needs ring attention, whose attention kernel shards on CUDA only."""
        if not self.cp_enabled or not isinstance(heads, int) or device != "cpu":
            return None
        if self.context_method(heads) == "ulysses":
            return None
        return (f"{self.cp} does not divide the model's {heads} attention heads, which needs ring attention, and "
                f"ring attention runs on CUDA only; use a context_parallel that divides {heads}, or budget.device cuda")

    def check_context(self, config: Any, device: str | None, where: str = "") -> None:
        """DegreesError naming distributed.context_parallel (after `where`) when `context_problem`."""
        problem = self.context_problem(getattr(config, "num_attention_heads", None), device)
        if problem:
            raise DegreesError(f"{where}{CONTEXT_PARALLEL}: {problem}")

    # -- the device mesh --------------------------------------------------------------------------------

    def mesh(self, device: str) -> Any:
        """The device mesh over the default process group: ("dp", "tp"), with "pp" first when there are
        stages (a stage's "dp" sub-mesh is what its FSDP2 shards or DDP replicas span); a "tp" group is
        consecutive ranks (on one machine first, where the per-block collectives are cheapest)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("a device mesh needs a process group: run under torchrun")
        if dist.get_world_size() != self.world_size:
            raise DegreesError(f"{TENSOR_PARALLEL}: {self.world_size} processes planned, "
                               f"{dist.get_world_size()} started")
        shape, names = (self.dp, self.tp), ("dp", "tp")
        if self.cp_enabled:
            shape, names = (self.dp, self.cp, self.tp), ("dp", "cp", "tp")
        if self.pp > 1:
            shape, names = (self.pp, *shape), ("pp", *names)
        return init_device_mesh(device, shape, mesh_dim_names=names)
