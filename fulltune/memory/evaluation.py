"""The evaluate stage inside the budget: its weights in the trained precision, its batches fitted like training's
micro-batch, layer offload where one device cannot hold the weights.

The evaluate stage loads one candidate at a time (base, fine-tuned, champion), each freed before the next, and
runs three phases on it one after another: the held-out loss, greedy generation for exact match, the
lm-evaluation-harness tasks. Its device peak is the weights plus the largest phase, or on CPU the load when
that is larger (the checkpoint's pages beside weights cast to another dtype, as `process.py` measures for the
training process). Each phase's batch is the largest, up to the configured one, that fits beside the weights
(`plan_evaluation`); the evaluate stage runs the batches the plan chose (fulltune/evaluation/evaluate.py).

The weights take the precision the run trained in (`eval_dtype`): bf16 when it trained under bf16 autocast or
pure bf16 (the precision its forward computed in), fp32 only when it trained in fp32 or
`evaluate.precision: fp32` asks for it.

A run whose training held its weights sharded over N processes (`distributed.strategy: fsdp`, or tensor parallel)
is evaluated the same way (`eval_processes`): the evaluate stage starts N processes through the training's launch
path, each holding 1/N of the weights as FSDP2 shards, and while a unit computes its gathered weights (FSDP2 keeps
the previous unit's all-gather buffer until the next gather: two layers' worth) and the root's (the final norm,
a tied embedding). Every figure here is then per process (`EvalMemory.gathered`, `EvalPlan.processes`).
Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from fulltune.degrees import CONTEXT
from fulltune.memory.overhead import evaluation_overhead
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import EvalRequest, MemoryPlan, PlanRequest, Settings
from fulltune.memory.units import format_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class EvalMemory:
    """Device tensor bytes of evaluating one model, by phase. Only one phase runs at a time, so the peak is
    the weights plus the largest phase; `load` is the loading transient (CPU: the file's pages beside a cast)."""

    weights: int
    loss: int  # one batch of the held-out loss: one layer's transient + the logits and their log-softmax
    generation: int  # the KV cache of one generation batch + the prefill transient + last-position logits
    harness: int  # one lm-evaluation-harness log-likelihood batch: full-vocabulary logits and their log-softmax
    load: int = 0
    gathered: int = 0  # sharded over processes: the units FSDP2 holds gathered while one computes

    @property
    def peak_bytes(self) -> int:
        return max(self.load, self.weights + self.gathered + max(self.loss, self.generation, self.harness))

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "peak_bytes": self.peak_bytes}


def eval_dtype(settings: Settings, precision: str = "trained") -> str:
    """The dtype the evaluate stage loads every candidate in: the one the run's forward computed in."""
    if precision == "fp32":
        return "fp32"
    if settings.pure_bf16:
        return "bf16"
    if settings.mixed_precision == "fp16" and settings.device == "cpu":
        return "fp32"  # Accelerate does not autocast fp16 on CPU: the run computed in fp32
    return settings.mixed_precision if settings.mixed_precision in ("bf16", "fp16") else "fp32"


def eval_processes(settings: Settings) -> int:
    """The processes the evaluate stage shards each candidate over: the training's, when it held the weights
    sharded (FSDP, tensor parallel) or its rows' positions (context parallel) over more than one; else 1 (one
    process holds the whole model)."""
    dims = settings.dims
    if settings.num_processes > 1 and (dims.fsdp_enabled or dims.tp_enabled or dims.cp_enabled):
        return settings.num_processes
    return 1


