"""The tokenize stage: data files → packed Parquet under `<workdir>/tokenized/<fingerprint>/`, and back.

`tokenize_dataset` turns a `DataSpec` into these files under `<workdir>/tokenized/<fingerprint>/`:

- `train.parquet`: `input_ids`, `labels`, `position_ids` (list<int32>), packed into rows of at most
  `max_length` tokens when `data.packing` is on, one example per row otherwise;
- `train.arrow`: the same rows as an uncompressed Arrow IPC file, plus each row's `targets` (loss terms)
  and `attention_pairs` (Σ document length²): what training reads, memory-mapped (fulltune/data/batching.py
  `TokenizedRows`), so a process touches only the pages of its rows and the ranks of a machine share one
  copy in the page cache;
- `eval.parquet`: the same columns, never packed, plus `prompt` and `completion` strings (format
  `prompt_completion`; null for the other formats) for exact-match generation;
- `meta.json`: the `TokenizedData` record (counts, lengths, the tokenizer it was built with).

Labels follow the convention in fulltune/data/formats.py.

The directory name is a content fingerprint (data bytes, tokenizer files, formatting options, `DATA_FORMAT_VERSION`,
and `train.seed` where it shapes the rows: `seed_uses`): changing any of them builds a new directory, an unchanged input is a cache hit
that does no work. `train_fingerprint` covers only what `train.parquet` depends on (not `data.eval`), so
new held-out data re-evaluates a model without retraining it. A hub dataset counts by its commit. File
digests are remembered in the workdir (fulltune/storage.py), so a data file is read once to key the stage
and fingerprint its output. Builds happen in a temp dir that is renamed into place, so a killed build
never leaves a half-written dataset behind.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune import hub
from fulltune.data.files import update_hash_with_source
from fulltune.data.formats import IGNORE_INDEX, format_columns, no_target_text_message, pad_token_id_of
from fulltune.data.mapped import MappedRowsWriter, row_target_counts
from fulltune.data.mix import (
    SOURCES_FILE,
    SourceExamples,
    prune_source_caches,
    source_examples,
    source_fingerprint,
    weighted_rows,
)
from fulltune.data.sources import Source, describe, is_single, sources
from fulltune.errors import DataError
from fulltune.spec import DataSpec
from fulltune.storage import FileHashes, atomic_dir, file_sha256, hash_parts, remove_stale_temp_dirs

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

# Bump when the on-disk layout or the tokenization rules change: every cached dataset is rebuilt.
DATA_FORMAT_VERSION = 2
TOKENIZED_FILES = ("train.parquet", "train.arrow", "eval.parquet")
_ROW_CHUNK = 8192  # rows per Parquet row group, at most
_CHUNK_TOKENS = 1 << 20  # tokens per row group, at most (rows of max_length): what writing holds at a time


@dataclass(frozen=True)
class TokenizedData:
    """A tokenized dataset on disk: where it is and what is in it (small: passed between stages)."""

    path: str  # <workdir>/tokenized/<fingerprint>
    fingerprint: str  # sha256 hex
    format: str
    packing: bool
    num_train_examples: int  # examples (documents) in train.parquet
    num_eval_examples: int
    num_train_rows: int  # rows in train.parquet (after packing)
    train_tokens: int  # tokens in train.parquet (rows are stored unpadded)
    train_label_tokens: int  # tokens with labels != -100: the number of loss terms per epoch
    max_row_length: int  # longest row in train.parquet
    truncated_examples: int  # train + eval examples cut to max_length
    tokenizer: str = ""  # the tokenizer reference it was built with (directory or hub id)
    max_length: int = 0
    pad_token_id: int = 0  # the tokenizer's pad token, else its eos token
    dropped_examples: int = 0  # train + eval examples with no label token left after truncation
    eval_tokens: int = 0
    eval_label_tokens: int = 0
    max_row_targets: int = 0  # most loss terms in one train row (0: unknown)
    train_fingerprint: str = ""  # what train.parquet depends on: train data, tokenizer, options, seed

    @property
    def training_fingerprint(self) -> str:
        """The fingerprint training depends on (the whole one for data tokenized before it was recorded)."""
        return self.train_fingerprint or self.fingerprint

    @property
    def train_file(self) -> str:
        return str(Path(self.path) / "train.parquet")

    @property
    def train_rows_file(self) -> str:
        """train.arrow: the rows of train.parquet as training reads them, memory-mapped."""
        return str(Path(self.path) / "train.arrow")

    @property
    def eval_file(self) -> str:
        return str(Path(self.path) / "eval.parquet")




# ---------------------------------------------------------------------------------------------------
# Fingerprints


def _update_hash_with_tokenizer(h: Any, tokenizer: str, hashes: FileHashes) -> None:
    """Add a tokenizer to a hash: its files' digests for a local directory, the id for a hub tokenizer.
    Model weights are skipped: a checkpoint directory doubles as the tokenizer directory when
    `model.tokenizer` is not set, and its weights can be gigabytes."""
    root = Path(tokenizer).expanduser()
    if not root.is_dir():
        hash_parts(h, "hub-tokenizer", tokenizer)
        return
    for file in sorted(p for p in root.iterdir() if p.is_file()):
        if any(fnmatch.fnmatch(file.name, pattern) for pattern in hub.WEIGHT_PATTERNS):
            continue
        hash_parts(h, "tokenizer-file", file.name, hashes.sha256(file))


def _format_options(data: DataSpec) -> dict[str, Any]:
    options: dict[str, Any] = {"format": data.format, "max_length": data.max_length, "packing": data.packing,
                               **format_columns(data)}
    if data.eval is None:
        options["eval_split"] = data.eval_split
    return options


def seed_uses(data: DataSpec) -> list[str]:
    """What `train.seed` decides in the tokenized data (none: the seed is not part of its fingerprint): the order
    packing puts examples into rows, the examples `data.eval_split` holds out, the sample a fractional weight keeps."""
    uses = ["packing shuffles the examples into rows with it"] if data.packing else []
    if data.eval is None:
        uses.append("the held-out split (data.eval_split) is drawn with it")
    if any(source.weight != int(source.weight) for source in sources(data, "train")):
        uses.append("a fractional data.train weight samples its examples with it")
    return uses


def fingerprint_covers(data: DataSpec) -> str:
    """What the tokenized data's fingerprint covers, in words (the tokenize artifact, the MLflow datasets)."""
    uses = seed_uses(data)
    return "the data files, the tokenizer and the data: options" + (f"; train.seed ({'; '.join(uses)})" if uses else "")


