"""The training rows as training processes read them: an Arrow IPC file mapped without a copy.

The tokenize stage writes `train.arrow` beside `train.parquet` (`MappedRowsWriter`, a chunk of rows per
record batch): the same `input_ids`, `labels`, `position_ids` (list<int32>), uncompressed, plus each row's
`targets` (loss terms) and `attention_pairs` (Σ document length²), so that a reader never has to read every
token to count them. `RowColumns` opens it with `pyarrow.memory_map`: the columns are views of the mapped
file, a row is read (paged in) only when it is trained on, and the ranks of one machine share one copy in
the page cache. A Parquet file of the same columns (written by hand, or by an earlier fulltune) is read
into memory instead, and its per-row counts computed from its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.data.formats import IGNORE_INDEX
from fulltune.errors import DataError

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

TOKEN_COLUMNS = ("input_ids", "labels", "position_ids")
ROW_COLUMNS = (("targets", "int64"), ("attention_pairs", "float64"))


class MappedRowsWriter:
    """train.arrow, written a chunk of rows at a time (each chunk one record batch); a no-op without a path."""

    def __init__(self, path: Path | None, schema: pa.Schema) -> None:
        import pyarrow as pa

        self.path = path
        self.schema = pa.schema([schema.field(name) for name in TOKEN_COLUMNS]
                                + [(name, getattr(pa, kind)()) for name, kind in ROW_COLUMNS])
        self._sink: Any = None
        self._writer: Any = None

    def __enter__(self) -> MappedRowsWriter:
        import pyarrow as pa

        if self.path is not None:
            self._sink = pa.OSFile(str(self.path), "wb")
            self._writer = pa.ipc.new_file(self._sink, self.schema)
        return self

    def write(self, table: pa.Table) -> None:
        """Append `table`'s rows (its token columns share one offsets array, as `_packed_chunk` builds them)."""
        import numpy as np
        import pyarrow as pa

        if self._writer is None:
            return
        ids, labels, positions = (table[name].combine_chunks() for name in TOKEN_COLUMNS)
        offsets = ids.offsets.to_numpy().astype(np.int64)
        local = offsets - offsets[0]
        flat_labels = labels.values.to_numpy()[offsets[0]:offsets[-1]]
        flat_positions = positions.values.to_numpy()[offsets[0]:offsets[-1]]
        extra = [pa.array(row_target_counts(flat_labels, local), pa.int64()),
                 pa.array(row_attention_pairs(flat_positions, local), pa.float64())]
        self._writer.write_batch(pa.RecordBatch.from_arrays([ids, labels, positions, *extra], schema=self.schema))

    def __exit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()


