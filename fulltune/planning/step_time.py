"""The planner's step-time model: the estimated wall time of one optimizer step, which ranks the settings that fit.

Model FLOPs over a sustained throughput per device and precision, the optimizer's pass over its states at memory
bandwidth, and each lever's and each parallelism's added terms (host copies, the host optimizer, tensor parallel's
collectives, pipeline stages' bubble and point-to-point sends). Only the ranking of candidates matters, so the
constants are round numbers; each one not measured is named as the assumption it is. `STEP_TIME_CORRECTION` holds
autotune's measured corrections for the machine at hand.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fulltune import levers
from fulltune.memory import parallelism
from fulltune.memory.pipeline import per_stage
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings
from fulltune.optimizers import OPTIMIZER_TABLE, OPTIMIZERS_BY_NAME, compensation_of

# Only the ranking of candidates matters, so the constants are round numbers:
# sustained matmul throughput per device and precision (FLOP/s), the number of tokens per
# micro-batch at which a device reaches half its throughput, and memory bandwidth for the
# optimizer's pass over its states.
FLOPS = {
    ("cuda", "bf16"): 400e12,
    ("cuda", "fp16"): 400e12,
    ("cuda", "no"): 150e12,  # TF32 matmuls
    # CPU: what small-model training steps sustain on one core of the development CPU (its fp32 GEMM
    # peak is ~1.6e11; benchmarks/planner_choice.py: predicted ≈ measured step time, median 0.96×), so
    # the optimizer's bandwidth term below weighs right against compute.
    ("cpu", "no"): 9e10,
    # bf16 on CPUs without bf16 matrix instructions: 3.6× the fp32 step time on the development CPU of the
    # planner-choice benchmark, not the 1.5× the casts alone would cost. With them (AVX512-BF16, AMX:
    # `cpu_bf16_units`), `CPU_BF16_UNITS_FLOPS`.
    ("cpu", "bf16"): 2.5e10,
    ("cpu", "fp16"): 9e10,  # Accelerate runs fp16 as fp32 on CPU
}
# bf16 on a CPU with AVX512-BF16 (benchmarks/cpu_precision.py, a 6.5M Llama on an AMD EPYC with avx512_bf16:
# bf16 autocast 0.40× and pure bf16 0.67× the fp32 step time): ~0.55× the fp32 step.
CPU_BF16_UNITS_FLOPS = FLOPS[("cpu", "no")] / 0.55


def _flops(device: str, precision: str) -> float:
    """Sustained FLOP/s of a training step on `device` computing in `precision` (bf16 on CPU: by the CPU)."""
    if device == "cpu" and precision == "bf16" and cpu_bf16_units():
        return CPU_BF16_UNITS_FLOPS
    return FLOPS[(device, precision)]
# Tokens per micro-batch at which throughput is half its peak. CPU throughput is nearly flat in
# micro-batch size (benchmarks/planner_choice.py: micro-batch 1 costs ~1.12× the largest that fits).
HALF_EFFICIENCY_TOKENS = {"cuda": 1024, "cpu": 16}
# A recomputed layer costs more than its matmul FLOPs (norms, activations, dropout run again):
# measured 6–7% of the step per layer on CPU against 5% from FLOPs alone.
RECOMPUTE_OVERHEAD = 1.4
BANDWIDTH = {"cuda": 2.0e12, "cpu": 2.0e10}
# Each optimizer's own numbers are its record's (fulltune/optimizers.py): the bytes it reads and writes per
# parameter in one step (weights, grads, states; on a CPU device where that differs), the penalty for what its
# FLOPs do not show, and its host step's speed against fused AdamW's.
OPTIMIZER_TRAFFIC = {r.name: r.traffic for r in OPTIMIZER_TABLE}
CPU_OPTIMIZER_TRAFFIC = {r.name: r.cpu_traffic or r.traffic for r in OPTIMIZER_TABLE}
OPTIMIZER_PENALTY = {r.name: r.penalty for r in OPTIMIZER_TABLE}
# Memory levers (assumptions, to be replaced by measurements on a GPU: benchmarks/device_check.py):
# - host↔device copies run at ~25 GB/s (PCIe 4.0 x16 pinned-memory copies reach 22–26 GB/s);
PCIE_BYTES_PER_S = 25e9
# - the host optimizer of `offload_optimizer` moves ~1.5 GB/s of its fp32 masters, gradients and states
#   (ZeRO-Offload's CPU Adam is 1–2 GB/s-class per socket without AVX-512 tuning; torch's fused CPU AdamW
#   is in that range too), each optimizer at its record's `host_slowdown` of that;
HOST_OPTIMIZER_BYTES_PER_S = 1.5e9
HOST_OPTIMIZER_SLOWDOWN = {r.name: r.host_slowdown for r in OPTIMIZER_TABLE}
# - under FSDP's CPU offload over several processes the parameter and gradient copies of one unit overlap the
#   compute of its neighbour (FSDP2 copies the shards in on its all-gather streams and prefetches the next unit;
#   gradients go out on its reduce-scatter stream); assumed: 80% of the compute time hides copies, the rest is
#   exposed. Over one process (parameters in host RAM on one GPU) FSDP2 skips its all-gather streams (torch 2.13
#   `FSDPParamGroup.unshard` returns at world size 1, and `wait_for_unshard` copies each shard in on the compute
#   stream), so the parameter copies are not hidden at all; the gradient copies still leave on the reduce-scatter
#   stream and overlap as above;
OFFLOAD_OVERLAP = 0.8
# - tensor parallel's collectives run inside one machine (parallel.py puts a "tp" group on consecutive ranks):
#   ~150 GB/s of all-gather / reduce-scatter bandwidth per GPU over NVLink (NCCL's bus bandwidth on A100/H100
#   machines is 150-350 GB/s), a few GB/s for gloo between CPU processes, and a fixed cost per collective;
TP_BYTES_PER_S = {"cuda": 150e9, "cpu": 2e9}
COLLECTIVE_SECONDS = {"cuda": 20e-6, "cpu": 100e-6}
# - the Kahan-compensated update reads and writes one more bf16 buffer: 4 B/param of extra traffic.
# What each lever adds is its record's `cost` (fulltune/levers.py) over these constants (`StepCosts`); a lever's own
# constants are beside its cost where its record names it with `Elsewhere`.
KAHAN_TRAFFIC = 4


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

    Model FLOPs per token from fulltune/memory/flops.py (each token attending to `Settings.attended_length`
    keys: its packed document's, else the row's; the output head at the `target_fraction` of positions with a
    target), plus one more forward of each checkpointed layer
    (a third of that layer's training FLOPs) at `RECOMPUTE_OVERHEAD`; throughput grows with tokens
    per micro-batch. Under tensor parallel each rank computes 1/T of every matmul and waits for the TP
    group's collectives (`kind_seconds`).
    """
    if parallelism.rank_kind(settings) is parallelism.PIPELINE:  # the slowest stage through the fill, the steady
        return pipeline_step_seconds(shape, per_stage(settings), settings.pipeline_parallel)[0]  # state, the drain
    compute = compute_seconds(shape, settings)
    shard = parallelism.optimizer_shards(settings)
    record = OPTIMIZERS_BY_NAME[settings.optimizer]
    traffic = (CPU_OPTIMIZER_TRAFFIC if settings.device == "cpu" else OPTIMIZER_TRAFFIC)[settings.optimizer]
    if settings.pure_bf16:  # bf16 weights, gradients and (adamw) states: half the traffic, plus Kahan's buffer
        traffic = traffic / 2 + (KAHAN_TRAFFIC if compensation_of(settings) == "kahan" else 0)
    optimizer = shape.num_params / shard * traffic / BANDWIDTH[settings.device]
    if record.step_flops is not None:  # matmuls of its own (Muon's orthogonalisation), whole on every rank
        optimizer += record.step_flops(shape.optimizer_shapes) / _flops(settings.device, "bf16")
    if settings.offload_optimizer:
        optimizer = 0.0
    seconds = (compute + optimizer) * OPTIMIZER_PENALTY[settings.optimizer] + sum(lever_seconds(shape, settings).values())
    for traffic in parallelism.traffic(shape, settings):
        seconds += traffic_seconds(traffic, settings.device)
    correction = STEP_TIME_CORRECTION.get()
    return seconds * correction(settings) if correction is not None else seconds