def _seed_part(data: DataSpec, seed: int) -> str:
    """The seed as the fingerprint sees it: only where it changes the rows."""
    return str(seed) if seed_uses(data) else "unused"


def fingerprint_data(data: DataSpec, tokenizer: str, seed: int, *, token: str | None = None,
                     include_eval: bool = True, workdir: str | Path | None = None) -> str:
    """sha256 of everything the tokenized dataset depends on.

    Data files' bytes (not their paths: moving a file keeps its fingerprint; a hub dataset by its
    commit), the tokenizer's files (or its hub id), the formatting options (format, the fields it reads,
    max_length, packing, eval_split), the seed where it shapes the rows (`seed_uses`) and DATA_FORMAT_VERSION. With
    `include_eval=False`, what `train.parquet` alone depends on: `data.eval` is left out (a held-out split of train
    is not).
    With `workdir`, file digests are remembered there. Raises DataError when a data file is missing.
    A list of sources is fingerprinted by each source's fingerprint and weight (`_mix_fingerprint`); without
    the held-out data only `data.train`'s form decides which, so a single train file keeps its training
    fingerprint whether `data.eval` is one file or a list (the train rows are built the same way either way).
    """
    if not is_single(data.train) or (include_eval and not is_single(data.eval)):
        return _mix_fingerprint(data, tokenizer, seed, token=token, include_eval=include_eval, workdir=workdir)
    h = hashlib.sha256()
    hash_parts(h, "fulltune-data", str(DATA_FORMAT_VERSION))
    with FileHashes(workdir) as hashes:
        hash_parts(h, "train")
        update_hash_with_source(h, data.train, what="data.train", token=token, hashes=hashes)
        if data.eval is not None and include_eval:
            hash_parts(h, "eval")
            update_hash_with_source(h, data.eval, what="data.eval", token=token, hashes=hashes)
        hash_parts(h, "tokenizer")
        _update_hash_with_tokenizer(h, tokenizer, hashes)
    hash_parts(h, "options", json.dumps(_format_options(data), sort_keys=True), "seed", _seed_part(data, seed))
    return h.hexdigest()


