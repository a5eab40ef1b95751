"""Optimizer bytes: what each optimizer's states and temporaries take, and the host RAM its levers need.

Pure arithmetic over parameter shapes (no torch): the memory model counts with it, and the optimizers of
fulltune/runtime/optim.py allocate exactly this (tests/test_levers.py checks each against what it allocates),
so the estimate, the memory trace and the trainer cannot disagree.
"""

from __future__ import annotations

import math
from typing import Iterable

from fulltune.levers import default_compensation

OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit", "adafactor")

# bitsandbytes: tensors under 4096 elements keep fp32 states; blocks of 256 with one fp32 absmax each,
# and one 256-entry fp32 quantisation map per state kind.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
# torchao low-bit AdamW: tensors of at least 4096 elements whose size divides by the block are quantised
# (codes + one fp32 scale per block + a fp32 map per state tensor); the others keep states in the weight dtype.
TORCHAO_MIN_LOWBIT_SIZE = 4096
TORCHAO_BLOCKSIZE = {8: 256, 4: 128}
TORCHAO_QMAP_ENTRIES = {8: 256, 4: 16}


def weight_bytes(pure_bf16: bool) -> int:
    """Bytes per parameter element of the device weights (and of their gradients)."""
    return 2 if pure_bf16 else 4


def optimizer_state_bytes(name: str, shapes: Iterable[tuple[int, ...]], param_bytes: int = 4,
                          compensation: str = "none") -> tuple[int, int]:
    """(persistent state bytes, temporary bytes during `step`) of optimizer `name` over parameter `shapes`.

    `param_bytes` is the dtype size of the parameters the optimizer updates (2 for pure bf16 weights,
    4 for fp32 weights or offloaded fp32 masters): torch AdamW, torch-optimi and torchao's small-tensor
    states follow it; bitsandbytes' small-tensor states are always fp32.
    """
    shapes = list(shapes)
    if name == "adamw":
        # exp_avg + exp_avg_sq in the weight dtype and a fp32 step per tensor (torch fused) or per group
        # (torch-optimi); Kahan adds one weight-sized compensation buffer. Both update in place.
        kahan = param_bytes if compensation == "kahan" else 0
        return sum((2 * param_bytes + kahan) * _n(sh) + 4 for sh in shapes), 0
    if name == "adamw_8bit":
        state = 0
        for sh in shapes:
            n = _n(sh)
            state += 8 * n if n < BNB_MIN_8BIT_SIZE else 2 * n + 2 * 4 * -(-n // BNB_BLOCKSIZE)
        # The CPU/CUDA kernels update block by block in place; no full-size temporaries.
        return state + 2 * BNB_BLOCKSIZE * 4, 0
    if name == "adamw_4bit":
        return _torchao_state_bytes(4, shapes, param_bytes), 0
    if name == "adafactor":
        return _adafactor_bytes(shapes)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")


def _torchao_state_bytes(bits: int, shapes: list[tuple[int, ...]], param_bytes: int) -> int:
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


def _adafactor_bytes(shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    # transformers Adafactor without beta1: factored second moment (row and column means) for matrices,
    # a full second moment for vectors, an RMS scalar and a step per parameter. Its step builds
    # `grad**2 + eps`, the approximated update and `-update` (full-size fp32) for one parameter at a
    # time: two live at once for the largest tensor.
    state, largest = 0, 0
    for sh in shapes:
        n = _n(sh)
        state += 4 * (_n(sh[:-1]) + _n(sh[:-2] + sh[-1:])) if len(sh) >= 2 else 4 * n
        state += 4
        largest = max(largest, n)
    return state, 2 * 4 * largest


def device_gradient_bytes(shapes: Iterable[tuple[int, ...]], pure_bf16: bool = False,
                          optimizer_in_backward: bool = False, offload_optimizer: bool = False) -> int:
    """Gradient bytes alive on the device at the optimizer step (the peak's gradient term).

    All gradients normally; with `optimizer_in_backward` or `offload_optimizer` one parameter's at a time
    (the largest).
    """
    sizes = [_n(sh) for sh in shapes]
    per = weight_bytes(pure_bf16)
    if optimizer_in_backward or offload_optimizer:
        return per * max(sizes, default=0)
    return per * sum(sizes)


def device_state_bytes(name: str, shapes: Iterable[tuple[int, ...]], pure_bf16: bool = False,
                       offload_optimizer: bool = False, compensation: str | None = None) -> tuple[int, int]:
    """(persistent, temporary) optimizer-state bytes on the device: none when offloaded."""
    if offload_optimizer:
        return 0, 0
    if compensation is None:
        compensation = default_compensation(name) if pure_bf16 else "none"
    return optimizer_state_bytes(name, shapes, weight_bytes(pure_bf16), compensation)


def host_bytes(name: str, shapes: Iterable[tuple[int, ...]], pure_bf16: bool = False,
               optimizer_in_backward: bool = False, offload_optimizer: bool = False,
               gradient_accumulation_steps: int = 1) -> int:
    """Host RAM the levers need beyond the process itself (pinned where CUDA is present).

    offload_optimizer: fp32 master weights + fp32 gradients + the optimizer's states over fp32 weights.
    optimizer_in_backward with accumulation > 1: one gradient buffer in the weight dtype.
    """
    shapes = list(shapes)
    numel = sum(_n(sh) for sh in shapes)
    if offload_optimizer:
        states, temporary = optimizer_state_bytes(name, shapes, 4, "none")
        return 8 * numel + states + temporary
    if optimizer_in_backward and gradient_accumulation_steps > 1:
        return weight_bytes(pure_bf16) * numel
    return 0


def _n(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
