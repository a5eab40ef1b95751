"""The optimizers `train.optimizer` names: one record each (`OptimizerRecord`), read by the spec (its choices),
the lever table (what refuses an optimizer), the memory model (its state bytes), the step-time model (its traffic,
penalty and host speed), the planner (which ones `optimizer: auto` may choose) and the trainer (fulltune/runtime/
optim.py builds each from its name: `BUILDERS` there).

Pure arithmetic, no torch: the state bytes are what fulltune/runtime/optim.py's optimizers allocate, counted per
parameter tensor (tests/test_levers.py checks each against what it allocates), so the estimate, the memory trace
and the trainer cannot disagree.

    name         builder (fulltune/runtime/optim.py)                               states per parameter element
    adamw        torch AdamW, fused kernel (CPU and CUDA)                         2 × weight bytes (8 B fp32)
    adamw_8bit   bitsandbytes AdamW8bit, block-wise 8-bit states (256 / block)    ~2 B
    adamw_4bit   torchao AdamW4bit, block-wise 4-bit states (128 / block)         ~1 B
    adafactor    transformers Adafactor, factored second moment, no first moment  ~0 B for matrices
    muon         torch Muon on the decoder layers' 2-D matrices (AdamW on the rest)  1 × weight bytes for them

An optimizer sees the parameters as `ParamShapes`: the decoder layers' 2-D matrices apart from the rest
(embeddings, output head, norms, biases), which only Muon tells apart.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Callable, Iterable

Shapes = Iterable[tuple[int, ...]]


@dataclass(frozen=True)
class ParamShapes:
    """A model's parameter shapes as its optimizer sees them: `matrices`, the 2-D weights of the decoder layers
    (what Muon orthogonalises), and `others` (embeddings, output head, norms, biases)."""

    matrices: tuple[tuple[int, ...], ...] = ()
    others: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, shapes: ParamShapes | Shapes) -> ParamShapes:
        """`shapes` as ParamShapes: a plain list of shapes has no decoder-layer matrices told apart."""
        return shapes if isinstance(shapes, ParamShapes) else cls(others=tuple(tuple(sh) for sh in shapes))

    @property
    def all(self) -> tuple[tuple[int, ...], ...]:
        return self.others + self.matrices

# bitsandbytes: tensors under 4096 elements keep fp32 states; blocks of 256 with one fp32 absmax each,
# and one 256-entry fp32 quantisation map per state kind.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
# torchao low-bit AdamW: tensors of at least 4096 elements whose size divides by the block are quantised
# (codes + one fp32 scale per block + a fp32 map per state tensor); the others keep states in the weight dtype.
TORCHAO_MIN_LOWBIT_SIZE = 4096
TORCHAO_BLOCKSIZE = {8: 256, 4: 128}
TORCHAO_QMAP_ENTRIES = {8: 256, 4: 16}


def _n(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _adamw_bytes(params: ParamShapes, param_bytes: int, compensation: str) -> tuple[int, int]:
    # exp_avg + exp_avg_sq in the weight dtype and a fp32 step per tensor (torch fused) or per group
    # (torch-optimi); Kahan adds one weight-sized compensation buffer. Both update in place.
    kahan = param_bytes if compensation == "kahan" else 0
    return sum((2 * param_bytes + kahan) * _n(sh) + 4 for sh in params.all), 0


def _bnb_8bit_bytes(params: ParamShapes, param_bytes: int, compensation: str) -> tuple[int, int]:
    if compensation == "stochastic":  # torchao's AdamW8bit, which rounds stochastically, in place of bitsandbytes
        return torchao_state_bytes(8, params.all, param_bytes), 0
    state = 0
    for sh in params.all:
        n = _n(sh)
        state += 8 * n if n < BNB_MIN_8BIT_SIZE else 2 * n + 2 * 4 * -(-n // BNB_BLOCKSIZE)
    # The CPU/CUDA kernels update block by block in place; no full-size temporaries.
    return state + 2 * BNB_BLOCKSIZE * 4, 0


def torchao_state_bytes(bits: int, shapes: Shapes, param_bytes: int) -> int:
    """torchao's low-bit AdamW states (exp_avg, exp_avg_sq and a fp32 step per tensor) over `shapes`."""
    block = TORCHAO_BLOCKSIZE[bits]
    state = 0
    for sh in shapes:
        n = _n(sh)
        if n >= TORCHAO_MIN_LOWBIT_SIZE and n % block == 0:
            per_state = n * bits // 8 + 4 * (n // block) + 4 * TORCHAO_QMAP_ENTRIES[bits]
        else:
            per_state = param_bytes * n
        state += 2 * per_state + 4  # exp_avg, exp_avg_sq and a fp32 step
    return state


