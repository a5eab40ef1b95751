"""Load data files (local or a hub dataset) and, when `datasets` fails, say which file and line is wrong."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune import hub
from fulltune.errors import DataError, root_message
from fulltune.storage import FileHashes, hash_parts

if TYPE_CHECKING:
    import datasets

# File suffix → `datasets` builder.
SUFFIX_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_READ_CHUNK = 1 << 20

def load_records(path: str, *, what: str, cache_dir: str | Path | None = None,
                 token: str | None = None) -> datasets.Dataset:
    """Load a dataset from a local file or directory, or a Hugging Face Hub dataset id.

    Local files: `.jsonl`/`.json` (JSON lines, or one JSON list of objects), `.csv` (every cell text as written,
    an empty one missing), `.parquet`, `.txt`
    (one example per line in column `text`; blank lines are skipped). A directory loads every such
    file under it (name order, hidden files skipped; one file type per directory). Anything that does
    not look like a local path is a hub id, optionally with a split: `org/name` or `org/name:validation`
    (default split `train`), read from its repository snapshot (fulltune/hub.py; offline from the cache).

    `what` is the YAML path used in messages (`data.train`). `cache_dir` is where `datasets` writes its
    Arrow copy of the files (default: the `datasets` cache). `token` reads a private hub dataset.

    Raises DataError: missing or empty file, text that is not UTF-8 or broken JSON (with the line), an
    unreadable file, a dataset without examples, a hub dataset that cannot be loaded.
    """
    import datasets

    files = local_data_files(path, what)
    if files is None:
        return _load_hub(path, what, cache_dir, token)
    for file in files:
        if file.stat().st_size == 0:
            raise DataError(f"{what}: {file} is empty; add examples to it or point {what} at another file")
        if SUFFIX_BUILDERS[file.suffix.lower()] != "parquet":
            _require_utf8(file, what)
    builder = SUFFIX_BUILDERS[files[0].suffix.lower()]
    with quiet_datasets():
        try:
            dataset = datasets.load_dataset(
                builder,
                data_files=[str(f) for f in files],
                split="train",
                cache_dir=str(cache_dir) if cache_dir is not None else None,
                **(_csv_as_text(files[0]) if builder == "csv" else {}),
            )
        except (datasets.exceptions.DatasetsError, ValueError, StopIteration, OSError) as exc:
            raise _diagnose_load_error(files, builder, what, exc) from None
        if builder == "text":
            dataset = dataset.filter(lambda rows: [bool(t.strip()) for t in rows["text"]], batched=True,
                                     keep_in_memory=True, new_fingerprint=transient_fingerprint())
    if len(dataset) == 0:
        where = files[0] if len(files) == 1 else path
        raise DataError(f"{what}: {where} has no examples; add examples or point {what} at another file")
    return dataset


def _csv_as_text(file: Path) -> dict[str, Any]:
    """`load_dataset("csv")` options that read every column of the header as text, as written: pandas would
    infer a column of digit strings as integers ("035" → 35) and a completion "NA" or "null" as missing. Only an
    empty cell is missing. The files of one source share the first one's header."""
    import csv

    import datasets

    with file.open(newline="", encoding="utf-8") as handle:
        header = next(csv.reader(handle), [])
    return {"features": datasets.Features({name: datasets.Value("string") for name in header}),
            "keep_default_na": False, "na_values": [""]}


