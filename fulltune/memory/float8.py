"""float8 training (`train.float8`, torchao's `convert_to_float8_training`): which linears of a decoder layer it
converts, and the bytes their float8 matmuls hold, as torchao 0.18 runs them (fulltune/runtime/float8.py applies it);
the functions the lever's record (fulltune/levers.py) names here: the step time it saves (`step_seconds`), the
request as the model allows it (`for_model`) and what the plan says of it (`reasons`).

A converted linear (`Float8Linear`) keeps its weight as it is (fp32 masters, or bf16 under pure bf16 and FSDP's
bf16 gather) and saves for backward what a plain linear saves: its input and its weight (a view, not a copy). Each
matmul casts its two operands to float8 first (torchao's `hp_tensor_to_float8_dynamic`: the amax, then the tensor
upcast to fp32 and scaled, clamped to float8's range and cast, with the scaled and the clamped fp32 tensors both
alive at the cast: 9 bytes per element at its peak, whatever the source dtype), and keeps the float8 operands until
the matmul returns; in backward the local float8 copies live until the whole backward of the linear returns.
Measured with MemTracker on CPU for bf16 and fp32 operands of several shapes, both recipes: the peaks below match
to the byte, plus the scales (4 bytes per tensor for `tensorwise`, 4 per row or column for `rowwise`).

Forward, beyond its input x (T×K) and weight W (N×K), before the output y (T×N) exists:
    max(9·TK, TK + 9·NK, TK + NK + y)           the input's cast, the weight's beside float8 x, the matmul
Backward, beyond what autograd saved and the output's gradient g (T×N), with gx the input's gradient:
    max(9·TN, TN + 9·NK, TN + NK + gx + 9·TN, 2TN + NK + gx + 9·TK)   g for grad_input, W, g again for
                                                                       grad_weight, x

Under autocast no 16-bit copy of a converted weight is made (float8 is cast from the fp32 master), so those copies,
which a plain layer keeps from its forward to its backward, are gone. These are eager casts: torch.compile fuses
the amax and the cast (torchao's recommended way to run float8 for speed), so a compiled step holds less than
this and the estimate stays an upper bound.

Kernels take float8 matmuls whose both dimensions are multiples of 16 (`torch._scaled_mm`); a linear that is not
stays in its own precision, as do the output head (its logits feed the loss: torchtitan and torchao keep it in
high precision) and everything outside the decoder layers. Only the Llama layout (Llama, Mistral, Qwen) is
converted: GPT-2's projections are `Conv1D` modules, which torchao does not convert, and GPT-NeoX's fused qkv is
not modelled here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fulltune.memory.errors import MemoryConfigError
from fulltune.memory.shapes import ModelShape

ALIGNMENT = 16  # both dimensions of a float8 matmul (torch._scaled_mm)
CAST_BYTES = 9  # per element at a cast's peak: scaled fp32 + clamped fp32 + the float8 result
# The converted linears' matmuls sustain this many times bf16's throughput (assumed): on GPUs with float8 tensor
# cores the dense float8 peak is twice bf16's, and torchtitan's Llama-3.1-8B on 8 × H100 ran 1.28× faster end to
# end with torch.compile and float8 (6,667 → 8,532 tokens/s/GPU), the casts, attention and the layers left in bf16
# taking the rest; a CPU has no float8 units (its eager casts are not counted).
SPEEDUP = {"cuda": 1.6, "cpu": 1.0}
# The layouts whose decoder linears are converted (see the module docstring).
CONVERTED_LAYOUTS = ("llama",)


@dataclass(frozen=True)
class Linear:
    """One linear of a decoder layer: its name in the layer, its input and output features, its half."""

    name: str
    in_features: int
    out_features: int
    mlp: bool

    @property
    def convertible(self) -> bool:
        """Both dimensions are multiples of `ALIGNMENT`: the float8 kernels take it."""
        return self.in_features % ALIGNMENT == 0 and self.out_features % ALIGNMENT == 0

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


def layer_linears(shape: ModelShape) -> tuple[Linear, ...]:
    """The linears of one decoder layer of the Llama layout (none for the other layouts)."""
    if shape.layout not in CONVERTED_LAYOUTS:
        return ()
    h, I = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return (Linear("self_attn.q_proj", h, q, False), Linear("self_attn.k_proj", h, kv, False),
            Linear("self_attn.v_proj", h, kv, False), Linear("self_attn.o_proj", q, h, False),
            Linear("mlp.gate_proj", h, I, True), Linear("mlp.up_proj", h, I, True),
            Linear("mlp.down_proj", I, h, True))


def converted(shape: ModelShape) -> tuple[Linear, ...]:
    """The linears float8 converts in every decoder layer."""
    return tuple(linear for linear in layer_linears(shape) if linear.convertible)


def kept(shape: ModelShape) -> tuple[Linear, ...]:
    """The decoder layer's linears that stay in their own precision (a dimension not a multiple of 16)."""
    return tuple(linear for linear in layer_linears(shape) if not linear.convertible)


