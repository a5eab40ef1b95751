"""Training FLOPs of a decoder-only transformer, the one formula, and the GPU peaks MFU is measured against.

    FLOPs = per_token · tokens + per_target · targets + per_pair · Σ_documents length²

- per_token = 6 · (N − N_head − N_lookup): forward (2 per parameter and token) and backward (4) of every
  weight that multiplies, at every position (PaLM appendix B's 6N);
- per_target = 6 · N_head: the output head runs only at the positions with a target (fulltune/runtime/loss.py);
- per_pair = 12 · L · a·d: the attention scores and their weighted sum (a heads of width d; PaLM's
  12·L·H·Q·T per token with T summed per document, since packed documents do not attend to each other).

N_lookup are the embedding tables (tokens and learned positions): a lookup multiplies nothing, except a
token table tied to the output head, which counts as the head. Recomputation (gradient checkpointing,
the chunked loss) is not model FLOPs; the planner adds it to its step time itself.

`from_model` counts a built model's parameters, `from_shape` the memory model's `ModelShape`; the tests
check that they agree. Nothing here imports torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Dense 16-bit tensor-core peak per GPU (NVIDIA datasheets, FLOP/s), for MFU. Checked in order by substring
# of torch.cuda.get_device_name(), so a name that contains another (H100 PCIe / H100, A100 / A10,
# L40S / L4) comes first. Other GPUs, fp32 runs and CPUs report no MFU.
GPU_PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12),
                  ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12), ("4090", 165e12), ("V100", 125e12),
                  ("T4", 65e12))


def peak_flops(device_name: str) -> float | None:
    """The dense 16-bit peak of the GPU called `device_name`; None when it is not in GPU_PEAK_FLOPS."""
    return next((peak for key, peak in GPU_PEAK_FLOPS if key in device_name), None)


@dataclass(frozen=True)
class FlopCoefficients:
    """Training FLOPs per token, per target position and per attended (query, key) pair."""

    per_token: float
    per_target: float
    per_pair: float

    def training_flops(self, tokens: float, targets: float, pairs: float) -> float:
        """FLOPs of forward and backward over `tokens` with `targets` target positions and `pairs` =
        Σ over the documents of length²."""
        return self.per_token * tokens + self.per_target * targets + self.per_pair * pairs

    def per_token_of_rows(self, seq_len: int, target_fraction: float = 1.0) -> float:
        """FLOPs per token of rows of one `seq_len`-token document with a target at `target_fraction` of the
        positions (Σ length² / tokens = seq_len)."""
        return self.per_token + target_fraction * self.per_target + self.per_pair * seq_len


def coefficients(*, num_params: int, head_params: int, lookup_params: int, num_layers: int,
                 attention_width: int) -> FlopCoefficients:
    """The coefficients from counts: all parameters (shared ones once), the output head's, the embedding
    tables' that are not the head, and L and a·d."""
    return FlopCoefficients(per_token=6.0 * (num_params - head_params - lookup_params),
                            per_target=6.0 * head_params, per_pair=12.0 * num_layers * attention_width)


def from_model(model: Any) -> FlopCoefficients:
    """The coefficients of a transformers causal LM (on any device, `meta` included)."""
    import torch

    config = model.config.get_text_config()
    output = model.get_output_embeddings()
    head = {id(p): p for p in output.parameters()} if output is not None else {}
    lookups = {id(p): p for module in model.modules() if isinstance(module, torch.nn.Embedding)
               for p in module.parameters(recurse=False) if id(p) not in head}
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return coefficients(num_params=sum(p.numel() for p in model.parameters()),
                        head_params=sum(p.numel() for p in head.values()),
                        lookup_params=sum(p.numel() for p in lookups.values()),
                        num_layers=config.num_hidden_layers, attention_width=heads * head_dim)


def from_shape(shape: Any) -> FlopCoefficients:
    """The coefficients of a `fulltune.memory.shapes.ModelShape`.

    Outside the layers, the 2-D tensors are the embedding tables and the untied output head (V × h); a tied
    head is the token table itself. Either way the head is V × h and the rest of them are lookups.
    """
    head = shape.vocab * shape.hidden
    tables = sum(rows * cols for rows, cols in (s for s in shape.other_params if len(s) == 2))
    return coefficients(num_params=shape.num_params, head_params=head, lookup_params=tables - head,
                        num_layers=shape.num_layers, attention_width=shape.heads * shape.head_dim)
