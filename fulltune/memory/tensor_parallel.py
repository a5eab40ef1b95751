"""Per-rank memory of tensor parallel and FSDP × TP (fulltune/runtime/parallel.py), phase by phase.

With `distributed.tensor_parallel: T` and `num_processes: N`, each rank holds 1/T of every block's matmuls
and of the vocabulary, and FSDP2 then shards that over the dp = N / T data-parallel ranks. So a rank is FSDP
over dp processes of a smaller model of its own (`rank_shape`): q/k/v and gate/up split by output (H/T heads,
I/T columns), o/down by input, the embedding and the head by vocabulary (V/T rows), the norms replicated.
Its parameters, gradients, optimizer states, gathered units, unsharded gradients and reduce-scatter buffers
are FSDP2's over that shape, counted as `memory/fsdp.py` counts them (dp = 1 included: FSDP2 over one
process still gathers a unit into its own buffer and reduces its gradient through a reduce-scatter one).

What tensor parallel changes is the activations, the logits and the collectives' buffers:

    block input (b, s, h) whole ─► its s/T positions (a copy, kept by the input norm)
    norm        sequence parallel: input, 1/rms and the normalised x on s/T positions
    q, k, v     all-gathered input (b, s, h) kept for the weight gradients; H/T heads over all s positions
    o           row-parallel (b, s, h) partial sums ─► reduce-scatter ─► (b, s/T, h)
    MLP         the same: all-gathered input kept, (b, s, I/T) intermediates, reduce-scatter to s/T
    output      all-gathered to the whole (b, s, h) for the next block (not kept: the next block keeps
                its own s/T copy)
    head        vocabulary-parallel (t, V/T) logits, all-gathered to (t, V) on every rank: the loss runs
                on whole logits (fulltune/runtime/loss.py's TargetHead sees a plain tensor), so the three fp32
                (t, V) tensors of its backward are whole, as without TP
    embedding   a masked lookup of the rank's V/T rows, its (b, s, h) partial sums all-reduced

Each collective's output is a new tensor beside its input (gloo and NCCL alike): an all-gather along the
sequence gathers into a (T·b, s/T, h) buffer and copies it into (b, s, h); a reduce-scatter first copies
its input into that layout. In backward every column-parallel linear all-reduces its input gradient and
every sequence-parallel boundary all-gathers or reduce-scatters the gradient of the stream. All of it was
checked op by op against FSDPMemTracker in every rank on CPU (benchmarks/tensor_parallel_memory.py).

Only the Llama layout is split (parallel.check_model); the heads, key/value heads and MLP width divide T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fulltune.memory.activations import LayerBytes, ModelActivations, attention_bytes, compute_bytes, stream_bytes
from fulltune.memory.errors import MemoryConfigError
from fulltune.memory.fsdp import Units
from fulltune.memory.shapes import ModelShape
from fulltune.memory.timeline import StepTerms, Timeline
from fulltune.memory.types import Settings
from fulltune.memory.walk import Layout


def rank_shape(shape: ModelShape, tensor_parallel: int) -> ModelShape:
    """The parameters one tensor-parallel rank holds before FSDP shards them (fulltune/runtime/parallel.py's plan)."""
    T = tensor_parallel
    if T == 1:
        return shape
    if shape.layout != "llama":
        raise MemoryConfigError(f"tensor_parallel {T}: only Llama-layout blocks are split (model_type "
                                f"{shape.model_type!r}); use tensor_parallel 1")
    heads, kv, inter = shape.heads // T, shape.kv_heads // T, shape.intermediate // T
    vocab = math.ceil(shape.vocab / T)  # DTensor's Shard(0) gives the first ranks one more row when uneven
    # The block's parameters in `shapes._llama_shape`'s order: two norms (whole), q, k, v (split by output) and
    # o (by input), their biases (q, k, v split; o's whole), gate and up (by output), down (by input), their
    # biases (gate's and up's split, down's whole).
    layer, matrices, vectors = [], 0, 0
    for p in shape.layer_params:
        if len(p) == 2:
            matrices, vectors = matrices + 1, 0
            layer.append((p[0], p[1] // T) if matrices in (4, 7) else (p[0] // T, p[1]))
        else:
            vectors += 1
            split = (matrices == 4 and vectors <= 3) or (matrices == 7 and vectors <= 2)
            layer.append((p[0] // T,) if split else p)
    other = tuple((vocab, p[1]) if p == (shape.vocab, shape.hidden) else p for p in shape.other_params)
    return replace(shape, heads=heads, kv_heads=kv, intermediate=inter, vocab=vocab, layer_params=tuple(layer),
                   other_params=other)


def rank_settings(settings: Settings) -> Settings:
    """A rank's settings as FSDP over the data-parallel processes (num_processes / tensor_parallel)."""
    return replace(settings, num_processes=settings.dims.dp, tensor_parallel=1)


@dataclass(frozen=True)
class TensorParallelTerms(StepTerms):
    """`StepTerms` of one tensor-parallel rank: `shape` and `settings` are the rank's (`rank_shape`,
    `rank_settings`), the activations its own; the whole model's numbers beside them."""

    tensor_parallel: int
    full_vocab: int  # the logits the loss sees are whole
    padded_seq: int  # a block's positions: the micro-batch padded to a multiple of T (parallel.py)

    @property
    def whole_logits_c(self) -> int:
        """The all-gathered (t, V) logits in the compute dtype."""
        return self.t * self.full_vocab * self.c

    @property
    def logits32(self) -> int:
        """One fp32 (t, V) tensor of the loss (whole logits: the loss runs on every rank)."""
        return 4 * self.t * self.full_vocab


def layer_bytes_tp(shape: ModelShape, act: Settings, tensor_parallel: int) -> LayerBytes:
    """One sequence-parallel block of a rank (`shape` = `rank_shape`): what it saves, its forward transient and
    backward working sets. `saved` includes the block's own copy of its s/T input positions."""
    T = tensor_parallel
    b = act.micro_batch_size
    s = math.ceil(act.seq_len / T) * T
    sl = s // T
    h, I, a, kv, d = shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim
    c, sb = compute_bytes(act), stream_bytes(act)
    pure = act.pure_bf16
    local = sb * b * sl * h  # one stream tensor on the rank's positions
    gathered = c * b * s * h  # an all-gathered norm output: the column-parallel linears' input
    # RMSNorm on s/T positions: 1/rms and the normalised x; with bf16 weights also its fp32 upcast input (the
    # bf16 input itself is then not kept). Its output is all-gathered and not kept itself.
    norm = local + 4 * b * sl + (4 * b * sl * h if pure else 0)
    core, work, _ = attention_bytes(shape, replace(act, seq_len=s), c)
    if act.attention_mask and kv == 1 and a > 1:
        # One key/value head per rank: transformers' repeat_kv expands it to the rank's heads as a view (a
        # size-1 dimension reshapes without a copy), so k and v stay (b, 1, s, d).
        core -= 2 * b * s * (a - kv) * d * c
    block_input = 0 if pure else local  # the s/T copy of the block input (bf16 weights: the upcast instead)
    mid_residual = 0 if pure else local  # the post-attention norm's input
    attn_saved = block_input + norm + gathered + core
    mlp_saved = mid_residual + norm + gathered + 4 * b * s * I * c
    return LayerBytes(
        saved=attn_saved + mlp_saved,
        attn_saved=attn_saved,
        # At the MLP's reduce-scatter: the norm output (its caller's), the down projection's (b, s, h)
        # partial sums, their copy in the scatter's layout and the scattered (b, s/T, h) result.
        forward_transient=c * b * sl * h + 2 * gathered + c * b * sl * h,
        # The stream's gradient on s/T positions, then the gated product's: two (b, s, I/T) gradients beside
        # the saved factors (the product's input freed).
        mlp_backward=local + 2 * b * s * I * c,
        # The stream's gradient all-gathered for o's input gradient, the gradients of q, k, v.
        attn_backward=local + gathered + b * s * a * d * c + work,
        # A checkpointed block keeps its s/T input positions: the input hook that cuts them runs before the
        # checkpointed forward (measured: the whole input is freed).
        checkpoint_saved=local,
        grads=4 * shape.layer_numel,
        mlp_grads=4 * (3 * h * I),
        mlp_first_grad=4 * h * I,
    )


def model_activations_tp(shape: ModelShape, settings: Settings, act: Settings, layer: LayerBytes,
                         tensor_parallel: int) -> ModelActivations:
    """What one rank's forward leaves saved: the blocks as `layer_bytes_tp`, the final norm on the whole
    sequence (it keeps its whole input too), the head's gathered rows, rotary tables in the compute dtype."""
    b, s, h, L = settings.micro_batch_size, settings.seq_len, shape.hidden, shape.num_layers
    c, sb = compute_bytes(act), stream_bytes(act)
    k = min(settings.gradient_checkpointing, L)
    t = b * settings.targets_per_row
    whole = sb * b * s * h
    final_norm = whole + 4 * b * s + (4 * b * s * h if act.pure_bf16 else whole)
    kept_mask = b * s * s if k > 0 and settings.attention_mask else 0
    saved_by_layer = tuple(layer.checkpoint_saved if i < k else layer.saved for i in range(L))
    return ModelActivations(
        # The embedding's output is not kept (the first block keeps its own s/T copy); it lives through the
        # forward (`tp_layout`).
        stream_in=0, final_norm=final_norm, lm_head_input=t * h * c,
        rope=2 * c * b * s * shape.rotary_dim,  # cos and sin, cast to the activations' dtype
        head_copy=0, kept_mask=kept_mask, saved_by_layer=saved_by_layer,
        offloaded=k * layer.checkpoint_saved if settings.offload_activations else 0,
        mask_bool=b * s * s if settings.attention_mask else 0,
    )


def tp_layout(tl: Timeline) -> Layout:
    """The walk of a tensor-parallel rank: `fsdp.Units` over the rank's shape and the data-parallel processes,
    with the block, head and embedding terms of the module docstring.

    FSDP2 keeps a unit's all-gather buffer beside its gathered weights until the next unit's gather, and in
    backward prefetches the next unit's gather; over one data-parallel process the gathered weights are that
    buffer (one copy) and the next unit is gathered only after this one's post-backward (measured). The
    embedding's forward is a masked lookup of the rank's rows whose (b, s, h) partial sums are all-reduced; its
    backward makes a dense gradient of the rows and its masked copy. The embedding's output lives through the
    forward (the model's own reference, not saved), the last block's whole input beside it."""
    x = tl.terms
    assert isinstance(x, TensorParallelTerms)
    n = x.settings.num_processes  # the data-parallel processes FSDP2 shards over
    units = Units(tl, copies=2 if n > 1 else 1, prefetching=n > 1, masked=1)
    whole = x.bsh4  # the stream on every position (between blocks)
    return Layout(layers=(0, x.shape.num_layers), embedding=True, head=_vocabulary_parallel_head, gradients=units,
                  gathered_embedding=units.gathered_embedding(), gathered_layer=units.gathered_last_layer(),
                  lookup=2, forward_stream=whole + (whole if x.shape.num_layers > 1 else 0))


def _vocabulary_parallel_head(tl: Timeline, units: Units) -> int:
    """The head: the final norm's whole output, the rank's (t, V/T) logits, the all-gather's buffer and the whole
    (t, V) logits; in backward the logits' gradient (and its 16-bit cast), the rank's slice copied out of it,
    then the head's unsharded weight gradient, the rows' gradient and its all-reduce; last the final norm's
    backward on the whole sequence and the last block's s/T slice of its gradient."""
    x = tl.terms
    assert isinstance(x, TensorParallelTerms)
    t, c, h, done = x.t, x.c, x.shape.hidden, units.done
    logits32, whole_c, acts_total, whole = x.logits32, x.whole_logits_c, x.acts.total, x.bsh4
    local_logits = t * x.shape.vocab * c  # this rank's vocabulary slice of the logits
    kept_head, gathered_head = units.kept_head(), units.gathered_head()
    add = tl.add
    add("forward of the lm head / loss", done, acts_total, local_logits + 2 * whole_c, whole, backward=False,
        unsharded=(units.in_head(), 0))
    if c == 2:
        add("forward of the lm head / loss", done, acts_total, whole_c + logits32, 0, backward=False,
            unsharded=(kept_head, 0))
    add("forward of the lm head / loss", done, acts_total, 2 * logits32, 0, backward=False, unsharded=(kept_head, 0))
    add("backward of the lm head / loss", done, acts_total, 3 * logits32, 0, unsharded=(kept_head, 0))
    add("backward of the lm head / loss", done, acts_total, logits32 + (whole_c if c == 2 else 0) + local_logits, 0,
        unsharded=(gathered_head, 0))
    add("backward of the lm head / loss", done, acts_total, local_logits, 2 * t * h * c,
        unsharded=(gathered_head, units.pb * units.vh))
    return units.head_end(tl, acts_total - x.acts.lm_head_input, whole + t * h * c, 3 * whole + 4 * t * h)


# Collectives of one block per micro-batch, as parallel.py's plan runs them (counted in the op trace of the
# measured step, benchmarks/tensor_parallel_memory.py): forward, 3 all-gathers of the (b, s, h) stream (the two
# norms' outputs, the block's output) and 2 reduce-scatters (o and down); backward, 2 all-gathers (the
# reduce-scatters' gradients) and 5 all-reduces (the input gradients of q, k, v, gate and up, each reduced
# on its own). In units of one all-gather's traffic: an all-reduce moves twice as much.
BLOCK_FORWARD_COLLECTIVES = 5
BLOCK_BACKWARD_COLLECTIVES = 7
BLOCK_FORWARD_TRAFFIC = 5
BLOCK_BACKWARD_TRAFFIC = 2 + 2 * 5


@dataclass(frozen=True)
class Collectives:
    """What one rank sends over its tensor-parallel group in one optimizer step."""

    bytes: float  # ring collectives: an all-gather or reduce-scatter of X bytes moves (T - 1) / T · X per rank
    count: int  # collectives (each pays a latency)


def collectives(shape: ModelShape, settings: Settings) -> Collectives:
    """The tensor-parallel traffic of one optimizer step of `settings` (none without tensor parallel): every
    block's (`BLOCK_*`), a checkpointed block's forward again, the embedding's all-reduce, the logits' all-gather
    and the head input gradient's all-reduce; per micro-batch, times the accumulation."""
    T = settings.tensor_parallel
    if T == 1:
        return Collectives(0.0, 0)
    act = settings if settings.mixed_precision != "bf16" else replace(settings, pure_bf16=True)
    c = compute_bytes(act)
    b, L = settings.micro_batch_size, shape.num_layers
    s = math.ceil(settings.seq_len / T) * T
    k = min(settings.gradient_checkpointing, L)
    t = b * settings.targets_per_row
    stream = c * b * s * shape.hidden
    share = (T - 1) / T
    blocks = L * (BLOCK_FORWARD_TRAFFIC + BLOCK_BACKWARD_TRAFFIC) + k * BLOCK_FORWARD_TRAFFIC
    per_micro = share * (stream * (blocks + 2) + t * shape.vocab * c + 2 * t * shape.hidden * c)
    count = L * (BLOCK_FORWARD_COLLECTIVES + BLOCK_BACKWARD_COLLECTIVES) + k * BLOCK_FORWARD_COLLECTIVES + 3
    ga = settings.gradient_accumulation_steps
    return Collectives(ga * per_micro, ga * count)