def source_fingerprints(data: DataSpec, tokenizer: str, *, token: str | None = None,
                        workdir: str | Path | None = None) -> dict[str, list[tuple[Source, str]]]:
    """{"train": [(source, its fingerprint)], "eval": [...]}: what each source's cached examples are named by."""
    with FileHashes(workdir) as hashes:
        h = hashlib.sha256()
        _update_hash_with_tokenizer(h, tokenizer, hashes)
        digest = h.hexdigest()
        return {split: [(s, source_fingerprint(s, digest, DATA_FORMAT_VERSION, token=token, hashes=hashes))
                        for s in sources(data, split)] for split in ("train", "eval")}


def _mix_fingerprint(data: DataSpec, tokenizer: str, seed: int, *, token: str | None, include_eval: bool,
                     workdir: str | Path | None) -> str:
    h = hashlib.sha256()
    hash_parts(h, "fulltune-data-mix", str(DATA_FORMAT_VERSION))
    fingerprints = source_fingerprints(data, tokenizer, token=token, workdir=workdir)
    for source, fingerprint in fingerprints["train"]:
        hash_parts(h, "train", fingerprint, repr(source.weight))
    for source, fingerprint in fingerprints["eval"] if include_eval else []:
        hash_parts(h, "eval", fingerprint)
    options = {"max_length": data.max_length, "packing": data.packing,
               "eval_split": data.eval_split if data.eval is None else None}
    hash_parts(h, "options", json.dumps(options, sort_keys=True), "seed", _seed_part(data, seed))
    return h.hexdigest()