def float8_all_gather(settings: Any) -> bool:
    """Whether FSDP2 gathers the converted weights in float8 (torchao's `enable_fsdp_float8_all_gather`): under
    strategy fsdp on GPUs with the `tensorwise` recipe (torchao has no float8 gather for `rowwise` scales; gloo
    cannot move float8 tensors; FSDP's CPU offload keeps the shards on the host, where the cast would run)."""
    return (settings.dims.fsdp_enabled and settings.device == "cuda" and settings.float8_recipe == "tensorwise"
            and not settings.offload_optimizer)


def _scales(recipe: str, *rows: int) -> int:
    """The scales of the casts of tensors with `rows` rows each (fp32): one per tensor, or one per row."""
    return 4 * (sum(rows) if recipe == "rowwise" else len(rows))


def forward_extra(linear: Linear, tokens: int, out_bytes: int, recipe: str) -> int:
    """Bytes a converted linear's forward holds beyond the plain linear's (its output), at its peak."""
    T, K, N = tokens, linear.in_features, linear.out_features
    y = T * N * out_bytes
    peak = max(CAST_BYTES * T * K, T * K + CAST_BYTES * N * K, T * K + N * K + y)
    return peak + _scales(recipe, T, N) - y


def backward_peak(linear: Linear, tokens: int, grad_bytes: int, recipe: str) -> int:
    """Bytes a converted linear's backward holds at its peak beyond what autograd saved and the output's gradient
    (the input's gradient among them; the weight's gradient, which the layer's counts hold as the hook takes it,
    left out)."""
    T, K, N = tokens, linear.in_features, linear.out_features
    gx = T * K * grad_bytes
    peak = max(CAST_BYTES * T * N,  # the output's gradient for grad_input
               T * N + CAST_BYTES * N * K,  # the weight beside it
               T * N + N * K + gx + CAST_BYTES * T * N,  # the output's gradient again, for grad_weight
               2 * T * N + N * K + gx + CAST_BYTES * T * K,  # the input
               2 * T * N + N * K + T * K + gx)  # the weight's gradient being made
    return peak + _scales(recipe, T, N, N, T)


@dataclass(frozen=True)
class LayerFloat8:
    """What float8 adds to one decoder layer's counts (`activations.layer_bytes`), per micro-batch."""

    forward: int  # the largest forward cast peak beyond a plain linear's (the layer's forward transient)
    mlp_backward: int  # beyond the MLP backward peak the layer's counts hold
    attn_backward: int  # beyond the attention backward peak
    converted_numel: int  # weights no longer copied to 16 bit by autocast
    converted_mlp_numel: int


def layer_terms(shape: ModelShape, settings: Any, c: int, attn_core: int, attn_work: int) -> LayerFloat8:
    """float8's terms in one decoder layer's counts under `settings` (the `float8` lever's `layer_terms`)."""
    return layer_float8(shape, settings.micro_batch_size * settings.seq_len, c, settings.float8_recipe, attn_core,
                        attn_work)


def gathered_numel(shape: ModelShape, settings: Any) -> int:
    """The elements of a decoder layer's weights FSDP2 gathers in float8, one byte each (the `float8` lever's
    `gathered_numel`): its converted linears' where `float8_all_gather`, else none."""
    return sum(x.numel for x in converted(shape)) if float8_all_gather(settings) else 0


