"""What the memory model needs to know about a transformers config: dimensions and parameter tensors.

Three layouts are modelled tensor by tensor (checked against `model.parameters()` in the tests):
- `llama`: Llama, Mistral, Qwen2, Qwen3, Gemma and other decoder-only models with separate q/k/v
  projections, grouped-query attention, a gated MLP, RMSNorm and rotary positions.
- `gpt2`: fused `c_attn`, learned positions, LayerNorm with biases, GELU MLP, tied embeddings.
- `gpt_neox`: fused `query_key_value`, partial rotary, LayerNorm, parallel residual, GELU MLP.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

from fulltune.memory.errors import MemoryConfigError
from fulltune.optimizers import ParamShapes

LLAMA_LIKE = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "olmo",
    "olmo2",
    "smollm3",
    "granite",
    "cohere",
    "starcoder2",
    "phi3",
    "stablelm",
    "internlm2",
    "deepseek",
    "yi",
}


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder-only transformer, as the memory model reads them."""

    layout: str  # "llama" | "gpt2" | "gpt_neox"
    model_type: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    activation: str
    rotary_dim: int
    layer_params: tuple[tuple[int, ...], ...]  # parameter shapes of one decoder layer
    other_params: tuple[tuple[int, ...], ...]  # embeddings, final norm, untied lm head
    gated_mlp: bool = False
    qk_norm: bool = False
    parallel_residual: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    embedding_dropout: float = 0.0
    approximate: bool = False  # a model type read as one of the three layouts, never measured itself
    stored_bytes: int = 4  # bytes per parameter in the checkpoint (the config's dtype; fp32 when it names none)

    # Read for every candidate the planner weighs (thousands for a 70B model): computed once per shape.
    @functools.cached_property
    def layer_numel(self) -> int:
        return sum(_numel(s) for s in self.layer_params)

    @functools.cached_property
    def layer_matmul_numel(self) -> int:
        """Parameters of one layer that autocast copies to 16 bit (linear weights and biases)."""
        return sum(_numel(s) for s in self.layer_params if not _is_norm(s, self.hidden))

    @functools.cached_property
    def num_params(self) -> int:
        return self.num_layers * self.layer_numel + sum(_numel(s) for s in self.other_params)

    @functools.cached_property
    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.other_params) + tuple(s for _ in range(self.num_layers) for s in self.layer_params)

    @functools.cached_property
    def optimizer_shapes(self) -> ParamShapes:
        """The parameters as the optimizer sees them: the decoder layers' 2-D weights apart from the rest."""
        return ParamShapes(matrices=self.layer_optimizer_shapes.matrices * self.num_layers,
                           others=self.other_params + self.layer_optimizer_shapes.others * self.num_layers)

    @functools.cached_property
    def layer_optimizer_shapes(self) -> ParamShapes:
        """One decoder layer's parameters as the optimizer sees them (its 2-D weights apart)."""
        return ParamShapes(matrices=tuple(s for s in self.layer_params if len(s) == 2),
                           others=tuple(s for s in self.layer_params if len(s) != 2))

    @functools.cached_property
    def largest_param_numel(self) -> int:
        """Elements of the largest parameter tensor (0 without parameters)."""
        return max((_numel(s) for s in self.other_params + self.layer_params), default=0)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_norm(shape: tuple[int, ...], hidden: int) -> bool:
    # Norm weights/biases are 1-D of the hidden size; linear biases are 1-D too but autocast casts
    # them with the weight (addmm), so only norm-sized vectors are excluded here.
    return len(shape) == 1 and shape[0] == hidden


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def model_shape(config: Any) -> ModelShape:
    """Read a `transformers.PretrainedConfig` (or any object with the same attributes).

    Raises:
        MemoryConfigError: the config lacks the dimensions a decoder-only causal LM needs.
    """
    model_type = str(getattr(config, "model_type", "") or "")
    text_config = getattr(config, "text_config", None)
    if text_config is not None and getattr(config, "hidden_size", None) is None:
        config = text_config
        model_type = str(getattr(config, "model_type", model_type) or model_type)

    if model_type == "gpt2":
        shape = _gpt2_shape(config)
    elif model_type == "gpt_neox":
        shape = _neox_shape(config)
    else:
        shape = _llama_shape(config, model_type)
    return replace(shape, stored_bytes=_stored_bytes(config))


# The checkpoint dtypes a config may name (transformers 5 reads `torch_dtype` into `dtype`), in bytes per parameter.
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}


