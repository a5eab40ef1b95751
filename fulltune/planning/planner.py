"""Choose micro-batch, gradient checkpointing, mixed precision and optimizer to fit a memory budget.

The planner only changes fields the user left on auto, keeps the effective batch
(micro_batch_size × gradient_accumulation_steps × num_processes) fixed, and among the settings
whose estimated device memory fits in budget × (1 − headroom) picks the fastest by a simple
step-time model (below). Gradient checkpointing is turned on for as few layers as needed.

A setting fits when its estimate plus the estimate's uncertainty for that kind of configuration
(the largest disagreement measured, `uncertainty.py`) fits. Where the step has been traced under
FakeTensorMode (`plan_memory(trace=True)`), it fits when the larger of estimate and trace does.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import math
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any

from fulltune.memory.estimate import _estimate
from fulltune.memory.evaluation import with_evaluation
from fulltune.memory.process import node_host_bytes
from fulltune.memory.shapes import ModelShape, model_shape
from fulltune import levers as lever_table
from fulltune.memory.types import LEVERS, MemoryEstimate, MemoryPlan, PlanRequest, Settings
from fulltune.memory.uncertainty import Uncertainty, estimate_uncertainty, traced_uncertainty
from fulltune.memory.budget import host_ram, usable_bytes
from fulltune.memory.units import format_bytes
from fulltune.planning.strategy import host_parameter_suggestion, naive_strategy, strategy_choices, strategy_reasons

# --- step-time model --------------------------------------------------------------------------
# Only the ranking of candidates matters, so the constants are round numbers:
# sustained matmul throughput per device and precision (FLOP/s), the number of tokens per
# micro-batch at which a device reaches half its throughput, and memory bandwidth for the
# optimizer's pass over its states.
_FLOPS = {
    ("cuda", "bf16"): 400e12,
    ("cuda", "fp16"): 400e12,
    ("cuda", "no"): 150e12,  # TF32 matmuls
    # CPU: what small-model training steps sustain on one core of the development CPU (its fp32 GEMM
    # peak is ~1.6e11; benchmarks/planner_choice.py: predicted ≈ measured step time, median 0.96×), so
    # the optimizer's bandwidth term below weighs right against compute.
    ("cpu", "no"): 9e10,
    # bf16 on CPUs without bf16 matrix instructions: 3.6× the fp32 step time on the development CPU of the
    # planner-choice benchmark, not the 1.5× the casts alone would cost. With them (AVX512-BF16, AMX:
    # `cpu_bf16_units`), `_CPU_BF16_UNITS_FLOPS`.
    ("cpu", "bf16"): 2.5e10,
    ("cpu", "fp16"): 9e10,  # Accelerate runs fp16 as fp32 on CPU
}
# bf16 on a CPU with AVX512-BF16 (benchmarks/cpu_precision.py, a 6.5M Llama on an AMD EPYC with avx512_bf16:
# bf16 autocast 0.40× and pure bf16 0.67× the fp32 step time): ~0.55× the fp32 step.
_CPU_BF16_UNITS_FLOPS = _FLOPS[("cpu", "no")] / 0.55


def _flops(device: str, precision: str) -> float:
    """Sustained FLOP/s of a training step on `device` computing in `precision` (bf16 on CPU: by the CPU)."""
    if device == "cpu" and precision == "bf16" and cpu_bf16_units():
        return _CPU_BF16_UNITS_FLOPS
    return _FLOPS[(device, precision)]
# Tokens per micro-batch at which throughput is half its peak. CPU throughput is nearly flat in
# micro-batch size (benchmarks/planner_choice.py: micro-batch 1 costs ~1.12× the largest that fits).
_HALF_EFFICIENCY_TOKENS = {"cuda": 1024, "cpu": 16}
# A recomputed layer costs more than its matmul FLOPs (norms, activations, dropout run again):
# measured 6–7% of the step per layer on CPU against 5% from FLOPs alone.
_RECOMPUTE_OVERHEAD = 1.4
_BANDWIDTH = {"cuda": 2.0e12, "cpu": 2.0e10}
# Bytes the optimizer reads and writes per parameter in one step (weights, grads, states).
_OPTIMIZER_TRAFFIC = {"adamw": 32, "adamw_8bit": 20, "adamw_4bit": 18, "adafactor": 20}
# bitsandbytes' 8-bit AdamW on CPU runs a scalar fallback: ~20× fused AdamW's step time, i.e.
# what ~450 bytes per parameter would cost at the CPU bandwidth above.
_CPU_OPTIMIZER_TRAFFIC = {**_OPTIMIZER_TRAFFIC, "adamw_8bit": 450}
# Penalties for choices that cost more than their FLOPs show: 8-bit AdamW ≈5% slower per step
# (torchao optim README: bnb 8-bit 3000 vs fused AdamW 3200 tok/s, Llama2-7B), Adafactor's factored second moment converges slower on fine-tuning tasks.
_OPTIMIZER_PENALTY = {"adamw": 1.0, "adamw_8bit": 1.05, "adamw_4bit": 1.1, "adafactor": 1.12}
# Memory levers (assumptions, to be replaced by measurements on a GPU: benchmarks/device_check.py):
# - host↔device copies run at ~25 GB/s (PCIe 4.0 x16 pinned-memory copies reach 22–26 GB/s);
_PCIE_BYTES_PER_S = 25e9
# - the host optimizer of `offload_optimizer` moves ~1.5 GB/s of its fp32 masters, gradients and states
#   (ZeRO-Offload's CPU Adam is 1–2 GB/s-class per socket without AVX-512 tuning; torch's fused CPU AdamW
#   is in that range too), and bitsandbytes' 8-bit AdamW on a CPU is ~20× slower (its scalar fallback);
_HOST_OPTIMIZER_BYTES_PER_S = 1.5e9
_HOST_OPTIMIZER_SLOWDOWN = {"adamw": 1.0, "adamw_8bit": 20.0, "adamw_4bit": 1.0, "adafactor": 1.0}
# - under FSDP's CPU offload the parameter and gradient copies of one unit overlap the compute of its neighbour
#   (FSDP2 prefetches the next all-gather); assumed: 80% of the compute time hides copies, the rest is exposed;
_OFFLOAD_OVERLAP = 0.8
# - tensor parallel's collectives run inside one machine (parallel.py puts a "tp" group on consecutive ranks):
#   ~150 GB/s of all-gather / reduce-scatter bandwidth per GPU over NVLink (NCCL's bus bandwidth on A100/H100
#   machines is 150-350 GB/s), a few GB/s for gloo between CPU processes, and a fixed cost per collective;
_TP_BYTES_PER_S = {"cuda": 150e9, "cpu": 2e9}
_COLLECTIVE_SECONDS = {"cuda": 20e-6, "cpu": 100e-6}
# - the Kahan-compensated update reads and writes one more bf16 buffer: 4 B/param of extra traffic;
_KAHAN_TRAFFIC = 4
# - the chunked loss recomputes the head's logits in backward: one more head forward per target;
# - a step in backward costs nothing extra on the device (the same update, earlier).


@functools.lru_cache(maxsize=1)
def cpu_bf16_units() -> bool:
    """Whether this machine's CPU has bf16 matrix instructions (AVX512-BF16 or AMX), which oneDNN uses for
    bf16 GEMMs; without them a bf16 step converts every matmul to fp32 and back (benchmarks/cpu_precision.py)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def step_seconds(shape: ModelShape, settings: Settings) -> float:
    """Estimated wall time of one optimizer step (ranking only, not a promise).

    Model FLOPs per token from fulltune/memory/flops.py (rows of one document, the output head at the
    `target_fraction` of positions with a target), plus one more forward of each checkpointed layer
    (a third of that layer's training FLOPs) at `_RECOMPUTE_OVERHEAD`; throughput grows with tokens
    per micro-batch. Under tensor parallel each rank computes 1/T of every matmul and waits for the TP
    group's collectives (`tensor_parallel_seconds`).
    """
    if settings.pipeline_parallel > 1:  # the slowest stage through the fill, the steady state and the drain
        from fulltune.memory.pipeline import pipeline_step_seconds

        one = replace(settings, num_processes=settings.num_processes // settings.pipeline_parallel,
                      pipeline_parallel=1)
        return pipeline_step_seconds(shape, one, settings.pipeline_parallel)[0]
    compute = compute_seconds(shape, settings)
    shard = settings.num_processes if settings.strategy in ("fsdp", "deepspeed_zero2", "deepspeed_zero3") else 1
    traffic = (_CPU_OPTIMIZER_TRAFFIC if settings.device == "cpu" else _OPTIMIZER_TRAFFIC)[settings.optimizer]
    if settings.pure_bf16:  # bf16 weights, gradients and (adamw) states: half the traffic, plus Kahan's buffer
        traffic = traffic / 2 + (_KAHAN_TRAFFIC if settings.optimizer == "adamw" else 0)
    optimizer = shape.num_params / shard * traffic / _BANDWIDTH[settings.device]
    if settings.offload_optimizer:
        optimizer = 0.0
    seconds = (compute + optimizer) * _OPTIMIZER_PENALTY[settings.optimizer] + sum(lever_seconds(shape, settings).values())
    seconds += tensor_parallel_seconds(shape, settings)
    correction = STEP_TIME_CORRECTION.get()
    return seconds * correction(settings) if correction is not None else seconds