def _adafactor_bytes(params: ParamShapes, param_bytes: int, compensation: str) -> tuple[int, int]:
    # transformers Adafactor without beta1: factored second moment (row and column means) for matrices,
    # a full second moment for vectors, an RMS scalar and a step per parameter. Its step builds
    # `grad**2 + eps`, the approximated update and `-update` (full-size fp32) for one parameter at a
    # time: two live at once for the largest tensor.
    state, largest = 0, 0
    for sh in params.all:
        n = _n(sh)
        state += 4 * (_n(sh[:-1]) + _n(sh[:-2] + sh[-1:])) if len(sh) >= 2 else 4 * n
        state += 4
        largest = max(largest, n)
    return state, 2 * 4 * largest


def _adafactor_sharded_step(params: ParamShapes, param_bytes: int) -> int:
    """On FSDP2 shards (`GatheredOptimizer`): the largest parameter's whole weight and gradient, gathered,
    beside its step's temporaries."""
    largest = max((_n(sh) for sh in params.all), default=0)
    return 2 * param_bytes * largest + _adafactor_bytes(params, param_bytes, "none")[1]


def _newton_schulz_temp(shape: tuple[int, ...], param_bytes: int) -> int:
    """torch Muon's temporaries while it updates one (A, B) matrix, n = A·B, m = min(A, B): the Nesterov update
    in the weight dtype and two bf16 (m, M) iterates, or the bf16 copy and two iterates over fp32 weights (4n
    either way, measured under MemTracker on CPU: torch 2.13), and the (m, m) Gram matrix and its polynomial."""
    n, m = _n(shape), min(shape)
    return param_bytes * n + 4 * n + 4 * m * m


def _muon_bytes(params: ParamShapes, param_bytes: int, compensation: str) -> tuple[int, int]:
    # torch Muon keeps one momentum buffer per matrix in the weight dtype (no step count); AdamW (torch, fused)
    # the rest. Muon's step: the largest matrix's temporaries, one matrix at a time; AdamW's are none.
    momentum = sum(param_bytes * _n(sh) for sh in params.matrices)
    rest, _ = _adamw_bytes(ParamShapes(others=params.others), param_bytes, "none")
    return momentum + rest, max((_newton_schulz_temp(sh, param_bytes) for sh in params.matrices), default=0)


def _muon_sharded_step(params: ParamShapes, param_bytes: int) -> int:
    """On FSDP2 shards: one matrix at a time gathered (`GatheredOptimizer`: its weight, gradient and momentum
    whole) beside its step's temporaries; AdamW steps its shards in place."""
    return max((3 * param_bytes * _n(sh) + _newton_schulz_temp(sh, param_bytes) for sh in params.matrices),
               default=0)


def _newton_schulz_flops(params: ParamShapes) -> float:
    """Muon's orthogonalisation per step: 5 Newton–Schulz iterations on each (m, M) matrix (m = min(A, B), n = A·B),
    each X·Xᵀ (2·m·n), its polynomial (2·m³) and that times X (2·m·n), in bf16."""
    return float(sum(5 * (4 * min(sh) * _n(sh) + 2 * min(sh) ** 3) for sh in params.matrices))


