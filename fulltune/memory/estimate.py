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
- FSDP (fulltune/sharding.py) is walked unit by unit (`_fsdp_phases`): what is gathered, and which
  unsharded gradients and reduce-scatter buffers exist, depends on the phase; checked per rank on CPU
  (benchmarks/sharded_memory.py). NCCL's own buffers are not tensors and are not counted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
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
# A CPU training process, measured (benchmarks/cpu_rss.py: peak RSS of real runs through run_training,
# MLflow on, one OpenMP thread, 7M-150M parameters): ~570 MiB before the first step (interpreter, torch,
# transformers, accelerate, MLflow, the loaded model), plus what glibc keeps of freed step tensors, up to
# ~12% of the tensor peak. With these constants the estimate is 0-15% above every measured peak RSS.
CPU_PROCESS_BYTES = 753 * 2**20
CPU_ALLOCATOR_SLACK = 0.12


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
    """Bytes per element of the activations autocast produces (bf16 weights compute in bf16)."""
    if settings.mixed_precision == "bf16" or settings.pure_bf16:
        return 2
    if settings.mixed_precision == "fp16" and settings.device == "cuda":
        return 2
    # Accelerate leaves fp16 off on CPU (native_amp is False there): the step runs in fp32.
    return 4


def _stream_bytes(settings: Settings) -> int:
    """Bytes per element of the residual stream: the weights' dtype (autocast keeps it fp32)."""
    return 2 if settings.pure_bf16 else 4


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
    pure = settings.pure_bf16
    # One residual-stream tensor: fp32 with fp32 weights (autocast or not), bf16 with pure bf16 weights.
    bsh4 = _stream_bytes(settings) * b * s * h
    bshc = b * s * h * c
    bsI = b * s * I * c
    attn_core, attn_work, fused = _attention_bytes(shape, settings, c)
    # FSDP / ZeRO-3 gather 16-bit parameters per layer and free them after use, so autocast
    # copies are not kept (the gathered layers are counted with the communication buffers);
    # bf16 weights need no copies.
    sharded_params = settings.strategy in ("fsdp", "deepspeed_zero3")
    weight_copies = 2 * shape.layer_matmul_numel if mixed and not sharded_params and not pure else 0
    mlp_params = 2 * h * I + (I * h if shape.gated_mlp else 0)
    # The grad of the layer output (residual stream) is alive through the layer's backward.
    grad_stream = bsh4

    if shape.layout == "llama":
        # RMSNorm: fp32 input (the residual stream), 1/rms (b, s, 1) and the normalised x. The layer
        # input is counted as the previous layer's output; the mid residual belongs to this layer.
        norm = bsh4 + 4 * b * s
        # Linear inputs: fp32 norm outputs (shared by q/k/v and by gate/up), or under autocast one
        # 16-bit cast per projection (q, k, v, gate, up each cast their input separately).
        attn_inputs = 3 * b * s * h * 2 if mixed else bsh4
        mlp_inputs = 2 * b * s * h * 2 if mixed else bsh4
        mid_residual = bsh4  # the post-attention norm's input
        if pure:
            # bf16 weights: RMSNorm upcasts its bf16 input to fp32 (a new tensor, kept by pow and mul),
            # keeps 1/rms and the normalised x cast back to bf16; its bf16 output feeds the
            # projections as it is (no autocast casts). The bf16 input itself is not kept.
            norm = 4 * b * s * h + 4 * b * s + bsh4
            attn_inputs = mlp_inputs = bsh4
            mid_residual = 0
        qk_norm = 0
        if shape.qk_norm:
            # Qwen3 RMSNorm on q and k per head: the fp32 (upcast) input, 1/rms, and the
            # normalised x cast back to the compute dtype.
            qk_norm = (4 + c) * b * s * (a + kv) * d + 4 * b * s * (a + kv)
        attn_saved = norm + attn_inputs + attn_core + qk_norm
        # Gated MLP: gate output (act input), act output, up output, product (down input).
        mlp_saved = mid_residual + norm + mlp_inputs + 4 * bsI
        # Backward of the gated product: grad of the product and of both factors at once.
        mlp_backward = 2 * bsI
        forward_transient = 8 * b * s * h  # RMSNorm's fp32 temporaries
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


