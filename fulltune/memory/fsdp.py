"""Sharding: the share of weights, gradients and optimizer states each process keeps, the communication
buffers of DDP and ZeRO, and the step as FSDP2 runs it (`fsdp_phases`), unit by unit.

Under FSDP's CPU offload (`train.offload_optimizer` with strategy fsdp, CUDA only) the same walk holds on
the device without the persistent shards: every parameter, gradient and optimizer-state shard is in host
RAM (`lever_bytes.sharded_offload_bytes`), so a rank's device holds the gathered units, their unsharded
gradients and reduce-scatter buffers, the activations and the batch. The host parts of each phase are
this process's shards; a node's host RAM is `process.node_host_bytes`.

FSDP (fulltune/runtime/sharding.py) is walked unit by unit: what is gathered, and which unsharded gradients and
reduce-scatter buffers exist, depends on the phase; checked per rank on CPU (benchmarks/sharded_memory.py).
NCCL's own buffers are not tensors and are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fulltune.memory.timeline import Persistent, StepTerms, Timeline
from fulltune.memory.types import Settings


@dataclass(frozen=True)
class Shares:
    """The fraction of the whole model's weights, gradients and optimizer states one process keeps."""

    params: float
    grads: float
    states: float


def shares(settings: Settings) -> Shares:
    """FSDP and ZeRO-3 shard all three over the processes, ZeRO-2 gradients and states; DDP none."""
    n = settings.num_processes
    if settings.strategy in ("fsdp", "deepspeed_zero3"):
        return Shares(1.0 / n, 1.0 / n, 1.0 / n)
    if settings.strategy == "deepspeed_zero2":
        return Shares(1.0, 1.0 / n, 1.0 / n)
    return Shares(1.0, 1.0, 1.0)


def fsdp_walk(settings: Settings) -> bool:
    """Whether the step is walked as FSDP2 runs it (per unit gathers, reduce-scatters; `fsdp_phases`), the
    chunked head and the step in backward included; DeepSpeed ZeRO-3 keeps the per-step formula (two layers
    gathered, one layer's gradient bucket)."""
    return settings.strategy == "fsdp"


def activation_settings(settings: Settings) -> Settings:
    """The settings whose activations the step makes: FSDP's bf16 policy (fulltune/runtime/sharding.py) gathers
    bf16 weights and runs the model on them without autocast, so its activations, residual stream and
    logits are those of bf16 weights (`pure_bf16`), while the sharded masters, gradients and optimizer
    states stay fp32 (measured per rank on CPU: benchmarks/sharded_memory.py)."""
    if fsdp_walk(settings) and settings.mixed_precision == "bf16" and not settings.pure_bf16:
        return replace(settings, pure_bf16=True)
    return settings


