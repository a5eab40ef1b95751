"""The schema of pipelines.yaml.

A pipelines file has a `workdir`, optional `defaults` (merged into every pipeline) and a mapping of
named `pipelines`. It parses into frozen pydantic models that reject unknown keys; every problem is
reported at once with its YAML path (`pipelines.demo.train.learning_rate: must be > 0`). Reading a file,
merging `defaults` and applying `--set` overrides is fulltune/pipelines_file.py's; the `evaluate` and
`register` sections are fulltune/spec_gates.py's (importable from here too).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag, create_model, field_validator, model_validator

from fulltune import levers
from fulltune.degrees import ParallelDims
from fulltune.optimizers import OPTIMIZER_TABLE, OPTIMIZERS
from fulltune.sizes import SIZE_PATTERN, parse_size
# The evaluate and register sections, importable from here as the rest of the schema is.
from fulltune.spec_gates import (BUILTIN_METRICS, DEFAULT_METRIC_TIMEOUT, EvaluateSpec, LmEvalSpec,  # noqa: F401
                                 PromoteIf, RegisterSpec, Strict)

CRON_PATTERN = re.compile(r"^(\S+\s+){4}\S+$")

Auto = Literal["auto"]
# The choices of each setting, defined once: the spec, the planner and the trainer's job read them
# (`typing.get_args(Optimizer)` gives the tuple).
DataFormat = Literal["text", "prompt_completion", "chat"]
AttnImplementation = Literal["sdpa", "eager"]
Device = Literal["cpu", "cuda"]
MixedPrecision = Literal["bf16", "fp16", "no"]
Optimizer = Literal[OPTIMIZERS]  # one record each in fulltune/optimizers.py
LrScheduler = Literal["cosine", "linear", "constant"]
Strategy = Literal["none", "ddp", "fsdp", "auto"]
PipelineSchedule = Literal["1f1b", "gpipe"]


class TrainTokenizer(Strict):
    """Train a byte-level BPE tokenizer on the training data (for models built from a config)."""

    vocab_size: int = Field(512, ge=64, le=1_000_000, description="Vocabulary size of the trained tokenizer.")
    min_frequency: int = Field(1, ge=1, description="Minimum pair frequency for a BPE merge.")


class ModelSpec(Strict):
    """Which model to fine-tune: a checkpoint (path or hub id) or a fresh one built from a config."""

    name_or_path: str | None = Field(None, description="Local checkpoint directory or Hugging Face hub id.")
    from_config: str | dict[str, Any] | None = Field(
        None, description="Randomly initialised model from a config.json path or an inline config mapping."
    )
    tokenizer: str | TrainTokenizer | None = Field(
        None,
        description="Tokenizer path or hub id (default: name_or_path), or `{vocab_size: N}` to train a BPE "
        "tokenizer on the training data.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of name_or_path.")
    trust_remote_code: bool = Field(False, description="Run model code shipped with the checkpoint. Off by default.")
    allow_pickle_weights: bool = Field(
        False, description="Allow loading `.bin`/`.pt` weights (pickle). By default only safetensors load."
    )
    attn_implementation: AttnImplementation = Field("sdpa", description="Attention kernel.")
    token_env: str | None = Field(
        None, description="Name of the environment variable holding a Hub token (the token itself never goes here)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.name_or_path is None) == (self.from_config is None):
            raise ValueError("set exactly one of model.name_or_path and model.from_config")
        if self.from_config is not None and self.tokenizer is None:
            raise ValueError("model.tokenizer is required with model.from_config (a path, or {vocab_size: N})")
        return self


class EvalSource(Strict):
    """One item of a `data.eval` list: a file, directory or hub id, with the `data.` options it overrides."""

    path: str = Field(description="A .jsonl/.json/.csv/.parquet/.txt file, a directory, or a hub id.")
    split: str | None = Field(None, description="The split of a hub dataset (as `org/name:split` names it).")
    format: DataFormat | None = Field(None, description="How this source's records become text (default data.format).")
    text_field: str | None = Field(None, description="Column with the text (default data.text_field).")
    prompt_field: str | None = Field(None, description="Column with the prompt (default data.prompt_field).")
    completion_field: str | None = Field(None, description="Column with the completion (default data.completion_field).")
    messages_field: str | None = Field(None, description="Column with the chat messages (default data.messages_field).")


class TrainSource(EvalSource):
    """One item of a `data.train` list: an EvalSource with a weight."""

    weight: float = Field(1.0, gt=0, le=1000, description="Times each of this source's examples is seen per epoch "
                                                          "on average: 2 twice, 0.5 a seeded half.")


def _source_list(item_type: type[EvalSource]) -> Any:
    """`str | list[item_type]`, the list's plain strings read as `{path: ...}`; errors name `[n]`, not the union."""
    def as_items(value: Any) -> Any:
        return [{"path": v} if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    sources = Annotated[list[item_type], Field(min_length=1), BeforeValidator(as_items)]  # type: ignore[valid-type]
    return Annotated[Union[Annotated[str, Tag("Path")], Annotated[sources, Tag("Sources")]],
                     Discriminator(lambda v: "Path" if isinstance(v, str) else "Sources")]


TrainSources = _source_list(TrainSource)
EvalSources = _source_list(EvalSource)


class DataSpec(Strict):
    """Where the examples come from and how they become token sequences."""

    train: TrainSources = Field(description="Training data: a .jsonl/.json/.csv/.parquet/.txt file, a directory, or a "
                                            "hub id; or a list of them, each a reference or a mapping {path, weight, "
                                            "split, format, <field>_field} overriding these options for that source.")
    eval: EvalSources | None = Field(None, description="Held-out data (one source or a list, as train but without "
                                                       "weight); when absent, `eval_split` of train is held out.")
    eval_split: float = Field(0.1, gt=0, lt=1, description="Fraction of train held out when `eval` is absent.")
    format: DataFormat = Field("text", description="How records become text.")
    text_field: str = Field("text", description="Column with the text (format `text`).")
    prompt_field: str = Field("prompt", description="Column with the prompt (format `prompt_completion`).")
    completion_field: str = Field("completion", description="Column with the completion (format `prompt_completion`).")
    messages_field: str = Field("messages", description="Column with the chat messages (format `chat`).")
    max_length: int = Field(512, ge=8, le=1_048_576, description="Sequences are truncated to this many tokens.")
    num_workers: Union[Auto, int] = Field(
        "auto", description="Processes the tokenize stage formats and tokenizes with (each source cut into shards; "
                            "the output is the same for any number). `auto`: the CPUs this process may use."
    )
    packing: Union[bool, Auto] = Field(
        "auto", description="Pack several examples into each max_length row (positions restart; each example "
                            "attends to itself only, which needs model.attn_implementation: sdpa). `auto`: pack "
                            "when that trains faster (predicted per epoch, or measured under budget.autotune: "
                            "true), one example per row where no two examples fit in one row."
    )

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return value


class AutotuneSpec(Strict):
    """How autotune measures the planner's top candidates before the run (fulltune/planning/autotune.py)."""

    enabled: Union[Auto, bool] = Field(
        True, description="`auto`: tune only where the predicted training time is at least 20× the predicted "
                          "tuning time; true: always; false: never."
    )
    candidates: int = Field(3, ge=1, le=5, description="The plan and its next-fastest alternatives that fit, measured.")
    steps: int = Field(3, ge=1, le=100, description="Timed optimizer steps per candidate (their median counts).")
    warmup_steps: int = Field(1, ge=0, le=20, description="Untimed optimizer steps first (state allocation, warm-up).")
    max_seconds: float = Field(600.0, gt=0, description="Wall-time cap of the whole tuning; candidates past it are skipped.")


class BudgetSpec(Strict):
    """The memory the run must fit in."""

    device: Literal["auto", Device] = Field("auto", description="Device to plan for; auto = cuda if present.")
    memory: int | str = Field("auto", description="Budget per device: `auto` (the GPU's total; on CPU each process's "
                                                  "share of the machine's RAM, which its processes share), bytes, "
                                                  "or '24GiB'.")
    on_overflow: Literal["plan", "fail"] = Field(
        "plan", description="`plan`: change micro-batch/checkpointing/optimizer to fit; `fail`: exit with the breakdown."
    )
    headroom: float = Field(0.05, ge=0, lt=0.9, description="Fraction of the budget kept free.")
    host_memory: int | str = Field(
        "auto", description="Host RAM the run may use for offloaded optimizer states and activations: `auto` "
                            "(this machine's RAM), bytes, or '256GiB'. The planner offloads no more than this."
    )
    autotune: Union[bool, Auto, AutotuneSpec] = Field(
        "auto", description="Measure the planner's top candidates for a few steps on this machine and run the "
                            "fastest that fits: true, false, or a mapping (candidates, steps, warmup_steps, "
                            "max_seconds, enabled). `auto` tunes only where the predicted training time is at "
                            "least 20× the tuning time, so short runs never pay for it. Measurements are kept in "
                            "the workdir per hardware, model shape and settings."
    )

    @field_validator("memory", "host_memory")
    @classmethod
    def _memory(cls, value: int | str) -> int | str:
        if isinstance(value, int):
            if value <= 0:
                raise ValueError("must be > 0")
            return value
        if value == "auto":
            return value
        if SIZE_PATTERN.match(value):
            if parse_size(value) <= 0:
                raise ValueError("must be > 0")
            return value
        raise ValueError("must be 'auto', a number of bytes, or a size like '24GiB'")


class _TrainSpec(Strict):
    """The optimisation. `effective_batch_size` = micro_batch_size × gradient_accumulation_steps × processes."""

    effective_batch_size: int = Field(8, ge=1, description="Sequences per optimizer step, kept by the planner.")
    micro_batch_size: int | Auto = Field("auto", description="Sequences per forward pass per process.")
    gradient_accumulation_steps: int | Auto = Field("auto", description="Micro-batches per optimizer step.")
    gradient_checkpointing: Union[Auto, bool, int] = Field(
        "auto", description="Recompute activations: auto, true (all layers), false, or a number of layers."
    )
    mixed_precision: Literal["auto", MixedPrecision] = Field("auto", description="Autocast dtype.")
    optimizer: Literal["auto", Optimizer] = Field(
        "adamw", description="`auto` lets the planner pick a cheaper optimizer when memory requires it. "
                             + "; ".join(f"{r.name}: {r.description}" for r in OPTIMIZER_TABLE) + "."
    )
    learning_rate: float = Field(2e-5, gt=0, le=1, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps of linear warmup.")
    lr_scheduler: LrScheduler = Field("cosine", description="Decay after warmup.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    num_epochs: float = Field(1.0, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides num_epochs.")
    seed: int = Field(0, ge=0, description="Seed for initialisation, data order and the eval split.")
    checkpoint_every_steps: int = Field(50, ge=0, description="Save a resumable checkpoint every N steps (0: never).")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept on disk.")
    checkpoint_async: bool = Field(
        False, description="Write step checkpoints in the background: the weights and optimizer states are "
                           "copied to host RAM at the step boundary (counted in the plan's host RAM and its "
                           "checkpoint phase) and training goes on while the copy is written; the checkpoint "
                           "appears under its step name only once it is whole, and a run killed meanwhile "
                           "resumes from the one before. One process, DDP and FSDP; not with pipeline stages."
    )
    log_every_steps: int = Field(10, ge=1, description="Read the loss and log metrics every N optimizer steps.")
    compile: bool = Field(False, description="torch.compile the model.")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _unquoted_no(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `no` as false; `mixed_precision: no` means the string.
        return "no" if value is False else value

    @field_validator("micro_batch_size", "gradient_accumulation_steps")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return value

    @field_validator("gradient_checkpointing")
    @classmethod
    def _layers(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError("must be auto, true, false or a number of layers >= 0")
        return value

    @model_validator(mode="after")
    def _options_beside_their_levers(self) -> _TrainSpec:
        # The levers and their options are the generated TrainSpec's fields (below).
        refused = levers.off_refusals(self)
        if refused:
            raise ValueError("; ".join(refused))
        return self


# `train:`: the fields above, then one field per memory lever (`auto`, true or false) and each lever's options, made
# from its record in fulltune/levers.py, then the non-finite guard.
TrainSpec = create_model(
    "TrainSpec", __base__=_TrainSpec, __module__=__name__, __doc__=_TrainSpec.__doc__,
    **levers.spec_fields(),
    max_nonfinite_steps=(int, Field(5, ge=1, description="Stop after this many non-finite losses in a row.")))


class DistributedSpec(Strict):
    """How many processes train, and how model state is shared between them."""

    strategy: Strategy = Field(
        "auto",
        description="`none` trains in one process; `ddp` replicates the model in every process; `fsdp` shards weights, "
                    "gradients and optimizer states over the data-parallel processes (FSDP2); `auto`: the plan chooses "
                    "the fastest that fits: for one process `none` or `fsdp` over it (with train.offload_optimizer, "
                    "FSDP2's CPU offload keeps the parameters in host RAM), for several `ddp` or `fsdp`. Unset: `auto` "
                    "for one process (the plan names its choice), `none` where every process is a pipeline stage; "
                    "other numbers of processes need one set."
    )
    num_processes: int = Field(1, ge=1, le=4096, description="Processes (usually GPUs) in total.")
    num_machines: int = Field(1, ge=1, description="Machines taking part.")
    tensor_parallel: int | Auto = Field(
        1, description="Processes each layer's matmuls are split over (tensor parallel, with sequence parallel "
                       "norms); num_processes / tensor_parallel groups train on different data with FSDP between "
                       "them. Needs strategy fsdp; 1 = no tensor parallel; auto: the plan chooses a divisor of the "
                       "processes on one machine (the fastest that fits)."
    )
    context_parallel: int | Auto = Field(
        1, description="Processes each row's positions are split over (context parallel, for long rows): each keeps "
                       "1/N of every row's positions (chunks balanced for causal attention), so its activations are "
                       "1/N of the row's, and attention still sees the whole row: Ulysses (an all-to-all to "
                       "head-sharded attention and back) where N divides the attention heads, else ring attention "
                       "(CUDA only). num_processes = data parallel × context_parallel; needs strategy fsdp "
                       "(sharded over data parallel × context_parallel) or ddp. Not with tensor_parallel or "
                       "pipeline stages. 1 = none; auto: the plan chooses the fastest degree that fits."
    )
    pipeline_parallel: int | Auto = Field(
        1, description="Pipeline stages: the decoder layers split evenly over this many processes, "
                       "one stage each (the embedding on the first, the head on the last); "
                       "num_processes = pipeline_parallel × data parallel × tensor_parallel. 1 = none. "
                       "Each optimizer step's gradient_accumulation_steps micro-batches flow through "
                       "the stages. Data parallel beside them: num_processes = pipeline_parallel × dp with strategy "
                       "fsdp (each stage sharded over its dp processes) or ddp (replicated); strategy none: "
                       "num_processes = pipeline_parallel. Not with tensor_parallel. auto: the plan "
                       "chooses between data parallel over the processes (strategy ddp or fsdp, or one process) and "
                       "num_processes stages (strategy none), the fastest that fits; with strategy none it is "
                       "num_processes."
    )
    pipeline_schedule: PipelineSchedule = Field(
        "1f1b", description="The order a stage runs its micro-batches: `1f1b` (one forward, one backward: stage s "
                            "holds at most P − s micro-batches' activations; needs gradient_accumulation_steps ≥ "
                            "pipeline_parallel) or `gpipe` (all forwards, then all backwards: holds all of them)."
    )

    @field_validator("strategy", mode="before")
    @classmethod
    def _offered(cls, value: Any) -> Any:
        if isinstance(value, str) and value.startswith("deepspeed"):
            raise ValueError(f"{value} is not offered: fulltune's trainer is not verified under DeepSpeed; use fsdp "
                             "(FSDP2 shards weights, gradients and optimizer states as ZeRO-3 does)")
        return value

    @field_validator("pipeline_parallel", "context_parallel")
    @classmethod
    def _degree(cls, value: Any, info: Any) -> Any:
        if value != "auto" and not 1 <= value <= 64:
            raise ValueError(f"{info.field_name} must be auto or from 1 to 64; got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> DistributedSpec:
        if self.strategy_unset and self.num_processes > 1:  # unset: auto for one process only
            object.__setattr__(self, "strategy", "none")
        if self.pipeline_parallel == "auto":
            if self.tensor_parallel != 1 or self.context_parallel != 1:
                raise ValueError("pipeline_parallel auto is not combined with tensor_parallel or context_parallel "
                                 "(pipeline stages are built with neither); set them to 1")
            ParallelDims.from_spec(self)
            return self
        # The YAML values as written (auto still open), each check naming them; the layout is ParallelDims'.
        if self.strategy == "none" and self.num_processes != self.pipeline_parallel:
            raise ValueError("num_processes > 1 needs a strategy (ddp or fsdp)"
                             + (" or num_processes = pipeline_parallel" if self.pipeline_parallel > 1 else ""))
        if self.pipeline_parallel > 1 and self.strategy == "auto":
            raise ValueError("pipeline_parallel > 1 needs a fixed strategy: none (every process a stage), fsdp or "
                             "ddp (data parallel beside the stages); auto is not combined with fixed stages")
        if self.pipeline_parallel > 1 and self.tensor_parallel != 1:
            raise ValueError("pipeline_parallel > 1 is not combined with tensor_parallel (not built); set one of "
                             "them to 1")
        if self.tensor_parallel == "auto":
            return self  # the plan chooses a degree that divides the processes (planning/planner.py)
        if not 1 <= self.tensor_parallel <= 64:
            raise ValueError(f"tensor_parallel must be auto or from 1 to 64; got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.strategy != "fsdp":
            raise ValueError("tensor_parallel > 1 needs strategy fsdp (FSDP over the data-parallel processes)")
        ParallelDims.from_spec(self)  # DegreesError (a ValueError) unless the degree divides the processes
        return self

    @property
    def strategy_unset(self) -> bool:
        """The pipeline leaves `strategy` to the plan by not setting it (one process: read as auto)."""
        return "strategy" not in self.model_fields_set

    @property
    def dims(self) -> ParallelDims:
        """The parallel degrees these settings ask for (`tp` None while tensor_parallel is auto)."""
        return ParallelDims.from_spec(self)


# Fields a run started from a deployment may never override, even where a pipeline's `run_overrides`
# names them: they run code (remote model code, metric modules, task files with `!function`), load
# pickles, read a secret, or choose where outputs go.
NEVER_RUN_OVERRIDES = ("model.trust_remote_code", "model.allow_pickle_weights", "model.token_env",
                       "evaluate.metrics", "evaluate.lm_eval.tasks", "run_overrides", "workdir")


def covers(entry: str, key: str) -> bool:
    """Whether the dotted `entry` is `key` or one of the sections above it (`train` covers `train.seed`)."""
    return key == entry or key.startswith(entry + ".")


class PipelineSpec(Strict):
    """One named pipeline: tokenize → memory budget → fine-tune → evaluate → register."""

    description: str = Field("", description="Shown by `fulltune list` and in the Prefect UI.")
    model: ModelSpec
    data: DataSpec
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    distributed: DistributedSpec = Field(default_factory=DistributedSpec)
    evaluate: EvaluateSpec = Field(default_factory=EvaluateSpec)
    # `register` is the YAML key; the attribute name avoids shadowing BaseModel.register.
    registration: RegisterSpec = Field(default_factory=RegisterSpec, alias="register")
    schedule: str | None = Field(None, description="Cron expression for scheduled retraining (`fulltune serve`).")
    run_overrides: list[str] = Field(
        default_factory=list,
        description="Fields (dotted keys, or a section such as `evaluate`) that a run started from a deployment "
                    "(the Prefect UI, the API, a schedule) may override besides the training knobs it always may "
                    "(fulltune/stages/run_overrides.py). Never the fields that run code, load pickles, read secrets or "
                    f"choose where outputs go: {', '.join(NEVER_RUN_OVERRIDES)}. `fulltune run --set` is not "
                    "limited.")

    @field_validator("run_overrides")
    @classmethod
    def _never(cls, value: list[str]) -> list[str]:
        for entry in value:
            clash = next((k for k in NEVER_RUN_OVERRIDES if covers(entry, k) or covers(k, entry)), None)
            if clash:
                raise ValueError(f"{entry!r}: a run parameter may never set {clash}")
        return value

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str | None) -> str | None:
        if value is not None and not CRON_PATTERN.match(value.strip()):
            raise ValueError("must be a cron expression with five fields, e.g. '0 3 * * 1'")
        return value

    @model_validator(mode="after")
    def _batch(self) -> PipelineSpec:
        # micro × accumulation × data-parallel processes = effective (fulltune/degrees.py holds the rule).
        t = self.train
        micro, accumulation = (None if value == "auto" else value
                               for value in (t.micro_batch_size, t.gradient_accumulation_steps))
        self.distributed.dims.check_batch(t.effective_batch_size, micro, accumulation)
        return self

    @model_validator(mode="after")
    def _evaluate_processes(self) -> PipelineSpec:
        processes, d = self.evaluate.processes, self.distributed
        if processes == "auto" or processes == 1:
            return self
        if processes < 1:
            raise ValueError(f"evaluate.processes must be auto or at least 1; got {processes}")
        if d.strategy != "fsdp" or processes != d.num_processes:  # the YAML value the message names
            raise ValueError(f"evaluate.processes: {processes} shards each candidate over the training's processes, "
                             f"which needs distributed.strategy fsdp and num_processes {processes} (they are "
                             f"{d.strategy} and {d.num_processes}); set it to auto or 1")
        return self

    @model_validator(mode="after")
    def _packing_attention(self) -> PipelineSpec:
        # Packed rows keep their documents apart with fulltune's SDPA document attention (fulltune/attention.py);
        # eager attention would build a dense (s × s) mask per layer instead, and compute every pair of positions.
        if self.data.packing is True and self.model.attn_implementation != "sdpa":
            raise ValueError(f"data.packing: true needs model.attn_implementation: sdpa (packed documents attend alone "
                             f"without a (max_length × max_length) mask; {self.model.attn_implementation} attention "
                             "would build one in every layer); set model.attn_implementation: sdpa, or "
                             "data.packing: false (or auto, which then trains one example per row)")
        return self

    @model_validator(mode="after")
    def _lever_table(self) -> PipelineSpec:
        # Every combination of levers, optimizer, strategy, accumulation, precision and device that the
        # trainer cannot run is refused here, naming its fields (fulltune/levers.py is the one table).
        found = levers.problems(levers.from_spec(self))
        if found:
            raise ValueError("; ".join(found))
        return self

    def model_name(self, pipeline: str) -> str:
        return self.registration.model_name or f"fulltune-{pipeline}"

    def config_hash(self) -> str:
        """sha256 of the resolved pipeline, stable across runs and key order."""
        # run_overrides says who may change the pipeline, not what it computes.
        text = json.dumps(self.model_dump(mode="json", by_alias=True, exclude={"run_overrides"}), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


class PipelinesFile(Strict):
    """The whole pipelines.yaml after `defaults` are merged into each pipeline."""

    workdir: str = Field(".fulltune", description="Where tokenized data, runs, models and MLflow's database live.")
    pipelines: dict[str, PipelineSpec] = Field(description="Named pipelines.")

    @field_validator("pipelines")
    @classmethod
    def _names(cls, value: dict[str, PipelineSpec]) -> dict[str, PipelineSpec]:
        if not value:
            raise ValueError("declare at least one pipeline")
        for name in value:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
                raise ValueError(f"pipeline name {name!r} may only use letters, digits, '_', '-', '.'")
        return value
