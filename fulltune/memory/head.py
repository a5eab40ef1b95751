"""The output head and the loss: the (t, V) logits, their fp32 upcast, log_softmax and its backward.

The trainer runs the head only at the t positions with a target (fulltune/runtime/loss.py): a forward pre-hook
gathers its input (b, s, h) → (t, h). The loss upcasts the logits to fp32 and `log_softmax` keeps its fp32
output; its backward holds three fp32 (t, V) tensors at once (saved output, grad of nll, grad of
log_softmax): the usual peak for vocabularies over ~30k (the Liger and Cut-Cross-Entropy papers measure the
same). The chunked head (`chunked_loss`) computes the same in (rows × vocabulary) tiles.
"""

from __future__ import annotations

from fulltune.memory.timeline import Timeline

# The chunked head's tiles (fulltune/runtime/loss.py `ChunkedLinearCrossEntropy`): rows × vocabulary entries.
ROW_CHUNK = 4096
VOCAB_CHUNK = 8192


def chunked_head_bytes(targets: int, hidden: int, vocab: int, compute_bytes: int = 4,
                       row_chunk: int = ROW_CHUNK, vocab_chunk: int = VOCAB_CHUNK) -> dict[str, int]:
    """Memory of the chunked head beyond its input and the weight gradient, as the memory model counts it.

    saved: the per-row logsumexp kept from forward to backward (fp32).
    backward: the peak of backward's temporaries: the fp32 gradient of the head input, one weight-row
    tile's fp32 gradient accumulator and its cast, and the tiles (`_tile_peak`).
    """
    cols = min(vocab, vocab_chunk)
    weight_tile = cols * hidden * (4 + compute_bytes)
    tiles = _tile_peak(targets, vocab, compute_bytes, row_chunk, vocab_chunk)
    return {"saved": 4 * targets, "backward": 4 * targets * hidden + weight_tile + tiles}


def _tile_peak(targets: int, vocab: int, c: int, row_chunk: int, vocab_chunk: int) -> int:
    """The largest the backward's tiles hold at once. A tile holds its logits (compute dtype) and their fp32
    gradient with its cast to a 16-bit compute dtype (an fp32 one is the gradient itself): 8 bytes per entry in
    fp32 and in bf16. Every tile after the first also has the previous tile's cast gradient beside it (its
    variable is rebound only when the next gradient exists). Tiles run over the rows within each vocabulary
    slice. Measured with MemTracker on real tensors, the head the step's peak (2 × 127 targets): one tile
    (vocabulary 4,096) within 0.2%, three vocabulary slices (20,000) within 0.1% in fp32 and bf16; counted
    before as 12 and 10 bytes per entry whatever the tiles, one tile was 11.6% (fp32) and 5.6% (bf16) over."""
    own = c + 4 + (c if c != 4 else 0)  # per entry
    row_sizes = [min(row_chunk, targets - r) for r in (0, row_chunk)] if targets > row_chunk else [targets]
    col_sizes = [min(vocab_chunk, vocab - v) for v in (0, vocab_chunk)] if vocab > vocab_chunk else [vocab]
    last_rows = targets - (targets - 1) // row_chunk * row_chunk
    peaks = [own * row_sizes[0] * col_sizes[0]]  # the first tile
    if len(row_sizes) > 1:  # the next row tile of a slice, beside a whole row tile's gradient
        peaks.append(own * row_sizes[1] * col_sizes[0] + c * row_sizes[0] * col_sizes[0])
    if len(col_sizes) > 1:  # the next slice's first tile, beside the previous slice's last tile's gradient
        peaks.append(own * row_sizes[0] * col_sizes[1] + c * last_rows * col_sizes[0])
    return max(peaks)


