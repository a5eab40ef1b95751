"""The training loss: summed next-token cross-entropy, with the output head run only where there is a target.

A causal LM's output head (lm_head) turns every position's hidden state into V logits, and the loss then
ignores the positions without a target: prompt tokens of prompt/completion data, user turns of chat
data, padding, the last token of each row. fulltune gathers the positions that have a target *before*
the head, so neither the (positions × V) logits nor the head's matmuls are computed for the others:

    positions with a target   t ≤ b·s          (known on the host from the labels: no device sync)
    head input                (b, s, h) → (t, h)   index_select in a forward pre-hook on lm_head
    logits                    (t, V) instead of (b, s, V)

The loss and every gradient are the same as with full logits (the ignored positions contribute zero);
only the floating-point summation order of the head's matmuls differs. The hook sits on the output
embedding of the unwrapped model, so it runs inside DDP/FSDP/DeepSpeed wrappers and torch.compile, and
anything the model applies to the logits afterwards (Gemma's soft-capping, Cohere's scale) is elementwise
and unchanged. For a Llama-3.2-1B-shaped model (vocabulary 128k, hidden 2048) the head is ~40% of the
FLOPs and its fp32 logits 512 KiB per position, so a half-prompt batch saves a fifth of the compute and
half the logits memory; `fulltune.memory` counts the logits at t positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fulltune.data import IGNORE_INDEX


@dataclass(frozen=True)
class Targets:
    """Where the loss has terms in a (b, s) micro-batch and what they are.

    `index`: flat positions (row-major over b·s) whose next token is a target, int64 (t,).
    `tokens`: the target token ids at those positions, int64 (t,).
    """

    index: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def from_labels(cls, labels: torch.Tensor) -> Targets:
        """Shift like transformers' ForCausalLMLoss (position i predicts label i+1); call it on the host."""
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
        index = (shifted != IGNORE_INDEX).nonzero().squeeze(1)
        return cls(index=index, tokens=shifted.index_select(0, index))

    def __len__(self) -> int:
        return int(self.index.numel())

    def to(self, device: torch.device | str) -> Targets:
        return Targets(self.index.to(device, non_blocking=True), self.tokens.to(device, non_blocking=True))


class TargetHead:
    """Makes `model`'s output head run on the hidden states of the target positions only.

    Install it on the unwrapped model, before torch.compile or accelerator.prepare. While `loss_sum`
    runs, the head's input (b, s, h) is replaced by its rows at `Targets.index`; otherwise (generation,
    evaluation) the hook does nothing.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embedding (lm_head) to compute a loss with")
        self.index: torch.Tensor | None = None
        self._handle = head.register_forward_pre_hook(self._gather)

    def _gather(self, _module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self.index is None:
            return None
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.index), *args[1:])

    def remove(self) -> None:
        self._handle.remove()

    @staticmethod
    def compile(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
        """torch.compile for a model with a TargetHead: the gather index changes length with every
        micro-batch, and dynamo, which reaches it through a module's hook, would otherwise take its
        shape as static and recompile for each length (giving up after its recompile limit)."""
        torch._dynamo.config.force_nn_module_property_static_shapes = False
        return torch.compile(model, **options)

    def loss_sum(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], targets: Targets) -> torch.Tensor:
        """Σ over the target positions of the fp32 cross-entropy; the logits are freed on return."""
        self.index = targets.index
        try:
            # fp32 as Accelerate's convert_outputs_to_fp32 leaves them under mixed precision; the
            # 16-bit logits are freed here, before the loss.
            logits = model(**inputs, use_cache=False).logits.float()  # (t, V)
        finally:
            self.index = None
        if logits.dim() == 3:  # a model that bypasses its output-embedding module: select after the head
            logits = logits.reshape(-1, logits.shape[-1]).index_select(0, targets.index)
        return F.cross_entropy(logits, targets.tokens, reduction="sum")