def compute_seconds(shape: ModelShape, settings: Settings) -> float:
    """The matmul time of one optimizer step: every micro-batch's forward, backward and recomputed layers."""
    from fulltune.memory.flops import from_shape

    s, b = settings.seq_len, settings.micro_batch_size
    k = min(settings.gradient_checkpointing, shape.num_layers)
    c = from_shape(shape)
    # Each query attends to its document (packed rows' documents attend alone) or to the whole row.
    attended = settings.attended_length
    per_token = c.per_token_of_rows(attended, settings.target_fraction)
    # The layers' share of the per-token FLOPs (all but the final norm), a third of it per forward.
    per_token += RECOMPUTE_OVERHEAD * (k / shape.num_layers) * (c.per_token + c.per_pair * attended) / 3.0
    tokens = b * s
    dims = settings.dims
    # Context parallel: each rank computes its s/cp positions of every row (the zigzag balances attention's pairs).
    local = tokens / dims.cp
    efficiency = local / (local + HALF_EFFICIENCY_TOKENS[settings.device])
    flops = _flops(settings.device, settings.mixed_precision)
    return settings.gradient_accumulation_steps * tokens * per_token / (flops * efficiency * dims.tp * dims.cp)


# Measured corrections of this model for the machine at hand: a factor per kind of step, set by
# fulltune/planning/autotune.py (`calibrated`) from the step times it measured on this kind of device. Unset,
# the constants above stand.
STEP_TIME_CORRECTION: contextvars.ContextVar[Callable[[Settings], float] | None] = contextvars.ContextVar(
    "step_time_correction", default=None)


