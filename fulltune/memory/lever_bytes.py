"""Bytes the memory levers decide: weight dtype, optimizer states and their temporaries, host RAM.

The counts are the optimizers' own (fulltune/memory/optimizer_bytes.py: `device_state_bytes`,
`optimizer_state_bytes`, `host_bytes`, which fulltune/runtime/optim.py allocates), so the estimate and the
optimizer that allocates the states cannot disagree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fulltune.memory import optimizer_bytes as optim
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings
from fulltune.optimizers import compensation_of


@dataclass(frozen=True)
class LeverBytes:
    """Per-step byte counts the levers decide, as fulltune/runtime/optim.py counts them."""

    weight_bytes: int  # per parameter element of the device weights and gradients
    states: int  # optimizer states on the device (whole model, unsharded)
    states_temp: int  # the optimizer's temporaries during its update (on the device)
    host_masters: int  # fp32 master weights in host RAM (offload)
    host_states: int  # optimizer states in host RAM (offload)
    host_temp: int  # the host optimizer's temporaries
    host_buffer: int  # step in backward with accumulation: the host gradient sums
    # FSDP's CPU offload (`sharded_offload`): the host holds this process's shards in the weight dtype
    # (they are the parameters, not fp32 masters beside bf16 device weights), and the counts above are
    # this process's share; the single-process offload keeps fp32 sums of the gradients.
    sharded_offload: bool = False

    def host_parts(self, grads: int, offloaded: int) -> dict[str, int]:
        """Host RAM the levers hold in a phase whose gradients (without the hooks) are `grads` bytes and
        whose offloaded activations are `offloaded` bytes."""
        if self.sharded_offload:
            host_grads = grads  # the sharded gradients, reduce-scattered and copied to pinned host RAM
        else:
            host_grads = grads * 4 // self.weight_bytes if self.host_masters else 0  # fp32 sums on the host
        return {"parameters": self.host_masters, "gradients": host_grads + self.host_buffer,
                "optimizer_states": self.host_states, "activations": offloaded}

    @property
    def pinned(self) -> int:
        """Of the host RAM above, what FSDP's CPU offload pins (parameter and gradient shards), without the
        gradients (counted per phase): page-locked, not swappable, not shared with other processes."""
        return self.host_masters if self.sharded_offload else 0


def lever_bytes(shape: ModelShape, settings: Settings) -> LeverBytes:
    """The lever byte counts of `settings` on `shape` (cached: the planner asks for many settings)."""
    sharded = settings.offload_optimizer and settings.dims.fsdp_enabled
    return _lever_bytes_cached(shape, settings.optimizer, settings.pure_bf16, settings.optimizer_in_backward,
                               settings.offload_optimizer, settings.gradient_accumulation_steps,
                               settings.num_processes if sharded else 0, compensation_of(settings))


def sharded_offload_bytes(shape: ModelShape, optimizer: str, pure_bf16: bool, num_processes: int,
                          compensation: str | None = None) -> LeverBytes:
    """FSDP's CPU offload (fulltune/runtime/sharding.py, `CPUOffloadPolicy`): nothing of the optimizer on the device;
    one process's shards of the parameters (weight dtype: fp32, bf16 under pure bf16) in pinned host RAM, and
    the optimizer's states and temporaries over them, as the plain optimizer (compensated under pure bf16)
    allocates them there. The gradients' shards are counted per phase (`host_parts`)."""
    wb = optim.weight_bytes(pure_bf16)
    states, temp = optim.device_state_bytes(optimizer, shape.optimizer_shapes, pure_bf16=pure_bf16,
                                            compensation=compensation)
    n = num_processes
    return LeverBytes(wb, 0, 0, wb * shape.num_params // n, states // n, temp // n, 0, sharded_offload=True)


@functools.lru_cache(maxsize=256)
def _lever_bytes_cached(shape: ModelShape, optimizer: str, pure_bf16: bool, in_backward: bool, offload: bool,
                        accumulation: int, sharded_processes: int = 0, compensation: str | None = None) -> LeverBytes:
    if offload and sharded_processes:
        return sharded_offload_bytes(shape, optimizer, pure_bf16, sharded_processes, compensation)
    shapes = shape.optimizer_shapes
    states, temp = optim.device_state_bytes(optimizer, shapes, pure_bf16=pure_bf16, offload_optimizer=offload,
                                            compensation=compensation)
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