@dataclass(frozen=True)
class OptimizerRecord:
    """One optimizer `train.optimizer` may name.

    `state_bytes(params, param_bytes, compensation)`: (persistent state bytes, temporary bytes during its step)
    over parameters of `params` (`ParamShapes`) whose dtype takes `param_bytes` (2 under pure bf16, 4 for fp32
    weights or host masters). `sharded_step_bytes(params, param_bytes)`: its step's temporaries on FSDP2 shards
    (None: it steps each shard in place, with none). `step_flops(params)`: matmul FLOPs its step adds (bf16).
    `traffic`: bytes it reads and writes per parameter in one device step (weights, gradients, states;
    `cpu_traffic` on a CPU device where that differs); `penalty`: the factor a step with it is ranked by, for what
    its FLOPs do not show; `host_slowdown`: its host step's time against fused AdamW's at the same bytes
    (`offload_optimizer`; None where `offload_refusal` says why it does not run on the host). `compensations`: the
    updates it offers pure bf16 weights, its default first. `gathered`: it needs whole parameters (rows and
    columns), so on FSDP2 shards it steps one gathered parameter at a time (fulltune/runtime/optim.py
    `GatheredOptimizer`). `matrices`: it steps the decoder layers' 2-D matrices apart from the rest (its builder
    gets them in their own parameter groups). `fsdp_refusal` / `replicated_refusal` / `offload_refusal`: why
    FSDP2's shards, DDP's replicated DTensors beside pipeline stages, or `offload_optimizer` cannot run it (None:
    they can). `requires`: the package it needs and how to install it. `auto`: whether `optimizer: auto` may
    choose it: "always", "levers" (once the planner opens the memory levers) or "never"."""

    name: str
    description: str
    state_bytes: Callable[[ParamShapes, int, str], tuple[int, int]]
    traffic: int
    penalty: float
    host_slowdown: float | None
    compensations: tuple[str, ...] = ("none",)
    cpu_traffic: int | None = None
    gathered: bool = False
    matrices: bool = False
    sharded_step_bytes: Callable[[ParamShapes, int], int] | None = None
    step_flops: Callable[[ParamShapes], float] | None = None
    fsdp_refusal: str | None = None
    replicated_refusal: str | None = None
    offload_refusal: str | None = None
    requires: tuple[str, str] | None = None
    auto: str = "always"

    @property
    def default_compensation(self) -> str:
        """The update pure bf16 weights get with this optimizer unless told otherwise."""
        return self.compensations[0]

    def installed(self) -> bool:
        """Whether the package it needs (if any) is installed on this machine."""
        return self.requires is None or importlib.util.find_spec(self.requires[0]) is not None


# How pure bf16 weights keep updates smaller than their rounding step (`train.compensation`; an optimizer's record
# says which it offers): what each is, and what it costs beyond the optimizer's states (fulltune/runtime/optim.py).
COMPENSATIONS = {
    "kahan": "a bf16 buffer per weight keeps what each update's rounding drops and adds it back (Kahan summation: "
             "+2 B/param)",
    "stochastic": "each update rounds up or down at random in proportion to what it drops, so small updates "
                  "survive on average (no extra state; torchao)",
    "none": "plain rounding: updates below 1/256 of a weight are lost (torchtune's pure-bf16 recipes)",
}
# Stochastic rounding is torchao's (its `bf16_stochastic_round` AdamW variants); torch-optimi has none.
STOCHASTIC_NEEDS = ("torchao", "stochastic rounding needs torchao: pip install 'fulltune[lowbit]'")

# What the 8-bit and 4-bit updates cannot take: DTensor parameters, sharded or replicated.
_NO_DTENSOR_FSDP = ("the 8-bit and 4-bit updates have no sharding rule for FSDP2's DTensor shards (bitsandbytes' "
                    "optimizer_update_32bit refuses them); use adamw or adafactor with fsdp")
_NO_DTENSOR_REPLICATED = ("DDP beside the stages keeps each stage's parameters as replicated DTensors, which the "
                          "8-bit and 4-bit updates have no rule for (bitsandbytes' optimizer_update_32bit refuses "
                          "them); use adamw or adafactor, or set num_processes to pipeline_parallel")