def traffic_seconds(traffic: parallelism.Traffic, device: str) -> float:
    """Step time of a kind's collectives (`parallelism.Traffic`) over its link, not overlapped with compute: its
    bytes at the link's bandwidth (`LINK_BYTES_PER_S`) and a fixed cost per collective."""
    return traffic.bytes / LINK_BYTES_PER_S[traffic.link][device] + traffic.count * COLLECTIVE_SECONDS[device]


def kind_seconds(shape: ModelShape, settings: Settings, kind: parallelism.Parallelism) -> float:
    """Step time of one kind's collectives over its group (`Parallelism.traffic`: tensor parallel's all-gathers,
    reduce-scatters and all-reduces of the stream, context parallel's all-to-alls or ring sends) at its link's
    assumed bandwidth, not overlapped with compute; 0 where the settings do not run it."""
    return sum(traffic_seconds(t, settings.device) for t in parallelism.traffic(shape, settings)
               if t.link == kind.name)


def lever_seconds(shape: ModelShape, settings: Settings) -> dict[str, float]:
    """Step time each lever on adds beyond compute and the device optimizer: its record's `cost`
    (fulltune/levers.py) over this model's terms; a lever whose record says it adds none is left out."""
    step = StepCosts(shape, settings)
    return {lever.name: lever.cost(settings, step) for lever in levers.TABLE
            if getattr(settings, lever.name) and not isinstance(lever.cost, levers.NoAddedTime)}