def local_data_files(path: str, what: str) -> list[Path] | None:
    """The data files `path` names, or None when it is a hub dataset id."""
    p = Path(path).expanduser()
    supported = ", ".join(SUFFIX_BUILDERS)
    if p.is_dir():
        files = sorted(
            f for f in p.rglob("*")
            if f.is_file() and f.suffix.lower() in SUFFIX_BUILDERS
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if not files:
            raise DataError(f"{what}: directory {path} holds no data files ({supported}); add some or fix the path")
        kinds = sorted({SUFFIX_BUILDERS[f.suffix.lower()] for f in files})
        if len(kinds) > 1:
            raise DataError(
                f"{what}: directory {path} mixes file types ({', '.join(kinds)}); keep one type per directory"
            )
        return files
    if p.is_file():
        if p.suffix.lower() not in SUFFIX_BUILDERS:
            raise DataError(f"{what}: {path} has an unsupported file type; use one of {supported}")
        return [p]
    if looks_like_local_path(path):
        raise DataError(f"{what}: {path} not found (resolved to {p.resolve()}); check the path")
    return None


class RecordLocator:
    """Where record `index` of a loaded dataset is in its files: `train.jsonl line 1001`.

    `datasets` numbers records over all files and skips blank lines, so a record's index is neither its
    line nor its file. Found only when a message needs it (a rescan of the files up to the record);
    for a JSON-lines file whose column changes type the first such line is named instead, since the
    loader may have converted that column for every record (pandas reads `"2"` and `2` as numbers).
    """

    def __init__(self, files: list[Path] | None, source: str) -> None:
        self.files, self.source = files, source

    def __call__(self, index: int) -> str:
        """`<file> line N` (`row N` of a Parquet file), else `<source>: record N` (a hub dataset)."""
        remaining = index
        for file in self.files or []:
            count, where = _locate_in_file(file, remaining)
            if where is not None:
                return f"{file} {where}"
            remaining -= count
        return f"{self.source}: record {index + 1}"

    def type_problem(self) -> str | None:
        """The first JSON line whose column changes type (`<file> line N: column ...`), if any."""
        for file in self.files or []:
            if SUFFIX_BUILDERS[file.suffix.lower()] == "json":
                problem = _find_json_problem(file)
                if problem:
                    return problem
        return None


def record_locator(path: str, what: str) -> RecordLocator:
    """A RecordLocator for the records `load_records(path)` returns."""
    return RecordLocator(local_data_files(path, what), path)


def _locate_in_file(file: Path, index: int) -> tuple[int, str | None]:
    """(records in `file`, where record `index` of the file is, or None when the file holds fewer)."""
    builder = SUFFIX_BUILDERS[file.suffix.lower()]
    if builder == "parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(file).metadata.num_rows
        return rows, f"row {index + 1}" if index < rows else None
    if builder == "csv":
        import csv

        with file.open(newline="", errors="replace") as handle:
            reader = csv.reader(handle)
            next(reader, None)  # the header
            count = 0
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue  # pandas skips blank lines
                if count == index:
                    return count, f"line {reader.line_num}"
                count += 1
            return count, None
    if builder == "json" and _starts_with_list(file):  # one JSON list of objects
        try:
            count = len(json.loads(file.read_bytes()))
        except (ValueError, TypeError):
            return 0, None
        return count, f"element {index + 1}" if index < count else None
    count = 0
    with file.open("rb") as handle:  # JSON lines and text: one record per non-blank line
        for lineno, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            if count == index:
                return count, f"line {lineno}"
            count += 1
    return count, None


def _starts_with_list(file: Path) -> bool:
    """Whether a .json file is one JSON list of objects rather than JSON lines."""
    with file.open("rb") as handle:
        while chunk := handle.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1] == b"["
    return False


def looks_like_local_path(path: str) -> bool:
    """Whether a data reference that does not exist can only be meant as a local path: absolute, `./`,
    `~`, a data file suffix (`data/train.jsonl`), or not spelled like a hub id `org/name[:split]`."""
    return hub.looks_local(path, data_suffixes=tuple(SUFFIX_BUILDERS))


def hub_dataset_key(spec: str, what: str, token: str | None = None) -> str:
    """`hub:<org/name>@<commit>[:split]`: what a hub dataset contributes to a fingerprint."""
    name, split = hub.split_dataset_id(spec)
    try:
        commit = hub.commit_of(name, None, "dataset", token)
    except hub.HubError as exc:
        raise _hub_data_error(spec, what, exc) from None
    return f"hub:{name}@{commit}" + (f":{split}" if split else "")


def _hub_data_error(spec: str, what: str, exc: BaseException) -> DataError:
    local = Path(spec).expanduser().resolve()
    return DataError(f"{what}: {spec!r} is not a local file or directory ({local} does not exist), and as a "
                     f"Hugging Face Hub dataset: {exc}. Fix the path or the dataset id.")


def _load_hub(spec: str, what: str, cache_dir: str | Path | None, token: str | None) -> datasets.Dataset:
    import datasets

    name, split = hub.split_dataset_id(spec)
    try:
        # `datasets` cannot open a hub id offline; its repository snapshot it can (fulltune/hub.py).
        local = hub.snapshot(name, None, "dataset", token)
        with quiet_datasets():
            dataset = datasets.load_dataset(str(local), split=split or "train",
                                            cache_dir=str(cache_dir) if cache_dir is not None else None)
    except hub.HubError as exc:
        raise _hub_data_error(spec, what, exc) from None
    except (datasets.exceptions.DatasetsError, FileNotFoundError, ConnectionError, OSError, ValueError,
            KeyError) as exc:
        raise DataError(f"{what}: hub dataset {spec!r} could not be read: {root_message(exc)}. "
                        "Name an existing split as org/name:<split>.") from None
    if not isinstance(dataset, datasets.Dataset):
        raise DataError(f"{what}: {spec!r} did not load as one split; name it as {name}:<split>")
    if len(dataset) == 0:
        raise DataError(f"{what}: hub dataset {spec!r} has no examples")
    return dataset


