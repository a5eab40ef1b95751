"""Analytic peak memory of one training step, as fulltune's trainer runs it.

The trainer (fulltune/runtime/train.py) runs, per optimizer step and per process:

    for each of gradient_accumulation_steps micro-batches:
        # lm_head runs on the t positions that have a target (fulltune/runtime/loss.py): a forward
        # pre-hook gathers its input (b, s, h) → (t, h); t ≤ b·(s-1)
        logits = model(input_ids, position_ids, attention_mask).logits.float()   # (t, V)
        loss = cross_entropy(logits, targets, reduction="sum") / tokens  # logits freed on return
        accelerator.backward(loss)
    accelerator.clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad(set_to_none=True)

The model walks that step as a timeline of allocations and frees and reports its maximum. Where each
part is counted:

| what | where |
|---|---|
| activations of a decoder layer and of the whole model | `fulltune/memory/activations.py` |
| the output head's logits and the loss (whole or chunked) | `fulltune/memory/head.py` |
| bytes the levers decide (weight dtype, optimizer states, host RAM) | `fulltune/memory/lever_bytes.py` |
| sharded shares, DDP buckets, FSDP2's units (gathers, reduce-scatters, its head) | `fulltune/memory/fsdp.py` |
| the shared per-step numbers and the phase records | `fulltune/memory/timeline.py` |
| the one walk of the step, driven by each layout's description | `fulltune/memory/walk.py` |
| gradients into `.grad` (one process, DDP, a pipeline stage): the replicated layout | `fulltune/memory/replicated.py` |
| what a process holds beyond its tensors (CUDA context, allocator slack, a CPU process) | `fulltune/memory/overhead.py` |
| the whole process: loading, first step, checkpoint, export, evaluation | `fulltune/memory/process.py` |

Every byte count comes from the tensors autograd saves in the transformers 5 implementations (checked
with `saved_tensors_hooks` and MemTracker on CPU). What holds across the parts:

- Weights stay fp32 (4 B/param) under mixed precision; autocast makes a 16-bit copy of every
  linear weight the first time the forward uses it and the backward keeps it until that layer's
  gradient is computed (+2 B per matmul parameter from the forward until the layer's backward).
- Gradients are fp32 like the weights. With `zero_grad(set_to_none=True)` and no accumulation
  they appear layer by layer during backward; with accumulation they exist for the whole step.
- A checkpointed layer keeps only its input and rebuilds its activations during its backward.
- Keeping a reference to the logits through backward would add 4·t·V bytes at the peak; the
  trainer drops it (measured with Accelerate on CPU: +17.8% for a 3k vocabulary otherwise).
- The gather's backward scatters the head input's gradient into a zero (b, s, h) fp32 tensor.
"""

from __future__ import annotations

from typing import Any

from fulltune.memory import parallelism
from fulltune.memory.shapes import ModelShape, model_shape
from fulltune.memory.types import MemoryEstimate, Settings


def estimate_memory(config: Any, settings: Settings) -> MemoryEstimate:
    """Peak memory of one steady-state optimizer step of `config` trained with `settings`.

    Pure arithmetic (no torch); per process. See the module docstring for what is counted.

    Raises:
        MemoryConfigError: the config lacks the dimensions of a decoder-only causal LM.
    """
    shape = model_shape(config)
    return _estimate(shape, settings)


def rank_peak_bytes(config: Any, settings: Settings, rank: int) -> int:
    """The tensors at process `rank`'s step peak (`MemoryEstimate.peak_bytes`, what the trainer measures per
    rank: `fulltune.runtime.step_memory`): its pipeline stage's under `pipeline_parallel` > 1 (a stage is
    `ParallelDims.stage`'s consecutive ranks), otherwise the one figure every process shares."""
    shape = model_shape(config)
    return parallelism.rank_kind(settings).rank_peak_bytes(shape, settings, rank)


def _estimate(shape: ModelShape, settings: Settings, timeline: list | None = None) -> MemoryEstimate:
    """`estimate_memory` on a parsed shape; `timeline` (if given) receives every (phase, bytes, parts). The rank's
    kind of parallelism walks it (fulltune/memory/parallelism.py)."""
    return parallelism.estimate(shape, settings, timeline)


def num_parameters(config: Any) -> int:
    """Parameter count of `config` as the memory model counts it."""
    return model_shape(config).num_params


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token of rows of one `seq_len`-token document with a target at every position
    (fulltune/memory/flops.py; no recompute)."""
    from fulltune.memory import flops

    return flops.from_shape(model_shape(config)).per_token_of_rows(seq_len)
