"""The tokenize stage: data files → packed Parquet under `<workdir>/tokenized/<fingerprint>/`, and back.

`tokenize_dataset` turns a `DataSpec` into two Parquet files under `<workdir>/tokenized/<fingerprint>/`:

- `train.parquet`: `input_ids`, `labels`, `position_ids` (list<int32>), packed into rows of at most
  `max_length` tokens when `data.packing` is on, one example per row otherwise;
- `eval.parquet`: the same columns, never packed, plus `prompt` and `completion` strings (format
  `prompt_completion`; null for the other formats) for exact-match generation;
- `meta.json`: the `TokenizedData` record (counts, lengths, the tokenizer it was built with).

Labels follow the convention in fulltune/data/formats.py.

The directory name is a content fingerprint (data bytes, tokenizer files, formatting options, seed and
`DATA_FORMAT_VERSION`): changing any of them builds a new directory, an unchanged input is a cache hit
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
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune import hub
from fulltune.data.files import hub_dataset_key, load_records, local_data_files, record_locator
from fulltune.data.formats import (IGNORE_INDEX, format_columns, no_labels_message, no_target_text_message,
                                   pad_token_id_of, tokenize_split)
from fulltune.errors import DataError
from fulltune.spec import DataSpec
from fulltune.storage import FileHashes, atomic_dir, file_sha256, hash_parts, remove_stale_temp_dirs

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

# Bump when the on-disk layout or the tokenization rules change: every cached dataset is rebuilt.
DATA_FORMAT_VERSION = 1
TOKENIZED_FILES = ("train.parquet", "eval.parquet")
_ROW_CHUNK = 8192  # rows per Parquet row group


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
    def eval_file(self) -> str:
        return str(Path(self.path) / "eval.parquet")




# ---------------------------------------------------------------------------------------------------
# Fingerprints


def update_hash_with_source(h: Any, source: str, *, what: str, token: str | None = None,
                            hashes: FileHashes | None = None) -> None:
    """Add a data source to a hash: its files' digests for local data, the id, commit and split for a hub
    dataset. `hashes` remembers digests across calls (default: every file is read)."""
    files = local_data_files(source, what)
    if files is None:
        hash_parts(h, "hub", hub_dataset_key(source, what, token))
        return
    hashes = hashes or FileHashes(None)
    root = Path(source).expanduser()
    for file in files:
        # The name inside a directory (or the suffix of a single file) decides how the bytes are read.
        hash_parts(h, "file", file.relative_to(root).as_posix() if root.is_dir() else file.suffix.lower())
        hash_parts(h, hashes.sha256(file))


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


def fingerprint_data(data: DataSpec, tokenizer: str, seed: int, *, token: str | None = None,
                     include_eval: bool = True, workdir: str | Path | None = None) -> str:
    """sha256 of everything the tokenized dataset depends on.

    Data files' bytes (not their paths: moving a file keeps its fingerprint; a hub dataset by its
    commit), the tokenizer's files (or its hub id), the formatting options (format, the fields it reads,
    max_length, packing, eval_split), the seed and DATA_FORMAT_VERSION. With `include_eval=False`, what
    `train.parquet` alone depends on: `data.eval` is left out (a held-out split of train is not).
    With `workdir`, file digests are remembered there. Raises DataError when a data file is missing.
    """
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
    hash_parts(h, "options", json.dumps(_format_options(data), sort_keys=True), "seed", str(seed))
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


def _write_rows(path: Path, table: pa.Table, *, packing: bool, max_length: int, with_text: bool) -> dict[str, int]:
    """Write examples as Parquet rows (concatenating consecutive documents when packing). Returns counts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    ids_col = table["input_ids"].combine_chunks() if len(table) else pa.array([], pa.list_(pa.int64()))
    labels_col = table["labels"].combine_chunks() if len(table) else pa.array([], pa.list_(pa.int64()))
    lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    flat_ids = ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    flat_labels = labels_col.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    doc_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # position_ids restart at 0 at every document: 0..n-1 per document.
    starts = np.repeat(doc_offsets[:-1], lengths)
    flat_positions = (np.arange(doc_offsets[-1], dtype=np.int64) - starts).astype(np.int32)
    row_docs = _pack(lengths, max_length) if packing else np.arange(len(lengths) + 1, dtype=np.int64)
    row_offsets = doc_offsets[row_docs]

    schema = [(name, pa.list_(pa.int32())) for name in ("input_ids", "labels", "position_ids")]
    if with_text:
        schema += [("prompt", pa.string()), ("completion", pa.string())]
    schema = pa.schema(schema)
    prompts = table["prompt"].to_pylist() if with_text else None
    completions = table["completion"].to_pylist() if with_text else None

    num_rows = len(row_offsets) - 1
    with pq.ParquetWriter(path, schema) as writer:
        for first in range(0, max(num_rows, 1), _ROW_CHUNK):
            last = min(first + _ROW_CHUNK, num_rows)
            begin, end = int(row_offsets[first]), int(row_offsets[last])
            offsets = pa.array((row_offsets[first : last + 1] - begin).astype(np.int32))
            columns = [
                pa.ListArray.from_arrays(offsets, pa.array(flat[begin:end]))
                for flat in (flat_ids, flat_labels, flat_positions)
            ]
            if with_text:  # eval rows are never packed: row n is example n
                columns += [pa.array(prompts[first:last], pa.string()), pa.array(completions[first:last], pa.string())]
            writer.write_table(pa.Table.from_arrays(columns, schema=schema), row_group_size=_ROW_CHUNK)
    row_lengths = np.diff(row_offsets)
    # The most loss terms in one row bounds the output head's work per micro-batch (fulltune/runtime/loss.py).
    row_targets = row_target_counts(flat_labels, row_offsets)
    return {
        "examples": int(len(lengths)),
        "rows": int(num_rows),
        "tokens": int(doc_offsets[-1]),
        "label_tokens": int(np.count_nonzero(flat_labels != IGNORE_INDEX)),
        "max_row_length": int(row_lengths.max()) if num_rows else 0,
        "max_row_targets": int(row_targets.max()) if num_rows else 0,
    }


