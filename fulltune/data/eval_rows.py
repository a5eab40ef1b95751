"""eval.parquet as the evaluator reads it: a sequence of rows decoded a row group at a time.

`EvalRows` is a `Sequence` of row dicts (`input_ids`, `labels`, `position_ids`, `prompt`, `completion`),
so the evaluator's passes (the loss in batches, the examples it generates for, the bytes of target text)
read it as a list, but only one row group is held as Arrow columns at a time (the tokenize stage writes
groups of at most 8,192 rows or about 1M tokens) and only the rows asked for become Python objects: memory
follows the batch, not the eval set. With `data.eval` a list, `evaluate.max_examples` keeps the first rows of
each source (the file holds the sources' rows one after another).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from fulltune.errors import DataError

ITER_ROWS = 256  # rows turned into Python objects at a time while iterating


class EvalRows(Sequence):
    """The rows of a tokenized eval file, read on demand: of each source's rows (`counts`, in the file's order;
    None: the file is one source) the first `max_examples` (None: all)."""

    def __init__(self, path: str, max_examples: int | None = None, counts: Sequence[int] | None = None) -> None:
        import numpy as np
        import pyarrow.parquet as pq

        self.path = path
        try:
            self._file = pq.ParquetFile(path)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"{path}: cannot read tokenized eval data ({exc}); re-run the tokenize stage") from None
        metadata = self._file.metadata
        groups = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self._starts = np.concatenate([[0], np.cumsum(groups, dtype=np.int64)])
        total = int(self._starts[-1])
        if counts is None or sum(counts) != total:
            counts = [total]
        # (first row in the file, rows kept) of each source, one after another
        self._blocks: list[tuple[int, int]] = []
        for first, count in zip(np.concatenate([[0], np.cumsum(counts)]).tolist(), counts):
            self._blocks.append((int(first), count if max_examples is None else min(count, max_examples)))
        self._len = sum(kept for _, kept in self._blocks)
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

    def has_completion(self, start: int, stop: int) -> list[bool]:
        """Whether each of rows start … stop − 1 has a completion (read from that column only)."""
        pieces = self._pieces(start, stop, ["completion"])
        return [bool(valid) for piece in pieces for valid in piece.column(0).is_valid().to_pylist()]

    def _range(self, start: int, stop: int) -> list[dict[str, Any]]:
        """Rows start … stop − 1."""
        return [row for piece in self._pieces(start, stop) for row in piece.to_pylist()]

    def _pieces(self, start: int, stop: int, columns: list[str] | None = None) -> Iterator[Any]:
        """Rows start … stop − 1 as Arrow slices, block by block (the sources' kept rows) and group by group."""
        import numpy as np

        offset = 0
        for first, kept in self._blocks:
            lo, hi = max(start, offset), min(stop, offset + kept)
            row = first + lo - offset
            end = first + hi - offset
            while row < end:
                group = int(np.searchsorted(self._starts, row, side="right")) - 1
                group_first, group_end = int(self._starts[group]), int(self._starts[group + 1])
                take = min(end, group_end) - row
                table = self._group(group)
                yield (table.select(columns) if columns else table).slice(row - group_first, take)
                row += take
            offset += kept

    def _group(self, group: int) -> Any:
        """Row group `group` as an Arrow table: the last one read is kept (the passes read in order)."""
        if self._cached[0] != group:
            self._cached = (-1, None)  # the previous group is let go before the next is read
            self._cached = (group, self._file.read_row_group(group))
        return self._cached[1]


def has_completion(rows: Sequence[dict[str, Any]], start: int, stop: int) -> list[bool]:
    """Whether each of `rows[start:stop]` has a completion to compare a generation with: an `EvalRows` reads
    that column only, a list of rows (a sharded evaluation's child) looks at each."""
    if isinstance(rows, EvalRows):
        return rows.has_completion(start, stop)
    return [row.get("completion") is not None for row in rows[start:stop]]
