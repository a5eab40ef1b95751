"""Optimizer bytes under the levers: the gradients on the device, each optimizer's states and temporaries on
the device, and the host RAM its levers need.

Pure arithmetic over parameter shapes (no torch): the memory model counts with it, and fulltune/runtime/optim.py
allocates exactly this. Each optimizer's own counts are its record's (fulltune/optimizers.py `state_bytes`).
"""

from __future__ import annotations

import math
from typing import Iterable

from fulltune.optimizers import ParamShapes, optimizer

Shapes = ParamShapes | Iterable[tuple[int, ...]]  # a plain list: no decoder-layer matrices told apart (ParamShapes)


def weight_bytes(pure_bf16: bool) -> int:
    """Bytes per parameter element of the device weights (and of their gradients)."""
    return 2 if pure_bf16 else 4


def optimizer_state_bytes(name: str, shapes: Shapes, param_bytes: int = 4,
                          compensation: str = "none") -> tuple[int, int]:
    """(persistent state bytes, temporary bytes during `step`) of optimizer `name` over parameter `shapes`.

    `param_bytes` is the dtype size of the parameters the optimizer updates (2 for pure bf16 weights,
    4 for fp32 weights or offloaded fp32 masters): torch AdamW, torch-optimi and torchao's small-tensor
    states follow it; bitsandbytes' small-tensor states are always fp32.

    Raises:
        ValueError: an unknown optimizer.
    """
    return optimizer(name).state_bytes(ParamShapes.of(shapes), param_bytes, compensation)


def device_gradient_bytes(shapes: Shapes, pure_bf16: bool = False,
                          optimizer_in_backward: bool = False, offload_optimizer: bool = False) -> int:
    """Gradient bytes alive on the device at the optimizer step (the peak's gradient term).

    All gradients normally; with `optimizer_in_backward` or `offload_optimizer` one parameter's at a time
    (the largest).
    """
    sizes = [_n(sh) for sh in ParamShapes.of(shapes).all]
    per = weight_bytes(pure_bf16)
    if optimizer_in_backward or offload_optimizer:
        return per * max(sizes, default=0)
    return per * sum(sizes)


def device_state_bytes(name: str, shapes: Shapes, pure_bf16: bool = False,
                       offload_optimizer: bool = False, compensation: str | None = None) -> tuple[int, int]:
    """(persistent, temporary) optimizer-state bytes on the device: none when offloaded."""
    if offload_optimizer:
        return 0, 0
    if compensation is None:
        compensation = optimizer(name).default_compensation if pure_bf16 else "none"
    return optimizer_state_bytes(name, shapes, weight_bytes(pure_bf16), compensation)


def host_bytes(name: str, shapes: Shapes, pure_bf16: bool = False,
               optimizer_in_backward: bool = False, offload_optimizer: bool = False,
               gradient_accumulation_steps: int = 1) -> int:
    """Host RAM the levers need beyond the process itself (pinned where CUDA is present).

    offload_optimizer: fp32 master weights + fp32 gradients + the optimizer's states over fp32 weights.
    optimizer_in_backward with accumulation > 1: one gradient buffer in the weight dtype.
    """
    shapes = ParamShapes.of(shapes)
    numel = sum(_n(sh) for sh in shapes.all)
    if offload_optimizer:
        states, temporary = optimizer_state_bytes(name, shapes, 4, "none")
        return 8 * numel + states + temporary
    if optimizer_in_backward and gradient_accumulation_steps > 1:
        return weight_bytes(pure_bf16) * numel
    return 0


def _n(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
