"""eval.parquet as the evaluator reads it: a sequence of rows decoded a row group at a time.

`EvalRows` is a `Sequence` of row dicts (`input_ids`, `labels`, `position_ids`, `prompt`, `completion`),
so the evaluator's passes (the loss in batches, the examples it generates for, the bytes of target text)
read it as a list, but only one row group is held as Arrow columns at a time (the tokenize stage writes
groups of at most 8,192 rows or about 1M tokens) and only the rows asked for become Python objects: memory
follows the batch, not the eval set.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from fulltune.errors import DataError

ITER_ROWS = 256  # rows turned into Python objects at a time while iterating


class EvalRows(Sequence):
    """The first `max_examples` rows (None: all) of a tokenized eval file, read on demand."""

    def __init__(self, path: str, max_examples: int | None = None) -> None:
        import numpy as np
        import pyarrow.parquet as pq

        self.path = path
        try:
            self._file = pq.ParquetFile(path)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"{path}: cannot read tokenized eval data ({exc}); re-run the tokenize stage") from None
        metadata = self._file.metadata
        counts = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        total = int(self._starts[-1])
        self._len = total if max_examples is None else min(total, max_examples)
        self._cached: tuple[int, Any] = (-1, None)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self._range(start, max(start, stop))
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} of {self._len}")
        return self._range(index, index + 1)[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, self._len, ITER_ROWS):
            yield from self._range(start, min(start + ITER_ROWS, self._len))

    def _range(self, start: int, stop: int) -> list[dict[str, Any]]:
        """Rows start … stop − 1, group by group."""
        import numpy as np

        out: list[dict[str, Any]] = []
        while start < stop:
            group = int(np.searchsorted(self._starts, start, side="right")) - 1
            first, end = int(self._starts[group]), int(self._starts[group + 1])
            take = min(stop, end) - start
            out += self._group(group).slice(start - first, take).to_pylist()
            start += take
        return out

    def _group(self, group: int) -> Any:
        """Row group `group` as an Arrow table: the last one read is kept (the passes read in order)."""
        if self._cached[0] != group:
            self._cached = (-1, None)  # the previous group is let go before the next is read
            self._cached = (group, self._file.read_row_group(group))
        return self._cached[1]