@dataclass(frozen=True)
class StepCosts:
    """What a lever's cost (fulltune/levers.py `Lever.cost`) reads of this model: the step's throughputs, link
    speeds and sizes, with the constants above."""

    shape: ModelShape
    settings: Settings

    @property
    def num_params(self) -> int:
        return self.shape.num_params

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def hidden(self) -> int:
        return self.shape.hidden

    @property
    def pcie_bytes_per_s(self) -> float:
        return PCIE_BYTES_PER_S

    @property
    def head_forward(self) -> float:
        """FLOPs of the output head's forward for one target position."""
        from fulltune.memory.flops import from_shape

        return from_shape(self.shape).per_target / 3.0

    def flops(self, precision: str) -> float:
        """Sustained FLOP/s of this device computing in `precision`."""
        return _flops(self.settings.device, precision)

    def fsdp_offload(self) -> dict[str, float]:
        """FSDP2's CPU offload, term by term (`fsdp_offload_terms`)."""
        return fsdp_offload_terms(self.shape, self.settings)

    def host_optimizer_seconds(self) -> float:
        """The host optimizer's pass over the masters, gradients and states, at its optimizer's host speed."""
        host = _lever_host_traffic(self.shape, self.settings) / HOST_OPTIMIZER_BYTES_PER_S
        return host * HOST_OPTIMIZER_SLOWDOWN[self.settings.optimizer]


def fsdp_offload_terms(shape: ModelShape, settings: Settings) -> dict[str, float]:
    """The step-time terms of FSDP2's CPU offload (`offload_optimizer` under fsdp), per rank; over one process
    these are the parameters in host RAM. Each micro-batch copies every unit's parameter shard in for the
    forward's all-gather and again for the backward's (FSDP2 reshards after forward; a checkpointed layer
    recomputes inside that backward unit, so recompute brings no third copy) and its gradient shard out:
    2 + 1 × weight bytes × P / n over `PCIE_BYTES_PER_S` (`params_in_s`, `grads_out_s`). Over several processes
    both run on FSDP2's side streams while the neighbouring unit computes, so `OFFLOAD_OVERLAP` of the compute
    time hides them; over one process the parameter copies run on the compute stream (see `OFFLOAD_OVERLAP`) and
    only the gradient copies can hide. The host optimizer step waits for the last gradient and runs alone
    (`_lever_host_traffic` at `HOST_OPTIMIZER_BYTES_PER_S`). Every constant is an assumption until
    benchmarks/device_check.py measures it."""
    weight = 2 if settings.pure_bf16 else 4
    per_copy = settings.gradient_accumulation_steps * weight * shape.num_params / settings.num_processes
    params_in_s, grads_out_s = 2 * per_copy / PCIE_BYTES_PER_S, per_copy / PCIE_BYTES_PER_S
    compute_s = compute_seconds(shape, settings)
    hidden = OFFLOAD_OVERLAP * compute_s
    if settings.num_processes == 1:  # the parameters come in on the compute stream
        exposed = params_in_s + max(0.0, grads_out_s - hidden)
    else:
        exposed = max(0.0, params_in_s + grads_out_s - hidden)
    host = _lever_host_traffic(shape, settings) / HOST_OPTIMIZER_BYTES_PER_S
    return {"compute_s": compute_s, "pcie_bytes": 3 * per_copy, "pcie_s": params_in_s + grads_out_s,
            "params_in_s": params_in_s, "grads_out_s": grads_out_s, "exposed_pcie_s": exposed,
            "host_step_s": host * HOST_OPTIMIZER_SLOWDOWN[settings.optimizer]}


def _lever_host_traffic(shape: ModelShape, settings: Settings) -> float:
    """Bytes the host optimizer reads and writes per step: masters, gradients and states (fulltune.runtime.optim)."""
    from fulltune.memory.lever_bytes import lever_bytes

    levers = lever_bytes(shape, settings)
    if levers.sharded_offload:  # this rank's shards: read and write parameters and states, read gradients
        return 2.0 * (levers.host_masters + levers.host_states) + levers.host_masters
    return 2.0 * (levers.host_masters + levers.host_states) + 4.0 * shape.num_params


