"""Which rows each optimizer step trains on, and how one micro-batch becomes tensors.

The data order is a pure function of (seed, epoch, step), so a resumed run sees exactly the batches an
uninterrupted run would: the data position saved in a checkpoint is just the optimizer step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fulltune.data import collate, iter_length_grouped_batches
from fulltune.data.mapped import TOKEN_COLUMNS, RowColumns
from fulltune.errors import DataError


class TokenizedRows:
    """The rows a trainer reads: train.arrow memory-mapped (a Parquet file of the same columns is read into
    memory); a row is read, as lists, only when it is trained on (`rows`).

    Per row it holds what the loop needs without touching tokens: `lengths` (non-padding tokens),
    `targets` (loss terms: labels[1:] != -100, the count the loss is divided by) and `attention_pairs`
    (Σ over the row's documents of length², the attention term of the FLOP count): a few numbers per row,
    where the tokens are 12 bytes each (fulltune/data/mapped.py).
    """

    COLUMNS = TOKEN_COLUMNS

    def __init__(self, path: str) -> None:
        self._columns = RowColumns(path)
        self.lengths = self._columns.lengths
        self.targets = self._columns.targets
        self.attention_pairs = self._columns.attention_pairs
        if self.targets.sum() == 0:
            raise DataError(f"{path}: no token has a label (every label is -100); nothing to train on")

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self, indices: np.ndarray) -> list[dict[str, list[int]]]:
        """The rows as `collate` takes them."""
        return [self._columns.row(int(i)) for i in indices]


class StepSchedule:
    """Rows of each optimizer step (all micro-batches, all processes): a pure function of (seed, epoch, step).

    An epoch is a length-grouped shuffle seeded with seed + epoch (`data.iter_length_grouped_batches`
    with one batch per optimizer step: rows of similar length share a step, and within it they are sorted
    longest first, so micro-batches pad little; packed rows are all about max_length and it is a plain
    shuffle). How a step is cut into micro-batches and processes does not change which rows it holds, so
    micro 2 × accumulation 2, micro 4 × accumulation 1 and 2 processes × micro 2 train on the same data.
    The last incomplete step of an epoch is dropped. The data position is just the step number.
    """

    def __init__(self, lengths: np.ndarray, rows_per_step: int, seed: int) -> None:
        self.lengths, self.rows_per_step, self.seed = lengths, rows_per_step, seed
        self.per_epoch = len(lengths) // rows_per_step
        self._epoch, self._steps = -1, []

    def step_rows(self, step: int) -> np.ndarray:
        """Row indices of optimizer step `step` (0-based, counted over the whole run)."""
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._steps = list(iter_length_grouped_batches(self.lengths, self.rows_per_step, self.seed + epoch,
                                                           drop_last=True))
            self._epoch = epoch
        return np.asarray(self._steps[index])

    @staticmethod
    def micro_batch(rows: np.ndarray, index: int, process: int, micro_batch_size: int, processes: int) -> np.ndarray:
        """Process `process`'s rows of micro-batch `index`: each micro-batch is `processes` disjoint slices."""
        start = (index * processes + process) * micro_batch_size
        return rows[start:start + micro_batch_size]


def micro_batch_inputs(data: TokenizedRows, rows: np.ndarray, pad_token_id: int, device: Any,
                       padding_free: bool = False) -> tuple[dict, Any]:
    """The model inputs (input_ids, position_ids: (B, T); for packed rows `documents`) and the loss targets of one
    micro-batch, on `device`; with `padding_free`, packed rows as one row of their tokens (`collate`)."""
    from fulltune.data.targets import Targets

    batch = collate(data.rows(rows), pad_token_id, padding_free)
    # Padding is on the right, so in a causal LM no real token attends to it, and it has no labels: the
    # padding mask changes nothing but keeps SDPA off its causal kernel (11% slower per micro-batch of 200
    # tokens on CPU, measured when this was written). Packed rows are separated by their documents.
    batch.pop("attention_mask", None)
    targets = Targets.from_labels(batch.pop("labels")).to(device)
    documents = batch.pop("documents", None)  # packed rows: their documents, for the attention (host-side)
    inputs = {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
    if documents is not None:
        inputs["documents"] = documents
    return inputs, targets