def sharded_bytes(shape: ModelShape, weight_bytes: int, processes: int) -> tuple[int, int]:
    """(one process's weight shards, the weights FSDP2 holds gathered at a forward's peak) for the evaluate
    stage's FSDP2 units (fulltune/runtime/sharding.py `shard_model`, every unit resharded after its forward):
    a decoder layer or an untied embedding / head in its forward with the previous unit's all-gather buffer
    kept (two of the largest), and the root (final norm, a tied embedding) gathered through the whole forward."""
    vocab_hidden = shape.vocab * shape.hidden
    units = shape.num_layers * shape.layer_numel + (0 if shape.tied else 2 * vocab_hidden)
    root = shape.num_params - units
    largest = max(shape.layer_numel, 0 if shape.tied else vocab_hidden)
    shards = -(-shape.num_params // processes) * weight_bytes  # dim-0 shards round up
    return shards, (2 * largest + root) * weight_bytes


def exported_bytes(settings: Settings) -> int:
    """Bytes per parameter of the fine-tuned checkpoint: the training weights' dtype (bf16 under pure bf16)."""
    return 2 if settings.pure_bf16 else 4


def eval_memory(shape: ModelShape, *, weight_bytes: int, batches: tuple[int, int, int], seq_len: int,
                max_new_tokens: int = 0, harness_seq_len: int = 0, attn_implementation: str = "sdpa",
                chunked_loss: bool = False, row_split: int = 1) -> EvalMemory:
    """Analytic device tensors of evaluating one model of `shape` in `weight_bytes` per parameter.

    `batches` are the (loss, generation, harness) batches; a 0 skips that phase. Generation holds a KV cache of
    `seq_len + max_new_tokens` positions per row. Activations have the weights' width; logits are fp32.
    Inference keeps no activations for backward, so a forward's transient is one layer's: the residual stream
    and its normed copy, q/k/v and the attention output, the MLP's intermediate tensors, and with eager
    attention the (heads × s × s) scores and their softmax.

    `chunked_loss`: the held-out loss in (rows × vocabulary) tiles (fulltune/runtime/loss.py's chunked head), no
    (positions × vocabulary) logits: one tile's logits and their fp32 copy beside the gathered rows.
    `row_split` N: the held-out loss with each row's positions split over N processes (Ulysses, as the run
    trained): a process's layer transient is its s/N positions', its attention over the whole row for H/N heads
    with the all-to-alls' copies.
    """
    from fulltune.memory.head import ROW_CHUNK, VOCAB_CHUNK

    act = weight_bytes

    def layer_transient(batch: int, positions: int) -> int:
        kv = 2 * shape.kv_heads * shape.head_dim
        per_position = 4 * shape.hidden + shape.heads * shape.head_dim + kv + 3 * shape.intermediate
        scores = 2 * batch * shape.heads * positions * positions if attn_implementation == "eager" else 0
        return (batch * positions * per_position + scores) * act

    def scored(batch: int, positions: int) -> int:  # one forward's transient, its fp32 logits and log-softmax
        return layer_transient(batch, positions) + 2 * batch * positions * shape.vocab * 4 if batch else 0

    def held_out(batch: int, positions: int) -> int:
        if not batch or (not chunked_loss and row_split == 1):
            return scored(batch, positions)
        N = row_split
        local = -(-positions // (2 * N)) * 2 if N > 1 else positions
        transient = layer_transient(batch, local)
        if N > 1:  # the whole row's attention for H/N heads, the all-to-alls' copies of q
            scores = 2 * batch * (shape.heads // N) * (N * local) ** 2 * act if attn_implementation == "eager" else 0
            transient += scores + 3 * batch * local * shape.heads * shape.head_dim * act
        targets = batch * local
        tile = min(targets, ROW_CHUNK) * min(shape.vocab, VOCAB_CHUNK) * (act + 4)
        return transient + targets * shape.hidden * act + tile + 8 * targets

    loss_batch, generation_batch, harness_batch = batches
    generation = 0
    if generation_batch and max_new_tokens > 0:
        cache = 2 * shape.num_layers * generation_batch * (seq_len + max_new_tokens) * shape.kv_heads * shape.head_dim
        # the cache of every layer, one layer's prefill transient, the last position's logits and the logits
        # processors' fp32 copies of them
        generation = (cache * act + layer_transient(generation_batch, seq_len)
                      + 3 * generation_batch * shape.vocab * 4)
    return EvalMemory(shape.num_params * weight_bytes, held_out(loss_batch, seq_len), generation,
                      scored(harness_batch, harness_seq_len or seq_len))


@dataclass(frozen=True)
class EvalPlan:
    """What the evaluate stage runs and what it costs: the dtype, each phase's fitted batch, the memory at
    those batches (`device_bytes` with the runtime overhead), and where one device cannot hold the weights,
    how many bytes of them accelerate's big-model loading keeps on the device (`max_memory`)."""

    dtype: str
    loss_batch: int
    generation_batch: int
    harness_batch: int | None
    memory: EvalMemory
    device_bytes: int
    fits: bool
    reason: str
    offload_device_bytes: int | None = None  # None: every weight on the device (sharded: 0, shards in host RAM)
    offload_host_bytes: int = 0
    processes: int = 1  # > 1: every candidate sharded over this many processes; the figures are per process
    chunked_loss: bool = False  # the held-out loss in (rows × vocabulary) tiles: no whole-vocabulary logits
    row_split: int = 1  # > 1: the held-out loss with each row's positions split over this many processes (context
    # parallel, as trained; the plan records it under the degree's name)

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "loss_batch": self.loss_batch, "generation_batch": self.generation_batch,
                "harness_batch": self.harness_batch, "memory": self.memory.as_dict(),
                "device_bytes": self.device_bytes, "fits": self.fits, "reason": self.reason,
                "processes": self.processes, "chunked_loss": self.chunked_loss,
                CONTEXT.name: self.row_split,
                "offload": None if self.offload_device_bytes is None else {
                    "device_bytes": self.offload_device_bytes, "host_bytes": self.offload_host_bytes}}


def plan_evaluation(shape: ModelShape, settings: Settings, request: EvalRequest, usable: int | None,
                    host_budget: int | None = None, attn_implementation: str = "sdpa") -> EvalPlan:
    """The evaluate stage of a run trained with `settings`, fitted to `usable` device bytes (None: as configured).

    Each phase's batch is the largest up to the configured one whose peak fits beside the weights (on CPU beside
    the load's transient too). Where the weights and a batch of 1 do not fit a CUDA device, the weights are
    layer-offloaded: the device keeps what fits beside the batch-1 phases, host RAM (`host_budget`) the rest.
    A run trained sharded may be evaluated sharded over its processes (`eval_processes`): `usable` is then one
    process's, and so is every figure. Under `processes: auto` it is evaluated on one process instead when the
    whole model and the configured batches fit one device: no second launch of its processes, and generation
    without a gather of every unit per token.
    """
    plan = _plan_whole_logits(shape, settings, request, usable, host_budget, attn_implementation)
    if plan.fits or usable is None:
        return plan
    # Long rows: the held-out loss without whole-vocabulary logits, then (a run trained context parallel, sharded
    # over its processes) with each row's positions split as it trained.
    ways = [(True, 1)] + ([(True, settings.dims.cp)] if settings.dims.cp_enabled else [])
    for chunked, cp in ways:
        processes = eval_processes(settings) if cp > 1 else plan.processes
        tried = _plan_over(shape, settings, request, usable, host_budget, attn_implementation, processes, chunked, cp)
        if tried.fits:
            return tried
    return plan


def _plan_whole_logits(shape: ModelShape, settings: Settings, request: EvalRequest, usable: int | None,
                       host_budget: int | None, attn_implementation: str) -> EvalPlan:
    """`plan_evaluation` with the held-out loss on whole-vocabulary logits of whole rows."""
    sharded = eval_processes(settings)
    if sharded == 1 or request.processes == sharded:
        return _plan_over(shape, settings, request, usable, host_budget, attn_implementation, sharded)
    one = _plan_over(shape, settings, request, usable, host_budget, attn_implementation, 1)
    if request.processes == 1:
        return one
    if usable is not None and one.fits and one.offload_device_bytes is None and \
            (one.loss_batch, one.generation_batch, one.harness_batch or 0) == _configured(request):
        return replace(one, reason=f"{one.reason}; on one process: the whole model fits one device, so the "
                                   f"{sharded} training processes are not launched again (evaluate.processes: "
                                   f"{sharded} shards it like the training)")
    return _plan_over(shape, settings, request, usable, host_budget, attn_implementation, sharded)


def _configured(request: EvalRequest) -> tuple[int, int, int]:
    """The (loss, generation, harness) batches `evaluate.*` asks for; 0: the phase does not run."""
    return request.batch_size, request.batch_size if request.generate else 0, request.harness_batch_size or 0


def _plan_over(shape: ModelShape, settings: Settings, request: EvalRequest, usable: int | None,
               host_budget: int | None, attn_implementation: str, processes: int, chunked_loss: bool = False,
               row_split: int = 1) -> EvalPlan:
    """`plan_evaluation` with each candidate on `processes` processes (1, or sharded like the training), the
    held-out loss chunked and each row's positions split over `row_split` processes as asked."""
    dtype = eval_dtype(settings, request.precision)
    width = DTYPE_BYTES[dtype]
    seq_len = request.seq_len or settings.seq_len
    configured = _configured(request)

    def memory(batches: tuple[int, int, int]) -> EvalMemory:
        m = eval_memory(shape, weight_bytes=width, batches=batches, seq_len=seq_len,
                        max_new_tokens=request.max_new_tokens, harness_seq_len=request.harness_seq_len,
                        attn_implementation=attn_implementation, chunked_loss=chunked_loss,
                        row_split=row_split)
        if processes > 1:
            shards, gathered = sharded_bytes(shape, width, processes)
            # Each process reads its shards' slices of the checkpoint (`load_sharded_model`): its shards and
            # one tensor's slice, less than the forward's peak.
            return replace(m, weights=shards, gathered=gathered, load=0)
        return replace(m, load=_load_bytes(shape, settings, width))

    def total(m: EvalMemory) -> int:
        return m.peak_bytes + evaluation_overhead(settings.device, m.peak_bytes)

    where = f" sharded over {processes} processes (FSDP2, per process)" if processes > 1 else ""
    if chunked_loss:
        where += ", the held-out loss chunked over positions and vocabulary" + (
            f" with each row's positions split over {row_split} processes (context parallel, as trained)"
            if row_split > 1 else "")

    def plan(batches: tuple[int, int, int], fits: bool, reason: str, **offload: int) -> EvalPlan:
        m = memory(batches)
        return EvalPlan(dtype, batches[0], batches[1], batches[2] or None, m, total(m), fits, reason, **offload,
                        processes=processes, chunked_loss=chunked_loss, row_split=row_split)

    if usable is None:
        return plan(configured, True, f"evaluation in {dtype}{where}: no budget, the configured batches")
    fitted = tuple(_largest(lambda b, i=i: total(memory(_only(configured, i, b))) <= usable, n)
                   for i, n in enumerate(configured))
    if all(b or not n for b, n in zip(fitted, configured)):
        lowered = [f"{name} {b} (of {n})" for name, b, n in zip(("loss", "generation", "harness"), fitted, configured)
                   if b < n]
        return plan(fitted, True, f"evaluation in {dtype}{where}: " + (
            "batches lowered to fit: " + ", ".join(lowered) if lowered else "the configured batches fit"))
    smallest = tuple(min(1, n) for n in configured)
    if settings.device != "cuda":
        m = memory(smallest)
        return plan(smallest, False, f"evaluation{where} needs {format_bytes(total(m))} with batch 1 "
                                     f"({format_bytes(m.weights)} of weights), over the usable "
                                     f"{format_bytes(usable)}; a CPU device has no memory to offload its weights to")
    if processes > 1:
        return _sharded_offloaded(plan, memory, configured, settings, usable, host_budget, total)
    return _offloaded(plan, memory(smallest), smallest, settings, usable, host_budget, total)


def _sharded_offloaded(plan: Any, memory: Any, configured: tuple[int, int, int], settings: Settings, usable: int,
                       host_budget: int | None, total: Any) -> EvalPlan:
    """Sharded, where a process's shards and a batch of 1 do not fit its GPU: every shard in host RAM (FSDP2's CPU
    offload, as `train.offload_optimizer` trains), the GPU holding the gathered units and the batches, fitted again.
    CUDA only (the caller refuses a CPU device)."""
    processes = settings.num_processes
    smallest = tuple(min(1, n) for n in configured)
    need = format_bytes(total(memory(smallest)))
    fitted = tuple(_largest(lambda b, i=i: total(replace(memory(_only(configured, i, b)), weights=0)) <= usable, n)
                   for i, n in enumerate(configured))
    shards = memory(smallest).weights
    host = shards * processes  # every process of the machine holds its shards there
    if not all(b or not n for b, n in zip(fitted, configured)) or _over(host, host_budget):
        return plan(smallest, False, f"evaluation sharded over {processes} processes does not fit even with its "
                                     f"shards in host RAM: batch 1 needs {need} per process of the usable "
                                     f"{format_bytes(usable)}, {format_bytes(host)} of shards for the host"
                                     f"{_host_room(host_budget)}")
    offloaded = plan(fitted, True, f"evaluation sharded over {processes} processes (FSDP2, per process) with its "
                                   f"shards in host RAM ({format_bytes(host)} per machine; the shards and batch 1 do "
                                   f"not fit one GPU: {need}), batches {fitted[0]}/{fitted[1]}",
                     offload_device_bytes=0, offload_host_bytes=host)
    return replace(offloaded, device_bytes=total(replace(offloaded.memory, weights=0)))


def _offloaded(plan: Any, m: EvalMemory, smallest: tuple[int, int, int], settings: Settings, usable: int,
               host_budget: int | None, total: Any) -> EvalPlan:
    """Batch 1 with the weights that do not fit the device in host RAM (accelerate's `device_map="auto"`); CUDA
    only (the caller refuses a CPU device)."""
    need = format_bytes(total(m))
    beside = total(replace(m, weights=0, load=0))
    # The most weight bytes the device holds beside batch 1's phases, its runtime overhead included.
    on_device = _largest(lambda w: total(replace(m, weights=w, load=0)) <= usable, m.weights)
    on_host = m.weights - on_device
    if on_device <= 0 or _over(on_host, host_budget):
        return plan(smallest, False, f"evaluation does not fit even layer-offloaded: batch 1 needs "
                                     f"{format_bytes(beside)} of the usable {format_bytes(usable)} beside the weights, "
                                     f"{format_bytes(on_host)} of weights left for the host{_host_room(host_budget)}")
    offloaded = plan(smallest, True, f"evaluation layer-offloaded with accelerate's big-model loading: "
                                     f"{format_bytes(on_device)} of the {format_bytes(m.weights)} weights on the "
                                     f"device, {format_bytes(on_host)} in host RAM, batch 1 (the weights and a batch "
                                     f"do not fit one device: {need})",
                     offload_device_bytes=on_device, offload_host_bytes=on_host)
    return replace(offloaded, device_bytes=total(replace(m, weights=on_device, load=0)))  # its share of the weights


def _over(host: int, host_budget: int | None) -> bool:
    """Whether `host` bytes are more than budget.host_memory allows (no limit when it is unset)."""
    return host_budget is not None and host > host_budget


def _host_room(host_budget: int | None) -> str:
    """The host RAM a refusal names beside the device's (nothing when budget.host_memory is unset)."""
    return "" if host_budget is None else f", host RAM {format_bytes(host_budget)} (budget.host_memory)"


def _load_bytes(shape: ModelShape, settings: Settings, width: int) -> int:
    """On CPU, loading holds the checkpoint's touched pages beside weights cast to another dtype: the larger of
    the base checkpoint's and the fine-tuned export's. On a GPU the host reads, the device holds the weights."""
    if settings.device != "cpu":
        return 0
    return max(shape.num_params * (stored + (width if stored != width else 0))
               for stored in (shape.stored_bytes, exported_bytes(settings)))


def _only(configured: tuple[int, int, int], index: int, batch: int) -> tuple[int, int, int]:
    """The batches with phase `index` at `batch` and the others off: each phase runs alone."""
    return tuple(batch if i == index else 0 for i in range(len(configured)))  # type: ignore[return-value]


def _largest(fits: Any, upper: int) -> int:
    """The largest n in 1..upper for which `fits(n)` holds (monotone), or 0."""
    low, high = 0, upper
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def with_evaluation(shape: ModelShape, request: PlanRequest, host_budget: int | None, plan: MemoryPlan) -> MemoryPlan:
    """`plan` with the evaluate stage of its settings as one more phase, and part of `fits`: a run whose
    evaluation cannot fit is refused before it trains, with the evaluation's breakdown. `host_budget` is the
    host RAM an offloaded evaluation may use. Nothing changes without `request.evaluation`."""
    from fulltune.memory.process import EVALUATION

    if request.evaluation is None:
        return plan
    evaluation = plan_evaluation(shape, plan.settings, request.evaluation, plan.usable_bytes, host_budget,
                                 request.attn_implementation)
    estimate = replace(plan.plan_estimate, phases={**plan.plan_estimate.phases, EVALUATION: evaluation.device_bytes})
    reasons = plan.reasons + (evaluation.reason,)
    if plan.fits and not evaluation.fits:
        reasons += (f"training fits, but its evaluate stage does not: {evaluation.reason}; lower evaluate.batch_size "
                    "or data.max_length, or give the budget more memory",)
    return replace(plan, plan_estimate=estimate, fits=plan.fits and evaluation.fits, reasons=reasons,
                   evaluation=evaluation.to_dict())
