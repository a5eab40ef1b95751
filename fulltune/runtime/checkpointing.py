"""Gradient checkpointing on the first k decoder layers of a transformers model, and the memory levers that
change the model after it (`apply_model_levers`: the trainer and the memory trace build the same model).

The planner turns on only as many layers as the budget needs (each checkpointed layer costs one
extra forward of that layer in backward, ~1/3 of its compute); this applies its choice.
"""

from __future__ import annotations

import importlib
from typing import Any

from fulltune import levers
from fulltune.memory.errors import MemoryConfigError


def apply_model_levers(model: Any, settings: Any) -> int:
    """Checkpoint the first `settings.gradient_checkpointing` layers, then apply each memory lever on in
    `settings` (a `fulltune.memory.Settings`) that changes the model, in the lever table's order: its record's
    `apply` (fulltune/levers.py). Returns the number of layers checkpointed.

    Raises:
        MemoryConfigError: as `apply_gradient_checkpointing`.
    """
    checkpointed = apply_gradient_checkpointing(model, settings.gradient_checkpointing)
    for lever in levers.TABLE:
        if lever.apply is not None and getattr(settings, lever.name):
            module, function = lever.apply.split(":")
            getattr(importlib.import_module(module), function)(model, settings)
    return checkpointed


def decoder_layers(model: Any) -> list[Any]:
    """The repeated decoder blocks of a causal LM, in forward order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if layers:
        return layers
    # Models whose blocks do not derive from GradientCheckpointingLayer: the first ModuleList.
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            return list(module)
    raise MemoryConfigError(f"{type(model).__name__}: no decoder layers found to checkpoint")


def apply_gradient_checkpointing(model: Any, num_layers: int | bool) -> int:
    """Recompute the activations of the first `num_layers` decoder layers in backward.

    Uses transformers' own mechanism (`activation_checkpointing_enable` with non-reentrant
    `torch.utils.checkpoint`, which also makes the embedding output require grad) and then turns
    it off again on the layers after the first `num_layers`. `True` means all layers, `False`
    or 0 none. Returns the number of layers checkpointed.

    Raises:
        MemoryConfigError: `num_layers` is negative, or the model supports no gradient checkpointing.
    """
    layers = decoder_layers(model)
    if num_layers is True:
        k = len(layers)
    elif num_layers is False:
        k = 0
    else:
        k = int(num_layers)
    if k < 0:
        raise MemoryConfigError(f"gradient_checkpointing must be >= 0 layers; got {num_layers}")
    k = min(k, len(layers))
    if k == 0:
        return 0
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise MemoryConfigError(f"{type(model).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < k
    # HF's caching is incompatible with checkpointing; training never uses the cache.
    if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return k
