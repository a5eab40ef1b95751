"""Activation bytes: what autograd saves in one decoder layer and over the whole model, per micro-batch.

Every count is a tensor autograd keeps in the transformers 5 implementations of the three layouts
(Llama-like, GPT-2, GPT-NeoX), checked with `saved_tensors_hooks` and MemTracker on CPU:

- `layer_bytes`: one decoder layer: what it saves for its backward (split into the attention half,
  which outlives the MLP backward, and the rest), its forward transient, and its backward working sets;
- `model_activations`: the model-level tensors (embedding output, final norm, the output head's
  gathered input, rotary tables, kept masks) and each layer's share, with checkpointing applied.
"""

from __future__ import annotations

from dataclasses import dataclass

from fulltune import levers
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings


def compute_bytes(settings: Settings) -> int:
    """Bytes per element of the activations autocast produces (bf16 weights compute in bf16)."""
    if settings.mixed_precision == "bf16" or settings.pure_bf16:
        return 2
    if settings.mixed_precision == "fp16" and settings.device == "cuda":
        return 2
    # Accelerate leaves fp16 off on CPU (native_amp is False there): the step runs in fp32.
    return 4


def stream_bytes(settings: Settings) -> int:
    """Bytes per element of the residual stream: the weights' dtype (autocast keeps it fp32)."""
    return 2 if settings.pure_bf16 else 4


def attention_bytes(shape: ModelShape, settings: Settings, c: int) -> tuple[int, int, bool]:
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


@dataclass(frozen=True)
class LayerBytes:
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


@dataclass(frozen=True)
class _Sizes:
    """The tensor sizes one layer's counts are made of, for one micro-batch."""

    b: int  # micro-batch rows
    s: int  # sequence length
    c: int  # bytes per element of the activations autocast produces
    mixed: bool  # 16-bit compute over fp32 weights: autocast casts each projection's input
    bsh4: int  # one residual-stream tensor (the weights' dtype)
    bshc: int  # one (b, s, h) tensor in the compute dtype
    bsI: int  # one (b, s, intermediate) tensor in the compute dtype
    attn_core: int  # the attention core's saved tensors (`attention_bytes`)
    fused: bool  # a fused attention kernel


@dataclass(frozen=True)
class _Halves:
    """What one layout's layer keeps and holds, before the terms every layout shares."""

    attn_saved: int  # the attention half's saved tensors
    mlp_saved: int  # the MLP half's saved tensors
    mlp_backward: int  # the MLP backward's extra working set (without the stream's gradient)
    forward_transient: int


def layer_bytes(shape: ModelShape, settings: Settings) -> LayerBytes:
    """One decoder layer's saved tensors, transients and gradients under `settings` (per micro-batch)."""
    b, s = settings.micro_batch_size, settings.seq_len
    h, I = shape.hidden, shape.intermediate
    c = compute_bytes(settings)
    mixed = c == 2
    attn_core, attn_work, fused = attention_bytes(shape, settings, c)
    # One residual-stream tensor: fp32 with fp32 weights (autocast or not), bf16 with pure bf16 weights.
    z = _Sizes(b=b, s=s, c=c, mixed=mixed, bsh4=stream_bytes(settings) * b * s * h, bshc=b * s * h * c,
               bsI=b * s * I * c, attn_core=attn_core, fused=fused)
    # FSDP / ZeRO-3 gather 16-bit parameters per layer and free them after use, so autocast
    # copies are not kept (the gathered layers are counted with the communication buffers);
    # bf16 weights need no copies.
    sharded_params = settings.dims.fsdp_enabled
    mlp_params = 2 * h * I + (I * h if shape.gated_mlp else 0)
    # The levers with terms of their own in a layer (their records' `layer_terms`; float8: its linears' casts, and
    # no 16-bit copies of their weights).
    terms = [lever.layer_terms(shape, settings, c, attn_core, attn_work) for lever in levers.LAYER_LEVERS
             if getattr(settings, lever.name)]
    copied = shape.layer_matmul_numel - sum(t.converted_numel for t in terms)
    copied_mlp = mlp_params - sum(t.converted_mlp_numel for t in terms)
    copies = mixed and not sharded_params and not settings.pure_bf16
    weight_copies = 2 * copied if copies else 0
    halves = _LAYOUT_HALVES[shape.layout](shape, settings, z)
    # The grad of the layer output (residual stream) is alive through the layer's backward.
    grad_stream = z.bsh4
    return LayerBytes(
        saved=halves.attn_saved + halves.mlp_saved + weight_copies,
        # The attention half keeps its share of the 16-bit weight copies after the MLP backward.
        attn_saved=halves.attn_saved + (2 * (copied - copied_mlp) if copies else 0),
        forward_transient=max([halves.forward_transient, *(t.forward for t in terms)]),
        mlp_backward=grad_stream + halves.mlp_backward + sum(t.mlp_backward for t in terms),
        attn_backward=grad_stream + z.bshc + attn_work + sum(t.attn_backward for t in terms),
        checkpoint_saved=z.bsh4,
        grads=4 * shape.layer_numel,
        mlp_grads=4 * mlp_params,
        mlp_first_grad=4 * h * I,
    )