def layer_float8(shape: ModelShape, tokens: int, c: int, recipe: str, attn_core: int, attn_work: int) -> LayerFloat8:
    """The float8 terms of one Llama-layout decoder layer whose linears see `tokens` rows in `c` bytes per element
    (`attn_core`, `attn_work`: the attention core's saved tensors and its backward's gradients of q, k, v).

    Each converted linear's backward peak (`backward_peak`) happens at a moment of the layer's backward where less
    than the layer's modelled peak is alive, and is placed there: the MLP's modelled peak holds the layer's saved
    tensors, the two (b, s, I) gradients of the gated product and the down projection's weight gradient; at the
    down projection's backward the product's gradient is being made (its input's gradient, inside its peak), the
    other and the weight gradient are not yet; at the up projection's the product and its two factors are freed
    and its own output's gradient is inside its peak; at the gate's the gate's output is freed too. The
    attention's modelled peak holds the gradient of its output and of q, k and v; the output projection runs
    before those exist, q, k and v after the core's saved tensors are freed. MemTracker on the trainer's step of a
    two-layer Llama (pure bf16 and fp32, both recipes; tests/float8_worker.py): the step peak then within 0.6%."""
    converted_names = {x.name: x for x in converted(shape)}
    T, bsI, bsh = tokens, tokens * shape.intermediate * c, tokens * shape.hidden * c

    def at(name: str, freed: int) -> int:
        linear = converted_names.get(name)
        return backward_peak(linear, T, c, recipe) - freed if linear else 0

    down = converted_names.get("mlp.down_proj")
    mlp = max(0, at("mlp.down_proj", 2 * bsI + (down.numel * c if down else 0)), at("mlp.up_proj", 3 * bsI),
              at("mlp.gate_proj", 5 * bsI))
    attention = max(0, at("self_attn.o_proj", bsh + attn_work),
                    *(at(name, bsh + attn_core) for name in ("self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.v_proj")))
    linears = tuple(converted_names.values())
    return LayerFloat8(
        forward=max((forward_extra(x, T, c, recipe) for x in linears), default=0),
        mlp_backward=mlp, attn_backward=attention,
        converted_numel=sum(x.numel for x in linears),
        converted_mlp_numel=sum(x.numel for x in linears if x.mlp))


def step_seconds(settings: Any, step: Any) -> float:
    """The lever's cost (fulltune/levers.py `Lever.cost`, over the step-time model's `StepCosts`): the converted
    linears' matmuls at float8's throughput (`SPEEDUP` × bf16's) instead of the step's precision's (negative: time
    saved). Their FLOPs: 6 per weight and token in the forward and backward, 2 more in a checkpointed layer's
    recomputed forward."""
    s, shape = settings, step.shape
    tokens = s.gradient_accumulation_steps * s.micro_batch_size * s.seq_len
    recomputed = min(s.gradient_checkpointing, shape.num_layers)
    flops = tokens * sum(x.numel for x in converted(shape)) * (6 * shape.num_layers + 2 * recomputed)
    precision = "bf16" if s.pure_bf16 else s.mixed_precision
    return flops * (1 / (step.flops("bf16") * SPEEDUP[s.device]) - 1 / step.flops(precision))


def for_model(shape: ModelShape, request: Any) -> Any:
    """The plan request (`fulltune.memory.PlanRequest`) with `float8: auto` off for a model float8 converts nothing
    of (another layout than Llama's, or no linear the kernels take).

    Raises:
        MemoryConfigError: `float8: true` for such a model, naming train.float8.
    """
    if converted(shape) or request.float8 is False:
        return request
    if request.float8 is None:
        return replace(request, float8=False)
    what = (f"the {shape.model_type} layout" if shape.layout not in CONVERTED_LAYOUTS
            else "none of its decoder linears has both dimensions a multiple of 16")
    raise MemoryConfigError(f"train.float8: float8 training converts the decoder linears of the Llama layout (Llama, "
                            f"Mistral, Qwen) whose dimensions float8 kernels take, and this model has {what}; set "
                            "float8 to false or auto")


def reasons(shape: ModelShape, request: Any, settings: Any) -> list[str]:
    """What `train.float8` converts (and what stays in its precision), or why `auto` left it off on a GPU."""
    s = settings
    if not s.float8:
        if request.float8 is None and s.device == "cuda" and converted(shape):
            missing = [why for needed, why in ((request.float8_supported, "a GPU with float8 tensor cores (compute "
                                                "capability 8.9 or above)"), (request.compile, "train.compile "
                                                "(eager, torchao's casts cost more than float8 saves)"))
                       if not needed]
            if missing:
                return [f"float8: auto stays off: it needs {' and '.join(missing)}"]
        return []
    linears, left = layer_linears(shape), kept(shape)
    dtype = "bf16" if s.pure_bf16 or s.mixed_precision == "bf16" else "fp32"
    gathered = ", gathered in float8 under FSDP" if float8_all_gather(s) else ""
    line = (f"float8: {len(linears) - len(left)} of the {len(linears)} linears of each decoder layer run float8 "
            f"matmuls ({s.float8_recipe} scales{gathered}); the output head and the embeddings stay {dtype}")
    if left:
        line += f", and so do {', '.join(x.name for x in left)} (a dimension not a multiple of 16)"
    return [line]