def row_target_counts(labels: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Loss terms per row of flat `labels` cut at `offsets` (n_rows + 1): labels shifted left by one, as
    the loss predicts them, so a row's first label never counts."""
    import numpy as np

    trainable = labels != IGNORE_INDEX
    starts = offsets[:-1]
    trainable[starts[np.diff(offsets) > 0]] = False
    cumulative = np.concatenate([[0], np.cumsum(trainable)])
    return cumulative[offsets[1:]] - cumulative[starts]




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
    return load_tokenized(str(final))


def _build(data: DataSpec, tokenizer_ref: str, seed: int, fingerprint: str, out: Path, token: str | None,
           trust_remote_code: bool, workdir: str | Path) -> None:
    from fulltune.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_ref, trust_remote_code=trust_remote_code)
    arrow_cache = out / "datasets-cache"  # datasets' Arrow copy of the local files; deleted with the build
    train_table, eval_table, truncated, dropped = _split_tables(data, tokenizer, tokenizer_ref, seed, arrow_cache,
                                                                token)
    train = _write_rows(out / "train.parquet", train_table, packing=data.packing, max_length=data.max_length,
                        with_text=False)
    evaluation = _write_rows(out / "eval.parquet", eval_table, packing=False, max_length=data.max_length,
                             with_text=True)
    shutil.rmtree(arrow_cache, ignore_errors=True)
    record = TokenizedData(
        path=str(out),
        fingerprint=fingerprint,
        format=data.format,
        packing=data.packing,
        num_train_examples=train["examples"],
        num_eval_examples=evaluation["examples"],
        num_train_rows=train["rows"],
        train_tokens=train["tokens"],
        train_label_tokens=train["label_tokens"],
        max_row_length=train["max_row_length"],
        truncated_examples=truncated,
        tokenizer=tokenizer_ref,
        max_length=data.max_length,
        pad_token_id=pad_token_id_of(tokenizer),
        dropped_examples=dropped,
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
    meta["files"] = {name: (out / name).stat().st_size for name in TOKENIZED_FILES}
    meta["sha256"] = {name: file_sha256(out / name) for name in TOKENIZED_FILES}
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def _tokenize_source(spec: str, what: str, tokenizer: Any, data: DataSpec, reference: str, arrow_cache: Path,
                     token: str | None) -> tuple[pa.Table, int, int, str]:
    """Load and tokenize one of data.train / data.eval: (table, truncated, dropped, source name)."""
    local = Path(spec).expanduser().exists()
    source = spec if local else f"hub dataset {spec}"
    records = load_records(spec, what=what, cache_dir=arrow_cache, token=token)
    locate = record_locator(spec, what) if local else None
    return (*tokenize_split(records, tokenizer, data, source=source, what=what, reference=reference, locate=locate),
            source)


def _split_tables(data: DataSpec, tokenizer: Any, reference: str, seed: int, arrow_cache: Path,
                  token: str | None) -> tuple[pa.Table, pa.Table, int, int]:
    """(train table, eval table, truncated, dropped): data.eval, or data.eval_split of data.train held
    out; the train table shuffled before packing so a sorted file does not pack similar examples together."""
    import numpy as np
    import pyarrow.compute as pc

    train_table, truncated, dropped, train_source = _tokenize_source(data.train, "data.train", tokenizer, data,
                                                                     reference, arrow_cache, token)
    rng = np.random.default_rng(seed)
    if data.eval is not None:
        eval_table, eval_truncated, eval_dropped, eval_source = _tokenize_source(
            data.eval, "data.eval", tokenizer, data, reference, arrow_cache, token)
        truncated += eval_truncated
        dropped += eval_dropped
        if len(eval_table) == 0:
            raise DataError(no_labels_message("data.eval", eval_source, data))
    else:
        n = len(train_table)
        if n == 0:
            raise DataError(no_labels_message("data.train", train_source, data))
        if n < 2:
            raise DataError(
                f"data.train: {train_source} has only {n} usable example; holding out data.eval_split needs at "
                "least 2 — add examples or set data.eval"
            )
        # At least one example held out, at least one left for training.
        num_eval = min(max(1, round(n * data.eval_split)), n - 1)
        order = rng.permutation(n)
        eval_table = train_table.take(np.sort(order[:num_eval]))
        train_table = train_table.take(np.sort(order[num_eval:]))
        if not pc.any(eval_table["has_target_text"]).as_py():
            raise DataError(no_target_text_message("data.eval", f"the {num_eval} example(s) data.eval_split held out "
                                                   f"of {train_source}", data).replace(
                "point data.eval at another file", "set data.eval"))
    if len(train_table) == 0:
        raise DataError(no_labels_message("data.train", train_source, data))
    if data.packing:
        train_table = train_table.take(rng.permutation(len(train_table)))
    return train_table, eval_table, truncated, dropped

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


