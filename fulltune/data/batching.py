"""Which rows each optimizer step trains on, and how one micro-batch becomes tensors.

The data order is a pure function of (seed, epoch, step), so a resumed run sees exactly the batches an
uninterrupted run would: the data position saved in a checkpoint is just the optimizer step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fulltune.data import collate, iter_length_grouped_batches, row_target_counts
from fulltune.errors import DataError


class TokenizedRows:
    """train.parquet held as flat numpy arrays and row offsets: a row is a slice, not a Python object.

    Per row it precomputes what the loop needs without touching tensors: `lengths` (non-padding tokens),
    `targets` (loss terms: labels[1:] != -100, the count the loss is divided by) and `attention_pairs`
    (Σ over the row's documents of length², the attention term of the FLOP count).
    """

    COLUMNS = ("input_ids", "labels", "position_ids")

    def __init__(self, path: str) -> None:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: cannot read tokenized data ({exc}); re-run the tokenize stage") from None
        missing = [name for name in self.COLUMNS if name not in table.column_names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; expected {list(self.COLUMNS)}")
        if table.num_rows == 0:
            raise DataError(f"{path}: no rows to train on")
        lengths = {name: pc.list_value_length(table[name]).to_numpy(zero_copy_only=False) for name in self.COLUMNS}
        if any(not np.array_equal(lengths["input_ids"], other) for other in lengths.values()):
            raise DataError(f"{path}: input_ids, labels and position_ids differ in length in some rows")
        # int32 as stored: 12 bytes per token for the three columns.
        self.values = {name: pc.list_flatten(table[name]).to_numpy(zero_copy_only=False) for name in self.COLUMNS}
        self.lengths = lengths["input_ids"].astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])

        self.targets = row_target_counts(self.values["labels"], self.offsets)
        if self.targets.sum() == 0:
            raise DataError(f"{path}: no token has a label (every label is -100); nothing to train on")
        self.attention_pairs = self._attention_pairs()

    def _attention_pairs(self) -> np.ndarray:
        """Σ over each row's documents of length²: packed documents do not attend to each other."""
        # Documents: a row start, or a position id of 0 (packed rows restart positions per document).
        doc_start = self.values["position_ids"] == 0
        doc_start[self.offsets[:-1][self.lengths > 0]] = True
        first = np.flatnonzero(doc_start)
        doc_lengths = np.diff(np.append(first, len(doc_start)))
        doc_row = np.searchsorted(self.offsets, first, side="right") - 1
        return np.bincount(doc_row, weights=doc_lengths.astype(np.float64) ** 2, minlength=len(self.lengths))

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self, indices: np.ndarray) -> list[dict[str, list[int]]]:
        """The rows as `collate` takes them."""
        spans = [(self.offsets[i], self.offsets[i + 1]) for i in indices]
        return [{name: self.values[name][a:b].tolist() for name in self.COLUMNS} for a, b in spans]


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


def micro_batch_inputs(data: TokenizedRows, rows: np.ndarray, pad_token_id: int, device: Any) -> tuple[dict, Any]:
    """The model inputs (input_ids, position_ids: (B, T)) and the loss targets of one micro-batch, on `device`."""
    from fulltune.data.targets import Targets

    batch = collate(data.rows(rows), pad_token_id)
    # Padding is on the right, so in a causal LM no real token attends to it, and it has no labels: the
    # padding mask changes nothing but keeps SDPA off its causal kernel (11% slower per micro-batch of 200
    # tokens on CPU, measured when this was written). Packed rows are separated by position_ids.
    batch.pop("attention_mask", None)
    targets = Targets.from_labels(batch.pop("labels")).to(device)
    inputs = {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
    return inputs, targets
