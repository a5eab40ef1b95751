"""Batches for the trainer and the evaluator: padding, collation and length-grouped batch order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.data.formats import IGNORE_INDEX

if TYPE_CHECKING:
    import numpy as np
    import torch

def collate(rows: Sequence[dict[str, Sequence[int]]], pad_token_id: int, padding_free: bool = False) -> dict[str, Any]:
    """Stack Parquet rows into int64 tensors, padding on the right to the longest row in the batch.

    Returns input_ids, labels (-100 on padding), position_ids, and attention_mask (1 real / 0 padding)
    only when a row needed padding.

    Packed rows (position_ids restart inside the row) are never given an attention_mask; they come with
    `documents` instead (`fulltune.attention.Documents`: each row's document lengths, read here from the
    position lists without touching a device), which the model's forward hands to every attention call, so
    each document attends to itself only (`fulltune.attention.sdpa_documents`) with no (s × s) mask. Their
    padding gets position_ids 0, 1, … so it is a document of its own, which real tokens never see.
    With `padding_free`, packed rows are laid end to end as one row of their tokens and no padding at all (the
    documents attend alone, so which row a document sits in changes nothing; a document's first label is
    always -100, so no row's last token is trained to predict the next row's first).
    transformers' own SDPA and eager attention, which ignore `documents`, build a block mask from the
    restarting position_ids instead (`masking_utils.find_packed_sequence_indices`), but only without a KV cache:
    call the model with `use_cache=False` when training on packed rows (tests/test_data.py pins this).
    """
    import torch

    packed = any(0 in list(row["position_ids"])[1:] for row in rows)
    if packed and padding_free:
        rows = [{name: [value for row in rows for value in row[name]] for name in ("input_ids", "labels", "position_ids")}]
    longest = max(len(row["input_ids"]) for row in rows)
    needs_padding = any(len(row["input_ids"]) < longest for row in rows)
    input_ids, labels, positions, mask = [], [], [], []
    for row in rows:
        n = len(row["input_ids"])
        pad = longest - n
        input_ids.append(list(row["input_ids"]) + [pad_token_id] * pad)
        labels.append(list(row["labels"]) + [IGNORE_INDEX] * pad)
        row_positions = list(row["position_ids"])
        if packed:
            row_positions += list(range(pad))
        else:
            start = row_positions[-1] + 1 if row_positions else 0
            row_positions += list(range(start, start + pad))
        positions.append(row_positions)
        mask.append([1] * n + [0] * pad)
    batch = {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
    }
    if needs_padding and not packed:
        batch["attention_mask"] = torch.tensor(mask, dtype=torch.long)
    if packed:
        from fulltune.attention import Documents

        batch["documents"] = Documents.from_positions(positions)
    return batch


def read_row_lengths(parquet_file: str | Path) -> np.ndarray:
    """Token count of every row of a tokenized Parquet file (reads only the list offsets)."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    column = pq.read_table(parquet_file, columns=["input_ids"])["input_ids"]
    return np.concatenate([pc.list_value_length(c).to_numpy(zero_copy_only=False) for c in column.chunks]
                          or [np.zeros(0, dtype=np.int64)]).astype(np.int64)


def iter_length_grouped_batches(
    lengths: Sequence[int], batch_size: int, seed: int, *, mega_batch_factor: int = 50, drop_last: bool = False
) -> Iterator[list[int]]:
    """Row indices in batches of similar length, for unpacked data (less padding per batch).

    The rows are shuffled (by `seed`; pass seed + epoch for a new order each epoch), cut into mega
    batches of `mega_batch_factor * batch_size` rows, each sorted by length (longest first) and cut
    into batches; batch order is then shuffled, except that the batch holding the longest row comes
    first so an out-of-memory shows up at step 1 (as transformers' LengthGroupedSampler does).
    Deterministic: the same arguments give the same batches, which makes resume exact.
    """
    import numpy as np

    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths_arr))
    mega = batch_size * mega_batch_factor
    batches: list[list[int]] = []
    for start in range(0, len(order), mega):
        group = order[start : start + mega]
        group = group[np.argsort(-lengths_arr[group], kind="stable")]
        batches += [group[i : i + batch_size].tolist() for i in range(0, len(group), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    if not batches:
        return
    batch_order = rng.permutation(len(batches))
    longest = max(range(len(batches)), key=lambda b: int(lengths_arr[batches[b]].max()))
    batch_order = [longest] + [b for b in batch_order.tolist() if b != longest]
    for b in batch_order:
        yield batches[b]