def _llama_halves(shape: ModelShape, settings: Settings, z: _Sizes) -> _Halves:
    b, s, h, bsh4 = z.b, z.s, shape.hidden, z.bsh4
    # RMSNorm: fp32 input (the residual stream), 1/rms (b, s, 1) and the normalised x. The layer
    # input is counted as the previous layer's output; the mid residual belongs to this layer.
    norm = bsh4 + 4 * b * s
    # Linear inputs: fp32 norm outputs (shared by q/k/v and by gate/up), or under autocast one
    # 16-bit cast per projection (q, k, v, gate, up each cast their input separately).
    attn_inputs = 3 * b * s * h * 2 if z.mixed else bsh4
    mlp_inputs = 2 * b * s * h * 2 if z.mixed else bsh4
    mid_residual = bsh4  # the post-attention norm's input
    if settings.pure_bf16:
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
        a, kv, d = shape.heads, shape.kv_heads, shape.head_dim
        qk_norm = (4 + z.c) * b * s * (a + kv) * d + 4 * b * s * (a + kv)
    return _Halves(attn_saved=norm + attn_inputs + z.attn_core + qk_norm,
                   # Gated MLP: gate output (act input), act output, up output, product (down input).
                   mlp_saved=mid_residual + norm + mlp_inputs + 4 * z.bsI,
                   # Backward of the gated product: grad of the product and of both factors at once.
                   mlp_backward=2 * z.bsI,
                   forward_transient=8 * b * s * h)  # RMSNorm's fp32 temporaries


def _gpt2_halves(shape: ModelShape, settings: Settings, z: _Sizes) -> _Halves:
    b, s, h, c, bsI = z.b, z.s, shape.hidden, z.c, z.bsI
    # LayerNorm: input (stream / mid residual), mean and rstd (b, s, 1).
    norm = 8 * b * s
    attn_inputs = b * s * h * 2 if z.mixed else z.bsh4
    mlp_inputs = attn_inputs
    # SDPA's q, k and v are views of the c_attn output (b, s, 3h): that whole buffer is kept.
    fused_qkv = 3 * z.bshc - b * s * shape.heads * shape.head_dim * c - 2 * b * s * shape.kv_heads * shape.head_dim * c
    attn_saved = norm + attn_inputs + z.attn_core + (fused_qkv if z.fused else 0)
    if shape.activation in ("gelu_new", "gelu_fast", "gelu_pytorch_tanh_python"):
        # The python tanh-GELU keeps four (b, s, I) tensors. CUDA autocast runs `pow` in fp32
        # (torch.amp op lists), which makes three of them fp32; CPU autocast keeps them 16-bit.
        if z.mixed and settings.device == "cuda":
            act_saved = b * s * shape.intermediate * (4 + 4 + 4 + 2)
        else:
            act_saved = 4 * bsI
        mlp_backward = 2 * bsI
    else:
        act_saved, mlp_backward = bsI, bsI
    mlp_saved = z.bsh4 + norm + mlp_inputs + act_saved + bsI
    if shape.hidden_dropout > 0:
        # Dropout keeps its mask: in the input's dtype on CPU, boolean on CUDA.
        mask_bytes = b * s * h * (c if settings.device == "cpu" else 1)
        attn_saved += mask_bytes
        mlp_saved += mask_bytes
    return _Halves(attn_saved=attn_saved, mlp_saved=mlp_saved, mlp_backward=mlp_backward,
                   forward_transient=2 * z.bsh4)


def _neox_halves(shape: ModelShape, settings: Settings, z: _Sizes) -> _Halves:
    b, s, h = z.b, z.s, shape.hidden
    norm = 8 * b * s
    attn_inputs = b * s * h * 2 if z.mixed else z.bsh4
    mlp_inputs = attn_inputs
    # q and k are rebuilt by the partial rotary concat; v is a view of the fused qkv output
    # (b, s, 3h), which is kept whole; the reshape before `dense` copies the attention output.
    fused_qkv = 3 * z.bshc - b * s * shape.kv_heads * shape.head_dim * z.c + z.bshc
    return _Halves(attn_saved=norm + attn_inputs + z.attn_core + (fused_qkv if z.fused else 0),
                   mlp_saved=norm + mlp_inputs + 2 * z.bsI + (0 if shape.parallel_residual else z.bsh4),
                   mlp_backward=z.bsI, forward_transient=2 * z.bsh4)