# In the order the spec lists them; `optimizer: auto` tries them in this order.
OPTIMIZER_TABLE: tuple[OptimizerRecord, ...] = (
    OptimizerRecord(
        "adamw", "torch AdamW, fused (8 B/param of states over fp32 weights)",
        state_bytes=_adamw_bytes, traffic=32, penalty=1.0, host_slowdown=1.0,
        # Kahan: torch-optimi's AdamW with `kahan_sum`, pure PyTorch (CPU and CUDA, no compiler), the
        # AnyPrecisionAdamW update torchdistx validated; stochastic rounding: torchao's `_AdamW`.
        compensations=("kahan", "stochastic", "none")),
    OptimizerRecord(
        "adamw_8bit", "bitsandbytes (~2 B/param of states)",
        state_bytes=_bnb_8bit_bytes, traffic=20,
        # ≈5% slower per step (torchao optim README: bnb 8-bit 3000 vs fused AdamW 3200 tok/s, Llama2-7B). On a
        # CPU bitsandbytes runs a scalar fallback: ~20× fused AdamW's step time, what ~450 bytes per parameter
        # would cost at the CPU's bandwidth, and ~20× on the host of `offload_optimizer` alike.
        penalty=1.05, cpu_traffic=450, host_slowdown=20.0,
        compensations=("none", "stochastic"),  # torchao's AdamW8bit rounds stochastically
        fsdp_refusal=_NO_DTENSOR_FSDP, replicated_refusal=_NO_DTENSOR_REPLICATED),
    OptimizerRecord(
        "adamw_4bit", "torchao (~1 B/param)",
        state_bytes=lambda params, param_bytes, compensation: (torchao_state_bytes(4, params.all, param_bytes), 0),
        traffic=18, penalty=1.1, host_slowdown=1.0,
        # Stochastic rounding is its only compensated path; its update is torch.compile'd.
        compensations=("stochastic", "none"),
        fsdp_refusal=_NO_DTENSOR_FSDP, replicated_refusal=_NO_DTENSOR_REPLICATED,
        requires=("torchao", "4-bit optimizer states need torchao: pip install 'fulltune[lowbit]'"), auto="levers"),
    OptimizerRecord(
        "adafactor", "transformers Adafactor, factored second moment and no first moment (~0 B/param for matrices)",
        state_bytes=_adafactor_bytes, traffic=20,
        penalty=1.12,  # its factored second moment converges slower on fine-tuning tasks
        host_slowdown=1.0, gathered=True, sharded_step_bytes=_adafactor_sharded_step),
    OptimizerRecord(
        "muon", "torch Muon for the decoder layers' 2-D matrices, one momentum buffer each (4 B/param over fp32 "
                "weights), and AdamW for the embeddings, output head, norms and biases; never chosen by auto",
        state_bytes=_muon_bytes, matrices=True, sharded_step_bytes=_muon_sharded_step,
        step_flops=_newton_schulz_flops,
        # Its elementwise pass reads the gradient and the momentum and writes the momentum, the update and the
        # weight (~24 B/param in fp32); ranking terms, assumed, like the others'.
        traffic=24, penalty=1.0, host_slowdown=None,
        offload_refusal=("Muon orthogonalises each whole matrix with bf16 matmuls (5 Newton–Schulz iterations), "
                         "which a host CPU runs orders of magnitude slower than the device; keep the optimizer on "
                         "the device (turn offload_optimizer off), or use adamw"),
        # Its effect on models pretrained with AdamW is not settled: `optimizer: auto` keeps to the AdamW family.
        auto="never"),
)
OPTIMIZERS_BY_NAME: dict[str, OptimizerRecord] = {record.name: record for record in OPTIMIZER_TABLE}
OPTIMIZERS = tuple(OPTIMIZERS_BY_NAME)


def optimizer(name: str) -> OptimizerRecord:
    """The record of optimizer `name`.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name not in OPTIMIZERS_BY_NAME:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS_BY_NAME[name]


def compensation_of(settings: object) -> str:
    """The update pure bf16 weights get under planned `settings` (a `fulltune.memory.Settings`): its
    `compensation`, or its optimizer's default where that is `auto`; "none" without pure bf16, or with fp32
    masters on the host (`offload_optimizer` on one process)."""
    s = settings
    if not s.pure_bf16 or (s.offload_optimizer and not s.dims.fsdp_enabled):  # type: ignore[attr-defined]
        return "none"
    chosen = getattr(s, "compensation", "auto")
    return optimizer(s.optimizer).default_compensation if chosen == "auto" else chosen  # type: ignore[attr-defined]