def row_target_counts(labels: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Loss terms per row of flat `labels` cut at `offsets` (n_rows + 1): labels shifted left by one, as
    the loss predicts them, so a row's first label never counts."""
    import numpy as np

    trainable = labels != IGNORE_INDEX
    starts = offsets[:-1]
    trainable[starts[np.diff(offsets) > 0]] = False
    cumulative = np.concatenate([[0], np.cumsum(trainable)])
    return cumulative[offsets[1:]] - cumulative[starts]


def row_attention_pairs(positions: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Σ over each row's documents of length² (packed documents do not attend to each other), for flat
    `positions` cut at `offsets` (n_rows + 1): a document starts at a row start or at a position id of 0."""
    import numpy as np

    lengths = np.diff(offsets)
    doc_start = positions == 0
    doc_start[offsets[:-1][lengths > 0]] = True
    first = np.flatnonzero(doc_start)
    doc_lengths = np.diff(np.append(first, len(doc_start)))
    doc_row = np.searchsorted(offsets, first, side="right") - 1
    return np.bincount(doc_row, weights=doc_lengths.astype(np.float64) ** 2, minlength=len(lengths))


@dataclass(frozen=True)
class Chunk:
    """One record batch of rows: row offsets into its columns' flat values (views, not copies)."""

    offsets: np.ndarray  # n_rows + 1 (int32, from 0), into `values`
    values: dict[str, np.ndarray]  # column → flat int32 values


class RowColumns:
    """The token columns of a tokenized train file, chunk by chunk, and each row's length, targets and
    attention pairs (small: a few numbers per row). Raises DataError for a file that is not one."""

    def __init__(self, path: str) -> None:
        import numpy as np

        table = _open(path)
        missing = [name for name in TOKEN_COLUMNS if name not in table.column_names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; expected {list(TOKEN_COLUMNS)}")
        if table.num_rows == 0:
            raise DataError(f"{path}: no rows to train on")
        self.chunks = [_chunk(path, batch) for batch in table.select(list(TOKEN_COLUMNS)).to_batches()
                       if batch.num_rows]
        self.lengths = np.concatenate([np.diff(c.offsets).astype(np.int64) for c in self.chunks])
        self.chunk_starts = np.concatenate([[0], np.cumsum([len(c.offsets) - 1 for c in self.chunks])])
        if all(name in table.column_names for name, _ in ROW_COLUMNS):
            self.targets = np.concatenate([view(c) for c in table["targets"].chunks]).astype(np.int64)
            self.attention_pairs = np.concatenate([view(c) for c in table["attention_pairs"].chunks]
                                                  ).astype(np.float64)
        else:  # a file without them (Parquet): counted from every token
            self.targets = np.concatenate([row_target_counts(c.values["labels"], c.offsets) for c in self.chunks])
            self.attention_pairs = np.concatenate([row_attention_pairs(c.values["position_ids"], c.offsets)
                                                   for c in self.chunks])

    def row(self, index: int) -> dict[str, list[int]]:
        """Row `index` as `collate` takes it (only its pages are read)."""
        import numpy as np

        c = int(np.searchsorted(self.chunk_starts, index, side="right")) - 1
        chunk, local = self.chunks[c], index - int(self.chunk_starts[c])
        a, b = int(chunk.offsets[local]), int(chunk.offsets[local + 1])
        return {name: values[a:b].tolist() for name, values in chunk.values.items()}


def _open(path: str) -> pa.Table:
    """The file's table: an Arrow IPC file memory-mapped (its buffers are the map), Parquet read into memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if Path(path).suffix == ".arrow":
            return pa.ipc.open_file(pa.memory_map(path)).read_all()
        return pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: cannot read tokenized data ({exc}); re-run the tokenize stage") from None


def _chunk(path: str, batch: pa.RecordBatch) -> Chunk:
    """A record batch's row offsets (from 0) and each column's flat values of those rows, as numpy views of
    the batch's buffers; DataError when the columns' rows differ in length."""
    import numpy as np

    columns = [batch.column(name) for name in TOKEN_COLUMNS]
    offsets = [view(column.offsets) for column in columns]
    local = offsets[0] - offsets[0][0]
    if any(not np.array_equal(local, other - other[0]) for other in offsets[1:]):
        raise DataError(f"{path}: input_ids, labels and position_ids differ in length in some rows")
    values = {name: view(column.values)[o[0]:o[-1]] for name, column, o in zip(TOKEN_COLUMNS, columns, offsets)}
    return Chunk(local, values)


# The numpy type of each Arrow type a tokenized file holds.
_NUMPY_TYPES = {"int32": "int32", "int64": "int64", "float": "float32", "double": "float64"}


def view(array: pa.Array) -> np.ndarray:
    """A numeric Arrow array as a numpy view of its buffer, without a copy.

    pyarrow's own `to_numpy` does the same but first imports pandas (its pandas shim: about 0.3 s and
    40 MiB in every training process, which never uses it). An array with nulls, or of another type, takes
    `to_numpy` (a copy)."""
    import numpy as np

    kind = _NUMPY_TYPES.get(str(array.type))
    if kind is None or array.null_count:
        return array.to_numpy(zero_copy_only=False)
    itemsize = np.dtype(kind).itemsize
    return np.frombuffer(array.buffers()[1], dtype=kind, count=len(array), offset=array.offset * itemsize)
