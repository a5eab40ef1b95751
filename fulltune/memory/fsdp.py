"""Sharding: the share of weights, gradients and optimizer states each process keeps, DDP's gradient
buckets, and FSDP2's units (`Units`): the description `walk.walk` walks an FSDP2 rank's step by.

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

from fulltune import levers
from fulltune.memory.shapes import ModelShape
from fulltune.memory.timeline import Persistent, StepTerms, Timeline, shares
from fulltune.memory.types import Settings
from fulltune.memory.walk import Layout
from fulltune.memory.shapes import ModelShape
from fulltune.optimizers import ParamShapes, optimizer


def fsdp_walk(settings: Settings) -> bool:
    """Whether the step is walked as FSDP2 runs it (per unit gathers, reduce-scatters; `Units`), the
    chunked head and the step in backward included."""
    return settings.dims.fsdp_enabled


def activation_settings(settings: Settings) -> Settings:
    """The settings whose activations the step makes: FSDP's bf16 policy (fulltune/runtime/sharding.py) gathers
    bf16 weights and runs the model on them without autocast, so its activations, residual stream and
    logits are those of bf16 weights (`pure_bf16`), while the sharded masters, gradients and optimizer
    states stay fp32 (measured per rank on CPU: benchmarks/sharded_memory.py)."""
    if fsdp_walk(settings) and settings.mixed_precision == "bf16" and not settings.pure_bf16:
        return replace(settings, pure_bf16=True)
    return settings


def persistent(x: StepTerms) -> Persistent:
    """What persists through the step on one process: its weights, states and DDP's gradient buckets (FSDP2's
    gathered units and reduce-scatter buffers change phase by phase: `Units`)."""
    shape, settings = x.shape, x.settings
    share = shares(settings)
    wb = x.levers.weight_bytes
    # DDP keeps flat gradient buckets besides .grad (gradient_as_bucket_view=False default).
    buckets = wb * shape.num_params if settings.dims.ddp_enabled else 0
    b, s, t = settings.micro_batch_size, settings.seq_len, x.t
    # FSDP's CPU offload: the parameter shards live in host RAM (`lever_bytes.sharded_offload_bytes`).
    on_device = 0 if x.levers.sharded_offload else 1
    return Persistent(
        params=int(wb * shape.num_params * share.params) * on_device,
        buffers=4 * (shape.rotary_dim // 2) if shape.rotary_dim else 0,
        states=int(x.levers.states * share.states),
        buckets=buckets,
        batch=2 * 8 * b * s + 2 * 8 * t,  # input_ids, position_ids; target index and tokens (int64)
    )


def staging_bytes(x: StepTerms) -> int:
    """Bytes per gathered element that FSDP2 stages on the device while it gathers a unit under CPU offload over
    one process (0 otherwise). At world size 1 torch 2.13's `FSDPParamGroup.wait_for_unshard` copies each
    parameter in on the compute stream: `all_gather_inputs` moves the host shard to the device (its stored
    dtype), casts it to the gathered dtype, and that is copied into the unit's buffer. So the unit's largest
    parameter, in both dtypes, exists for a moment beside the gathered unit. Several processes copy their
    shards into the all-gather buffer the walk already counts (`Units.copies`)."""
    settings = x.settings
    if not x.levers.sharded_offload or settings.num_processes != 1:
        return 0
    wb = x.levers.weight_bytes
    gathered = 2 if settings.mixed_precision == "bf16" else wb
    return wb + (gathered if gathered != wb else 0)


class Units:
    """FSDP2's units on one rank (fulltune/runtime/sharding.py): where each unit's gradient goes and what the unit and
    the collectives hold, phase by phase (`walk.Gradients`).

    Units: each decoder layer; the input embedding and the output head when untied (the head keeps its
    gathered weight from its forward to its backward); the root (final norm, and a tied embedding). What is
    unsharded depends on the phase: a unit's full weight exists while it computes (plus the all-gather buffer
    FSDP2 keeps until the next unit's gather: `copies`, and in backward the next unit's prefetched gather:
    `prefetching`); the root frees its gathered weights after the forward (a tied embedding is not gathered in
    the loss) and gathers them again for the backward. A unit's gradient is unsharded (the gathered dtype)
    until its post-backward copies it into a fp32 reduce-scatter buffer, which FSDP2 keeps until the next
    unit's reduce-scatter; only the sharded result stays. A tied head's unsharded gradient waits in autograd
    for the embedding's share. `masked`: what the embedding's backward adds (tensor parallel's masked copy).
    Checked per phase against FSDPMemTracker in each rank (benchmarks/sharded_memory.py)."""

    def __init__(self, tl: Timeline, copies: int = 2, prefetching: bool = True, masked: int = 0) -> None:
        x = tl.terms
        shape, settings = x.shape, x.settings
        policy_bf16 = settings.mixed_precision == "bf16"
        self.wb = 2 if settings.pure_bf16 else 4  # the sharded weights and gradients
        self.pb = 2 if policy_bf16 else self.wb  # gathered weights and unsharded gradients
        self.rb = 4 if policy_bf16 else self.wb  # reduce-scatter buffers (the policy reduces in fp32)
        self.n, self.copies, self.prefetching = settings.num_processes, copies, prefetching
        self.lay, self.vh, self.tied = shape.layer_numel, shape.vocab * shape.hidden, shape.tied
        # A decoder layer's gathered weights: what a lever gathers in one byte an element (its record's
        # `gathered_numel`; float8's converted linears under its all-gather), the rest in the gathered dtype.
        narrow = sum(lever.gathered_numel(shape, settings) for lever in levers.GATHER_LEVERS
                     if getattr(settings, lever.name))
        self.layer_g = self.pb * (self.lay - narrow) + narrow
        # The root: the final norm (+ a tied embedding, positions).
        self.root = shape.num_params - shape.num_layers * self.lay - (0 if self.tied else 2 * self.vh)
        self.root_g = self.pb * self.root  # its gathered weights (forward, and backward from the head on)
        self.masked = masked * self.pb * self.vh
        # Sharded gradients as the backward finishes units (all of them when accumulating).
        self.done = x.grads_total if x.accumulating else 0
        self.waiting = 0  # a tied head's unsharded gradient, waiting for the embedding's
        self.kept_rs = 0  # the last unit's reduce-scatter buffer, kept until the next one
        # Parameters staged while a unit is gathered (`staging_bytes`): counted in the phase of the gather or,
        # where the walk has no phase of its own for it, the first phase after it (an upper bound there).
        staged = staging_bytes(x)
        self.staged_layer = staged * max((math.prod(p) for p in shape.layer_params), default=0)
        self.staged_vh = staged * self.vh

    def gathered_embedding(self) -> int:
        """The input embedding's gathered weight and all-gather buffer in its forward (tied: the root's)."""
        pb, vh, root_g = self.pb, self.vh, self.root_g
        return (self.copies * pb * vh + root_g if not self.tied else self.copies * root_g) + self.staged_vh

    def gathered_last_layer(self) -> int:
        """The last layer gathered in its forward (the previous gather's buffer kept), the root gathered."""
        return self.copies * self.layer_g + self.root_g + self.staged_layer

    def in_head(self) -> int:
        """Gathered in the head's forward: untied, its weight and its all-gather buffer; tied, the root's."""
        pb = self.pb
        if self.tied:
            return self.root_g + (self.copies - 1) * self.layer_g
        return self.copies * pb * self.vh + self.root_g + self.staged_vh

    def kept_head(self) -> int:
        """Gathered in the loss, after the root's forward: only an untied head stays gathered."""
        return 0 if self.tied else self.pb * self.vh

    def gathered_head(self) -> int:
        """Gathered in the head's backward: its weight (tied: the root gathered again), the last layer's gather
        prefetched."""
        return (self.pb * self.vh if not self.tied else self.root_g + self.staged_vh) + self._next_layer()

    def _next_layer(self) -> int:
        return self.layer_g if self.prefetching else 0

    def _prefetch(self, i: int) -> int:
        """The unit below layer `i`, prefetched during its backward: layer 0 prefetches an untied embedding."""
        if not self.prefetching:
            return 0
        return self.layer_g if i > 0 else (0 if self.tied else self.pb * self.vh)

    def shard(self, numel: int) -> int:
        return int(self.wb * numel / self.n)

    def post_backward(self, tl: Timeline, numel: int, params: ParamShapes) -> int:
        """A unit's post-backward: besides its unsharded gradient and the reduce-scatter buffer, one more
        unit-sized tensor in the reduce dtype and the sharded output (FSDPMemTracker, every rank).

        Stepping in backward (fulltune/runtime/optim.py InBackwardOptimizer on the shards), the unit's hooks update its
        parameters (`params`) one at a time once the sharded output exists, the extra unit-sized tensor gone:
        fused or Kahan AdamW in place; an optimizer that needs whole parameters (Adafactor, Muon's matrices)
        gathered (`GatheredOptimizer`) with its temporaries (measured per rank: benchmarks/sharded_memory.py
        --levers)."""
        settings, rb = tl.terms.settings, self.rb
        reduce = rb * numel + int(rb * numel / self.n)
        if not settings.optimizer_in_backward:
            return reduce
        return max(reduce, int(rb * numel / self.n) + sharded_step_bytes(settings.optimizer, params, self.wb))

    def head_end(self, tl: Timeline, acts: int, temp: int, after_temp: int) -> int:
        """The head's last phases: untied, its post-backward (`acts` saved, `temp` beside it: the gradient
        copied into the reduce-scatter buffer, the weight resharded); then the gradient of the head's input
        (`after_temp`) with the final norm's and the head's activations freed. Returns what stays saved."""
        x = tl.terms
        shape, pb, rb, vh = x.shape, self.pb, self.rb, self.vh
        after_head = x.acts.total - x.acts.lm_head_input - x.acts.final_norm
        if not self.tied:
            tl.add("backward of the lm head / loss", self.done, acts, 0,
                   temp + self.post_backward(tl, vh, _head_params(shape)),
                   unsharded=(self._next_layer(), pb * vh + rb * vh))
            self.done += 0 if x.accumulating else self.shard(vh)
        # Tied: the head's gradient waits unsharded for the embedding's; untied: the head's reduce-scatter
        # buffer is kept until the next one.
        self.waiting = pb * vh if self.tied else 0
        self.kept_rs = 0 if self.tied else rb * vh
        tl.add("backward of the lm head / loss", self.done, after_head, 0, after_temp,
               unsharded=(self._next_layer() + (self.root_g if self.tied else 0), self.waiting + self.kept_rs))
        return after_head

    def partial(self, tl: Timeline, i: int, first: bool) -> dict:
        """This layer gathered, the next one (below it) prefetched; the output projection's gradient first,
        then the MLP's, unsharded."""
        shape, pb = tl.terms.shape, self.pb
        h, I = shape.hidden, shape.intermediate
        made = h * I if first else 2 * h * I + (I * h if shape.gated_mlp else 0)
        gathered = self.layer_g + self._prefetch(i) + (self.root_g if self.tied else 0)
        gathered += self.staged_layer if first else 0  # the layer was gathered again just before
        return {"grads": self.done, "temp": 0, "unsharded": (gathered, self.waiting + self.kept_rs + pb * made)}

    def finish(self, tl: Timeline, name: str, i: int, acts: int) -> None:
        """The layer's post-backward: the whole unsharded gradient and its reduce-scatter buffer."""
        x, pb, rb, lay = tl.terms, self.pb, self.rb, self.lay
        tl.add(name, self.done, acts, 0, self.post_backward(tl, lay, x.shape.layer_optimizer_shapes),
               unsharded=(self._prefetch(i) + (self.root_g if self.tied else 0), self.waiting + pb * lay + rb * lay))
        self.done += 0 if x.accumulating else self.shard(lay)
        self.kept_rs = rb * lay

    def embeddings(self, tl: Timeline, acts: int) -> None:
        """Tied: the embedding's dense gradient, then its sum with the waiting head gradient (three at once);
        the root's post-backward reduce-scatters that sum. Untied: the embedding unit's gradient and its
        post-backward."""
        shape, pb, rb, vh, root = tl.terms.shape, self.pb, self.rb, self.vh, self.root
        name = "backward of the embeddings"
        if self.tied:
            tl.add(name, self.done, acts, 0, 3 * pb * vh + self.masked, unsharded=(self.root_g, self.kept_rs))
            # Under the bf16 policy the summed bf16 gradient is gone once copied into the fp32 buffer (measured).
            summed = 0 if pb != rb else pb * root
            tl.add(name, self.done, acts, 0, self.post_backward(tl, root, ParamShapes(others=shape.other_params)),
                   unsharded=(0, summed + rb * root))
        else:
            tl.add(name, self.done, acts, 0, self.masked, unsharded=(pb * vh + self.staged_vh, self.kept_rs + pb * vh))
            tl.add(name, self.done, acts, 0, self.post_backward(tl, vh, _head_params(shape)) + self.masked,
                   unsharded=(0, pb * vh + rb * vh))

    def step(self, tl: Timeline) -> None:
        """The step runs on the shards (AdamW: in place). An optimizer that needs whole parameters (Adafactor's
        factored statistics take whole rows and columns, Muon orthogonalises whole matrices) runs them through
        fulltune/runtime/optim.py's GatheredOptimizer, which gathers one parameter at a time and runs the unsharded
        update on it: the largest one's gathered tensors plus its temporaries (its record's `sharded_step_bytes`).
        Under FSDP's
        CPU offload the step runs on the host shards: the device holds nothing of it (the host's temporaries
        are in the phase's host parts). Stepped in backward (`post_backward`), each sharded gradient is freed
        by its step as its unit's reduce-scatter assigns it (the hooks: `Timeline.add` counts none of them):
        no step is left."""
        x = tl.terms
        settings, levers = x.settings, x.levers
        if settings.optimizer_in_backward:
            return
        step_temp = 0 if levers.sharded_offload else sharded_step_bytes(settings.optimizer, x.shape.optimizer_shapes,
                                                                           self.wb)
        tl.add("optimizer step", x.grads_total, 0, 0, step_temp)
        if levers.sharded_offload and levers.host_temp:
            # The host step's temporaries beside every host shard (the device is idle: nothing there).
            tl.phases[-1][2]["host"] += levers.host_temp


def sharded_step_bytes(name: str, params: ParamShapes, weight_bytes: int) -> int:
    """Optimizer `name`'s temporaries while it steps FSDP2 shards of `params`: its record's `sharded_step_bytes`
    (gathered parameters), else its own temporaries (none for AdamW, which steps each shard in place)."""
    record = optimizer(name)
    if record.sharded_step_bytes is not None:
        return record.sharded_step_bytes(params, weight_bytes)
    return record.state_bytes(params, weight_bytes, "none")[1]


def _head_params(shape: ModelShape) -> ParamShapes:
    """An untied output head's unit: its (V, h) weight."""
    return ParamShapes(others=((shape.vocab, shape.hidden),))


def fsdp_layout(tl: Timeline) -> Layout:
    """The walk of an FSDP2 rank (fulltune/runtime/sharding.py): every layer's unit gathered while it computes, its
    gradient reduce-scattered by its post-backward."""
    n = tl.terms.settings.num_processes
    units = Units(tl, copies=2 if n > 1 else 1, prefetching=n > 1)
    return Layout(layers=(0, tl.terms.shape.num_layers), embedding=True, head=_head, gradients=units,
                  gathered_embedding=units.gathered_embedding(), gathered_layer=units.gathered_last_layer())


def _head(tl: Timeline, units: Units) -> int:
    """The head and the loss under FSDP2, whole or chunked (`memory/head.py`'s tensors, with the head's units)."""
    x = tl.terms
    t, h, c, done = x.t, x.shape.hidden, x.c, units.done
    acts_total, logits_c, logits32 = x.acts.total, x.logits_c, x.logits32
    if x.settings.chunked_loss:
        _chunked_head(tl, units)
    else:
        add = tl.add
        add("forward of the lm head / loss", done, acts_total, logits_c, x.bsh4 + 4 * t * h, backward=False,
            unsharded=(units.in_head(), 0))
        kept_head = units.kept_head()
        if c == 2:
            add("forward of the lm head / loss", done, acts_total, logits_c + logits32, 0, backward=False,
                unsharded=(kept_head, 0))
        add("forward of the lm head / loss", done, acts_total, 2 * logits32, 0, backward=False,
            unsharded=(kept_head, 0))
        add("backward of the lm head / loss", done, acts_total, 3 * logits32, 0, unsharded=(kept_head, 0))
        add("backward of the lm head / loss", done, acts_total, logits_c + (logits32 if c == 2 else 0), t * h * c,
            unsharded=(units.gathered_head(), units.pb * units.vh))
    return units.head_end(tl, acts_total, t * h * c, x.bsh4 + 4 * t * h)


def _chunked_head(tl: Timeline, units: Units) -> None:
    """The chunked head (fulltune/runtime/loss.py) under FSDP2: `memory/head.py`'s tiles, with the head's units.

    Its loss flows through the model's output, so the root (and an untied head, kept since its forward) is
    gathered again before the recompute reads the weight; the unsharded weight gradient exists from the
    backward's start (the tiles fill it). The gathered weight is in the compute dtype: no tile casts."""
    from fulltune.memory.head import ROW_CHUNK, VOCAB_CHUNK, chunked_head_bytes

    x = tl.terms
    t, h, V, c, sb, done = x.t, x.shape.hidden, x.shape.vocab, x.c, x.sb, units.done
    total, bsh4 = x.acts.total, x.bsh4
    rows, cols = min(t, ROW_CHUNK), min(V, VOCAB_CHUNK)
    tiles = chunked_head_bytes(t, h, V, c)
    gathered_head, head_grad = units.gathered_head(), units.pb * units.vh
    tl.add("forward of the lm head / loss", done, total, 0, bsh4 + 8 * t + rows * cols * (c + 4), backward=False,
           unsharded=(units.in_head(), 0))
    backward = tiles["backward"] - cols * h * c  # the weight tile is a view of the gathered weight
    tl.add("backward of the lm head / loss", done, total, 0, tiles["saved"] + backward,
           unsharded=(gathered_head, head_grad))
    if sb != 4:  # the fp32 input gradient and its cast to the stream dtype
        tl.add("backward of the lm head / loss", done, total, 0, tiles["saved"] + 4 * t * h + sb * t * h,
               unsharded=(gathered_head, head_grad))


@dataclass(frozen=True)
class StageUnits:
    """FSDP beside pipeline stages, the part of a stage's Layout (`walk.Layout.gathered`) that FSDP2's units add
    to the replicated walk: which of an FSDP-sharded stage's units hold their gathered weights in each phase of a
    micro-batch (fulltune/runtime/pipeline_parallel.py `data_parallel_stage`: the embedding and each layer a unit,
    the head a unit kept gathered after its forward, the stage the root). The schedule keeps a unit gathered from its
    backward on (`set_reshard_after_backward(False)`) until its next forward reshards it, so while a micro-batch
    runs its backward the units it has backwarded are gathered, and the unit below it (FSDP2's backward
    prefetch: the layer below, or the first stage's embedding below its first layer), the others not; the head
    stays gathered from its first forward to the step's end. Found by reading which units were unsharded at each
    rank's measured peak (FSDP2's `FSDPParamGroup.is_unsharded`). Counted before as all gathered through the
    step, the estimate was 2–10% over; now 0.04–1.91% under (the module docstring's cases)."""

    shape: ModelShape  # the stage's
    weight_bytes: int
    layers: tuple[int, int]  # [start, end) in the model's numbering
    first: bool
    last: bool
    fresh: bool  # the step's first micro-batch: the head is not gathered before its forward

    @property
    def root(self) -> int:
        """The root's weights (the final norm), gathered through the step."""
        return self.weight_bytes * sum(p[0] for p in self.shape.other_params if len(p) == 1)

    @property
    def embedding(self) -> int:
        """The input embedding's weights on the first stage (0 on the others)."""
        tables = [p for p in self.shape.other_params if len(p) == 2]
        return self.weight_bytes * tables[0][0] * tables[0][1] if self.first and tables else 0

    @property
    def layer(self) -> int:
        """One decoder layer's weights."""
        return self.weight_bytes * self.shape.layer_numel

    @property
    def head(self) -> int:
        """The output head's weights on the last stage (0 on the others)."""
        return self.weight_bytes * self.shape.vocab * self.shape.hidden if self.last else 0

    def bytes_in(self, phase: str) -> int:
        """The units' gathered weights (beyond their shards) during `phase`."""
        start, end = self.layers
        if phase == "forward":  # the stage's last layer computing; the head from an earlier micro-batch
            return self.layer + (0 if self.fresh else self.head)
        if phase.startswith("backward of layer "):  # this layer and the ones above, and the unit below prefetched
            i = int(phase.removeprefix("backward of layer "))
            return (end - i) * self.layer + (self.layer if i > start else self.embedding) + self.head
        if phase == "backward of the embeddings":
            return (end - start) * self.layer + self.embedding
        if phase == "optimizer step":  # resharded after the step's last backward
            return 0
        return self.head  # the head's forward and backward

    def gather_bytes(self, phase: str) -> int:
        """The gathered weights while "backward of layer i" gathers layer i: the ones above and the head, and
        layer i twice (FSDP2's all-gather output and the weights it is copied into)."""
        return (self.layers[1] - int(phase.removeprefix("backward of layer ")) + 1) * self.layer + self.head

    def record(self, tl: Timeline, phase: str, grads: int, acts: int, logits: int, temp: int, now: int,
               backward: bool, unsharded: tuple[int, int]) -> None:
        """`Timeline.add` of a stage's phase with the gathered units (`bytes_in`) among the parameters; as a
        layer's backward begins, first its gather: its activations saved, the stream's gradient arrived, and its
        all-gather output beside the weights being copied out of it (the prefetch comes after)."""
        if phase.startswith("backward of layer ") and (not tl.phases or tl.phases[-1][0] != phase):
            x = tl.terms
            tl.record(phase, grads, acts, logits, x.layer.saved + x.bsh4, now, backward,
                      (unsharded[0] + self.gather_bytes(phase), unsharded[1]))
        tl.record(phase, grads, acts, logits, temp, now, backward, (unsharded[0] + self.bytes_in(phase), unsharded[1]))
