"""The tokenize stage on every core: a source's records cut into shards, each tokenized by a worker process.

`data.num_workers` processes (`auto`: the CPUs this process may use, `os.sched_getaffinity`) each take
shards of at most SHARD records in turn and write each as an Arrow IPC file; the shards, read back in
order, are the examples one process would have made, byte for byte (an example does not depend on the
batch it was tokenized in: `formats.encode_range`). The workers are forked, so they start with the
tokenizer loaded and the records memory-mapped from `datasets`' Arrow cache, and a shard is the most any
of them holds: memory does not grow with the source. There are a few shards per worker (PER_WORKER),
so a worker that the machine's other work slows is not the one the stage waits for at the end. The
parent's objects are frozen out of the garbage collector before the fork (`gc.freeze`), so the workers'
collections do not touch, and copy, every page they inherit. The first shard (in record order) that
fails is the error reported, as one process would have reported it.
"""

from __future__ import annotations

import gc
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.data.formats import BATCH, Encoded, Encoder, encode_range

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

SHARD = 20_000  # records per shard: what one worker holds at a time
PER_WORKER = 4  # shards per worker, at least, where the source has that many batches

# What forked workers inherit (set only while a pool runs): the encoder and the records.
_INHERITED: tuple[Encoder, datasets.Dataset] | None = None


@dataclass(frozen=True)
class Shard:
    """One written shard: its file and what tokenizing it counted."""

    file: str
    rows: int
    truncated: int
    dropped: int
    has_target_text: bool


def worker_count(setting: int | str) -> int:
    """`data.num_workers` as a number: `auto` is the CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if setting == "auto" else int(setting)


def tokenize_shards(encoder: Encoder, records: datasets.Dataset, out: Path, workers: int) -> list[Shard]:
    """Tokenize `records` into `out/examples-NNNNN.arrow`, one file per shard, with `workers` processes
    (this process alone for 1, or for a source of one shard: fewer than 2 × BATCH records)."""
    global _INHERITED

    n = len(records)
    # A worker is worth starting for a batch or more; a few shards each balance the workers' load.
    size = min(SHARD, max(BATCH, -(-n // (max(workers, 1) * PER_WORKER))))
    ranges = [(start, min(start + size, n), str(out / f"examples-{k:05d}.arrow"))
              for k, start in enumerate(range(0, n, size))]
    if workers <= 1 or len(ranges) <= 1:
        return [_write_shard(encoder, records, *r) for r in ranges]
    _INHERITED = (encoder, records)
    gc.freeze()
    pool = ProcessPoolExecutor(min(workers, len(ranges)), mp_context=get_context("fork"))
    try:
        return list(pool.map(_inherited_shard, *zip(*ranges)))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        gc.unfreeze()
        _INHERITED = None


def _inherited_shard(start: int, stop: int, file: str) -> Shard:
    assert _INHERITED is not None, "runs in a worker forked by tokenize_shards"
    return _write_shard(*_INHERITED, start, stop, file)


def _write_shard(encoder: Encoder, records: datasets.Dataset, start: int, stop: int, file: str) -> Shard:
    import pyarrow as pa

    encoded: Encoded = encode_range(encoder, records, start, stop)
    with pa.OSFile(file, "wb") as sink, pa.ipc.new_file(sink, encoded.table.schema) as writer:
        writer.write_table(encoded.table)
    return Shard(Path(file).name, len(encoded.table), encoded.truncated, encoded.dropped, encoded.has_target_text)


def read_shards(root: Path, shards: list[dict[str, Any]]) -> pa.Table:
    """The shards' examples as one table, memory-mapped (no copy: the page cache holds them)."""
    import pyarrow as pa

    tables = [pa.ipc.open_file(pa.memory_map(str(root / shard["file"]))).read_all() for shard in shards]
    return pa.concat_tables(tables)