def compute_seconds(shape: ModelShape, settings: Settings) -> float:
    """The matmul time of one optimizer step: every micro-batch's forward, backward and recomputed layers."""
    from fulltune.memory.flops import from_shape

    s, b = settings.seq_len, settings.micro_batch_size
    k = min(settings.gradient_checkpointing, shape.num_layers)
    c = from_shape(shape)
    per_token = c.per_token_of_rows(s, settings.target_fraction)
    # The layers' share of the per-token FLOPs (all but the final norm), a third of it per forward.
    per_token += _RECOMPUTE_OVERHEAD * (k / shape.num_layers) * (c.per_token + c.per_pair * s) / 3.0
    tokens = b * s
    efficiency = tokens / (tokens + _HALF_EFFICIENCY_TOKENS[settings.device])
    flops = _flops(settings.device, settings.mixed_precision)
    return settings.gradient_accumulation_steps * tokens * per_token / (flops * efficiency * settings.tensor_parallel)


# Measured corrections of this model for the machine at hand: a factor per kind of step, set by
# fulltune/planning/autotune.py (`calibrated`) from the step times it measured on this kind of device. Unset,
# the constants above stand.
STEP_TIME_CORRECTION: contextvars.ContextVar[Callable[[Settings], float] | None] = contextvars.ContextVar(
    "step_time_correction", default=None)


def tensor_parallel_seconds(shape: ModelShape, settings: Settings) -> float:
    """Step time of tensor parallel's collectives over the TP group (memory/tensor_parallel.py counts them:
    the blocks' all-gathers, reduce-scatters and all-reduces of the stream, the logits' all-gather), not
    overlapped with compute; 0 without tensor parallel."""
    from fulltune.memory.tensor_parallel import collectives

    traffic = collectives(shape, settings)
    return traffic.bytes / _TP_BYTES_PER_S[settings.device] + traffic.count * _COLLECTIVE_SECONDS[settings.device]


def lever_seconds(shape: ModelShape, settings: Settings) -> dict[str, float]:
    """Step time the levers add beyond compute and the device optimizer (assumed constants above)."""
    from fulltune.memory.flops import from_shape

    s, b, ga = settings.seq_len, settings.micro_batch_size, settings.gradient_accumulation_steps
    h, P = shape.hidden, shape.num_params
    out: dict[str, float] = {}
    if settings.chunked_loss:
        flops = _flops(settings.device, "bf16" if settings.pure_bf16 else settings.mixed_precision)
        head_forward = from_shape(shape).per_target / 3.0  # the head's logits once more, per target
        out["chunked_loss"] = ga * b * settings.targets_per_row * head_forward / flops
    if settings.offload_optimizer and settings.strategy == "fsdp":
        terms = fsdp_offload_terms(shape, settings)
        out["offload_optimizer"] = terms["exposed_pcie_s"] + terms["host_step_s"]
    elif settings.offload_optimizer:
        weight = 2 if settings.pure_bf16 else 4
        # Each micro-batch's gradients go to the host; the fp32 masters come back once per step.
        pcie = (ga * weight * P + 4 * P) / _PCIE_BYTES_PER_S
        host = _lever_host_traffic(shape, settings) / _HOST_OPTIMIZER_BYTES_PER_S
        out["offload_optimizer"] = pcie + host * _HOST_OPTIMIZER_SLOWDOWN[settings.optimizer]
    if settings.offload_activations:
        k = min(settings.gradient_checkpointing, shape.num_layers)
        stream = 2 if settings.pure_bf16 else 4
        out["offload_activations"] = ga * 2 * k * stream * b * s * h / _PCIE_BYTES_PER_S
    return out


