"""Checkpointed activations in host RAM: the inputs a checkpointed layer keeps for its recompute.

A checkpointed decoder layer (fulltune/runtime/checkpointing.py) keeps only its inputs for backward (the
hidden states and the rotary tables, ~b·s·h in the compute dtype); with L layers checkpointed that is
what remains of the activations. `ActivationOffload.install(model)` runs each checkpointed layer's
checkpoint call under saved-tensor hooks that copy those inputs to host memory (pinned when CUDA is
present, so the copies overlap compute) and bring them back when backward recomputes the layer:
`torch.autograd.graph.save_on_cpu`'s pack/unpack, plus a byte count that tests and benchmarks read.

The hooks wrap only the checkpoint call: the tensors the layer saves inside the checkpoint are the
checkpoint's own (recomputed, never stored), and the non-checkpointed layers keep their activations on
the device. Device memory saved = host memory used = the checkpointed inputs of the wrapped layers.
The cost is one device→host and one host→device copy of them per micro-batch (torchtune measures ~0%
step time on GPU for Llama-3.2 3B). On a CPU device the copies are pure cost: the planner should not
choose it there.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep saved tensors in host memory and count the bytes they moved."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.bytes_offloaded = 0  # since the last `reset`: the host memory one micro-batch's inputs take
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, torch.nn.Parameter):  # a weight is on the device anyway
            return tensor
        packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=self.pin_memory)
        packed.copy_(tensor)
        self.bytes_offloaded += packed.nbytes
        return tensor.device, packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, tensor = packed
        return tensor.to(device, non_blocking=self.pin_memory)

    def reset(self) -> None:
        self.bytes_offloaded = 0

    def install(self, model: torch.nn.Module) -> int:
        """Offload the saved inputs of every checkpointed decoder layer of `model` (apply gradient
        checkpointing first); returns the number of layers wrapped.

        transformers runs a checkpointed layer's forward through the layer's `_gradient_checkpointing_func`
        (torch.utils.checkpoint); the hooks are pushed around that call.
        """
        from fulltune.runtime.checkpointing import decoder_layers

        wrapped = 0
        for layer in decoder_layers(model):
            inner = getattr(layer, "_gradient_checkpointing_func", None)
            if not getattr(layer, "gradient_checkpointing", False) or inner is None:
                continue
            layer._gradient_checkpointing_func = functools.partial(self._call, inner)
            wrapped += 1
        return wrapped

    def _call(self, checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        with self:
            return checkpoint(*args, **kwargs)


def offload_checkpointed_inputs(model: torch.nn.Module, settings: Any) -> None:
    """`train.offload_activations` (fulltune/levers.py): the checkpointed layers' saved inputs wait in host RAM."""
    ActivationOffload().install(model)
