"""The loss targets of one micro-batch: where the loss has terms, and which token each one predicts.

The trainer's head (fulltune/runtime/loss.py `TargetHead`) runs only at these positions; the micro-batch that
fulltune/data/batching.py hands the step carries them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fulltune.data.formats import IGNORE_INDEX


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

