"""A parallelism is a degree of `ParallelDims` (fulltune/degrees.py) plus one object per kind, declared here and
dispatched once (`rank_kind`, `kinds`).

    kind               runs when                  its rank's step (memory)               its traffic (step time)
    one process        strategy none, no stages   the replicated layout (`replicated`)    none
    DDP                strategy ddp               replicated + gradient buckets           not counted
    FSDP               strategy fsdp              FSDP2's units (`fsdp.fsdp_layout`)      not counted
    tensor parallel    tp > 1 (over FSDP)         a rank-shape transform (`tensor_parallel.rank_shape`),
                                                  sequence-parallel activations and the
                                                  vocabulary-parallel head (`tp_layout`)  the TP group's collectives
    context parallel   cp > 1 (over FSDP or DDP)  a rank-shape transform (s/N positions, the attention's all-to-alls
                                                  `context_parallel.rank_settings`),       (Ulysses) or the ring's
                                                  whole-row attention for H/N heads        sends
                                                  (`context_parallel.layer_bytes_cp`)
    pipeline stages    pp > 1                     each stage walked on its own layers     the sends between stages
                                                  (`memory/pipeline.py`; FSDP beside the   (the bubble is the step
                                                  stages: `fsdp.StageUnits`)               time's: planning/step_time)

Each object holds what the planner and the estimate ask of its kind: the rank's step terms (`step_terms`: the
rank-shape transform and the activations), the walk's description (`layout`), the whole estimate where the kind
is more than one walk (pipeline stages), its collectives' traffic (`traffic`, which the step-time model turns into
seconds with its named link constants), its measured margin (`margin`: the largest |estimate / measured − 1| of a
per-rank peak, or None where it was never measured), and its words in a plan (`words`, `describe`). Its runtime
half — how the trainer applies it to a model over its mesh — is `fulltune/runtime/parallelize.py`'s `apply`,
keyed by the same `name` (the runtime is a floor above this one).

A rank runs one data-parallel kind (one process, DDP, FSDP) and, on top, the kinds whose degree is above 1
(`kinds`); the outermost (`rank_kind`: stages, then tensor parallel, then the data-parallel kind) walks its step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fulltune.degrees import ParallelDims
from fulltune.memory import context_parallel as cp
from fulltune.memory.activations import (LayerBytes, ModelActivations, compute_bytes, layer_bytes, model_activations,
                                         stream_bytes)
from fulltune.memory.fsdp import activation_settings, fsdp_layout, persistent
from fulltune.memory.overhead import training_overhead
from fulltune.memory.process import STEP, TRAINING_PHASES, checkpoint_staging_bytes, phase_tensors
from fulltune.memory.replicated import replicated
from fulltune.memory.shapes import ModelShape
from fulltune.memory import tensor_parallel as tp
from fulltune.memory.timeline import StepTerms, Timeline, step_terms
from fulltune.memory.types import MemoryEstimate, Settings
from fulltune.memory.units import format_bytes
from fulltune.memory.walk import Layout, walk


@dataclass(frozen=True)
class Traffic:
    """What one rank sends over a kind's group in one optimizer step: `bytes` (ring collectives: an all-gather
    or reduce-scatter of X bytes moves (n − 1) / n · X per rank) in `count` collectives (each pays a latency)
    over `link` (the step-time model's constants per link)."""

    bytes: float = 0.0
    count: int = 0
    link: str = ""


NO_TRAFFIC = Traffic()


@dataclass(frozen=True)
class Margin:
    """A kind's measured margin: the largest |estimate / measured − 1| of a rank's step peak, and where."""

    fraction: float
    evidence: str


class Parallelism:
    """One kind of parallelism (see the module docstring); the base is the walk every kind shares."""

    name = ""
    margin: Margin | None = None
    # The degree (fulltune/degrees.py `DEGREES`) whose `auto` the plan explains in this kind's words (`chosen_words`,
    # `traffic_words`, `alone_words`); "" for none (pipeline stages say theirs in fulltune/planning/pipeline.py).
    degree = ""

    def runs(self, dims: ParallelDims) -> bool:
        """Whether a rank of `dims` runs this kind."""
        raise NotImplementedError

    # -- memory ---------------------------------------------------------------------------------------

    def rank(self, shape: ModelShape, settings: Settings) -> tuple[ModelShape, Settings]:
        """The shape and settings of one rank's own model (a rank-shape transform; the whole model here)."""
        return shape, settings

    def layer_bytes(self, shape: ModelShape, act: Settings) -> LayerBytes:
        return layer_bytes(shape, act)

    def model_activations(self, shape: ModelShape, settings: Settings, act: Settings,
                          layer: LayerBytes) -> ModelActivations:
        return model_activations(shape, settings, act, layer)

    def step_terms(self, shape: ModelShape, settings: Settings) -> StepTerms:
        """The rank's shared numbers of a step: its own shape and settings (`rank`), its activations."""
        act = activation_settings(settings)
        local, ranked = self.rank(shape, settings)
        local_act = self.rank(shape, act)[1]
        layer = self.layer_bytes(local, local_act)
        return step_terms(local, ranked, local_act, layer=layer,
                          acts=self.model_activations(local, ranked, local_act, layer))

    def layout(self, tl: Timeline) -> Layout:
        """The walk's description of this kind's rank."""
        raise NotImplementedError

    def estimate(self, shape: ModelShape, settings: Settings, timeline: list | None = None) -> MemoryEstimate:
        """One rank's estimate: its step walked once (`walk.walk` over `layout`), the process's phases around it;
        `timeline` (if given) receives every (phase, bytes, parts)."""
        x = self.step_terms(shape, settings)
        tl = Timeline(x, persistent(x))
        walk(tl, self.layout(tl))
        return result(x.shape, tl.phases, timeline, x.settings, notes(shape, settings))

    def rank_peak_bytes(self, shape: ModelShape, settings: Settings, rank: int) -> int:
        """The tensors at process `rank`'s step peak (what the trainer measures per rank): one figure that
        every process shares, unless the kind's ranks differ."""
        return self.estimate(shape, settings).peak_bytes

    # -- step time, margin, words -----------------------------------------------------------------------

    def traffic(self, shape: ModelShape, settings: Settings) -> Traffic:
        """The kind's collectives in one optimizer step (none counted unless the kind says)."""
        return NO_TRAFFIC

    def optimizer_shards(self, settings: Settings) -> int:
        """Over how many processes the optimizer's pass over its states is split."""
        return 1

    def unmeasured(self, settings: Settings) -> str | None:
        """Why a step of this kind has no measured margin (None: `margin` holds, or the kind adds nothing to the
        single-process step's: `uncertainty.MEASURED`)."""
        return None

    def words(self, settings: Settings) -> str:
        """What the margin's kind says of it (`uncertainty`: "llama, checkpointing none, fsdp × tensor parallel 2")."""
        return ""

    def describe(self, settings: Settings) -> str:
        """The kind in a plan's one-line settings (`planning.reasons.describe`); "" when it says nothing."""
        return ""

    # -- the plan's sentence about an auto degree (`planning.reasons.degree_reasons`) ---------------------

    def chosen_words(self, shape: ModelShape, settings: Settings) -> str:
        """What follows "dp data-parallel × N" where the plan chose this kind (", Ulysses"); "" for nothing."""
        return ""

    def traffic_words(self, shape: ModelShape, settings: Settings, link_bytes_per_s: float) -> str:
        """What its step time beyond compute is ("collectives (3 MiB per rank)"), its link at `link_bytes_per_s`."""
        raise NotImplementedError

    def alone_words(self, request: Any) -> str:
        """Why the plan kept the degree at 1 for a `PlanRequest` with it auto."""
        raise NotImplementedError


class OneProcess(Parallelism):
    """One process (strategy none): every parameter on its device, gradients into `.grad`."""

    name = "one process"

    def runs(self, dims: ParallelDims) -> bool:
        return not dims.fsdp_enabled and not dims.ddp_enabled

    def layout(self, tl: Timeline) -> Layout:
        return replicated(tl)


class DistributedDataParallel(OneProcess):
    """DDP: a replica per process, its gradient buckets beside `.grad` (`fsdp.persistent`). Never measured
    against a real step: the assumed margin (`uncertainty.UNMEASURED`)."""

    name = "ddp"

    def runs(self, dims: ParallelDims) -> bool:
        return dims.ddp_enabled

    def unmeasured(self, settings: Settings) -> str | None:
        return "ddp not measured"

    def words(self, settings: Settings) -> str:
        return ", ddp"


# FSDP2's per-rank peak (the sharding terms of `fsdp.Units`), measured in every rank with FSDPMemTracker on CPU
# (benchmarks/sharded_memory.py, BENCHMARKS.md): the largest |estimate/measured − 1| over the grid. An FSDP step
# keeps the larger of this and its single-process kind's entry.
FSDP_MEASURED = Margin(0.0059, "FSDP2 per rank on CPU, fp32, tied embeddings, every layer checkpointed, micro-batch "
                               "2 (worst of 29 configurations, benchmarks/sharded_memory.py)")
# The levers measured under FSDP the same way (`benchmarks/sharded_memory.py --levers`: within 0.17% of every
# rank); an FSDP step with another lever on (pure bf16, CPU offload) keeps the assumed margin.
FSDP_LEVERS_MEASURED = ("chunked_loss", "optimizer_in_backward")


class FullyShardedDataParallel(Parallelism):
    """FSDP2 over the data-parallel processes: each unit gathered while it computes, its gradient
    reduce-scattered (`fsdp.Units`)."""

    name = "fsdp"
    margin = FSDP_MEASURED

    def runs(self, dims: ParallelDims) -> bool:
        return dims.fsdp_enabled

    def layout(self, tl: Timeline) -> Layout:
        return fsdp_layout(tl)

    def optimizer_shards(self, settings: Settings) -> int:
        return settings.num_processes

    def unmeasured(self, settings: Settings) -> str | None:
        if any(on for name, on in settings.levers().items() if name not in FSDP_LEVERS_MEASURED):
            return "fsdp with memory levers not measured"
        return None

    def words(self, settings: Settings) -> str:
        return ", fsdp"


# A tensor-parallel rank (FSDP × TP, `memory/tensor_parallel.py`), measured the same way
# (benchmarks/tensor_parallel_memory.py): its step also keeps FSDP's entry when that is larger.
TP_MEASURED = Margin(0.0009, "tensor parallel 2 per rank on CPU, fp32, micro-batch 1 (worst of 18 configurations, "
                             "benchmarks/tensor_parallel_memory.py)")


class TensorParallel(Parallelism):
    """Tensor parallel over FSDP (fulltune/runtime/parallel.py): a rank-shape transform (`tensor_parallel.rank_shape`:
    H/T heads, I/T columns, V/T rows; FSDP over the dp processes of that shape) plus its Layout
    (`tensor_parallel.tp_layout`: sequence-parallel blocks, the vocabulary-parallel head)."""

    name = "tensor parallel"
    margin = TP_MEASURED
    degree = "tensor_parallel"

    def runs(self, dims: ParallelDims) -> bool:
        return dims.tp_enabled

    def rank(self, shape: ModelShape, settings: Settings) -> tuple[ModelShape, Settings]:
        return tp.rank_shape(shape, settings.tensor_parallel), tp.rank_settings(settings)

    def step_terms(self, shape: ModelShape, settings: Settings) -> StepTerms:
        act = activation_settings(settings)
        T = settings.tensor_parallel
        local, ranked = self.rank(shape, settings)
        local_act = tp.rank_settings(act)
        layer = tp.layer_bytes_tp(local, local_act, T)
        return step_terms(local, ranked, local_act, layer=layer,
                          acts=tp.model_activations_tp(local, ranked, local_act, layer, T),
                          terms=tp.TensorParallelTerms, tensor_parallel=T, full_vocab=shape.vocab,
                          padded_seq=math.ceil(settings.seq_len / T) * T)

    def layout(self, tl: Timeline) -> Layout:
        return tp.tp_layout(tl)

    def traffic(self, shape: ModelShape, settings: Settings) -> Traffic:
        traffic = tp.collectives(shape, settings)
        return Traffic(traffic.bytes, traffic.count, self.name)

    def words(self, settings: Settings) -> str:
        return f" × tensor parallel {settings.tensor_parallel}"

    def describe(self, settings: Settings) -> str:
        return f"tensor parallel {settings.tensor_parallel}"

    def traffic_words(self, shape: ModelShape, settings: Settings, link_bytes_per_s: float) -> str:
        return f"collectives ({format_bytes(int(tp.collectives(shape, settings).bytes))} per rank)"

    def alone_words(self, request: Any) -> str:
        if not request.dims.fsdp_enabled:
            return f"tensor parallel runs under strategy fsdp, this pipeline's is {request.strategy}"
        return "FSDP alone"


# A pipeline stage's per-rank peak (`memory/pipeline.py`), measured in every rank with MemTracker on CPU through
# the trainer's step (benchmarks/pipeline_parallel.py, BENCHMARKS.md): a pipelined step keeps the larger of this
# and its kind's entry.
PIPELINE_MEASURED = Margin(0.0191, "pipeline stages per rank on CPU: FSDP beside 2 stages, bf16 1F1B, one rank of "
                                   "the first stage 1.91% under (that rank's peak varies from run to run by about "
                                   "one unit's all-gather: gloo's timing); a middle stage of 4 at 1.00% under "
                                   "(benchmarks/pipeline_parallel.py)")


class PipelineStages(Parallelism):
    """Pipeline stages (fulltune/runtime/pipeline_parallel.py): each stage walked over its own layers with the
    schedule's in-flight micro-batches and receive buffers beside it (`memory/pipeline.py`); the device figure is
    the largest stage's."""

    name = "pipeline stages"
    margin = PIPELINE_MEASURED

    def runs(self, dims: ParallelDims) -> bool:
        return dims.pp_enabled

    def estimate(self, shape: ModelShape, settings: Settings, timeline: list | None = None) -> MemoryEstimate:
        from fulltune.memory.pipeline import stage_memory_estimate

        return stage_memory_estimate(shape, settings)

    def rank_peak_bytes(self, shape: ModelShape, settings: Settings, rank: int) -> int:
        """Its pipeline stage's (a stage is `ParallelDims.stage`'s consecutive ranks)."""
        from fulltune.memory.pipeline import estimate_stages, per_stage

        stages = estimate_stages(shape, per_stage(settings), settings.pipeline_parallel, settings.pipeline_schedule)
        return stages[settings.dims.stage(rank)].peak_bytes

    def slot_traffic(self, shape: ModelShape, settings: Settings) -> Traffic:
        """What a stage sends in one micro-batch slot of the schedule (`settings` one stage's): its (b, s, h)
        activation forward and a gradient back. The slots, the bubble, are the step time's
        (`planning.step_time.pipeline_step_seconds`); the step's own collectives are its stages' kinds'."""
        activation = stream_bytes(settings) * settings.micro_batch_size * settings.seq_len * shape.hidden
        return Traffic(2 * activation, 0, self.name)

    def describe(self, settings: Settings) -> str:
        return f"{settings.pipeline_parallel} pipeline stages"


# A context-parallel rank (Ulysses over FSDP2, `memory/context_parallel.py`), measured the same way
# (benchmarks/context_parallel_memory.py): its step also keeps FSDP's entry when that is larger.
CP_MEASURED = Margin(0.0086, "context parallel 2 per rank on CPU (Ulysses over FSDP2), eager attention, fp32, "
                             "2 × 512 positions (worst of 9 configurations, benchmarks/context_parallel_memory.py)")


class ContextParallel(Parallelism):
    """Context parallel over FSDP or DDP (fulltune/runtime/context_parallel.py): a rank-shape transform (each rank
    s/N of every row's positions: `context_parallel.rank_settings`) whose attention is over the whole row for
    H/N heads (Ulysses) with the all-to-alls' copies (`context_parallel.layer_bytes_cp`), walked as its
    data-parallel layout (FSDP over dp × cp, or DDP: not measured, the assumed margin). Ring attention (CUDA) is
    counted as Ulysses' layout: not measured on a GPU (benchmarks/device_check.py)."""

    name = "context parallel"
    margin = CP_MEASURED
    degree = "context_parallel"

    def runs(self, dims: ParallelDims) -> bool:
        return dims.cp_enabled

    def rank(self, shape: ModelShape, settings: Settings) -> tuple[ModelShape, Settings]:
        return shape, cp.rank_settings(settings)

    def step_terms(self, shape: ModelShape, settings: Settings) -> StepTerms:
        act = activation_settings(settings)
        N = settings.context_parallel
        S = cp.padded_seq(settings.seq_len, N)
        ranked, local_act = cp.rank_settings(settings), cp.rank_settings(act)
        layer = cp.layer_bytes_cp(shape, local_act, N, S)
        return step_terms(shape, ranked, local_act, layer=layer,
                          acts=cp.model_activations_cp(shape, ranked, local_act, layer, S, settings))

    def layout(self, tl: Timeline) -> Layout:
        return fsdp_layout(tl) if tl.terms.settings.dims.fsdp_enabled else replicated(tl)

    def traffic(self, shape: ModelShape, settings: Settings) -> Traffic:
        """Ulysses: per layer and micro-batch four all-to-alls forward (q, k, v, the output) and four backward
        (their gradients), four more for a recomputed layer, each moving (N − 1) / N of the rank's tensor. Ring
        attention (N not dividing the heads): each layer passes the rank's keys and values N − 1 times forward,
        and keys, values and their gradients N − 1 times backward."""
        N = settings.context_parallel
        local = cp.rank_settings(activation_settings(settings))
        c = compute_bytes(local)
        b, s, L, d = local.micro_batch_size, local.seq_len, shape.num_layers, shape.head_dim
        passes = 2 * L + min(settings.gradient_checkpointing, L)
        q = b * s * shape.heads * d * c
        ga = settings.gradient_accumulation_steps
        if shape.heads % N == 0:
            kv = b * s * shape.kv_heads * cp.kv_repeats(shape.kv_heads, N) * d * c
            return Traffic(ga * passes * (2 * q + 2 * kv) * (N - 1) / N, ga * passes * 4, self.name)
        kv = b * s * shape.kv_heads * d * c
        return Traffic(ga * (2 * L + passes) * 2 * kv * (N - 1), ga * (2 * L + passes) * (N - 1), self.name)

    def words(self, settings: Settings) -> str:
        return f" × context parallel {settings.context_parallel}"

    def describe(self, settings: Settings) -> str:
        return f"context parallel {settings.context_parallel}"

    def chosen_words(self, shape: ModelShape, settings: Settings) -> str:
        return ", Ulysses" if _ulysses(shape, settings) else ", ring attention"

    def traffic_words(self, shape: ModelShape, settings: Settings, link_bytes_per_s: float) -> str:
        traffic = "all-to-alls" if _ulysses(shape, settings) else "ring sends"
        return f"{traffic} (assumed {link_bytes_per_s / 1e9:g} GB/s, not overlapped)"

    def alone_words(self, request: Any) -> str:
        return "every process holds whole rows"


def _ulysses(shape: ModelShape, settings: Settings) -> bool:
    """Context parallel attends by Ulysses where its degree divides the heads (else ring attention)."""
    return shape.heads % settings.dims.cp == 0



ONE_PROCESS = OneProcess()
DDP = DistributedDataParallel()
FSDP = FullyShardedDataParallel()
TENSOR_PARALLEL = TensorParallel()
PIPELINE = PipelineStages()
CONTEXT_PARALLEL = ContextParallel()
# The data-parallel kinds (exactly one runs on every rank), then the kinds over them, innermost first.
DATA_PARALLEL = (FSDP, DDP, ONE_PROCESS)
OVER_DATA_PARALLEL = (CONTEXT_PARALLEL, TENSOR_PARALLEL, PIPELINE)
KINDS = (*DATA_PARALLEL, *OVER_DATA_PARALLEL)
# The kinds that explain their degree's `auto` in a plan, by the degree's name.
BY_DEGREE = {kind.degree: kind for kind in KINDS if kind.degree}


def kinds_of(dims: ParallelDims) -> tuple[Parallelism, ...]:
    """The kinds a rank of `dims` runs: its data-parallel kind, then those over it, innermost first."""
    return (next(k for k in DATA_PARALLEL if k.runs(dims)), *(k for k in OVER_DATA_PARALLEL if k.runs(dims)))


def rank_kind_of(dims: ParallelDims) -> Parallelism:
    """The kind whose walk is a rank's step: the outermost it runs."""
    return kinds_of(dims)[-1]


def kinds(settings: Settings) -> tuple[Parallelism, ...]:
    """`kinds_of` the settings' degrees."""
    return kinds_of(settings.dims)


def rank_kind(settings: Settings) -> Parallelism:
    """`rank_kind_of` the settings' degrees."""
    return kinds(settings)[-1]


def estimate(shape: ModelShape, settings: Settings, timeline: list | None = None) -> MemoryEstimate:
    """One rank's estimate of `settings`, by its kind (the one dispatch of the memory model)."""
    return rank_kind(settings).estimate(shape, settings, timeline)


def result(shape: ModelShape, phases: list, timeline: list | None, settings: Settings,
           notes: list[str]) -> MemoryEstimate:
    """The estimate: the step at the largest of `phases` (and the timeline, if asked for), and the whole
    process's phases (`process.py`) around it."""
    if timeline is not None:
        timeline.extend(phases)
    phase, peak, parts = max(phases, key=lambda p: p[1])
    overhead = training_overhead(settings, peak, STEP, shape)
    breakdown = {key: int(value) for key, value in parts.items() if key != "host"}
    breakdown["runtime_overhead"] = int(overhead)
    host = max(p[2]["host"] for p in phases)
    if settings.device != "cpu":  # a background checkpoint write's copy, held while the steps go on
        host += checkpoint_staging_bytes(shape, settings)
    process_phases = {name: tensors + training_overhead(settings, tensors, name, shape)
                      for name, tensors in phase_tensors(shape, settings, int(peak)).items()}
    training = {name: process_phases[name] for name in TRAINING_PHASES}
    # A tie between the first and a later step is the training step's.
    process_peak = max(training, key=lambda name: (training[name], name == STEP))
    return MemoryEstimate(
        peak_bytes=int(peak),
        device_bytes=int(training[process_peak]),
        breakdown=breakdown,
        peak_phase=phase,
        notes=tuple(notes),
        host_bytes=int(host),
        step_device_bytes=int(peak + overhead),
        phases={name: int(value) for name, value in process_phases.items()},
        process_peak_phase=process_peak,
    )


def notes(shape: ModelShape, settings: Settings) -> list[str]:
    """What the estimate says beside its numbers: an approximated model type, fp16 on CPU, capped checkpointing,
    offload on a CPU device."""
    found: list[str] = []
    if shape.approximate:
        found.append(f"model_type {shape.model_type!r} is modelled as a Llama-like decoder; expect a few % error")
    if settings.mixed_precision == "fp16" and settings.device == "cpu":
        found.append("Accelerate does not autocast fp16 on CPU: counted as fp32")
    if settings.gradient_checkpointing > shape.num_layers:
        found.append(f"gradient_checkpointing={settings.gradient_checkpointing} capped at {shape.num_layers} layers")
    if settings.device == "cpu" and (settings.offload_optimizer or settings.offload_activations):
        found.append("on a CPU device host RAM is the device memory: offloading moves bytes, it saves none")
    return found


def words(settings: Settings) -> str:
    """The kinds of a rank as the margin's table names them."""
    return "".join(k.words(settings) for k in kinds(settings))


def describe(settings: Settings) -> list[str]:
    """The kinds' parts of a plan's one-line settings, innermost first."""
    return [text for text in (k.describe(settings) for k in kinds(settings)) if text]


def traffic(shape: ModelShape, settings: Settings) -> list[Traffic]:
    """Every kind's collectives in one optimizer step of a rank of `settings` (the step-time model's terms)."""
    return [t for t in (k.traffic(shape, settings) for k in kinds(settings)) if t.count]


def optimizer_shards(settings: Settings) -> int:
    """Over how many processes a rank's optimizer pass is split (its data-parallel kind's)."""
    return kinds(settings)[0].optimizer_shards(settings)


def margin(settings: Settings) -> tuple[Margin | None, str | None]:
    """(the largest measured margin of the rank's kinds, or None; why a kind is unmeasured, or None)."""
    found: list[Margin] = []
    for k in kinds(settings):
        why = k.unmeasured(settings)
        if why is not None:
            return None, why
        if k.margin is not None:
            found.append(k.margin)
    return (max(found, key=lambda m: m.fraction) if found else None), None