def _pack(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Row boundaries (as document indices) for next-fit packing: documents are never split.

    Documents are taken in order; a row is closed when the next document does not fit.
    Returns the document index at which each row starts, plus len(lengths) at the end.
    """
    import numpy as np

    starts = [0]
    used = 0
    for n, length in enumerate(lengths.tolist()):
        if used and used + length > max_length:
            starts.append(n)
            used = 0
        used += length
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


def _write_rows(path: Path, examples: pa.Table, order: np.ndarray, *, packing: bool, max_length: int,
                with_text: bool, mapped: Path | None = None) -> dict[str, int]:
    """Write examples `order` (indices into `examples`) as Parquet rows, concatenating consecutive
    documents when packing. Rows are packed from the examples' lengths alone and written a row group at a
    time (_ROW_CHUNK rows, fewer where max_length would make it more than _CHUNK_TOKENS tokens), each
    group's examples taken from `examples` (memory-mapped) only then: memory holds one group, not the
    data. With `mapped`, the same rows and their per-row counts also go there as Arrow IPC record batches
    (`fulltune.data.mapped`). Returns counts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    all_lengths = np.concatenate([pc.list_value_length(c).to_numpy(zero_copy_only=False)
                                  for c in examples["input_ids"].chunks] or [np.zeros(0, np.int32)])
    lengths = all_lengths.astype(np.int64)[order]
    row_docs = _pack(lengths, max_length) if packing else np.arange(len(lengths) + 1, dtype=np.int64)
    columns = ["input_ids", "labels", *(("prompt", "completion") if with_text else ())]
    schema = pa.schema([(name, pa.list_(pa.int32())) for name in ("input_ids", "labels", "position_ids")]
                       + [(name, pa.string()) for name in columns[2:]])
    num_rows = len(row_docs) - 1
    counts = {"examples": int(len(lengths)), "rows": int(num_rows), "tokens": int(lengths.sum()), "label_tokens": 0,
              "max_row_length": 0, "max_row_targets": 0}
    # The Parquet encoding of a group (pyarrow, without the GIL) runs on a thread while this one gathers and
    # packs the next group and writes train.arrow: two groups are held at a time, at most.
    with pq.ParquetWriter(path, schema) as writer, MappedRowsWriter(mapped, schema) as mapped_writer, \
            ThreadPoolExecutor(1, thread_name_prefix="fulltune-parquet") as parquet:
        group = max(1, min(_ROW_CHUNK, _CHUNK_TOKENS // max_length))
        written: Future[None] | None = None
        for first in range(0, max(num_rows, 1), group):
            last = min(first + group, num_rows)
            chunk = _take(examples.select(columns), order[row_docs[first]:row_docs[last]])
            table, chunk_counts = _packed_chunk(chunk, row_docs[first:last + 1] - row_docs[first], schema)
            if written is not None:
                written.result()
            written = parquet.submit(writer.write_table, table, row_group_size=group)
            mapped_writer.write(table)
            counts["label_tokens"] += chunk_counts["label_tokens"]
            for key in ("max_row_length", "max_row_targets"):
                counts[key] = max(counts[key], chunk_counts[key])
        if written is not None:
            written.result()
    return counts


def _take(table: pa.Table, indices: np.ndarray) -> pa.Table:
    """`table.take(indices)`, gathered one record batch at a time: pyarrow's take over a table of many
    batches (the sources' memory-mapped shards) costs a pass over every batch per call."""
    import numpy as np
    import pyarrow as pa

    bounds = np.cumsum([0] + [batch.num_rows for batch in table.to_batches()])
    batch_of = np.searchsorted(bounds, indices, side="right") - 1
    order = np.argsort(batch_of, kind="stable")
    parts = [table.slice(bounds[b], bounds[b + 1] - bounds[b]).take(indices[order][batch_of[order] == b] - bounds[b])
             for b in np.unique(batch_of)]
    if not parts:
        return table.slice(0, 0)
    return pa.concat_tables(parts).combine_chunks().take(np.argsort(order, kind="stable"))


def _packed_chunk(chunk: pa.Table, row_docs: np.ndarray, schema: pa.Schema) -> tuple[pa.Table, dict[str, int]]:
    """One chunk of rows: documents `row_docs[r]`..`row_docs[r + 1]` of `chunk` make row r, position_ids
    restarting at 0 at every document. Returns the table and its label tokens, longest row, most targets."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    ids_col = chunk["input_ids"].combine_chunks() if len(chunk) else pa.array([], pa.list_(pa.int32()))
    labels_col = chunk["labels"].combine_chunks() if len(chunk) else pa.array([], pa.list_(pa.int32()))
    lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    flat_ids = ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    flat_labels = labels_col.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    doc_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    starts = np.repeat(doc_offsets[:-1], lengths)
    flat_positions = (np.arange(doc_offsets[-1], dtype=np.int64) - starts).astype(np.int32)
    row_offsets = doc_offsets[row_docs]
    offsets = pa.array(row_offsets.astype(np.int32))
    columns = [pa.ListArray.from_arrays(offsets, pa.array(flat)) for flat in (flat_ids, flat_labels, flat_positions)]
    # Text columns only for eval rows, which are never packed: row n is example n.
    columns += [chunk[name].combine_chunks() if len(chunk) else pa.array([], pa.string())
                for name in schema.names[3:]]
    # The most loss terms in one row bounds the output head's work per micro-batch (fulltune/runtime/loss.py).
    row_targets = row_target_counts(flat_labels, row_offsets)
    return pa.Table.from_arrays(columns, schema=schema), {
        "label_tokens": int(np.count_nonzero(flat_labels != IGNORE_INDEX)),
        "max_row_length": int(np.diff(row_offsets).max()) if len(row_offsets) > 1 else 0,
        "max_row_targets": int(row_targets.max()) if len(row_targets) else 0,
    }


# ---------------------------------------------------------------------------------------------------
# The stage


def tokenize_dataset(data: DataSpec, tokenizer: str, workdir: str | Path, seed: int, *, token: str | None = None,
                     trust_remote_code: bool = False) -> TokenizedData:
    """Tokenize (and pack) `data` into `<workdir>/tokenized/<fingerprint>/`; a cache hit does no work.

    `tokenizer` is what `fulltune.data.tokenizer.prepare_tokenizer` returned (a directory, for hub tokenizers
    the snapshot's); `token` reads private hub datasets; `trust_remote_code` is `model.trust_remote_code`.

    Raises DataError for every problem with the data (missing/empty/broken files, missing columns,
    records of the wrong type, no example left with a label token) and ConfigError when the tokenizer
    cannot be loaded or lacks what the format needs (eos token, chat template).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if data.packing == "auto":  # the tokenize stage resolves `auto` first (fulltune/planning/autotune.py resolve_packing)
        data = data.model_copy(update={"packing": False})
    fingerprint = fingerprint_data(data, tokenizer, seed, token=token, workdir=workdir)
    root = Path(workdir) / "tokenized"
    final = root / fingerprint
    cached = _read_intact(final, workdir)
    if cached is not None:
        return cached
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(root)
    with atomic_dir(final, lambda p: _read_intact(p, workdir) is not None) as tmp:
        _build(data, tokenizer, seed, fingerprint, tmp, token, trust_remote_code, workdir)
    prune_source_caches(workdir)
    return load_tokenized(str(final))


def _build(data: DataSpec, tokenizer_ref: str, seed: int, fingerprint: str, out: Path, token: str | None,
           trust_remote_code: bool, workdir: str | Path) -> None:
    from fulltune.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_ref, trust_remote_code=trust_remote_code)
    splits = source_fingerprints(data, tokenizer_ref, token=token, workdir=workdir)
    # The source caches this build reads, for other runs' prune_source_caches while it runs.
    (out / SOURCES_FILE).write_text(json.dumps(sorted({fp for pairs in splits.values() for _, fp in pairs})))
    parts = {split: [source_examples(source, source_fp, tokenizer, tokenizer_ref, workdir, token)
                     for source, source_fp in pairs]
             for split, pairs in splits.items()}
    train_split, eval_split, mixed = _split_tables(data, parts["train"], parts["eval"], seed)
    train = _write_rows(out / "train.parquet", *train_split, packing=data.packing, max_length=data.max_length,
                        with_text=False, mapped=out / "train.arrow")
    evaluation = _write_rows(out / "eval.parquet", *eval_split, packing=False, max_length=data.max_length,
                             with_text=True)
    every = parts["train"] + parts["eval"]
    record = TokenizedData(
        path=str(out),
        fingerprint=fingerprint,
        format="+".join(dict.fromkeys(part.source.data.format for part in every)),
        packing=data.packing,
        num_train_examples=train["examples"],
        num_eval_examples=evaluation["examples"],
        num_train_rows=train["rows"],
        train_tokens=train["tokens"],
        train_label_tokens=train["label_tokens"],
        max_row_length=train["max_row_length"],
        truncated_examples=sum(part.truncated for part in every),
        tokenizer=tokenizer_ref,
        max_length=data.max_length,
        pad_token_id=pad_token_id_of(tokenizer),
        dropped_examples=sum(part.dropped for part in every),
        eval_tokens=evaluation["tokens"],
        eval_label_tokens=evaluation["label_tokens"],
        max_row_targets=train["max_row_targets"],
        train_fingerprint=fingerprint_data(data, tokenizer_ref, seed, token=token, include_eval=False,
                                           workdir=workdir),
    )
    meta = dataclasses.asdict(record)
    meta.pop("path")
    meta["data_format_version"] = DATA_FORMAT_VERSION
    meta["num_eval_rows"] = evaluation["rows"]
    meta["sources"] = _source_counts(parts, mixed)
    meta["files"] = {name: (out / name).stat().st_size for name in TOKENIZED_FILES}
    meta["sha256"] = {name: file_sha256(out / name) for name in TOKENIZED_FILES}
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    (out / SOURCES_FILE).unlink()  # the sources were touched as they were read: recently used from here on


def _source_counts(parts: dict[str, list[SourceExamples]], mixed: list[int]) -> dict[str, list[dict[str, Any]]]:
    """Per source, for meta.json: its examples, and for train sources the examples of one epoch it gives
    (after the hold-out and its weight); eval sources' rows follow each other in list order in eval.parquet."""
    def row(part: SourceExamples) -> dict[str, Any]:
        return {"what": part.source.what, "reference": part.source.reference, "examples": len(part.table),
                "fingerprint": part.fingerprint}

    return {"train": [{**row(part), "weight": part.source.weight, "per_epoch": n}
                      for part, n in zip(parts["train"], mixed)],
            "eval": [row(part) for part in parts["eval"]]}


_Split = tuple["pa.Table", "np.ndarray"]  # examples, and the indices of a split's rows among them, in order


def _concat(tables: list[pa.Table]) -> pa.Table:
    """The sources' examples one after another (columns a format leaves null take the others' type)."""
    import pyarrow as pa

    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")


def _split_tables(data: DataSpec, train_parts: list[SourceExamples], eval_parts: list[SourceExamples],
                  seed: int) -> tuple[_Split, _Split, list[int]]:
    """(train, eval, each train source's examples per epoch): data.eval, or data.eval_split of data.train
    held out; train sources mixed by weight (fulltune/data/mix.py), the train rows shuffled before packing
    so a sorted file does not pack similar examples together. The sources' examples stay memory-mapped:
    the hold-out, the weights and the shuffle compose into one index per split (`_write_rows` takes it)."""
    import numpy as np

    examples = _concat([part.table for part in train_parts])
    counts = [len(part.table) for part in train_parts]
    rng = np.random.default_rng(seed)
    if eval_parts:
        held_out = _concat([part.table for part in eval_parts])
        evaluation, rows = (held_out, np.arange(len(held_out))), np.arange(len(examples))
    else:
        eval_rows, rows, counts = _hold_out(data, examples, counts, train_parts, rng)
        evaluation = (examples, eval_rows)
    weights = [part.source.weight for part in train_parts]
    keep = weighted_rows(counts, weights, [[seed, int(part.fingerprint[:15], 16)] for part in train_parts])
    if keep is not None:
        rows = rows[keep]
        counts = np.bincount(np.searchsorted(np.cumsum(counts), keep, side="right"),
                             minlength=len(counts)).tolist()
    if len(rows) == 0:
        raise DataError(f"data.train: the weights leave no example to train on ({describe(data.train)}); "
                        "raise the weights")
    if data.packing:
        rows = rows[rng.permutation(len(rows))]
    return (examples, rows), evaluation, counts


def _hold_out(data: DataSpec, table: pa.Table, counts: list[int], parts: list[SourceExamples],
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(the rows held out, the rows left to train on, their count per source): data.eval_split of the
    train sources' examples, at least one held out and one left; each source keeps its examples in order."""
    import numpy as np
    import pyarrow.compute as pc

    n = len(table)
    name = parts[0].name if len(parts) == 1 else f"the {len(parts)} sources"
    if n < 2:
        raise DataError(f"data.train: {name} has only {n} usable example; holding out data.eval_split needs at "
                        "least 2 — add examples or set data.eval")
    num_eval = min(max(1, round(n * data.eval_split)), n - 1)
    order = rng.permutation(n)
    held_out, kept = np.sort(order[:num_eval]), np.sort(order[num_eval:])
    if not pc.any(table["has_target_text"].take(held_out)).as_py():
        raise DataError(no_target_text_message("data.eval", f"the {num_eval} example(s) data.eval_split held out "
                                               f"of {name}", data).replace(
            "point data.eval at another file", "set data.eval"))
    source_of = np.repeat(np.arange(len(counts)), counts)
    return held_out, kept, np.bincount(source_of[kept], minlength=len(counts)).tolist()


def _read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise DataError(f"{path}: no meta.json; this is not a tokenized dataset (run the tokenize stage again)")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{meta_file}: broken ({exc}); delete {path} and run the tokenize stage again") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_file}: broken (not an object); delete {path} and run the tokenize stage again")
    return meta


def load_tokenized(path: str) -> TokenizedData:
    """The TokenizedData of a tokenized directory. DataError when meta.json or a Parquet file is missing,
    broken, of another DATA_FORMAT_VERSION, or not the size it was written with."""
    root = Path(path)
    meta = _read_meta(root)
    redo = f"delete {root} and run the tokenize stage again"
    if meta.get("data_format_version") != DATA_FORMAT_VERSION:
        raise DataError(f"{root}: written by data format version {meta.get('data_format_version')}, "
                        f"this fulltune reads {DATA_FORMAT_VERSION}; {redo}")
    sizes = meta.get("files") or {}
    for name in TOKENIZED_FILES:
        file = root / name
        if not file.is_file() or file.stat().st_size != sizes.get(name):
            raise DataError(f"{file}: missing or not the size it was written with; {redo}")
    names = [f.name for f in dataclasses.fields(TokenizedData) if f.name != "path"]
    try:
        record = TokenizedData(path=str(root), **{name: meta[name] for name in names if name in meta})
    except TypeError as exc:
        raise DataError(f"{root / 'meta.json'}: broken ({exc}); {redo}") from None
    if "max_row_targets" not in meta:  # written before it was recorded: count it (the file is not rewritten)
        try:
            record = dataclasses.replace(record, max_row_targets=_max_row_targets(record.train_file))
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"{record.train_file}: unreadable ({exc}); {redo}") from None
    return record


def _max_row_targets(train_file: str) -> int:
    import numpy as np
    import pyarrow.parquet as pq

    labels = pq.read_table(train_file, columns=["labels"])["labels"].combine_chunks()
    offsets = labels.offsets.to_numpy().astype(np.int64)
    counts = row_target_counts(labels.flatten().to_numpy(zero_copy_only=False), offsets - offsets[0])
    return int(counts.max()) if len(counts) else 0


def _read_intact(path: Path, workdir: str | Path | None = None) -> TokenizedData | None:
    """The dataset at `path` when it is whole: loadable, of its fingerprint, and (when meta.json records
    them) every Parquet file with the sha256 it was written with, remembered in `workdir`'s hash cache."""
    if not path.is_dir():
        return None
    try:
        record = load_tokenized(str(path))
    except DataError:
        return None
    digests = _read_meta(path).get("sha256") or {}
    with FileHashes(workdir) as hashes:
        if any(hashes.sha256(path / name) != digest for name, digest in digests.items()):
            return None
    return record if record.fingerprint == path.name else None