def _stored_bytes(config: Any) -> int:
    """Bytes per parameter of the weights as the checkpoint stores them (what loading reads)."""
    dtype = getattr(config, "dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return _DTYPE_BYTES.get(name, 4)


def _require(config: Any, model_type: str, *pairs: tuple[str, ...]) -> list[int]:
    values = []
    for names in pairs:
        value = _get(config, *names)
        if value is None:
            raise MemoryConfigError(
                f"model config ({model_type or 'unknown type'}) has no {names[0]}: the memory model needs "
                "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size and vocab_size"
            )
        values.append(int(value))
    return values


def _llama_shape(config: Any, model_type: str) -> ModelShape:
    h, L, a, I, V = _require(
        config,
        model_type,
        ("hidden_size",),
        ("num_hidden_layers",),
        ("num_attention_heads",),
        ("intermediate_size",),
        ("vocab_size",),
    )
    kv = int(_get(config, "num_key_value_heads", default=a))
    d = int(_get(config, "head_dim", default=h // a))
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    qk_norm = model_type == "qwen3"
    layer: list[tuple[int, ...]] = [(h,), (h,)]  # input_layernorm, post_attention_layernorm
    layer += [(a * d, h), (kv * d, h), (kv * d, h), (h, a * d)]
    if qkv_bias:
        layer += [(a * d,), (kv * d,), (kv * d,)]
    if o_bias:
        layer += [(h,)]
    if qk_norm:
        layer += [(d,), (d,)]
    layer += [(I, h), (I, h), (h, I)]
    if mlp_bias:
        layer += [(I,), (I,), (h,)]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    other: list[tuple[int, ...]] = [(V, h), (h,)]
    if not tied:
        other.append((V, h))
    act = str(_get(config, "hidden_act", "hidden_activation", default="silu"))
    return ModelShape(layout="llama", model_type=model_type, num_layers=L, hidden=h, heads=a, kv_heads=kv, head_dim=d,
                      intermediate=I, vocab=V, tied=tied, gated_mlp=True, activation=act, qk_norm=qk_norm,
                      rotary_dim=d, attention_dropout=_rate(config, "attention_dropout"), layer_params=tuple(layer),
                      other_params=tuple(other), approximate=model_type not in LLAMA_LIKE)


def _rate(config: Any, name: str) -> float:
    """A dropout rate of the config (0 when it names none)."""
    return float(getattr(config, name, 0.0) or 0.0)


def _gpt2_shape(config: Any) -> ModelShape:
    h, L, a, V = _require(config, "gpt2", ("n_embd", "hidden_size"), ("n_layer",), ("n_head",), ("vocab_size",))
    I = int(getattr(config, "n_inner", None) or 4 * h)
    n_pos = int(_get(config, "n_positions", "max_position_embeddings", default=1024))
    layer: list[tuple[int, ...]] = [(h,), (h,)]  # ln_1
    layer += [(h, 3 * h), (3 * h,), (h, h), (h,)]  # c_attn, c_proj (Conv1D: in x out)
    layer += [(h,), (h,)]  # ln_2
    layer += [(h, I), (I,), (I, h), (h,)]  # mlp.c_fc, mlp.c_proj
    other: list[tuple[int, ...]] = [(V, h), (n_pos, h), (h,), (h,)]
    tied = bool(getattr(config, "tie_word_embeddings", True))
    if not tied:
        other.append((V, h))
    return ModelShape(layout="gpt2", model_type="gpt2", num_layers=L, hidden=h, heads=a, kv_heads=a, head_dim=h // a,
                      intermediate=I, vocab=V, tied=tied, rotary_dim=0,
                      activation=str(getattr(config, "activation_function", "gelu_new")),
                      attention_dropout=_rate(config, "attn_pdrop"), hidden_dropout=_rate(config, "resid_pdrop"),
                      embedding_dropout=_rate(config, "embd_pdrop"), layer_params=tuple(layer),
                      other_params=tuple(other))


def _neox_shape(config: Any) -> ModelShape:
    h, L, a, I, V = _require(
        config,
        "gpt_neox",
        ("hidden_size",),
        ("num_hidden_layers",),
        ("num_attention_heads",),
        ("intermediate_size",),
        ("vocab_size",),
    )
    d = h // a
    rope = getattr(config, "rope_parameters", None) or {}
    pct = rope.get("partial_rotary_factor", getattr(config, "rotary_pct", 0.25)) if isinstance(rope, dict) else 0.25
    rot = int(d * float(pct))
    bias = bool(getattr(config, "attention_bias", True))
    layer: list[tuple[int, ...]] = [(h,), (h,), (h,), (h,)]  # input_layernorm, post_attention_layernorm
    layer += [(3 * h, h), (h, h)]
    if bias:
        layer += [(3 * h,), (h,)]
    layer += [(I, h), (I,), (h, I), (h,)]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    other: list[tuple[int, ...]] = [(V, h), (h,), (h,)]
    if not tied:
        other.append((V, h))
    return ModelShape(layout="gpt_neox", model_type="gpt_neox", num_layers=L, hidden=h, heads=a, kv_heads=a,
                      head_dim=d, intermediate=I, vocab=V, tied=tied, rotary_dim=rot,
                      activation=str(getattr(config, "hidden_act", "gelu")),
                      parallel_residual=bool(getattr(config, "use_parallel_residual", True)),
                      attention_dropout=_rate(config, "attention_dropout"),
                      hidden_dropout=_rate(config, "hidden_dropout"), layer_params=tuple(layer),
                      other_params=tuple(other))