def fsdp_offload_terms(shape: ModelShape, settings: Settings) -> dict[str, float]:
    """The step-time terms of FSDP2's CPU offload (`offload_optimizer` under fsdp), per rank; over one process
    these are the parameters in host RAM. Each micro-batch copies every unit's parameter shard up for the
    forward's all-gather and again for the backward's (FSDP2 reshards after forward; a checkpointed layer
    recomputes inside that backward unit, so recompute brings no third copy) and its gradient shard down:
    3 × weight bytes × P / n over `_PCIE_BYTES_PER_S`. The copies run on FSDP2's all-gather and reduce-scatter
    streams while the previous unit computes (prefetch), so `_OFFLOAD_OVERLAP` of the compute time hides them;
    the host optimizer step waits for the last gradient and runs alone (`_lever_host_traffic` at
    `_HOST_OPTIMIZER_BYTES_PER_S`). Every constant is an assumption until benchmarks/device_check.py measures it."""
    weight = 2 if settings.pure_bf16 else 4
    pcie = settings.gradient_accumulation_steps * 3 * weight * shape.num_params / settings.num_processes
    pcie_s = pcie / _PCIE_BYTES_PER_S
    compute_s = compute_seconds(shape, settings)
    host = _lever_host_traffic(shape, settings) / _HOST_OPTIMIZER_BYTES_PER_S
    return {"compute_s": compute_s, "pcie_bytes": pcie, "pcie_s": pcie_s,
            "exposed_pcie_s": max(0.0, pcie_s - _OFFLOAD_OVERLAP * compute_s),
            "host_step_s": host * _HOST_OPTIMIZER_SLOWDOWN[settings.optimizer]}


def _lever_host_traffic(shape: ModelShape, settings: Settings) -> float:
    """Bytes the host optimizer reads and writes per step: masters, gradients and states (fulltune.runtime.optim)."""
    from fulltune.memory.lever_bytes import lever_bytes

    levers = lever_bytes(shape, settings)
    if levers.sharded_offload:  # this rank's shards: read and write parameters and states, read gradients
        return 2.0 * (levers.host_masters + levers.host_states) + levers.host_masters
    return 2.0 * (levers.host_masters + levers.host_states) + 4.0 * shape.num_params


# --- search ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    settings: Settings
    estimate: MemoryEstimate
    seconds: float
    uncertainty: Uncertainty
    host_budget: int | None = None  # host RAM the levers may use; None: no limit
    # Several processes: one machine's host RAM (`process.node_host_bytes`); the estimate's host_bytes is then
    # its total.
    host_parts: dict[str, int] | None = None

    @property
    def host_fits(self) -> bool:
        """The levers' host RAM fits `budget.host_memory` (on a CPU device it is inside the device bytes)."""
        if self.host_budget is None or self.settings.device == "cpu":
            return True
        return self.estimate.host_bytes <= self.host_budget

    @property
    def expected_bytes(self) -> int:
        """Device bytes of the larger of estimate and trace (the estimate where not traced)."""
        traced = self.uncertainty.traced_peak_bytes
        if traced is None or traced <= self.estimate.peak_bytes:
            return self.estimate.device_bytes
        # The traced step with the estimate's own overhead; the process's other phases as estimated.
        return max(self.estimate.device_bytes, traced + self.estimate.step_device_bytes - self.estimate.peak_bytes)

    @property
    def planned_bytes(self) -> int:
        """What must fit: expected bytes plus the uncertainty, unless this very step was traced."""
        margin = 0 if self.uncertainty.basis == "trace" else self.uncertainty.bytes
        return self.expected_bytes + margin


def _fits(c: _Candidate, usable: int) -> bool:
    return c.planned_bytes <= usable and c.host_fits


def _per_process(request: PlanRequest) -> int:
    return request.dims.per_process(request.effective_batch_size)


def _device_word(device: str) -> str:
    """What one process's device is called in a plan's reasons: a GPU on cuda, a process on a CPU."""
    return "GPU" if device == "cuda" else "process"


