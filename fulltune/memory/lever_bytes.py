"""Bytes the memory levers decide: weight dtype, optimizer states and their temporaries, host RAM.

The counts are fulltune/optim.py's own (`device_state_bytes`, `optimizer_state_bytes`, `host_bytes`), so the
estimate and the optimizer that allocates the states cannot disagree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings


@dataclass(frozen=True)
class LeverBytes:
    """Per-step byte counts the levers decide, as fulltune/optim.py counts them."""

    weight_bytes: int  # per parameter element of the device weights and gradients
    states: int  # optimizer states on the device (whole model, unsharded)
    states_temp: int  # the optimizer's temporaries during its update (on the device)
    host_masters: int  # fp32 master weights in host RAM (offload)
    host_states: int  # optimizer states in host RAM (offload)
    host_temp: int  # the host optimizer's temporaries
    host_buffer: int  # step in backward with accumulation: the host gradient sums

    def host_parts(self, grads: int, offloaded: int) -> dict[str, int]:
        """Host RAM the levers hold in a phase whose gradients (without the hooks) are `grads` bytes and
        whose offloaded activations are `offloaded` bytes."""
        host_grads = grads * 4 // self.weight_bytes if self.host_masters else 0  # fp32 sums on the host
        return {"parameters": self.host_masters, "gradients": host_grads + self.host_buffer,
                "optimizer_states": self.host_states, "activations": offloaded}


def lever_bytes(shape: ModelShape, settings: Settings) -> LeverBytes:
    """The lever byte counts of `settings` on `shape` (cached: the planner asks for many settings)."""
    return _lever_bytes_cached(shape, settings.optimizer, settings.pure_bf16, settings.optimizer_in_backward,
                               settings.offload_optimizer, settings.gradient_accumulation_steps)


@functools.lru_cache(maxsize=256)
def _lever_bytes_cached(shape: ModelShape, optimizer: str, pure_bf16: bool, in_backward: bool, offload: bool,
                        accumulation: int) -> LeverBytes:
    # fulltune.optim imports torch: imported here so that importing the memory model does not.
    from fulltune import optim

    shapes = shape.param_shapes
    states, temp = optim.device_state_bytes(optimizer, shapes, pure_bf16=pure_bf16, offload_optimizer=offload)
    host_masters = host_states = host_temp = host_buffer = 0
    if offload:
        host_states, host_temp = optim.optimizer_state_bytes(optimizer, shapes, 4, "none")
        host_masters = 4 * shape.num_params
        # optim.host_bytes = masters + gradients + states + temporaries (the gradients are counted per phase).
        assert optim.host_bytes(optimizer, shapes, pure_bf16, in_backward, offload, accumulation) == (
            host_masters + 4 * shape.num_params + host_states + host_temp)
    elif in_backward:
        host_buffer = optim.host_bytes(optimizer, shapes, pure_bf16, in_backward, offload, accumulation)
    return LeverBytes(optim.weight_bytes(pure_bf16), states, temp, host_masters, host_states, host_temp,
                      host_buffer)
