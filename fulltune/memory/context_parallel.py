"""Per-rank memory of context parallel (fulltune/runtime/context_parallel.py), phase by phase.

With `distributed.context_parallel: N` each rank keeps s/N of every row's positions (the row padded to a multiple
of 2N), so everything a layer saves outside attention is that of a step of s/N positions (`rank_settings`). Its
weights, gradients and optimizer states are FSDP's share over all dp × N processes (or DDP's replica): the walk
of the data-parallel layout over that shape (`fsdp.fsdp_layout`, `replicated.replicated`).

What context parallel changes is attention. Under Ulysses a rank attends over all S positions for H/N heads:

    q, k, v (b, H, s/N, d)  ─all-to-all─►  (b, H/N, S, d), put in sequence order (kept by the attention kernel)
    attention output (b, S, H/N, d)  ─all-to-all─►  (b, s/N, H, d)

so the attention core keeps H/N heads over S positions (`attention_bytes` of that shape): the same bytes as H heads
over s/N for q and the output, more for key/value heads repeated to split them (grouped-query models with fewer
key/value heads than N), one more q-sized tensor under sdpa's causal kernel (its head-sharded output is no longer
the output projection's input), and the whole row's S × S mask where one is needed (packed rows under sdpa, eager
always), which the rank builds once per micro-batch and keeps through its backward. Each all-to-all adds the copies it is
made of (a contiguous copy in, its output, the copy into sequence order) for a moment: `A2A_COPIES` q-sized
tensors at the attention's forward and backward. The step time of the all-to-alls is `traffic` (per rank, in
units of each tensor's bytes), turned into seconds with the step-time model's link constants.

Measured per rank on CPU against FSDPMemTracker (benchmarks/context_parallel_memory.py, BENCHMARKS.md).
"""

from __future__ import annotations

import math
from dataclasses import replace

from fulltune.memory.activations import (LayerBytes, ModelActivations, attention_bytes, compute_bytes, layer_bytes,
                                         model_activations)
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings

# The all-to-all's transient copies of one q-sized tensor beside what the layer keeps, in forward and backward
# (a contiguous copy of the input, the collective's output, the copy into or out of sequence order).
A2A_COPIES = 3


def padded_seq(seq_len: int, degree: int) -> int:
    """A row padded to a multiple of 2 × `degree` (the zigzag's chunks)."""
    return -(-seq_len // (2 * degree)) * (2 * degree)


def kv_repeats(kv_heads: int, degree: int) -> int:
    """Each key/value head's copies so that `degree` splits them (fulltune/runtime/context_parallel.py)."""
    return degree // math.gcd(kv_heads, degree)


def rank_settings(settings: Settings) -> Settings:
    """One rank's settings: its s/N positions of each row, no further context parallel (its processes still share
    the weights as the data-parallel layout does: `num_processes` stays)."""
    N = settings.context_parallel
    return replace(settings, seq_len=padded_seq(settings.seq_len, N) // N, context_parallel=1)


def heads_shape(shape: ModelShape, degree: int) -> ModelShape:
    """The attention a Ulysses rank computes: H/N heads, the key/value heads split (repeated first if need be)."""
    kv = shape.kv_heads * kv_repeats(shape.kv_heads, degree)
    return replace(shape, heads=shape.heads // degree, kv_heads=kv // degree)


def whole_mask(settings: Settings, act: Settings, S: int) -> int:
    """The whole row's (b, 1, S, S) mask a rank builds once per micro-batch: boolean for sdpa over packed rows,
    additive (compute dtype) for eager attention, none for sdpa over unpacked rows (its causal kernel)."""
    b = settings.micro_batch_size
    if settings.attn_implementation == "eager":
        return b * S * S * compute_bytes(act)
    return b * S * S if settings.attention_mask else 0


def layer_bytes_cp(shape: ModelShape, act: Settings, degree: int, S: int) -> LayerBytes:
    """One layer of a rank (`act`: the rank's settings, s/N positions): its s/N positions' tensors, the attention
    core over S positions and H/N heads, the all-to-alls' copies."""
    local = layer_bytes(shape, act)
    c = compute_bytes(act)
    core_local, work_local, _ = attention_bytes(shape, act, c)
    core, work, _ = attention_bytes(heads_shape(shape, degree), replace(act, seq_len=S), c)
    q = act.micro_batch_size * act.seq_len * shape.heads * shape.head_dim * c  # one q-sized tensor of the rank
    # sdpa's causal kernel (no mask) returns its output in the (b, s, H, d) layout the output projection reads, so
    # in one process the two keep one storage; here the kernel keeps the head-sharded output and the projection its
    # own sequence-sharded copy (measured with saved_tensors_hooks). With a mask, or eager, both are copies anyway.
    own_output = q if act.attn_implementation == "sdpa" and not act.attention_mask else 0
    more = core - core_local + own_output
    return replace(local, saved=local.saved + more, attn_saved=local.attn_saved + more,
                   forward_transient=max(local.forward_transient, A2A_COPIES * q),
                   attn_backward=local.attn_backward + work - work_local + A2A_COPIES * q)


def model_activations_cp(shape: ModelShape, settings: Settings, act: Settings, layer: LayerBytes, S: int,
                         whole: Settings) -> ModelActivations:
    """What a rank's forward leaves saved: the s/N positions' model-level tensors, the whole row's mask in place of
    transformers' own (none is built over a rank's share), and its position ids (the mask's source)."""
    acts = model_activations(shape, settings, act, layer)
    b = settings.micro_batch_size
    return replace(acts, mask_bool=0, kept_mask=whole_mask(whole, act, S) + 8 * b * S + 16 * S)