def _fsdp_walk(settings: Settings) -> bool:
    """Whether the step is walked as FSDP2 runs it (per unit gathers, reduce-scatters; `_fsdp_phases`).

    fulltune's FSDP does not combine with the chunked head (the planner refuses it); that pair, and
    DeepSpeed ZeRO-3, keep the per-step formula (two layers gathered, one layer's gradient bucket)."""
    return settings.strategy == "fsdp" and not settings.chunked_loss


def _activation_settings(settings: Settings) -> Settings:
    """The settings whose activations the step makes: FSDP's bf16 policy (fulltune/sharding.py) gathers
    bf16 weights and runs the model on them without autocast, so its activations, residual stream and
    logits are those of bf16 weights (`pure_bf16`), while the sharded masters, gradients and optimizer
    states stay fp32 (measured per rank on CPU: benchmarks/sharded_memory.py)."""
    if _fsdp_walk(settings) and settings.mixed_precision == "bf16" and not settings.pure_bf16:
        return replace(settings, pure_bf16=True)
    return settings


def _estimate(shape: ModelShape, settings: Settings, timeline: list | None = None) -> MemoryEstimate:
    """`estimate_memory` on a parsed shape; `timeline` (if given) receives every (phase, bytes, parts)."""
    b, s = settings.micro_batch_size, settings.seq_len
    h, V, L = shape.hidden, shape.vocab, shape.num_layers
    P = shape.num_params
    act = _activation_settings(settings)
    c = _compute_bytes(act)
    mixed = c == 2 and not act.pure_bf16  # autocast over fp32 weights
    k = min(settings.gradient_checkpointing, L)
    n = settings.num_processes
    strategy = settings.strategy
    notes = _notes(shape, settings)

    # --- what persists through the step (per process) ---
    param_shard = grad_shard = state_shard = 1.0
    if strategy in ("fsdp", "deepspeed_zero3"):
        param_shard = grad_shard = state_shard = 1.0 / n
    elif strategy == "deepspeed_zero2":
        grad_shard = state_shard = 1.0 / n
    levers = _lever_bytes(shape, settings)
    wb = levers.weight_bytes
    params = int(wb * P * param_shard)
    buffers = 4 * (shape.rotary_dim // 2) if shape.rotary_dim else 0
    states, opt_temp = int(levers.states * state_shard), levers.states_temp
    grads_total = int(wb * P * grad_shard)  # every gradient, as without the gradient-hook levers
    gathered = buckets = 0  # communication buffers: gathered parameters, gradient buckets
    if strategy == "ddp":
        # DDP keeps flat gradient buckets besides .grad (gradient_as_bucket_view=False default).
        buckets = wb * P
    elif strategy in ("fsdp", "deepspeed_zero3") and not _fsdp_walk(settings):
        # Two layers' full parameters are gathered at a time (current + prefetch), the embedding
        # while it is used, plus one layer's unsharded gradients before reduce-scatter.
        gathered = 2 * wb * shape.layer_numel + (wb * shape.embedding_numel if n > 1 else 0)
        buckets = wb * shape.layer_numel
    elif strategy == "deepspeed_zero2":
        # Gradients are reduced in buckets about two layers large before being partitioned.
        buckets = 2 * wb * shape.layer_numel
    t = b * settings.targets_per_row  # positions with a target: the head's rows
    batch = 2 * 8 * b * s + 2 * 8 * t  # input_ids, position_ids; target index and tokens (int64)
    accumulating = settings.gradient_accumulation_steps > 1
    grads_before = grads_total if accumulating else 0

    layer = _layer(shape, act)
    sb = _stream_bytes(act)
    bsh4 = sb * b * s * h  # one residual-stream tensor
    # Model-level saved tensors: the embedding output, the final norm (input is the last layer's
    # output, normalised x, 1/rms or mean/rstd), the lm_head input, rotary cos/sin.
    # RMSNorm keeps the normalised x and 1/rms; LayerNorm only mean and rstd (its input, the last
    # layer's output, is counted with that layer). With bf16 weights RMSNorm keeps its fp32 upcast
    # input instead of the bf16 one (see `_layer`).
    final_norm = bsh4 + 4 * b * s if shape.layout == "llama" else 8 * b * s
    if act.pure_bf16 and shape.layout == "llama":
        final_norm += 4 * b * s * h
    # The gathered rows: a 16-bit copy under autocast; the chunked head casts tile by tile and
    # keeps the rows as they come.
    lm_head_input = t * h * (sb if settings.chunked_loss else c)
    rope = 2 * 4 * b * s * shape.rotary_dim if shape.rotary_dim else 0
    head_copy = 2 * V * h if mixed and not settings.chunked_loss and strategy not in ("fsdp", "deepspeed_zero3") else 0
    # The embedding output (the input of layer 0): with bf16 weights only a checkpointed layer 0 keeps it.
    stream_in = 0 if act.pure_bf16 and k == 0 and shape.layout == "llama" else bsh4
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
    # With bf16 weights a layer's output is kept only as a checkpointed layer's input (the next
    # RMSNorm keeps its own fp32 upcast).
    pure_llama = act.pure_bf16 and shape.layout == "llama"
    full = layer.saved + (0 if pure_llama else bsh4)
    saved_by_layer = [layer.checkpoint_saved if i < k else full for i in range(L)]
    if pure_llama and k > 0:
        saved_by_layer[k - 1] = 0
    acts_total = model_saved + sum(saved_by_layer)
    # Offloaded activations: the checkpointed layers' inputs wait in host RAM (fulltune/offload.py).
    offloaded = k * bsh4 if settings.offload_activations else 0
    mask_bool = b * s * s if settings.attention_mask else 0

    logits_c = t * V * c  # lm_head output in the compute dtype
    logits32 = 4 * t * V
    hooks = settings.optimizer_in_backward or settings.offload_optimizer
    # Accumulating into an existing .grad makes each new gradient a temporary beside it; with the hooks
    # there is no device .grad to add into (the hook takes each one as it is made).
    new_grad_added = accumulating and not hooks
    on_host = settings.device == "cpu"  # host RAM is the device's memory: count it in the peak

    phases: list[tuple[str, int, dict[str, int]]] = []

    def add(phase: str, grads: int, acts: int, logits: int, temp: int, now: int = 0, backward: bool = True,
            unsharded: tuple[int, int] = (0, 0)) -> None:
        """`grads`: the gradients alive without the hook levers; `now`: the one a hook is about to take;
        `unsharded`: FSDP's gathered parameters and (unsharded gradients + reduce-scatter buffers) now."""
        device_grads = now if hooks else grads
        # Offloaded activations move to the host once the forward has passed their layer.
        away = offloaded if backward else 0
        # The hook has moved every gradient to the host but the one it is about to take (accumulating,
        # the host holds the sums of the earlier micro-batches already).
        host_parts = _host_parts(levers, grads if accumulating else max(grads - now, 0), wb, away)
        parts = {
            "parameters": params + buffers + gathered + unsharded[0] + (host_parts["parameters"] if on_host else 0),
            "gradients": device_grads + buckets + unsharded[1] + (host_parts["gradients"] if on_host else 0),
            "optimizer_states": states + (host_parts["optimizer_states"] if on_host else 0),
            "activations": acts + batch - (0 if on_host else away),
            "logits": logits,
            "temporary": temp,
        }
        parts["host"] = sum(host_parts.values())
        phases.append((phase, sum(v for key, v in parts.items() if key != "host"), parts))

    # Forward: the last layer's forward peak with everything below it saved.
    before_head = acts_total - final_norm - lm_head_input - head_copy
    if _fsdp_walk(settings):
        _fsdp_phases(add, shape, settings, layer, saved_by_layer, grads_total, acts_total, before_head,
                     lm_head_input + final_norm, mask_bool, t, c, bsh4, logits_c, logits32)
        return _result(phases, timeline, settings, notes)
    add("forward", grads_before, before_head, 0, layer.forward_transient + mask_bool, backward=False)
    head_grad = int(wb * V * h * grad_shard)
    after_head = acts_total - lm_head_input - head_copy - final_norm
    if settings.chunked_loss:
        _chunked_head_phases(add, levers, grads_before, acts_total, after_head, head_grad, accumulating,
                             t, h, V, c, sb, bsh4, new_grad_added)
    else:
        _head_phases(add, grads_before, acts_total, after_head, head_grad, accumulating, mixed, t, h, V, c,
                     bsh4, logits_c, logits32, new_grad_added)

    # Backward through the layers, last to first. Each layer has two peaks: the MLP backward
    # (everything of the layer still saved, plus the grads of the (b, s, I) tensors) and the
    # attention backward (the MLP part freed, its weight gradients made, grads of q, k, v).
    layer_grads = int(layer.grads * grad_shard * wb // 4)
    grads_now = grads_before if accumulating else head_grad + wb * h * (2 if shape.layout != "llama" else 1)
    # Tied: the head's weight gradient waits in autograd's input buffer for the embedding's share
    # (when accumulating it is not yet added into .grad, so it is extra; with the gradient hooks it
    # is not a .grad yet, so the hook has not taken it).
    waiting = head_grad if shape.tied and (accumulating or hooks) else 0
    grads_now += waiting if not hooks else 0
    acts_now = after_head
    first = layer.mlp_first_grad * wb // 4
    for i in reversed(range(L)):
        below = acts_now - saved_by_layer[i]
        # A checkpointed layer first rebuilds the same activations (non-reentrant checkpoint
        # with early stop: its output is not rebuilt); an offloaded input comes back first.
        back = bsh4 if settings.offload_activations and i < k and not on_host else 0
        grad_mlp = 0 if accumulating else int(layer.mlp_grads * grad_shard * wb // 4)
        # The down/output projection's weight gradient is made before the MLP backward peak;
        # when accumulating it is a new tensor added into the existing .grad.
        add(
            f"backward of layer {i}",
            grads_now + (0 if accumulating else int(first * grad_shard)),
            below + back,
            0,
            layer.saved + layer.mlp_backward + (first if new_grad_added else 0),
            now=waiting + int(first * grad_shard),
        )
        add(f"backward of layer {i}", grads_now + grad_mlp, below + back, 0, layer.attn_saved + layer.attn_backward,
            now=waiting)
        grads_now += 0 if accumulating else layer_grads
        acts_now = below
    # Embedding backward: a dense (V, h) gradient. Tied, autograd then sums it with the waiting head
    # gradient out of place (three (V, h) tensors at once, .grad not yet among them unless
    # accumulating); untied and accumulating, it is added into the existing .grad.
    # At the end of backward every gradient exists.
    emb_grad = int(wb * V * h * grad_shard)
    emb_tmp = (3 if new_grad_added else 2) * emb_grad if shape.tied else (emb_grad if new_grad_added else 0)
    # With the hooks: the embedding's gradient (tied: the sum) is the one the hook takes; stepping
    # inside backward adds the optimizer's own temporaries there.
    hook_tmp = opt_temp if settings.optimizer_in_backward else 0
    add("backward of the embeddings", grads_total, max(acts_now, 0), 0, emb_tmp if not hooks else
        (emb_tmp if shape.tied else 0) + hook_tmp, now=0 if shape.tied else emb_grad)

    # Optimizer step: all gradients, states, the optimizer's own temporaries (on the host when offloaded;
    # nothing left to do when stepped in backward).
    if not settings.optimizer_in_backward:
        step_temp = levers.host_temp if settings.offload_optimizer else opt_temp
        add("optimizer step", grads_total, 0, 0, step_temp if (on_host or not settings.offload_optimizer) else 0)

    return _result(phases, timeline, settings, notes)


def _result(phases: list, timeline: list | None, settings: Settings, notes: list[str]) -> MemoryEstimate:
    """The estimate at the largest of `phases` (and the timeline, if asked for)."""
    if timeline is not None:
        timeline.extend(phases)
    phase, peak, parts = max(phases, key=lambda p: p[1])
    overhead = _runtime_overhead(settings, peak)
    breakdown = {key: int(value) for key, value in parts.items() if key != "host"}
    breakdown["runtime_overhead"] = int(overhead)
    host = max(p[2]["host"] for p in phases)
    return MemoryEstimate(
        peak_bytes=int(peak),
        device_bytes=int(peak + overhead),
        breakdown=breakdown,
        peak_phase=phase,
        notes=tuple(notes),
        host_bytes=int(host),
    )


def _fsdp_phases(add: Any, shape: ModelShape, settings: Settings, layer: _Layer, saved_by_layer: list[int],
                 grads_total: int, acts_total: int, before_head: int, head_inputs: int, mask_bool: int, t: int,
                 c: int, bsh4: int, logits_c: int, logits32: int) -> None:
    """The step as FSDP2 runs it in every rank (fulltune/sharding.py), phase by phase.

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

    def post_backward(numel: int) -> int:
        # A unit's post-backward: besides its unsharded gradient and the reduce-scatter buffer, one more
        # unit-sized tensor in the reduce dtype and the sharded output (FSDPMemTracker, every rank).
        return rb * numel + int(rb * numel / n)

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
    add("forward of the lm head / loss", done, acts_total, logits_c, bsh4 + 4 * t * h, backward=False,
        unsharded=(in_head, 0))
    # The loss, after the root's forward: only an untied head stays gathered.
    kept_head = 0 if tied else pb * vh
    if c == 2:
        add("forward of the lm head / loss", done, acts_total, logits_c + logits32, 0, backward=False,
            unsharded=(kept_head, 0))
    add("forward of the lm head / loss", done, acts_total, 2 * logits32, 0, backward=False, unsharded=(kept_head, 0))
    add("backward of the lm head / loss", done, acts_total, 3 * logits32, 0, unsharded=(kept_head, 0))
    # The head's backward: its unsharded weight gradient beside the gathered weight (tied: the root
    # gathered again), the last layer's gather prefetched.
    gathered_head = (pb * vh if not tied else root_g) + pb * lay
    add("backward of the lm head / loss", done, acts_total, logits_c + (logits32 if c == 2 else 0), t * h * c,
        unsharded=(gathered_head, pb * vh))
    after_head = acts_total - head_inputs
    if not tied:
        # Its post-backward: the gradient copied into the reduce-scatter buffer, the weight resharded.
        add("backward of the lm head / loss", done, acts_total, 0, t * h * c + post_backward(vh),
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
        add(f"backward of layer {i}", done, below, 0, post_backward(lay),
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
        add("backward of the embeddings", done, acts_now, 0, post_backward(root), unsharded=(0, summed + rb * root))
    else:
        add("backward of the embeddings", done, acts_now, 0, 0, unsharded=(pb * vh, kept_rs + pb * vh))
        add("backward of the embeddings", done, acts_now, 0, post_backward(vh),
            unsharded=(0, pb * vh + rb * vh))
    # The step runs on the shards (AdamW: in place). Adafactor's factored statistics need whole rows and
    # columns, so fulltune/optim.py's GatheredAdafactor gathers one parameter's weight and gradient at a
    # time and runs the unsharded update on them: the largest parameter's pair plus its temporaries.
    step_temp = 0
    if settings.optimizer == "adafactor":
        largest = max(_n(sh) for sh in shape.param_shapes)
        step_temp = 2 * wb * largest + _lever_bytes(shape, settings).states_temp
    add("optimizer step", grads_total, 0, 0, step_temp)


def _notes(shape: ModelShape, settings: Settings) -> list[str]:
    notes: list[str] = []
    if shape.approximate:
        notes.append(f"model_type {shape.model_type!r} is modelled as a Llama-like decoder; expect a few % error")
    if settings.mixed_precision == "fp16" and settings.device == "cpu":
        notes.append("Accelerate does not autocast fp16 on CPU: counted as fp32")
    if settings.gradient_checkpointing > shape.num_layers:
        notes.append(f"gradient_checkpointing={settings.gradient_checkpointing} capped at {shape.num_layers} layers")
    if settings.device == "cpu" and (settings.offload_optimizer or settings.offload_activations):
        notes.append("on a CPU device host RAM is the device memory: offloading moves bytes, it saves none")
    return notes


@dataclass(frozen=True)
class _LeverBytes:
    """Per-step byte counts the levers decide, as fulltune/optim.py counts them."""

    weight_bytes: int  # per parameter element of the device weights and gradients
    states: int  # optimizer states on the device (whole model, unsharded)
    states_temp: int  # the optimizer's temporaries during its update (on the device)
    host_masters: int  # fp32 master weights in host RAM (offload)
    host_states: int  # optimizer states in host RAM (offload)
    host_temp: int  # the host optimizer's temporaries
    host_buffer: int  # step in backward with accumulation: the host gradient sums


def _lever_bytes(shape: ModelShape, settings: Settings) -> _LeverBytes:
    return _lever_bytes_cached(shape, settings.optimizer, settings.pure_bf16, settings.optimizer_in_backward,
                              settings.offload_optimizer, settings.gradient_accumulation_steps)


@functools.lru_cache(maxsize=256)
def _lever_bytes_cached(shape: ModelShape, optimizer: str, pure_bf16: bool, in_backward: bool, offload: bool,
                        accumulation: int) -> _LeverBytes:
    # fulltune.optim imports torch: imported here so that importing the memory model does not.
    from fulltune import optim

    shapes = shape.param_shapes
    states, temp = optim.device_state_bytes(optimizer, shapes, pure_bf16=pure_bf16, offload_optimizer=offload)
    host_masters = host_states = host_temp = host_buffer = 0
    if offload:
        host_states, host_temp = optim.optimizer_state_bytes(optimizer, shapes, 4, "none")
        host_masters = 4 * shape.num_params
        # optim.host_bytes = masters + gradients + states + temporaries (the gradients are counted per phase).
        assert optim.host_bytes(optimizer, shapes, pure_bf16, in_backward, offload, accumulation) == (
            host_masters + 4 * shape.num_params + host_states + host_temp)
    elif in_backward:
        host_buffer = optim.host_bytes(optimizer, shapes, pure_bf16, in_backward, offload, accumulation)
    return _LeverBytes(optim.weight_bytes(pure_bf16), states, temp, host_masters, host_states, host_temp,
                       host_buffer)


def _host_parts(levers: _LeverBytes, grads: int, weight_bytes: int, offloaded: int) -> dict[str, int]:
    """Host RAM the levers hold in a phase whose gradients (without the hooks) are `grads` bytes."""
    host_grads = grads * 4 // weight_bytes if levers.host_masters else 0  # fp32 sums on the host
    return {"parameters": levers.host_masters, "gradients": host_grads + levers.host_buffer,
            "optimizer_states": levers.host_states, "activations": offloaded}


def _head_phases(add: Any, grads_before: int, acts_total: int, after_head: int, head_grad: int, accumulating: bool,
                 mixed: bool, t: int, h: int, V: int, c: int, bsh4: int, logits_c: int, logits32: int,
                 new_grad_added: bool) -> None:
    """The whole head: (t, V) logits, their fp32 upcast, log_softmax and its backward."""
    # lm_head's forward: the final norm's (b, s, h) output is alive until the model returns, next to
    # the gathered rows.
    add("forward of the lm head / loss", grads_before, acts_total, logits_c, bsh4 + 4 * t * h, backward=False)
    # lm_head output, its fp32 upcast and log_softmax's fp32 output.
    if mixed or c == 2:
        add("forward of the lm head / loss", grads_before, acts_total, logits_c + logits32, 0, backward=False)
    add("forward of the lm head / loss", grads_before, acts_total, 2 * logits32, 0, backward=False)
    # Backward of the loss: saved log_softmax output + grad of nll + grad of log_softmax.
    add("backward of the lm head / loss", grads_before, acts_total, 3 * logits32, 0)
    # Backward of lm_head: grad of logits (compute dtype) + weight gradient (under autocast first a
    # 16-bit one). Tied: it waits in autograd's input buffer for the embedding's share.
    head_grad_tmp = 2 * V * h if mixed else 0
    g = grads_before if accumulating else head_grad
    add("backward of the lm head / loss", g, acts_total, logits_c + (logits32 if c == 2 else 0),
        head_grad_tmp + (head_grad if new_grad_added else 0) + t * h * c, now=head_grad)
    # Backward of the gather: the rows' gradient scattered into a zero (b, s, h) tensor.
    add("backward of the lm head / loss", grads_before if accumulating else head_grad, after_head, 0,
        bsh4 + 4 * t * h, now=head_grad)


def _chunked_head_phases(add: Any, levers: _LeverBytes, grads_before: int, acts_total: int, after_head: int,
                         head_grad: int, accumulating: bool, t: int, h: int, V: int, c: int, sb: int,
                         bsh4: int, new_grad_added: bool) -> None:
    """The chunked head (fulltune/loss.py): a per-row logsumexp kept, one (rows × vocabulary) tile at a time."""
    from fulltune.loss import ROW_CHUNK, VOCAB_CHUNK, chunked_head_bytes

    tiles = chunked_head_bytes(t, h, V, c)
    rows, cols = min(t, ROW_CHUNK), min(V, VOCAB_CHUNK)
    if levers.weight_bytes == c:
        # The weights are in the compute dtype: the weight tile's cast is a view, no copy (measured with
        # MemTracker on real tensors: exactly cols·h·c less than `chunked_head_bytes`).
        tiles = {**tiles, "backward": tiles["backward"] - cols * h * c}
    # Forward: the logsumexp and target logit (fp32 per row), one tile's logits and their fp32 copy,
    # the weight tile and row casts (when the weights are not in the compute dtype).
    cast = (cols * h * c + rows * h * c) if levers.weight_bytes != c else 0
    add("forward of the lm head / loss", grads_before, acts_total, 0,
        bsh4 + 8 * t + rows * cols * (c + 4) + cast, backward=False)
    # Backward: the weight gradient (the head's .grad-to-be), the tiles, and the fp32 input gradient
    # (cast to the stream dtype at the end when that is 16-bit).
    g = grads_before if accumulating else head_grad
    add("backward of the lm head / loss", g, acts_total, 0,
        tiles["saved"] + tiles["backward"] + (head_grad if new_grad_added else 0), now=head_grad)
    if sb != 4:
        add("backward of the lm head / loss", g, acts_total, 0,
            tiles["saved"] + 4 * t * h + sb * t * h + (head_grad if new_grad_added else 0), now=head_grad)
    add("backward of the lm head / loss", grads_before if accumulating else head_grad, after_head, 0,
        bsh4 + sb * t * h, now=head_grad)


def _runtime_overhead(settings: Settings, peak: int) -> int:
    if settings.device == "cuda":
        return int(CUDA_CONTEXT_BYTES + CUDA_ALLOCATOR_SLACK * peak)
    return int(CPU_PROCESS_BYTES + CPU_ALLOCATOR_SLACK * peak)


def num_parameters(config: Any) -> int:
    """Parameter count of `config` as the memory model counts it."""
    return model_shape(config).num_params


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token of rows of one `seq_len`-token document with a target at every position
    (fulltune/flops.py; no recompute)."""
    from fulltune import flops

    return flops.from_shape(model_shape(config)).per_token_of_rows(seq_len)