def divisors(n: int) -> list[int]:
    """The divisors of `n`, largest first (micro-batches, tensor-parallel degrees, pipeline micro-batches)."""
    return sorted({d for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)


def _fixed_checkpointing(value: bool | int | None, num_layers: int) -> int | None:
    if value is None:
        return None
    if value is True:
        return num_layers
    if value is False:
        return 0
    return min(int(value), num_layers)


def _default_precision(request: PlanRequest) -> str:
    if request.device == "cuda" and request.bf16_supported:
        return "bf16"
    return "no"


def configured_settings(config: Any, request: PlanRequest) -> Settings:
    """The settings as configured, auto fields at their naive defaults.

    micro-batch: the whole per-process batch in one pass (accumulation 1), or what the fixed
    accumulation leaves; checkpointing off; mixed precision bf16 on a GPU that supports it, else
    fp32; optimizer AdamW; tensor parallel 1.
    """
    return _configured(model_shape(config), _configured_request(request))


def _configured_request(request: PlanRequest) -> PlanRequest:
    """The request with tensor_parallel auto at its naive default, 1 (FSDP alone), and strategy auto at its
    own (`strategy.naive_strategy`), as the other auto fields."""
    request = naive_strategy(request)
    return replace(request, tensor_parallel=1) if request.tensor_parallel is None else request


def _configured(shape: ModelShape, request: PlanRequest) -> Settings:
    per = _per_process(request)
    if request.micro_batch_size is not None:
        micro = request.micro_batch_size
    elif request.gradient_accumulation_steps is not None:
        micro = per // request.gradient_accumulation_steps
    elif request.pipeline_parallel > 1 and per % request.pipeline_parallel == 0:
        micro = per // request.pipeline_parallel  # a micro-batch per stage: the fewest 1F1B runs
    else:
        micro = per
    checkpointing = _fixed_checkpointing(request.gradient_checkpointing, shape.num_layers)
    levers = {name: bool(value) for name, value in request.levers().items()}  # auto levers start off
    if checkpointing is None:
        # Checkpointing starts off, unless offloaded activations (which are checkpointed layers' inputs) are asked for.
        checkpointing = shape.num_layers if levers["offload_activations"] else 0
    return _settings(request, micro, checkpointing, request.mixed_precision or _default_precision(request),
                     request.optimizer or "adamw", levers)


def _settings(request: PlanRequest, micro: int, checkpointing: int, precision: str, optimizer: str,
              levers: dict[str, bool] | None = None) -> Settings:
    """Settings with the planner's choices filled in and everything else as the request fixes it."""
    return Settings(
        micro_batch_size=micro,
        seq_len=request.seq_len,
        gradient_accumulation_steps=_per_process(request) // micro,
        gradient_checkpointing=checkpointing,
        mixed_precision=precision,
        optimizer=optimizer,
        attn_implementation=request.attn_implementation,
        device=request.device,
        strategy=request.strategy,
        num_processes=request.num_processes,
        tensor_parallel=request.tensor_parallel,
        pipeline_parallel=request.pipeline_parallel,
        pipeline_schedule=request.pipeline_schedule,
        attention_mask=request.attention_mask,
        target_fraction=request.target_fraction,
        **(levers or {}),
    )


def _options(shape: ModelShape, request: PlanRequest) -> tuple[list[int], list[str], list[str], int | None]:
    per = _per_process(request)
    if request.micro_batch_size is not None:
        micros = [request.micro_batch_size]
    elif request.gradient_accumulation_steps is not None:
        micros = [per // request.gradient_accumulation_steps]
    else:
        micros = divisors(per)
    if request.mixed_precision is not None:
        precisions = [request.mixed_precision]
    elif request.device == "cuda":
        precisions = ["bf16", "no"] if request.bf16_supported else ["fp16", "no"]
    else:
        precisions = ["no", "bf16"]
    optimizers = [request.optimizer] if request.optimizer is not None else ["adamw", "adamw_8bit", "adafactor"]
    return micros, precisions, optimizers, _fixed_checkpointing(request.gradient_checkpointing, shape.num_layers)


def _lever_sets(request: PlanRequest, stage: int) -> list[dict[str, bool]]:
    """The lever combinations of search stage `stage`: the auto levers among the first `stage` of
    `LEVERS` (cheapest first) on or off, the later auto ones off, the fixed ones as fixed. The lever table
    (fulltune/levers.py) is applied once per choice, with the optimizer, precision and accumulation it goes
    with (`_allowed_choice`); a combination it refuses whatever those are is refused there too."""
    fixed = {name: bool(value) for name, value in request.levers().items()}
    auto = [name for name in LEVERS[:stage] if request.levers()[name] is None and _may_choose(request, name)]
    return [{**fixed, **dict(zip(auto, values))} for values in itertools.product((False, True), repeat=len(auto))]


def _combination(request: PlanRequest) -> lever_table.Combination:
    """The request as the lever table reads it: auto fields still None."""
    return lever_table.from_settings(request, bf16_supported=request.bf16_supported if request.device == "cuda"
                                     else None)


def _may_choose(request: PlanRequest, lever: str) -> bool:
    """Whether turning an auto lever on can save memory for this request (whether the lever table allows it
    is `_allowed_choice`'s)."""
    # On a CPU device host RAM is the device memory: offloading saves nothing and costs copies.
    return not (lever in ("offload_optimizer", "offload_activations") and request.device != "cuda")


def _allowed_choice(request: PlanRequest, micro: int, checkpointing: int | None, precision: str, optimizer: str,
                    levers: dict[str, bool]) -> bool:
    """A choice of the search that the lever table allows (checkpointing None: still to be chosen)."""
    chosen = replace(_combination(request), levers=levers, optimizer=optimizer, mixed_precision=precision,
                     gradient_accumulation_steps=_per_process(request) // micro,
                     gradient_checkpointing=checkpointing)
    return not lever_table.problems(chosen)


def _lever_options(shape: ModelShape, request: PlanRequest, levers: dict[str, bool], micros: list[int],
                   precisions: list[str], optimizers: list[str], fixed_k: int | None, stage: int
                   ) -> tuple[list[int], list[str], list[str]] | None:
    """The micro-batches, precisions and optimizers that go with one lever combination (None: it makes no sense)."""
    if levers["optimizer_in_backward"]:
        # No accumulation across micro-batches: the effective batch is kept by one larger micro-batch.
        micros = [m for m in micros if m == _per_process(request)]
    if levers["pure_bf16"]:
        precisions = ["bf16"] if request.mixed_precision is None else precisions
    if stage > 0 and request.optimizer is None and "adamw_4bit" not in optimizers and _torchao_available():
        optimizers = [*optimizers, "adamw_4bit"]
    return (micros, precisions, optimizers) if micros else None


def _torchao_available() -> bool:
    from fulltune.runtime.optim import torchao_available

    return torchao_available()


def _candidate(shape: ModelShape, settings: Settings, host_budget: int | None = None) -> _Candidate:
    estimate = _estimate(shape, settings)
    uncertainty = estimate_uncertainty(shape, settings, estimate.peak_bytes)
    return _Candidate(settings, estimate, step_seconds(shape, settings), uncertainty, host_budget)


def _planned(shape: ModelShape, settings: Settings) -> int:
    return _candidate(shape, settings).planned_bytes


def _least_checkpointing(shape: ModelShape, base: Settings, usable: int, lowest: int = 0) -> _Candidate:
    """The candidate with the fewest checkpointed layers (>= lowest) that fits, else all layers.

    Memory falls monotonically with each layer checkpointed, so a binary search finds it.
    """
    L = shape.num_layers
    top = _candidate(shape, replace(base, gradient_checkpointing=L))
    if top.planned_bytes > usable:
        # All layers checkpointed has its own (larger) uncertainty: all but one may still fit.
        below = _candidate(shape, replace(base, gradient_checkpointing=L - 1)) if L - 1 >= max(lowest, 1) else top
        return below if below.planned_bytes <= usable else top
    lo, hi = lowest, L
    while lo < hi:
        mid = (lo + hi) // 2
        if _planned(shape, replace(base, gradient_checkpointing=mid)) <= usable:
            hi = mid
        else:
            lo = mid + 1
    return _candidate(shape, replace(base, gradient_checkpointing=lo))


def _search(
    shape: ModelShape,
    request: PlanRequest,
    usable: int,
    micros: list[int] | None = None,
    min_checkpointing: int = 0,
    stage: int = 0,
) -> list[_Candidate]:
    """One candidate per (micro-batch, precision, optimizer, lever combination of `stage`): fewest
    checkpointed layers that fit."""
    default_micros, precisions, optimizers, fixed_k = _options(shape, request)
    micros = default_micros if micros is None else micros
    host_budget = _host_budget(request)
    out = []
    for levers in _lever_sets(request, stage):
        options = _lever_options(shape, request, levers, micros, precisions, optimizers, fixed_k, stage)
        if options is None:
            continue
        for micro in options[0]:
            for precision in options[1]:
                for optimizer in options[2]:
                    if not _allowed_choice(request, micro, fixed_k, precision, optimizer, levers):
                        continue
                    # Offloaded activations are checkpointed layers' inputs: at least one layer is checkpointed.
                    lowest = max(min_checkpointing, 1) if levers["offload_activations"] else min_checkpointing
                    base = _settings(request, micro, fixed_k if fixed_k is not None else lowest, precision,
                                     optimizer, levers)
                    if fixed_k is not None:
                        c = _candidate(shape, base, host_budget)
                    else:
                        c = _least_checkpointing(shape, base, usable, lowest)
                    out.append(_per_machine(shape, c, host_budget, _ranks_per_machine(request)))
    return out


def _ranks_per_machine(request: PlanRequest) -> int:
    return max(request.num_processes // max(request.num_machines, 1), 1)


def _per_machine(shape: ModelShape, c: _Candidate, host_budget: int | None, ranks: int) -> _Candidate:
    """`c` with its host RAM as one machine holds it (`budget.host_memory` is per machine): every rank's
    offloaded tensors and, under FSDP, rank 0's gathered export (`process.node_host_bytes`)."""
    if c.settings.strategy == "none" or c.settings.device == "cpu":
        return replace(c, host_budget=host_budget)
    node = node_host_bytes(shape, c.settings, c.estimate.host_bytes, ranks)
    return replace(c, host_budget=host_budget, estimate=replace(c.estimate, host_bytes=node["total"]),
                   host_parts=node)


def _staged_search(shape: ModelShape, request: PlanRequest, usable: int, micros: list[int] | None = None,
                   min_checkpointing: int = 0) -> list[_Candidate]:
    """Search without the auto levers first (today's choices where they fit), then allow them one more at a
    time, cheapest first (`LEVERS`), until something fits; every candidate seen is returned. With
    `strategy` auto, that search for every strategy `strategy.strategy_choices` offers; with
    `tensor_parallel` auto (None), for every degree `tensor_parallel_degrees` allows."""
    if request.strategy == "auto":
        return [c for strategy in strategy_choices(request)
                for c in _staged_search(shape, replace(request, strategy=strategy), usable, micros,
                                        min_checkpointing)]
    if request.tensor_parallel is None:
        degrees, _ = tensor_parallel_degrees(shape, request)
        return [c for degree in degrees
                for c in _staged_search(shape, replace(request, tensor_parallel=degree), usable, micros,
                                        min_checkpointing)]
    out: list[_Candidate] = []
    for stage in range(len(LEVERS) + 1):
        if stage > 0 and request.levers()[LEVERS[stage - 1]] is not None:
            continue  # a fixed lever opens no new stage
        out.extend(_search(shape, request, usable, micros, min_checkpointing, stage))
        if any(_fits(c, usable) for c in out):
            break
    return out


def tensor_parallel_degrees(shape: ModelShape, request: PlanRequest) -> tuple[list[int], dict[int, str]]:
    """The tensor-parallel degrees `distributed.tensor_parallel: auto` may choose, and why the other divisors
    of the processes may not: a degree splits the blocks of one machine's processes (parallel.py's "tp" groups
    are consecutive ranks), the heads, key/value heads and MLP width and keeps the effective batch over the
    data-parallel processes (`degrees.ParallelDims`), and breaks no rule of the lever table with the fixed
    fields (`levers.from_settings`). 1 is always among them unless the request fixes another degree."""
    if request.tensor_parallel is not None:
        return [request.tensor_parallel], {}
    degrees, refused = [1], {}
    if request.strategy != "fsdp":
        return degrees, refused
    for degree in sorted(divisors(request.num_processes)):
        if degree == 1:
            continue
        if _ranks_per_machine(request) % degree:
            refused[degree] = f"more than one machine's {_ranks_per_machine(request)} processes"
            continue
        if shape.layout != "llama" or shape.qk_norm:
            refused[degree] = f"{shape.model_type}'s blocks are not split (Llama layout only)"
            continue
        split = request.dims.with_tp(degree).split_problem(shape.heads, shape.kv_heads, shape.intermediate,
                                                           shape.num_layers)
        if split:
            refused[degree] = split
            continue
        try:  # the request checks the batch rule and the lever table's rules for the degree
            candidate = replace(request, tensor_parallel=degree)
        except ValueError as exc:
            refused[degree] = str(exc).split(": ", 1)[-1]
            continue
        found = lever_table.problems(_combination(candidate))
        if found:
            refused[degree] = found[0]
            continue
        degrees.append(degree)
    return degrees, refused


def _host_budget(request: PlanRequest) -> int:
    return request.host_memory_bytes if request.host_memory_bytes is not None else host_ram()


def _describe(settings: Settings) -> str:
    parts = [f"micro-batch {settings.micro_batch_size} × accumulation {settings.gradient_accumulation_steps}"]
    if settings.tensor_parallel > 1:
        parts.append(f"tensor parallel {settings.tensor_parallel}")
    parts.append(f"checkpointing {settings.gradient_checkpointing} layers")
    parts.append(f"precision {settings.mixed_precision}")
    parts.append(settings.optimizer)
    parts.extend(name for name, on in settings.levers().items() if on)
    return ", ".join(parts)


def _alternative(c: _Candidate, why: str) -> dict[str, Any]:
    return {
        **c.settings.choices(),
        "tensor_parallel": c.settings.tensor_parallel,
        "peak_bytes": c.estimate.peak_bytes,
        "device_bytes": c.estimate.device_bytes,
        "uncertainty_bytes": c.uncertainty.bytes,
        "estimated_step_seconds": round(c.seconds, 6),
        "rejected_because": why,
    }


def plan_memory(config: Any, request: PlanRequest, trace: bool | None = False) -> MemoryPlan:
    """Plan the settings of a run so that one training step fits `request.budget_bytes`.

    With no budget, the configured settings run as they are (fits=True). Otherwise every
    combination of the auto fields is estimated; the fastest one whose `device_bytes` plus the
    estimate's uncertainty for its kind of configuration (`uncertainty.py`) fits in budget ×
    (1 − headroom) wins. When none fits, `fits` is False, `settings` is the candidate with the
    smallest footprint and `suggestions` say what would fit (more memory, more GPUs with
    FSDP/ZeRO-3, a shorter max_length).

    `trace=True` also traces the chosen step under FakeTensorMode (`simulate_memory`; one process
    only) and plans for the larger of estimate and trace; when the trace does not fit, the next
    candidate is traced (at most `MAX_TRACES`). `trace=None` traces when that is cheap
    (`trace_is_cheap`). The plan's `uncertainty` says which basis it rests on.
    """
    shape = model_shape(config)
    configured = _configured(shape, _configured_request(request))
    configured_estimate = _estimate(shape, configured)
    if request.budget_bytes is None:
        return with_evaluation(shape, request, _host_budget(request), MemoryPlan(
            device=request.device,
            budget_bytes=None,
            fits=True,
            configured_estimate=configured_estimate,
            settings=configured,
            plan_estimate=configured_estimate,
            reasons=(
                "no memory budget given: running the configured settings "
                f"(estimated peak {format_bytes(configured_estimate.peak_bytes)})",
            ),
            smallest_peak_bytes=configured_estimate.peak_bytes,
            estimated_step_seconds=step_seconds(shape, configured),
            uncertainty=_candidate(shape, configured).uncertainty.to_dict(),
            expected_bytes=configured_estimate.device_bytes,
        ))
    usable = request.usable_bytes
    candidates = _staged_search(shape, request, usable)
    reasons: tuple[str, ...] = ()
    if trace or (trace is None and trace_is_cheap(shape, request)):
        candidates, reasons = _traced(config, shape, candidates, usable)
    return with_evaluation(shape, request, _host_budget(request),
                           _finish(shape, request, usable, configured, configured_estimate, candidates, reasons))


# --- tracing the chosen step ------------------------------------------------------------------


def _widened(c: _Candidate, seen: Uncertainty) -> _Candidate:
    """An untraced candidate's uncertainty, at least what a trace of this model just showed."""
    if c.uncertainty.basis == "trace" or seen.fraction <= c.uncertainty.fraction:
        return c
    evidence = f"a trace of this model read {seen.fraction:.2%} off its estimate"
    return replace(c, uncertainty=replace(c.uncertainty, bytes=int(seen.fraction * c.estimate.peak_bytes),
                                          fraction=seen.fraction, basis="measured", evidence=evidence))

MAX_TRACES = 3
# A FakeTensor trace costs about this much per decoder layer and forward/backward pass on one core of
# the development CPU (the short schedule runs 2 passes, 3 with accumulation: trace.py).
TRACE_SECONDS_PER_LAYER_PASS = 0.35
# `trace=None` (auto) traces when that costs less than this.
CHEAP_TRACE_SECONDS = 10.0


def trace_is_cheap(shape: ModelShape, request: PlanRequest) -> bool:
    """Whether tracing a step of this model costs under `CHEAP_TRACE_SECONDS` (one process only)."""
    if request.strategy not in ("none", "auto") or request.num_processes != 1:
        return False
    return shape.num_layers * 3 * TRACE_SECONDS_PER_LAYER_PASS <= CHEAP_TRACE_SECONDS


def _traced(config: Any, shape: ModelShape, candidates: list[_Candidate], usable: int
            ) -> tuple[list[_Candidate], tuple[str, ...]]:
    """Trace the fastest fitting candidate; while the larger of estimate and trace does not fit, the next."""
    from fulltune.planning.trace import simulate_memory

    candidates = list(candidates)
    reasons = []
    for _ in range(MAX_TRACES):
        fitting = sorted((c for c in candidates if _fits(c, usable)),
                         key=lambda c: (c.seconds, c.settings.gradient_checkpointing, -c.settings.micro_batch_size))
        if not fitting or fitting[0].uncertainty.basis == "trace":
            break
        chosen = fitting[0]
        if chosen.settings.strategy != "none" or chosen.settings.num_processes != 1:
            reasons.append("not traced: the trace runs one process; the estimate's measured uncertainty applies")
            break
        traced_peak = simulate_memory(config, chosen.settings).peak_bytes
        uncertainty = traced_uncertainty(shape, chosen.settings, chosen.estimate.peak_bytes, traced_peak)
        traced = replace(chosen, uncertainty=uncertainty)
        candidates = [traced if c is chosen else _widened(c, uncertainty) for c in candidates]
        reasons.append(
            f"traced {_describe(chosen.settings)}: peak {format_bytes(traced_peak)} against the estimate's "
            f"{format_bytes(chosen.estimate.peak_bytes)}; planning for the larger"
            + ("" if _fits(traced, usable) else f" ({format_bytes(traced.planned_bytes)}: does not fit)")
        )
    return candidates, tuple(reasons)


def _finish(
    shape: ModelShape,
    request: PlanRequest,
    usable: int,
    configured: Settings,
    configured_estimate: MemoryEstimate,
    candidates: list[_Candidate],
    extra_reasons: tuple[str, ...] = (),
) -> MemoryPlan:
    budget = request.budget_bytes
    assert budget is not None
    fitting = sorted(
        (c for c in candidates if _fits(c, usable)),
        key=lambda c: (c.seconds, c.settings.gradient_checkpointing, -c.settings.micro_batch_size),
    )
    smallest = min(candidates, key=lambda c: (not c.host_fits, c.planned_bytes, c.seconds))
    fits = bool(fitting)
    chosen = fitting[0] if fits else smallest
    reasons = [
        f"budget {format_bytes(budget)} per {request.device} device; planning for {format_bytes(usable)} "
        f"({request.headroom:.0%} headroom)",
        *((request.host_memory_assumed,) if request.host_memory_assumed else ()),
        *extra_reasons,
    ]
    over = configured_estimate.device_bytes - usable
    if over <= 0:
        reasons.append(
            f"the configured settings fit: {format_bytes(configured_estimate.device_bytes)} "
            f"(peak in {configured_estimate.peak_phase})"
        )
    else:
        reasons.append(
            f"the configured settings ({_describe(configured)}) need {format_bytes(configured_estimate.device_bytes)}, "
            f"{format_bytes(over)} over budget (peak in {configured_estimate.peak_phase})"
        )
    reasons.extend(_change_reasons(shape, configured, chosen, usable))
    reasons.extend(strategy_reasons(shape, request, candidates, chosen, usable))
    reasons.extend(_tensor_parallel_reasons(shape, replace(request, strategy=chosen.settings.strategy), candidates,
                                            chosen, usable))
    reasons.extend(_host_reasons(request, candidates, chosen, usable))
    suggestions: tuple[str, ...] = ()
    if not fits:
        reasons.append(
            f"nothing fits: the smallest configuration ({_describe(chosen.settings)}) needs "
            f"{format_bytes(chosen.expected_bytes)} ± {format_bytes(chosen.uncertainty.bytes)}, "
            f"{format_bytes(chosen.planned_bytes - usable)} over budget with that uncertainty"
        )
        suggestions = _suggestions(shape, request, chosen)
    alternatives = []
    for c in fitting[1:]:
        if len(alternatives) >= 4:
            break
        alternatives.append(_alternative(c, f"slower: {c.seconds:.3g} s/step vs {chosen.seconds:.3g} s/step"))
    over_budget = sorted(
        (c for c in candidates if not _fits(c, usable) and c is not chosen),
        key=lambda c: c.seconds,
    )
    for c in over_budget[:3]:
        alternatives.append(
            _alternative(c, f"does not fit: {format_bytes(c.expected_bytes)} ± {format_bytes(c.uncertainty.bytes)} > "
                            f"{format_bytes(usable)} usable")
        )
    from fulltune.memory.pipeline import needs_advice, pipeline_advice  # pipeline.py imports this module

    pipeline = pipeline_advice(shape, request, chosen.settings, usable, chosen.seconds, fits) \
        if needs_advice(fits, chosen.settings) else None
    return MemoryPlan(
        device=request.device,
        budget_bytes=budget,
        fits=fits,
        configured_estimate=configured_estimate,
        settings=chosen.settings,
        plan_estimate=chosen.estimate,
        alternatives=alternatives,
        reasons=tuple(reasons),
        smallest_peak_bytes=smallest.estimate.peak_bytes,
        suggestions=suggestions,
        usable_bytes=usable,
        estimated_step_seconds=chosen.seconds,
        uncertainty=chosen.uncertainty.to_dict(),
        expected_bytes=chosen.expected_bytes,
        pipeline_parallel=pipeline,
    )


def _change_reasons(shape: ModelShape, configured: Settings, chosen: _Candidate, usable: int) -> list[str]:
    out = []
    s = chosen.settings
    if s == configured:
        return out
    if s.micro_batch_size != configured.micro_batch_size:
        out.append(
            f"micro-batch {configured.micro_batch_size} → {s.micro_batch_size} with gradient accumulation "
            f"{configured.gradient_accumulation_steps} → {s.gradient_accumulation_steps}: the effective batch "
            f"stays {s.micro_batch_size * s.gradient_accumulation_steps * s.dims.dp}"
        )
    if s.mixed_precision != configured.mixed_precision:
        out.append(f"mixed precision {configured.mixed_precision} → {s.mixed_precision}")
    if s.optimizer != configured.optimizer:
        before = _estimate(shape, replace(s, optimizer=configured.optimizer)).breakdown["optimizer_states"]
        after = chosen.estimate.breakdown["optimizer_states"]
        out.append(
            f"optimizer {configured.optimizer} → {s.optimizer}: optimizer states "
            f"{format_bytes(before)} → {format_bytes(after)}"
        )
    out.extend(_lever_reasons(shape, configured, chosen))
    if s.gradient_checkpointing and s.gradient_checkpointing != configured.gradient_checkpointing:
        k = configured.gradient_checkpointing
        # Without checkpointed layers there are no layer inputs to offload either.
        without = _estimate(shape, replace(s, gradient_checkpointing=k, offload_activations=s.offload_activations and k > 0))
        excess = without.device_bytes - usable
        tail = (
            f"{format_bytes(excess)} over budget without it"
            if excess > 0
            else f"{format_bytes(without.device_bytes)} without it"
        )
        out.append(f"gradient checkpointing on {s.gradient_checkpointing} of {shape.num_layers} layers: {tail}")
    return out


def best_by(candidates: list[_Candidate], key: Any, usable: int) -> dict[Any, _Candidate]:
    """Each `key(candidate)`'s best candidate: the fastest that fits, else the smallest."""
    def rank(c: _Candidate) -> tuple[bool, float]:
        fits = _fits(c, usable)
        return not fits, c.seconds if fits else c.planned_bytes

    best: dict[Any, _Candidate] = {}
    for c in candidates:
        if key(c) not in best or rank(c) < rank(best[key(c)]):
            best[key(c)] = c
    return best


def _tensor_parallel_reasons(shape: ModelShape, request: PlanRequest, candidates: list[_Candidate],
                             chosen: _Candidate, usable: int) -> list[str]:
    """With `tensor_parallel` auto: the degree chosen, what it costs, and each other degree's best candidate
    (the fastest that fits, else the smallest) or why it was not tried."""
    if request.tensor_parallel is not None:
        return []
    from fulltune.memory.tensor_parallel import collectives

    best = best_by(candidates, lambda c: c.settings.tensor_parallel, usable)
    s = chosen.settings
    T = s.tensor_parallel
    if T > 1:
        traffic = collectives(shape, s)
        head = (f"tensor parallel {T} ({s.dims.dp} data-parallel × {T}, distributed.tensor_parallel auto): "
                f"{format_bytes(chosen.expected_bytes)} per {_device_word(s.device)}, {chosen.seconds:.3g} s/step, "
                f"of which "
                f"{tensor_parallel_seconds(shape, s):.3g} s are its collectives ({format_bytes(int(traffic.bytes))} "
                f"per rank)")
    elif request.strategy != "fsdp":
        head = (f"tensor parallel 1 (distributed.tensor_parallel auto): tensor parallel runs under strategy fsdp, "
                f"this pipeline's is {request.strategy}")
    else:
        head = "tensor parallel 1 (distributed.tensor_parallel auto): FSDP alone"
    others = []
    for degree, c in sorted(best.items()):
        if degree == T:
            continue
        if _fits(c, usable):
            others.append(f"{degree} is slower ({c.seconds:.3g} s/step)")
        else:
            others.append(f"{degree} does not fit ({format_bytes(c.expected_bytes)} ± {format_bytes(c.uncertainty.bytes)})")
    _, refused = tensor_parallel_degrees(shape, request)
    others += [f"{degree} not tried ({why})" for degree, why in sorted(refused.items())]
    return [head + ("; " + "; ".join(others) if others else "")]


_LEVER_TEXT = {
    "chunked_loss": "chunked loss (no whole targets × vocabulary logits)",
    "pure_bf16": "pure bf16 weights and gradients (no fp32 master; compensated updates)",
    "optimizer_in_backward": "optimizer step in backward (one parameter's gradient at a time; each gradient "
                             "clipped on its own)",
    "offload_activations": "checkpointed layer inputs in host RAM",
    "offload_optimizer": "fp32 masters, gradients and optimizer states in host RAM, updated on the host",
}


_FSDP_OFFLOAD_TEXT = ("FSDP's CPU offload (every rank's parameter, gradient and optimizer-state shards in host RAM, "
                      "stepped there; only the gathered unit on the GPU)")


def _pure_bf16_text(settings: Settings) -> str:
    """What pure bf16 means for the chosen optimizer: whether small updates survive the rounding."""
    from fulltune.runtime.optim import default_compensation

    if settings.offload_optimizer and settings.strategy != "fsdp":
        return "pure bf16 weights and gradients on the device; the fp32 masters on the host keep small updates"
    compensation = default_compensation(settings.optimizer)
    if compensation == "none":
        return (f"pure bf16 weights and gradients; {settings.optimizer} offers no compensated update, so updates "
                "below 1/256 of a weight are rounded away (as in torchtune's pure-bf16 recipes); set "
                "train.pure_bf16: false to keep fp32 weights")
    return f"pure bf16 weights and gradients (no fp32 master; {compensation.replace('_', ' ')} keeps small updates)"


def lever_trade(shape: ModelShape, settings: Settings) -> dict[str, dict[str, float]]:
    """For each lever on in `settings`: the device bytes it saves and the step time it adds, against the
    same settings with that lever alone off (what `fulltune plan` explains)."""
    out = {}
    on = _estimate(shape, settings)
    seconds = step_seconds(shape, settings)
    for name, value in settings.levers().items():
        if not value:
            continue
        off = replace(settings, **{name: False})
        out[name] = {"saved_bytes": _estimate(shape, off).device_bytes - on.device_bytes,
                     "seconds": seconds - step_seconds(shape, off)}
    return out


def _lever_reasons(shape: ModelShape, configured: Settings, chosen: _Candidate) -> list[str]:
    out = []
    trade = lever_trade(shape, chosen.settings)
    for name, t in trade.items():
        if getattr(configured, name):
            continue
        cost = f"+{t['seconds']:.3g} s/step" if t["seconds"] >= 0.0005 else "no measurable step time"
        text = _pure_bf16_text(chosen.settings) if name == "pure_bf16" else _LEVER_TEXT[name]
        if name == "offload_optimizer" and chosen.settings.strategy == "fsdp":
            text = _FSDP_OFFLOAD_TEXT
        out.append(f"{name}: {text}: saves {format_bytes(t['saved_bytes'])} of device memory, {cost}")
    parts = chosen.host_parts
    if parts is not None and chosen.estimate.host_bytes:
        budget = f" of {format_bytes(chosen.host_budget)} budget.host_memory" if chosen.host_budget else ""
        s = chosen.settings
        what = []
        if parts["shards"]:
            what.append(f"{format_bytes(parts['shards'])} of offloaded shards over its ranks "
                        f"({format_bytes(parts['pinned'])} of them pinned)")
        if parts["export"]:
            what.append(f"the final export streams file by file: {format_bytes(parts['export'])} of gathered tensors")
        offload = " under FSDP's CPU offload (the step on the host)" if s.offload_optimizer else ""
        out.append(f"host RAM per machine: {format_bytes(chosen.estimate.host_bytes)}{budget}{offload}: "
                   + "; ".join(what))
    elif chosen.estimate.host_bytes and chosen.settings.device == "cuda":
        budget = f" of {format_bytes(chosen.host_budget)} budget.host_memory" if chosen.host_budget else ""
        out.append(f"host RAM: {format_bytes(chosen.estimate.host_bytes)}{budget} (offloaded "
                   f"{'optimizer states and masters' if chosen.settings.offload_optimizer else 'tensors'})")
    return out


def _host_reasons(request: PlanRequest, candidates: list[_Candidate], chosen: _Candidate, usable: int) -> list[str]:
    """Why offloading was not chosen when the host RAM budget refused it."""
    refused = [c for c in candidates if c.planned_bytes <= usable and not c.host_fits]
    if not refused or (chosen.seconds <= min(c.seconds for c in refused) and _fits(chosen, usable)):
        return []
    best = min(refused, key=lambda c: c.estimate.host_bytes)
    return [f"offloading would fit the device ({_describe(best.settings)}) but needs "
            f"{format_bytes(best.estimate.host_bytes)} of host RAM, over budget.host_memory "
            f"({format_bytes(best.host_budget or 0)}): refused"]


def _suggestions(shape: ModelShape, request: PlanRequest, smallest: _Candidate) -> tuple[str, ...]:
    out = []
    need = smallest.planned_bytes / (1.0 - request.headroom)
    # Every constraint the configuration needs: host RAM too, when it is over budget.host_memory.
    host = "" if smallest.host_fits else (
        f" and budget.host_memory of {format_bytes(smallest.estimate.host_bytes)} per machine (it is "
        f"{format_bytes(smallest.host_budget or 0)})")
    out.append(
        f"a budget of {format_bytes(need)} per device{host} would fit {_describe(smallest.settings)} "
        f"(peak {format_bytes(smallest.estimate.peak_bytes)})"
    )
    one_gpu = host_parameter_suggestion(shape, request)
    if one_gpu:
        out.append(one_gpu)
    if request.strategy in ("none", "ddp", "deepspeed_zero2"):
        # Shard over the processes already there first, then over more GPUs.
        counts = sorted({n for n in (2, 4, 8, 16, 32, 64) if n >= request.num_processes} | {request.num_processes})
        for n in counts:
            if n < 2 or request.effective_batch_size % n:
                continue
            sharded = replace(request, strategy="fsdp", num_processes=n, micro_batch_size=None,
                              gradient_accumulation_steps=None, optimizer_in_backward=None, offload_optimizer=None)
            usable = request.usable_bytes or 0
            candidates = [c for c in _staged_search(shape, sharded, usable) if _fits(c, usable)]
            if candidates:
                best = min(candidates, key=lambda c: c.seconds)
                out.append(
                    f"{n} {_device_word(request.device)}s with FSDP full shard (distributed.strategy: fsdp, "
                    f"num_processes: {n}) would fit: {format_bytes(best.estimate.device_bytes)} per "
                    f"{_device_word(request.device)}"
                )
                break
    usable = request.usable_bytes or 0
    seq = request.seq_len
    while seq > 64:
        seq //= 2
        shorter = replace(request, seq_len=seq)
        candidates = [c for c in _staged_search(shape, shorter, usable) if _fits(c, usable)]
        if candidates:
            out.append(f"data.max_length {seq} (instead of {request.seq_len}) would fit on this budget")
            break
    return tuple(out)


def replan_after_oom(
    config: Any, request: PlanRequest, previous: Settings, observed_peak_bytes: int | None
) -> MemoryPlan:
    """A new plan after `previous` ran out of memory: same effective batch, smaller footprint.

    The overshoot (observed peak over the estimate, or 15% when unknown) tightens the budget;
    the micro-batch shrinks to the largest divisor below the previous one that fits (more
    accumulation); at micro-batch 1, more layers are checkpointed. Fields the user fixed other
    than micro-batch/accumulation stay fixed; those two must change after an OOM.
    """
    shape = model_shape(config)
    if request.tensor_parallel is None:  # auto: the degree the run was planned with stays (its processes are set)
        request = replace(request, tensor_parallel=previous.tensor_parallel)
    if request.strategy == "auto":  # and so does the strategy the run was planned with
        request = replace(request, strategy=previous.strategy)
    previous_estimate = _estimate(shape, previous)
    if observed_peak_bytes is not None and observed_peak_bytes > 0:
        ratio = max(observed_peak_bytes / max(previous_estimate.device_bytes, 1), 1.05)
    else:
        ratio = 1.15
    budget = request.budget_bytes or previous_estimate.device_bytes
    tightened = max(int(budget / ratio), 1)
    relaxed = replace(request, budget_bytes=tightened, micro_batch_size=None, gradient_accumulation_steps=None)
    usable = usable_bytes(tightened, request.headroom)
    per = _per_process(request)
    smaller = [m for m in divisors(per) if m < previous.micro_batch_size]
    reason = (
        f"out of memory with {_describe(previous)}: the estimate was {format_bytes(previous_estimate.device_bytes)}"
        + (f", observed {format_bytes(observed_peak_bytes)}" if observed_peak_bytes else "")
        + f"; planning for {format_bytes(tightened)} (budget ÷ {ratio:.2f})"
    )
    if smaller:
        candidates = _staged_search(shape, relaxed, usable, micros=smaller)
    else:
        fixed = replace(relaxed, gradient_checkpointing=None) if request.gradient_checkpointing is None else relaxed
        floor = min(previous.gradient_checkpointing + max(1, shape.num_layers // 4), shape.num_layers)
        candidates = _staged_search(shape, fixed, usable, micros=[1], min_checkpointing=floor)
        if request.gradient_checkpointing is not None:
            forced = replace(previous, gradient_checkpointing=floor)
            candidates.append(_candidate(shape, forced))
    configured = _configured(shape, request)
    plan = _finish(shape, relaxed, usable, configured, _estimate(shape, configured), candidates, (reason,))
    return replace(plan, budget_bytes=request.budget_bytes)