# Point-to-point bandwidth between neighbouring pipeline stages (bytes/s). Assumptions, like the other link
# constants: GPUs without NVLink, or on two machines, move ~25 GB/s (PCIe 4.0 x16, a 200 Gb/s NIC); gloo
# between two CPU processes of one machine copies through loopback TCP.
P2P_BYTES_PER_S = {"cuda": 25e9, "cpu": 2e9}
# Each kind's link (`parallelism.Traffic.link`) and its bandwidth per device.
# Context parallel's all-to-alls (Ulysses) or ring sends run inside one machine, as tensor parallel's collectives
# do: the same assumed bandwidth (NVLink; gloo between CPU processes), not overlapped with compute.
CP_BYTES_PER_S = TP_BYTES_PER_S
LINK_BYTES_PER_S = {parallelism.TENSOR_PARALLEL.name: TP_BYTES_PER_S, parallelism.PIPELINE.name: P2P_BYTES_PER_S,
                    parallelism.CONTEXT_PARALLEL.name: CP_BYTES_PER_S}


def pipeline_step_seconds(shape: ModelShape, settings: Settings, num_stages: int) -> tuple[float, float]:
    """(seconds of one pipelined optimizer step, of which point-to-point sends).

    `settings` is the step as one process would run it (fulltune/memory/pipeline.py). Each stage's
    `step_seconds` on its own layers (and head, `pipeline.stage_shape`), at one and two micro-batches: the
    difference is its per-micro-batch time, the rest its optimizer pass. The step is M + P − 1 slots of the
    slowest stage's micro-batch (the fill and drain of the pipeline, GPipe and 1F1B alike) plus the slowest
    stage's optimizer pass; each slot also sends one (b, s, h) activation forward and one gradient back
    (`P2P_BYTES_PER_S`).
    """
    from fulltune.memory.pipeline import stage_settings, stage_shape

    M, P = settings.gradient_accumulation_steps, num_stages
    per_micro_batch, optimizer = [], []
    for s in range(P):
        sub, ss = stage_shape(shape, P, s), stage_settings(settings, P, s, shape.num_layers)
        one = step_seconds(sub, replace(ss, gradient_accumulation_steps=1))
        two = step_seconds(sub, replace(ss, gradient_accumulation_steps=2))
        per_micro_batch.append(two - one)
        optimizer.append(max(one - (two - one), 0.0))
    sends = parallelism.PIPELINE.slot_traffic(shape, settings)
    send = (sends.bytes / LINK_BYTES_PER_S[sends.link][settings.device]) if P > 1 else 0.0
    slots = M + P - 1
    return slots * (max(per_micro_batch) + send) + max(optimizer), slots * send


def host_step(shape: ModelShape, settings: Settings) -> dict[str, Any]:
    """A step with the parameters in host RAM, term by term (`fsdp_offload_terms`, the other levers' seconds):
    `seconds` as the planner ranks it (the optimizer's penalty included, `step_seconds` without a measured
    correction), `wall_s` without that penalty, the `tokens_per_s` it predicts, the `assumed` constants and the
    `measured_correction` autotune set, if any."""
    s = settings
    t = fsdp_offload_terms(shape, s)
    penalty = OPTIMIZER_PENALTY[s.optimizer]
    levers = {name: v for name, v in lever_seconds(shape, s).items() if name != "offload_optimizer"}
    wall = t["compute_s"] + t["exposed_pcie_s"] + t["host_step_s"] + sum(levers.values())
    tokens = s.micro_batch_size * s.gradient_accumulation_steps * s.seq_len * s.num_processes
    correction = STEP_TIME_CORRECTION.get()
    assumed = {"flops": FLOPS[("cuda", s.mixed_precision)], "pcie_bytes_per_s": PCIE_BYTES_PER_S,
               "offload_overlap": OFFLOAD_OVERLAP, "host_optimizer_bytes_per_s": HOST_OPTIMIZER_BYTES_PER_S}
    return {**t, "penalty": penalty, "levers": levers, "seconds": wall + t["compute_s"] * (penalty - 1),
            "wall_s": wall, "tokens_per_s": tokens / wall, "assumed": assumed,
            "measured_correction": correction(s) if correction is not None else None}