def persistent(x: StepTerms) -> Persistent:
    """What persists through the step on one process: its weights, states and communication buffers."""
    shape, settings = x.shape, x.settings
    share = shares(settings)
    wb, n = x.levers.weight_bytes, settings.num_processes
    gathered = buckets = 0
    if settings.strategy == "ddp":
        # DDP keeps flat gradient buckets besides .grad (gradient_as_bucket_view=False default).
        buckets = wb * shape.num_params
    elif settings.strategy in ("fsdp", "deepspeed_zero3") and not fsdp_walk(settings):
        # Two layers' full parameters are gathered at a time (current + prefetch), the embedding
        # while it is used, plus one layer's unsharded gradients before reduce-scatter.
        gathered = 2 * wb * shape.layer_numel + (wb * shape.embedding_numel if n > 1 else 0)
        buckets = wb * shape.layer_numel
    elif settings.strategy == "deepspeed_zero2":
        # Gradients are reduced in buckets about two layers large before being partitioned.
        buckets = 2 * wb * shape.layer_numel
    b, s, t = settings.micro_batch_size, settings.seq_len, x.t
    # FSDP's CPU offload: the parameter shards live in host RAM (`lever_bytes.sharded_offload_bytes`).
    on_device = 0 if x.levers.sharded_offload else 1
    return Persistent(
        params=int(wb * shape.num_params * share.params) * on_device,
        buffers=4 * (shape.rotary_dim // 2) if shape.rotary_dim else 0,
        states=int(x.levers.states * share.states),
        gathered=gathered,
        buckets=buckets,
        batch=2 * 8 * b * s + 2 * 8 * t,  # input_ids, position_ids; target index and tokens (int64)
    )


def _chunked_head(tl: Timeline, done: int, in_head: int, gathered_head: int, head_grad: int) -> None:
    """The chunked head (fulltune/runtime/loss.py) under FSDP2: `memory/head.py`'s tiles, with the head's units.

    Its loss flows through the model's output, so the root (and an untied head, kept since its forward) is
    gathered again before the recompute reads the weight; the unsharded weight gradient exists from the
    backward's start (the tiles fill it). The gathered weight is in the compute dtype: no tile casts."""
    from fulltune.runtime.loss import ROW_CHUNK, VOCAB_CHUNK, chunked_head_bytes

    x = tl.terms
    t, h, V, c, sb = x.t, x.shape.hidden, x.shape.vocab, x.c, x.sb
    total, bsh4 = x.acts.total, x.bsh4
    rows, cols = min(t, ROW_CHUNK), min(V, VOCAB_CHUNK)
    tiles = chunked_head_bytes(t, h, V, c)
    tl.add("forward of the lm head / loss", done, total, 0, bsh4 + 8 * t + rows * cols * (c + 4), backward=False,
           unsharded=(in_head, 0))
    backward = tiles["backward"] - cols * h * c  # the weight tile is a view of the gathered weight
    tl.add("backward of the lm head / loss", done, total, 0, tiles["saved"] + backward,
           unsharded=(gathered_head, head_grad))
    if sb != 4:  # the fp32 input gradient and its cast to the stream dtype
        tl.add("backward of the lm head / loss", done, total, 0, tiles["saved"] + 4 * t * h + sb * t * h,
               unsharded=(gathered_head, head_grad))


def fsdp_phases(tl: Timeline) -> None:
    """The step as FSDP2 runs it in every rank (fulltune/runtime/sharding.py), phase by phase.

    Units: each decoder layer; the input embedding and the output head when untied (the head keeps its
    gathered weight from its forward to its backward); the root (final norm, and a tied embedding).
    What is unsharded depends on the phase: a unit's full weight exists while it computes (plus the
    all-gather buffer FSDP2 keeps until the next unit's gather, and in backward the next unit's
    prefetched gather); the root frees its gathered weights after the forward (a tied embedding is not
    gathered in the loss) and gathers them again for the backward. A unit's gradient is unsharded (weight
    dtype) until its post-backward copies it into a fp32 reduce-scatter buffer, which FSDP2 keeps until
    the next unit's reduce-scatter; only the sharded result stays. A tied head's unsharded gradient waits
    in autograd for the embedding's share. Checked per phase against FSDPMemTracker in each rank
    (benchmarks/sharded_memory.py).
    """
    x = tl.terms
    shape, settings, layer, add = x.shape, x.settings, x.layer, tl.add
    saved_by_layer, grads_total, t, c = x.acts.saved_by_layer, x.grads_total, x.t, x.c
    bsh4, logits_c, logits32, mask_bool = x.bsh4, x.logits_c, x.logits32, x.acts.mask_bool
    acts_total, before_head = x.acts.total, x.acts.below_head
    head_inputs = x.acts.lm_head_input + x.acts.final_norm
    h, V, I, L = shape.hidden, shape.vocab, shape.intermediate, shape.num_layers
    n = settings.num_processes
    policy_bf16 = settings.mixed_precision == "bf16"
    wb = 2 if settings.pure_bf16 else 4  # the sharded weights and gradients
    pb = 2 if policy_bf16 else wb  # gathered weights and unsharded gradients
    rb = 4 if policy_bf16 else wb  # reduce-scatter buffers (the policy reduces in fp32)
    lay, vh = shape.layer_numel, V * h
    tied = shape.tied
    root = shape.num_params - L * lay - (0 if tied else 2 * vh)  # final norm (+ tied embedding, positions)
    accumulating = settings.gradient_accumulation_steps > 1

    def shard(numel: int) -> int:
        return int(wb * numel / n)

    def post_backward(numel: int, shapes: list[tuple[int, ...]] | None = None) -> int:
        # A unit's post-backward: besides its unsharded gradient and the reduce-scatter buffer, one more
        # unit-sized tensor in the reduce dtype and the sharded output (FSDPMemTracker, every rank).
        reduce = rb * numel + int(rb * numel / n)
        if not settings.optimizer_in_backward or not shapes:
            return reduce
        # Stepping in backward (fulltune/runtime/optim.py InBackwardOptimizer on the shards), the unit's hooks update
        # its parameters (`shapes`) one at a time once the sharded output exists, the extra unit-sized tensor
        # gone: fused or Kahan AdamW in place; Adafactor gathered (`GatheredAdafactor`: the whole weight and
        # gradient) with its temporaries (measured per rank: benchmarks/sharded_memory.py --levers).
        from fulltune.runtime import optim

        largest = max(shapes, key=math.prod)
        gathered = 2 * wb * math.prod(largest) if settings.optimizer == "adafactor" else 0
        step = gathered + optim.optimizer_state_bytes(settings.optimizer, [largest], wb)[1]
        return max(reduce, int(rb * numel / n) + step)

    # Sharded gradients as the backward finishes units (all of them when accumulating).
    done = grads_total if accumulating else 0
    root_g = pb * root  # the root's gathered weights (forward, and backward from the head on)

    # Forward of the input embedding: its gathered weight and all-gather buffer (tied: the root's).
    embedding = 2 * pb * vh + root_g if not tied else 2 * root_g
    add("forward", done, 0, 0, bsh4, backward=False, unsharded=(embedding, 0))
    # The last layer gathered, the previous gather's buffer kept, the root gathered.
    add("forward", done, before_head, 0, layer.forward_transient + mask_bool, backward=False,
        unsharded=(2 * pb * lay + root_g, 0))
    # The head's forward: untied, its weight and its all-gather buffer; tied, the root's weights.
    in_head = 2 * pb * vh + root_g if not tied else root_g + pb * lay
    # The head's backward: its unsharded weight gradient beside the gathered weight (tied: the root
    # gathered again), the last layer's gather prefetched.
    gathered_head = (pb * vh if not tied else root_g) + pb * lay
    if settings.chunked_loss:
        _chunked_head(tl, done, in_head, gathered_head, pb * vh)
    else:
        add("forward of the lm head / loss", done, acts_total, logits_c, bsh4 + 4 * t * h, backward=False,
            unsharded=(in_head, 0))
        # The loss, after the root's forward: only an untied head stays gathered.
        kept_head = 0 if tied else pb * vh
        if c == 2:
            add("forward of the lm head / loss", done, acts_total, logits_c + logits32, 0, backward=False,
                unsharded=(kept_head, 0))
        add("forward of the lm head / loss", done, acts_total, 2 * logits32, 0, backward=False,
            unsharded=(kept_head, 0))
        add("backward of the lm head / loss", done, acts_total, 3 * logits32, 0, unsharded=(kept_head, 0))
        add("backward of the lm head / loss", done, acts_total, logits_c + (logits32 if c == 2 else 0), t * h * c,
            unsharded=(gathered_head, pb * vh))
    after_head = acts_total - head_inputs
    if not tied:
        # Its post-backward: the gradient copied into the reduce-scatter buffer, the weight resharded.
        add("backward of the lm head / loss", done, acts_total, 0, t * h * c + post_backward(vh, [(V, h)]),
            unsharded=(pb * lay, pb * vh + rb * vh))
        done = done if accumulating else done + shard(vh)
    # Tied: the head's gradient waits unsharded for the embedding's; untied: the head's reduce-scatter
    # buffer is kept until the next one.
    waiting = pb * vh if tied else 0
    kept_rs = 0 if tied else rb * vh
    add("backward of the lm head / loss", done, after_head, 0, bsh4 + 4 * t * h,
        unsharded=(pb * lay + (root_g if tied else 0), waiting + kept_rs))

    mlp_params = 2 * h * I + (I * h if shape.gated_mlp else 0)
    acts_now = after_head
    for i in reversed(range(L)):
        below = acts_now - saved_by_layer[i]
        # This layer gathered, the next one (below it) prefetched: layer 0 prefetches an untied embedding.
        prefetch = pb * lay if i > 0 else (0 if tied else pb * vh)
        gathered = pb * lay + prefetch + (root_g if tied else 0)
        # The output projection's gradient first, then the MLP's, unsharded.
        add(f"backward of layer {i}", done, below, 0, layer.saved + layer.mlp_backward,
            unsharded=(gathered, waiting + kept_rs + pb * h * I))
        add(f"backward of layer {i}", done, below, 0, layer.attn_saved + layer.attn_backward,
            unsharded=(gathered, waiting + kept_rs + pb * mlp_params))
        # Its post-backward: the whole unsharded gradient and its reduce-scatter buffer.
        add(f"backward of layer {i}", done, below, 0, post_backward(lay, list(shape.layer_params)),
            unsharded=(prefetch + (root_g if tied else 0), waiting + pb * lay + rb * lay))
        done = done if accumulating else done + shard(lay)
        kept_rs = rb * lay
        acts_now = below
    acts_now = max(acts_now, 0)
    if tied:
        # The embedding's dense gradient, then its sum with the waiting head gradient (three at once);
        # the root's post-backward reduce-scatters that sum.
        add("backward of the embeddings", done, acts_now, 0, 3 * pb * vh, unsharded=(root_g, kept_rs))
        # Under the bf16 policy the summed bf16 gradient is gone once copied into the fp32 buffer (measured).
        summed = 0 if pb != rb else pb * root
        add("backward of the embeddings", done, acts_now, 0, post_backward(root, list(shape.other_params)),
            unsharded=(0, summed + rb * root))
    else:
        add("backward of the embeddings", done, acts_now, 0, 0, unsharded=(pb * vh, kept_rs + pb * vh))
        add("backward of the embeddings", done, acts_now, 0, post_backward(vh, [(V, h)]),
            unsharded=(0, pb * vh + rb * vh))
    # The step runs on the shards (AdamW: in place). Adafactor's factored statistics need whole rows and
    # columns, so fulltune/runtime/optim.py's GatheredAdafactor gathers one parameter's weight and gradient at a
    # time and runs the unsharded update on them: the largest parameter's pair plus its temporaries.
    # Under FSDP's CPU offload the step runs on the host shards: the device holds nothing of it (the
    # host's temporaries are in the phase's host parts).
    step_temp = 0
    if settings.optimizer == "adafactor" and not x.levers.sharded_offload:
        largest = max(math.prod(sh) for sh in shape.param_shapes)
        step_temp = 2 * wb * largest + x.levers.states_temp
    if settings.optimizer_in_backward:
        # Stepped in backward (`post_backward`): each sharded gradient is freed by its step as its unit's
        # reduce-scatter assigns it (the hooks: `Timeline.add` counts none of them); no step is left.
        return
    add("optimizer step", grads_total, 0, 0, step_temp)
    if x.levers.sharded_offload and x.levers.host_temp:
        # The host step's temporaries beside every host shard (the device is idle: nothing there).
        tl.phases[-1][2]["host"] += x.levers.host_temp