def head_phases(tl: Timeline) -> None:
    """The whole head: (t, V) logits, their fp32 upcast, log_softmax and its backward."""
    x = tl.terms
    t, h, V, c = x.t, x.shape.hidden, x.shape.vocab, x.c
    total, below = x.acts.total, x.acts.below_head
    grads_before, head_grad = x.grads_before, head_gradient(tl)
    # lm_head's forward: the final norm's (b, s, h) output is alive until the model returns, next to
    # the gathered rows.
    tl.add("forward of the lm head / loss", grads_before, total, x.logits_c, x.bsh4 + 4 * t * h, backward=False)
    # lm_head output, its fp32 upcast and log_softmax's fp32 output.
    if x.mixed or c == 2:
        tl.add("forward of the lm head / loss", grads_before, total, x.logits_c + x.logits32, 0, backward=False)
    tl.add("forward of the lm head / loss", grads_before, total, 2 * x.logits32, 0, backward=False)
    # Backward of the loss: saved log_softmax output + grad of nll + grad of log_softmax.
    tl.add("backward of the lm head / loss", grads_before, total, 3 * x.logits32, 0)
    # Backward of lm_head: grad of logits (compute dtype) + weight gradient (under autocast first a
    # 16-bit one). Tied: it waits in autograd's input buffer for the embedding's share.
    head_grad_tmp = 2 * V * h if x.mixed else 0
    g = grads_before if x.accumulating else head_grad
    tl.add("backward of the lm head / loss", g, total, x.logits_c + (x.logits32 if c == 2 else 0),
           head_grad_tmp + (head_grad if x.new_grad_added else 0) + t * h * c, now=head_grad)
    # Backward of the gather: the rows' gradient scattered into a zero (b, s, h) tensor.
    tl.add("backward of the lm head / loss", g, below, 0, x.bsh4 + 4 * t * h, now=head_grad)


def chunked_head_phases(tl: Timeline) -> None:
    """The chunked head (fulltune/runtime/loss.py): a per-row logsumexp kept, one (rows × vocabulary) tile at a time."""
    x = tl.terms
    t, h, V, c, sb = x.t, x.shape.hidden, x.shape.vocab, x.c, x.sb
    total, below = x.acts.total, x.acts.below_head
    grads_before, head_grad = x.grads_before, head_gradient(tl)
    tiles = chunked_head_bytes(t, h, V, c)
    rows, cols = min(t, ROW_CHUNK), min(V, VOCAB_CHUNK)
    in_compute_dtype = x.levers.weight_bytes == c
    if in_compute_dtype:
        # The weights are in the compute dtype: the weight tile's cast is a view, no copy (measured with
        # MemTracker on real tensors: exactly cols·h·c less than `chunked_head_bytes`).
        tiles = {**tiles, "backward": tiles["backward"] - cols * h * c}
    # Forward: the logsumexp and target logit (fp32 per row), one tile's logits and their fp32 copy,
    # the weight tile and row casts (when the weights are not in the compute dtype).
    cast = 0 if in_compute_dtype else cols * h * c + rows * h * c
    tl.add("forward of the lm head / loss", grads_before, total, 0,
           x.bsh4 + 8 * t + rows * cols * (c + 4) + cast, backward=False)
    # Backward: the weight gradient (the head's .grad-to-be), the tiles, and the fp32 input gradient
    # (cast to the stream dtype at the end when that is 16-bit).
    g = grads_before if x.accumulating else head_grad
    added = head_grad if x.new_grad_added else 0
    tl.add("backward of the lm head / loss", g, total, 0, tiles["saved"] + tiles["backward"] + added, now=head_grad)
    if sb != 4:
        tl.add("backward of the lm head / loss", g, total, 0, tiles["saved"] + 4 * t * h + sb * t * h + added,
               now=head_grad)
    tl.add("backward of the lm head / loss", g, below, 0, x.bsh4 + sb * t * h, now=head_grad)


def head_gradient(tl: Timeline) -> int:
    """The head weight's gradient on this process (the embedding's when tied)."""
    x = tl.terms
    return int(x.levers.weight_bytes * x.shape.vocab * x.shape.hidden * x.grad_shard)
