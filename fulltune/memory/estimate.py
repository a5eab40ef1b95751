"""Analytic peak memory of one training step, as fulltune's trainer runs it.

The trainer (fulltune/train.py) runs, per optimizer step and per process:

    for each of gradient_accumulation_steps micro-batches:
        # lm_head runs on the t positions that have a target (fulltune/loss.py): a forward
        # pre-hook gathers its input (b, s, h) → (t, h); t ≤ b·(s-1)
        logits = model(input_ids, position_ids, attention_mask).logits.float()   # (t, V)
        loss = cross_entropy(logits, targets, reduction="sum") / tokens  # logits freed on return
        accelerator.backward(loss)
    accelerator.clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad(set_to_none=True)

The model here walks that step as a timeline of allocations and frees and reports its maximum.
Every byte count comes from the tensors autograd saves in the transformers 5 implementations
(listed per layout below; checked with `saved_tensors_hooks` and MemTracker on CPU):

- Weights stay fp32 (4 B/param) under mixed precision; autocast makes a 16-bit copy of every
  linear weight the first time the forward uses it and the backward keeps it until that layer's
  gradient is computed (+2 B per matmul parameter from the forward until the layer's backward).
- Gradients are fp32 like the weights. With `zero_grad(set_to_none=True)` and no accumulation
  they appear layer by layer during backward; with accumulation they exist for the whole step.
- The loss upcasts logits to fp32 and `log_softmax` keeps its fp32 output; its backward holds
  three fp32 (t, V) tensors at once (saved output, grad of nll, grad of log_softmax): the
  usual peak for vocabularies over ~30k (Liger and Cut-Cross-Entropy papers measure the same).
- A checkpointed layer keeps only its input and rebuilds its activations during its backward.
- Keeping a reference to the logits through backward would add 4·t·V bytes at the peak; the
  trainer drops it (measured with Accelerate on CPU: +17.8% for a 3k vocabulary otherwise).
- The gather's backward scatters the head input's gradient into a zero (b, s, h) fp32 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fulltune.memory.shapes import ModelShape, model_shape
from fulltune.memory.types import MemoryEstimate, Settings

# bitsandbytes keeps tensors with fewer elements than this in 32-bit states (bnb `min_8bit_size`).
BNB_MIN_8BIT_SIZE = 4096
# bitsandbytes blockwise quantisation: one fp32 absmax per 256 elements and per state.
BNB_BLOCKSIZE = 256
# CUDA context + cuBLAS workspace on a recent GPU with lazy module loading (torch 2.x): ~0.5 GiB.
CUDA_CONTEXT_BYTES = 600 * 2**20
# The caching allocator reserves more than it hands out; 8% of the peak is typical for training
# steps with varying activation sizes (torch.cuda.memory_reserved vs max_memory_allocated).
CUDA_ALLOCATOR_SLACK = 0.08
# A CPU process also holds the Python interpreter, torch and transformers (~1 GiB RSS) and the
# glibc allocator keeps freed blocks around.
CPU_PROCESS_BYTES = 2**30
CPU_ALLOCATOR_SLACK = 0.05


@dataclass(frozen=True)
class _Layer:
    """Bytes of one decoder layer for a given micro-batch."""

    saved: int  # activations autograd keeps from the forward until this layer's backward
    attn_saved: int  # the part of `saved` that belongs to the attention half (alive after the MLP backward)
    forward_transient: int  # extra bytes alive at the layer's forward peak
    mlp_backward: int  # extra bytes at the MLP backward peak (gradients of (b, s, I) tensors)
    attn_backward: int  # extra bytes at the attention backward peak (gradients of q, k, v, ...)
    checkpoint_saved: int  # what a checkpointed layer keeps besides its input (its output)
    grads: int  # fp32 gradient bytes of its parameters
    mlp_grads: int  # fp32 gradient bytes of the MLP weights (produced before the attention backward)
    mlp_first_grad: int  # fp32 gradient bytes of the MLP output projection (made first in backward)


def _compute_bytes(settings: Settings) -> int:
    """Bytes per element of the activations autocast produces."""
    if settings.mixed_precision == "bf16":
        return 2
    if settings.mixed_precision == "fp16" and settings.device == "cuda":
        return 2
    # Accelerate leaves fp16 off on CPU (native_amp is False there): the step runs in fp32.
    return 4


def _attention_bytes(shape: ModelShape, settings: Settings, c: int) -> tuple[int, int, bool]:
    """(saved, backward working set, fused kernel?) bytes of the attention core of one layer."""
    b, s = settings.micro_batch_size, settings.seq_len
    a, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    mask = settings.attention_mask
    q = b * s * a * d * c
    dropout = shape.attention_dropout > 0
    probs32 = 4 * b * a * s * s
    probs = b * a * s * s * c
    if settings.attn_implementation == "eager":
        # transformers' eager attention: k/v heads repeated, the (b, a, s, s) softmax kept in fp32,
        # its 16-bit cast under autocast (or with dropout the mask and the dropped probabilities),
        # q, k, v and the attention output (copied by the reshape before o_proj).
        saved = 4 * q + probs32 + (2 * probs if dropout else (probs if c == 2 else 0))
        # Backward of the softmax: the fp32 grad of the probabilities and the softmax's own
        # output grad live beside the saved softmax; the 16-bit copy, v and the attention output
        # were released by the nodes before.
        return saved, 2 * probs32 - (probs if c == 2 else 0) - 2 * q, False
    if dropout and settings.device == "cpu":
        # SDPA with dropout on CPU falls back to the math kernel, which upcasts q, k, v to fp32 and
        # keeps the fp32 softmax, dropout mask and dropped probabilities; the output is cast back.
        q32 = 4 * b * s * a * d
        return 3 * q32 + 3 * probs32 + q, probs32 - 2 * q32, False
    lse = 4 * b * a * s  # fp32 logsumexp of the fused kernels
    # transformers passes enable_gqa to SDPA only without a mask; with one it repeats k/v heads.
    kvr = a if (mask and kv < a) else kv
    kv_bytes = b * s * kvr * d * c
    saved = 2 * q + 2 * kv_bytes + lse
    if mask:
        # SDPA turns the boolean (b, 1, s, s) mask into an additive one of the query dtype in every
        # layer and keeps it for backward.
        saved += b * s * s * c
    # Backward: grads of q, k, v (+ of the repeated heads, summed back to the kv heads).
    work = q + 2 * kv_bytes + (2 * b * s * kv * d * c if kvr != kv else 0)
    return saved, work, True


def _layer(shape: ModelShape, settings: Settings) -> _Layer:
    b, s = settings.micro_batch_size, settings.seq_len
    h, I = shape.hidden, shape.intermediate
    a, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    c = _compute_bytes(settings)
    mixed = c == 2
    bsh4 = 4 * b * s * h  # one fp32 residual-stream tensor
    bshc = b * s * h * c
    bsI = b * s * I * c
    attn_core, attn_work, fused = _attention_bytes(shape, settings, c)
    # FSDP / ZeRO-3 gather 16-bit parameters per layer and free them after use, so autocast
    # copies are not kept (the gathered layers are counted with the communication buffers).
    sharded_params = settings.strategy in ("fsdp", "deepspeed_zero3")
    weight_copies = 2 * shape.layer_matmul_numel if mixed and not sharded_params else 0
    mlp_params = 2 * h * I + (I * h if shape.gated_mlp else 0)
    # The grad of the layer output (fp32 residual stream) is alive through the layer's backward.
    grad_stream = bsh4

    if shape.layout == "llama":
        # RMSNorm: fp32 input (the residual stream), 1/rms (b, s, 1) and the normalised x. The layer
        # input is counted as the previous layer's output; the mid residual belongs to this layer.
        norm = bsh4 + 4 * b * s
        # Linear inputs: fp32 norm outputs (shared by q/k/v and by gate/up), or under autocast one
        # 16-bit cast per projection (q, k, v, gate, up each cast their input separately).
        attn_inputs = 3 * b * s * h * 2 if mixed else bsh4
        mlp_inputs = 2 * b * s * h * 2 if mixed else bsh4
        qk_norm = 0
        if shape.qk_norm:
            # Qwen3 RMSNorm on q and k per head: the fp32 (upcast) input, 1/rms, and the
            # normalised x cast back to the compute dtype.
            qk_norm = (4 + c) * b * s * (a + kv) * d + 4 * b * s * (a + kv)
        attn_saved = norm + attn_inputs + attn_core + qk_norm
        # Gated MLP: gate output (act input), act output, up output, product (down input).
        mlp_saved = bsh4 + norm + mlp_inputs + 4 * bsI
        # Backward of the gated product: grad of the product and of both factors at once.
        mlp_backward = 2 * bsI
        forward_transient = 2 * bsh4
    elif shape.layout == "gpt2":
        # LayerNorm: input (stream / mid residual), mean and rstd (b, s, 1).
        norm = 8 * b * s
        attn_inputs = b * s * h * 2 if mixed else bsh4
        mlp_inputs = attn_inputs
        # SDPA's q, k and v are views of the c_attn output (b, s, 3h): that whole buffer is kept.
        fused_qkv = 3 * bshc - b * s * a * d * c - 2 * b * s * kv * d * c
        attn_saved = norm + attn_inputs + attn_core + (fused_qkv if fused else 0)
        if shape.activation in ("gelu_new", "gelu_fast", "gelu_pytorch_tanh_python"):
            # The python tanh-GELU keeps four (b, s, I) tensors. CUDA autocast runs `pow` in fp32
            # (torch.amp op lists), which makes three of them fp32; CPU autocast keeps them 16-bit.
            if mixed and settings.device == "cuda":
                act_saved = b * s * I * (4 + 4 + 4 + 2)
            else:
                act_saved = 4 * bsI
            mlp_backward = 2 * bsI
        else:
            act_saved, mlp_backward = bsI, bsI
        mlp_saved = bsh4 + norm + mlp_inputs + act_saved + bsI
        if shape.hidden_dropout > 0:
            # Dropout keeps its mask: in the input's dtype on CPU, boolean on CUDA.
            mask_bytes = b * s * h * (c if settings.device == "cpu" else 1)
            attn_saved += mask_bytes
            mlp_saved += mask_bytes
        forward_transient = 2 * bsh4
    else:  # gpt_neox
        norm = 8 * b * s
        attn_inputs = b * s * h * 2 if mixed else bsh4
        mlp_inputs = attn_inputs
        # q and k are rebuilt by the partial rotary concat; v is a view of the fused qkv output
        # (b, s, 3h), which is kept whole; the reshape before `dense` copies the attention output.
        fused_qkv = 3 * bshc - b * s * kv * d * c + bshc
        attn_saved = norm + attn_inputs + attn_core + (fused_qkv if fused else 0)
        mlp_saved = norm + mlp_inputs + 2 * bsI + (0 if shape.parallel_residual else bsh4)
        mlp_backward = bsI
        forward_transient = 2 * bsh4
    return _Layer(
        saved=attn_saved + mlp_saved + weight_copies,
        # The attention half keeps its share of the 16-bit weight copies after the MLP backward.
        attn_saved=attn_saved + weight_copies * (shape.layer_matmul_numel - mlp_params) // shape.layer_matmul_numel,
        forward_transient=forward_transient,
        mlp_backward=grad_stream + mlp_backward,
        attn_backward=grad_stream + bshc + attn_work,
        checkpoint_saved=bsh4,
        grads=4 * shape.layer_numel,
        mlp_grads=4 * mlp_params,
        mlp_first_grad=4 * h * I,
    )


def _optimizer_state_bytes(shape: ModelShape, optimizer: str, shard: float) -> tuple[int, int]:
    """(persistent state bytes, temporary bytes during `step`) for the whole model."""
    shapes = shape.param_shapes
    if optimizer == "adamw":
        # torch AdamW: exp_avg + exp_avg_sq in fp32 and a fp32 `step` tensor per parameter
        # (fused/capturable keep it on the device). The fused kernel updates in place.
        state = sum(8 * _n(sh) + 4 for sh in shapes)
        return int(state * shard), 0
    if optimizer == "adamw_8bit":
        state = 0
        for sh in shapes:
            n = _n(sh)
            if n < BNB_MIN_8BIT_SIZE:
                state += 8 * n
            else:
                blocks = -(-n // BNB_BLOCKSIZE)
                state += 2 * n + 2 * 4 * blocks
        state += 2 * 256 * 4  # the two quantisation maps
        # The CPU/CUDA kernels update block by block in place; no full-size temporaries.
        return int(state * shard), 0
    # transformers Adafactor without beta1: factored second moment (row and column means) for
    # matrices, a full second moment for vectors, and an RMS scalar and step per parameter.
    state = 0
    largest = 0
    for sh in shapes:
        n = _n(sh)
        if len(sh) >= 2:
            rows = _n(sh[:-1])
            cols = _n(sh[:-2] + sh[-1:])
            state += 4 * (rows + cols)
        else:
            state += 4 * n
        state += 4
        largest = max(largest, n)
    # Adafactor.step builds `grad**2 + eps`, then the approximated update and `-update` (full-size
    # fp32 each) for one parameter at a time: two live at once for the largest tensor.
    return int(state * shard), 2 * 4 * largest


def _n(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def estimate_memory(config: Any, settings: Settings) -> MemoryEstimate:
    """Peak memory of one steady-state optimizer step of `config` trained with `settings`.

    Pure arithmetic (no torch); per process. See the module docstring for what is counted.

    Raises:
        MemoryConfigError: the config lacks the dimensions of a decoder-only causal LM.
    """
    shape = model_shape(config)
    return _estimate(shape, settings)


def _estimate(shape: ModelShape, settings: Settings, timeline: list | None = None) -> MemoryEstimate:
    """`estimate_memory` on a parsed shape; `timeline` (if given) receives every (phase, bytes, parts)."""
    b, s = settings.micro_batch_size, settings.seq_len
    h, V, L = shape.hidden, shape.vocab, shape.num_layers
    P = shape.num_params
    c = _compute_bytes(settings)
    mixed = c == 2
    k = min(settings.gradient_checkpointing, L)
    n = settings.num_processes
    strategy = settings.strategy
    notes: list[str] = []
    if shape.approximate:
        notes.append(f"model_type {shape.model_type!r} is modelled as a Llama-like decoder; expect a few % error")
    if settings.mixed_precision == "fp16" and settings.device == "cpu":
        notes.append("Accelerate does not autocast fp16 on CPU: counted as fp32")
    if settings.gradient_checkpointing > L:
        notes.append(f"gradient_checkpointing={settings.gradient_checkpointing} capped at {L} layers")

    # --- what persists through the step (per process) ---
    param_shard = grad_shard = state_shard = 1.0
    if strategy in ("fsdp", "deepspeed_zero3"):
        param_shard = grad_shard = state_shard = 1.0 / n
    elif strategy == "deepspeed_zero2":
        grad_shard = state_shard = 1.0 / n
    params = int(4 * P * param_shard)
    buffers = 4 * (shape.rotary_dim // 2) if shape.rotary_dim else 0
    states, opt_temp = _optimizer_state_bytes(shape, settings.optimizer, state_shard)
    grads_total = int(4 * P * grad_shard)
    gathered = buckets = 0  # communication buffers: gathered parameters, gradient buckets
    if strategy == "ddp":
        # DDP keeps flat gradient buckets besides .grad (gradient_as_bucket_view=False default).
        buckets = 4 * P
    elif strategy in ("fsdp", "deepspeed_zero3"):
        # Two layers' full parameters are gathered at a time (current + prefetch), the embedding
        # while it is used, plus one layer's unsharded gradients before reduce-scatter.
        gathered = 2 * 4 * shape.layer_numel + (4 * shape.embedding_numel if n > 1 else 0)
        buckets = 4 * shape.layer_numel
    elif strategy == "deepspeed_zero2":
        # Gradients are reduced in buckets about two layers large before being partitioned.
        buckets = 2 * 4 * shape.layer_numel
    t = b * settings.targets_per_row  # positions with a target: the head's rows
    batch = 2 * 8 * b * s + 2 * 8 * t  # input_ids, position_ids; target index and tokens (int64)
    accumulating = settings.gradient_accumulation_steps > 1
    grads_before = grads_total if accumulating else 0

    layer = _layer(shape, settings)
    bsh4 = 4 * b * s * h
    # Model-level saved tensors: the embedding output, the final norm (input is the last layer's
    # output, normalised x, 1/rms or mean/rstd), the lm_head input, rotary cos/sin.
    # RMSNorm keeps the normalised x and 1/rms; LayerNorm only mean and rstd (its input, the last
    # layer's output, is counted with that layer).
    final_norm = bsh4 + 4 * b * s if shape.layout == "llama" else 8 * b * s
    lm_head_input = t * h * c  # the gathered rows (a 16-bit copy under autocast)
    rope = 2 * 4 * b * s * shape.rotary_dim if shape.rotary_dim else 0
    head_copy = 2 * V * h if mixed and settings.strategy not in ("fsdp", "deepspeed_zero3") else 0
    stream_in = bsh4  # embedding output (the input of layer 0)
    if shape.layout == "gpt2" and shape.embedding_dropout > 0:
        stream_in += b * s * h * (4 if settings.device == "cpu" else 1)
    # Checkpointed layers keep their inputs alive until their backward, the attention mask among
    # them (boolean for SDPA, an fp32 additive mask for eager attention).
    kept_mask = 0
    if k > 0 and (settings.attention_mask or settings.attn_implementation == "eager"):
        kept_mask = b * s * s * (4 if settings.attn_implementation == "eager" else 1)
    model_saved = stream_in + final_norm + lm_head_input + rope + head_copy + kept_mask
    # Per layer: its saved tensors and its output (the next layer's input). A checkpointed layer
    # keeps only its output (checkpoint keeps the layer input, the previous layer's output).
    full = layer.saved + bsh4
    saved_by_layer = [layer.checkpoint_saved if i < k else full for i in range(L)]
    acts_total = model_saved + sum(saved_by_layer)
    mask_bool = b * s * s if settings.attention_mask else 0

    logits_c = t * V * c  # lm_head output in the compute dtype
    logits32 = 4 * t * V

    phases: list[tuple[str, int, dict[str, int]]] = []

    def add(phase: str, grads: int, acts: int, logits: int, temp: int) -> None:
        parts = {
            "parameters": params + buffers + gathered,
            "gradients": grads + buckets,
            "optimizer_states": states,
            "activations": acts + batch,
            "logits": logits,
            "temporary": temp,
        }
        phases.append((phase, sum(parts.values()), parts))

    # Forward: the last layer's forward peak with everything below it saved.
    before_head = acts_total - final_norm - lm_head_input - head_copy
    add("forward", grads_before, before_head, 0, layer.forward_transient + mask_bool)
    # lm_head's forward: the final norm's (b, s, h) output is alive until the model returns, next to
    # the gathered fp32 rows.
    add("forward of the lm head / loss", grads_before, acts_total, logits_c, bsh4 + 4 * t * h)
    # lm_head output, its fp32 upcast and log_softmax's fp32 output.
    if mixed:
        add("forward of the lm head / loss", grads_before, acts_total, logits_c + logits32, 0)
    add("forward of the lm head / loss", grads_before, acts_total, 2 * logits32, 0)
    # Backward of the loss: saved log_softmax output + grad of nll + grad of log_softmax.
    add("backward of the lm head / loss", grads_before, acts_total, 3 * logits32, 0)
    # Backward of lm_head: grad of logits (compute dtype) + weight gradient (fp32; under autocast
    # first a 16-bit one). Tied: it waits in autograd's input buffer for the embedding's share.
    head_grad = int(4 * V * h * grad_shard)
    head_grad_tmp = 2 * V * h if mixed else 0
    after_head = acts_total - lm_head_input - head_copy - final_norm
    g = grads_before if accumulating else head_grad
    add(
        "backward of the lm head / loss",
        g,
        acts_total,
        logits_c + (logits32 if mixed else 0),
        head_grad_tmp + (head_grad if accumulating else 0) + t * h * c,
    )
    # Backward of the gather: the rows' fp32 gradient scattered into a zero (b, s, h) tensor.
    add("backward of the lm head / loss", grads_before if accumulating else head_grad, after_head, 0,
        bsh4 + 4 * t * h)

    # Backward through the layers, last to first. Each layer has two peaks: the MLP backward
    # (everything of the layer still saved, plus the grads of the (b, s, I) tensors) and the
    # attention backward (the MLP part freed, its weight gradients made, grads of q, k, v).
    layer_grads = int(layer.grads * grad_shard)
    grads_now = grads_before if accumulating else head_grad + 4 * h * (2 if shape.layout != "llama" else 1)
    # Tied: the head's weight gradient waits in autograd's input buffer for the embedding's share
    # (when accumulating it is not yet added into .grad, so it is extra).
    waiting = head_grad if shape.tied and accumulating else 0
    grads_now += waiting
    acts_now = after_head
    for i in reversed(range(L)):
        below = acts_now - saved_by_layer[i]
        # A checkpointed layer first rebuilds the same activations (non-reentrant checkpoint
        # with early stop: its output is not rebuilt).
        grad_mlp = 0 if accumulating else int(layer.mlp_grads * grad_shard)
        # The down/output projection's weight gradient is made before the MLP backward peak;
        # when accumulating it is a new tensor added into the existing .grad.
        first = layer.mlp_first_grad
        add(
            f"backward of layer {i}",
            grads_now + (0 if accumulating else int(first * grad_shard)),
            below,
            0,
            layer.saved + layer.mlp_backward + (first if accumulating else 0),
        )
        add(f"backward of layer {i}", grads_now + grad_mlp, below, 0, layer.attn_saved + layer.attn_backward)
        grads_now += 0 if accumulating else layer_grads
        acts_now = below
    # Embedding backward: a dense (V, h) gradient. Tied, autograd then sums it with the waiting head
    # gradient out of place (three (V, h) tensors at once, .grad not yet among them unless
    # accumulating); untied and accumulating, it is added into the existing .grad.
    # At the end of backward every gradient exists.
    emb_grad = int(4 * V * h * grad_shard)
    emb_tmp = (3 if accumulating else 2) * emb_grad if shape.tied else (emb_grad if accumulating else 0)
    add("backward of the embeddings", grads_total, max(acts_now, 0), 0, emb_tmp)

    # Optimizer step: all gradients, states, the optimizer's own temporaries.
    add("optimizer step", grads_total, 0, 0, opt_temp)

    if timeline is not None:
        timeline.extend(phases)
    phase, peak, parts = max(phases, key=lambda p: p[1])
    overhead = _runtime_overhead(settings, peak)
    breakdown = {key: int(value) for key, value in parts.items()}
    breakdown["runtime_overhead"] = int(overhead)
    return MemoryEstimate(
        peak_bytes=int(peak),
        device_bytes=int(peak + overhead),
        breakdown=breakdown,
        peak_phase=phase,
        notes=tuple(notes),
    )


def _runtime_overhead(settings: Settings, peak: int) -> int:
    if settings.device == "cuda":
        return int(CUDA_CONTEXT_BYTES + CUDA_ALLOCATOR_SLACK * peak)
    return int(CPU_PROCESS_BYTES + CPU_ALLOCATOR_SLACK * peak)


def num_parameters(config: Any) -> int:
    """Parameter count of `config` as the memory model counts it."""
    return model_shape(config).num_params


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token, 6N + 12·L·h·s (PaLM appendix B; no recompute)."""
    shape = model_shape(config)
    return 6.0 * shape.num_params + 12.0 * shape.num_layers * shape.hidden * seq_len