def transient_fingerprint() -> str:
    """A `new_fingerprint` for an in-memory `datasets` transform whose result is never cached.

    Without one, `datasets` fingerprints the transform by pickling the function with dill, which
    disassembles it with `dis.dis` onto stdout (hundreds of lines in a Prefect task's log) to find the
    globals it reads. fulltune's own fingerprints (fulltune/data/store.py) name what a transform made.
    """
    import uuid

    return uuid.uuid4().hex


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """Silence `datasets` progress bars and its own error logging (we raise a DataError instead)."""
    import datasets

    bars_were_disabled = datasets.are_progress_bars_disabled()
    logger = logging.getLogger("datasets")
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
        if not bars_were_disabled:
            datasets.enable_progress_bars()


def _diagnose_load_error(files: list[Path], builder: str, what: str, exc: BaseException) -> DataError:
    """Find the file (and line) behind a `datasets` loading error."""
    for file in files:
        with file.open("rb") as f:
            if not any(line.strip() for line in f):
                return DataError(f"{what}: {file} is empty; add examples to it or point {what} at another file")
    if builder == "json":
        for file in files:
            problem = _find_json_problem(file)
            if problem:
                return DataError(f"{what}: {problem}")
    if builder == "text":
        for file in files:
            problem = _find_utf8_problem(file)
            if problem:
                return DataError(f"{what}: {problem}")
    where = files[0] if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"
    return DataError(f"{what}: could not read {where} as {builder}: {root_message(exc)}; fix the file")


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), "null")


def _find_json_problem(path: Path) -> str | None:
    """Name the first line of a JSON-lines file that is not a JSON object, or whose columns change type."""
    kinds: dict[str, tuple[str, int]] = {}
    first = True
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except UnicodeDecodeError:
                return f"{path} line {lineno}: not UTF-8 text; re-encode the file as UTF-8"
            except json.JSONDecodeError as exc:
                if first and path.suffix.lower() == ".json":
                    return _find_json_document_problem(path)
                return f"{path} line {lineno}: broken JSON ({exc.msg}, column {exc.colno}); fix or remove that line"
            first = False
            if not isinstance(record, dict):
                return (
                    f"{path} line {lineno}: expected one JSON object {{...}} per line, got a {_json_kind(record)}; "
                    "fix or remove that line"
                )
            for key, value in record.items():
                kind = _json_kind(value)
                if kind == "null":
                    continue
                seen = kinds.setdefault(key, (kind, lineno))
                if seen[0] != kind:
                    return (
                        f"{path} line {lineno}: column '{key}' is a {kind} here but a {seen[0]} on line {seen[1]}; "
                        "give it one type in every record"
                    )
    return None


def _find_json_document_problem(path: Path) -> str | None:
    try:
        document = json.loads(path.read_bytes())
    except UnicodeDecodeError:
        return f"{path}: not UTF-8 text; re-encode the file as UTF-8"
    except json.JSONDecodeError as exc:
        return f"{path} line {exc.lineno}: broken JSON ({exc.msg}, column {exc.colno}); fix the file"
    if not isinstance(document, list) or not all(isinstance(r, dict) for r in document):
        return f"{path}: expected JSON lines or one JSON list of objects [{{...}}, ...]"
    return None


def _find_utf8_problem(path: Path) -> str | None:
    """The line and byte offset of the first byte that is not UTF-8, streaming the file."""
    carry, offset, lines = b"", 0, 0
    with path.open("rb") as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            buffer = carry + chunk
            if not buffer:
                return None
            try:
                buffer.decode("utf-8")
                used, carry = len(buffer), b""
            except UnicodeDecodeError as exc:
                if not (chunk and exc.reason == "unexpected end of data"):
                    line = lines + buffer[: exc.start].count(b"\n") + 1
                    return f"{path} line {line} (byte {offset + exc.start}): not UTF-8 text; re-encode the file as UTF-8"
                # A character cut by the chunk boundary: decode it with the next chunk.
                used, carry = exc.start, buffer[exc.start:]
            lines += buffer[:used].count(b"\n")
            offset += used
            if not chunk:
                return None


def _require_utf8(path: Path, what: str) -> None:
    # pyarrow's JSON reader keeps invalid UTF-8 in its strings and fails only when a row is read.
    problem = _find_utf8_problem(path)
    if problem:
        raise DataError(f"{what}: {problem}")


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