_LAYOUT_HALVES = {"llama": _llama_halves, "gpt2": _gpt2_halves, "gpt_neox": _neox_halves}


@dataclass(frozen=True)
class ModelActivations:
    """What the forward of one micro-batch leaves saved for the backward, model-level terms and per layer.

    `saved_by_layer[i]` is what layer i adds: its saved tensors and its output (the next layer's input),
    or for a checkpointed layer its output only (checkpoint keeps the layer input, the previous output).
    """

    stream_in: int  # the embedding output (layer 0's input)
    final_norm: int  # the final norm's saved tensors
    lm_head_input: int  # the output head's gathered rows (t, h)
    rope: int  # rotary cos/sin
    head_copy: int  # the head weight's 16-bit autocast copy
    kept_mask: int  # the attention mask checkpointed layers keep as an input
    saved_by_layer: tuple[int, ...]
    offloaded: int  # checkpointed layers' inputs waiting in host RAM (offload_activations)
    mask_bool: int  # the boolean (b, 1, s, s) mask transformers builds in the forward

    @property
    def total(self) -> int:
        """Everything saved at the end of the forward."""
        return (self.stream_in + self.final_norm + self.lm_head_input + self.rope + self.head_copy + self.kept_mask
                + sum(self.saved_by_layer))

    @property
    def below_head(self) -> int:
        """Saved before the final norm and head run (and again once their backward has freed their share)."""
        return self.total - self.final_norm - self.lm_head_input - self.head_copy


def model_activations(shape: ModelShape, settings: Settings, act: Settings, layer: LayerBytes) -> ModelActivations:
    """The saved tensors of the whole model for `settings`, whose activations are those of `act`
    (`fsdp.activation_settings`: FSDP's bf16 policy runs the model as with bf16 weights)."""
    b, s, h, V, L = settings.micro_batch_size, settings.seq_len, shape.hidden, shape.vocab, shape.num_layers
    c = compute_bytes(act)
    mixed = c == 2 and not act.pure_bf16  # autocast over fp32 weights
    k = min(settings.gradient_checkpointing, L)
    t = b * settings.targets_per_row  # positions with a target: the head's rows
    sb = stream_bytes(act)
    bsh4 = sb * b * s * h  # one residual-stream tensor
    # The final norm: RMSNorm keeps the normalised x and 1/rms; LayerNorm only mean and rstd (its input,
    # the last layer's output, is counted with that layer). With bf16 weights RMSNorm keeps its fp32
    # upcast input instead of the bf16 one (see `layer_bytes`).
    final_norm = bsh4 + 4 * b * s if shape.layout == "llama" else 8 * b * s
    if act.pure_bf16 and shape.layout == "llama":
        final_norm += 4 * b * s * h
    # The gathered rows: a 16-bit copy under autocast; the chunked head casts tile by tile and
    # keeps the rows as they come.
    lm_head_input = t * h * (sb if settings.chunked_loss else c)
    rope = 2 * 4 * b * s * shape.rotary_dim if shape.rotary_dim else 0
    sharded = settings.dims.fsdp_enabled
    head_copy = 2 * V * h if mixed and not settings.chunked_loss and not sharded else 0
    # The embedding output (the input of layer 0): with bf16 weights only a checkpointed layer 0 keeps it.
    stream_in = 0 if act.pure_bf16 and k == 0 and shape.layout == "llama" else bsh4
    if shape.layout == "gpt2" and shape.embedding_dropout > 0:
        stream_in += b * s * h * (4 if settings.device == "cpu" else 1)
    # Checkpointed layers keep their inputs alive until their backward, the attention mask among
    # them (boolean for SDPA, an fp32 additive mask for eager attention).
    kept_mask = 0
    if k > 0 and (settings.attention_mask or settings.attn_implementation == "eager"):
        kept_mask = b * s * s * (4 if settings.attn_implementation == "eager" else 1)
    # With bf16 weights a layer's output is kept only as a checkpointed layer's input (the next
    # RMSNorm keeps its own fp32 upcast).
    pure_llama = act.pure_bf16 and shape.layout == "llama"
    full = layer.saved + (0 if pure_llama else bsh4)
    saved_by_layer = [layer.checkpoint_saved if i < k else full for i in range(L)]
    if pure_llama and k > 0:
        saved_by_layer[k - 1] = 0
    return ModelActivations(
        stream_in=stream_in, final_norm=final_norm, lm_head_input=lm_head_input, rope=rope, head_copy=head_copy,
        kept_mask=kept_mask, saved_by_layer=tuple(saved_by_layer),
        offloaded=k * bsh4 if settings.offload_activations else 0,
        mask_bool=b * s * s if settings.attention_mask else 0,
    )
