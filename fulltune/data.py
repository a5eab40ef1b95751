"""Load, format, tokenize, pack and fingerprint training data.

`tokenize_dataset` turns a `DataSpec` into two Parquet files under `<workdir>/tokenized/<fingerprint>/`:

- `train.parquet`: `input_ids`, `labels`, `position_ids` (list<int32>), packed into rows of at most
  `max_length` tokens when `data.packing` is on, one example per row otherwise;
- `eval.parquet`: the same columns, never packed, plus `prompt` and `completion` strings (format
  `prompt_completion`; null for the other formats) for exact-match generation;
- `meta.json`: the `TokenizedData` record (counts, lengths, the tokenizer it was built with).

Label convention (one rule for every format, packed or not): `labels[i] != -100` exactly when token i is
a training target. transformers' `ForCausalLMLoss` shifts labels left (`labels[..., 1:]`), so token i is
predicted from position i-1; the first token of every document therefore always gets -100 (it has no
in-document predecessor: in a packed row it would be predicted from the previous document's last
token). `train_label_tokens` is then exactly the number of loss terms.

The directory name is a content fingerprint (data bytes, tokenizer files, formatting options, seed and
`DATA_FORMAT_VERSION`): changing any of them builds a new directory, an unchanged input is a cache hit
that does no work. `train_fingerprint` covers only what `train.parquet` depends on (not `data.eval`), so
new held-out data re-evaluates a model without retraining it. A hub dataset counts by its commit. Builds happen in a temp dir that is renamed into place, so a killed build never
leaves a half-written dataset behind.

Heavy libraries (datasets, pyarrow, transformers, torch) are imported inside the functions that use
them so that importing this module stays cheap (`fulltune validate` imports the engine).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune import hub
from fulltune.errors import ConfigError, DataError
from fulltune.fingerprint import fsync_dir, fsync_tree, pid_alive
from fulltune.spec import DataSpec

if TYPE_CHECKING:
    import datasets
    import numpy as np
    import pyarrow as pa
    import torch

# Bump when the on-disk layout or the tokenization rules change: every cached dataset is rebuilt.
DATA_FORMAT_VERSION = 1
IGNORE_INDEX = -100

# File suffix → `datasets` builder.
SUFFIX_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
# Files in a tokenizer directory that are not tokenizer files: model weights can be gigabytes, and a
# checkpoint directory doubles as the tokenizer directory when `model.tokenizer` is not set.
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz"}
TOKENIZED_FILES = ("train.parquet", "eval.parquet")
_ROW_CHUNK = 8192  # rows per Parquet row group
_HASH_CHUNK = 1 << 20
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


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
# Loading records


def load_records(path: str, *, what: str, cache_dir: str | Path | None = None,
                 token: str | None = None) -> datasets.Dataset:
    """Load a dataset from a local file or directory, or a Hugging Face Hub dataset id.

    Local files: `.jsonl`/`.json` (JSON lines, or one JSON list of objects), `.csv`, `.parquet`, `.txt`
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
    with _quiet_datasets():
        try:
            dataset = datasets.load_dataset(
                builder,
                data_files=[str(f) for f in files],
                split="train",
                cache_dir=str(cache_dir) if cache_dir is not None else None,
            )
        except (datasets.exceptions.DatasetsError, ValueError, StopIteration, OSError) as exc:
            raise _diagnose_load_error(files, builder, what, exc) from None
        if builder == "text":
            dataset = dataset.filter(lambda rows: [bool(t.strip()) for t in rows["text"]], batched=True,
                                     keep_in_memory=True)
    if len(dataset) == 0:
        where = files[0] if len(files) == 1 else path
        raise DataError(f"{what}: {where} has no examples; add examples or point {what} at another file")
    return dataset


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
        with _quiet_datasets():
            dataset = datasets.load_dataset(str(local), split=split or "train",
                                            cache_dir=str(cache_dir) if cache_dir is not None else None)
    except hub.HubError as exc:
        raise _hub_data_error(spec, what, exc) from None
    except (datasets.exceptions.DatasetsError, FileNotFoundError, ConnectionError, OSError, ValueError,
            KeyError) as exc:
        raise DataError(f"{what}: hub dataset {spec!r} could not be read: {_root_message(exc)}. "
                        "Name an existing split as org/name:<split>.") from None
    if not isinstance(dataset, datasets.Dataset):
        raise DataError(f"{what}: {spec!r} did not load as one split; name it as {name}:<split>")
    if len(dataset) == 0:
        raise DataError(f"{what}: hub dataset {spec!r} has no examples")
    return dataset


@contextmanager
def _quiet_datasets() -> Iterator[None]:
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
    return DataError(f"{what}: could not read {where} as {builder}: {_root_message(exc)}; fix the file")


def _root_message(exc: BaseException) -> str:
    seen = exc
    while seen.__cause__ is not None or seen.__context__ is not None:
        seen = seen.__cause__ or seen.__context__
    return str(seen) or type(seen).__name__


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
            chunk = f.read(_HASH_CHUNK)
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


def require_columns(dataset: datasets.Dataset, data: DataSpec, *, source: str, what: str) -> None:
    """Raise DataError when the columns the format needs are missing."""
    needed = {
        "text": [("text_field", data.text_field)],
        "prompt_completion": [("prompt_field", data.prompt_field), ("completion_field", data.completion_field)],
        "chat": [("messages_field", data.messages_field)],
    }[data.format]
    for option, column in needed:
        if column not in dataset.column_names:
            have = ", ".join(dataset.column_names) or "none"
            raise DataError(
                f"{what}: {source} has no column '{column}' (columns: {have}); format {data.format} reads "
                f"data.{option} — set it to the column that holds the data"
            )


# ---------------------------------------------------------------------------------------------------
# Fingerprints


def hash_parts(h: Any, *parts: str | bytes) -> None:
    # Length-prefixed so that concatenations cannot collide ("ab"+"c" vs "a"+"bc").
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)


def _update_file(h: Any, path: Path) -> None:
    h.update(path.stat().st_size.to_bytes(8, "little"))
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)


def update_hash_with_source(h: Any, source: str, *, what: str, token: str | None = None) -> None:
    """Add a data source to a hash: file bytes (streamed) for local data, the id, commit and split for a
    hub dataset."""
    files = local_data_files(source, what)
    if files is None:
        hash_parts(h, "hub", hub_dataset_key(source, what, token))
        return
    root = Path(source).expanduser()
    for file in files:
        # The name inside a directory (or the suffix of a single file) decides how the bytes are read.
        hash_parts(h, "file", file.relative_to(root).as_posix() if root.is_dir() else file.suffix.lower())
        _update_file(h, file)


def update_hash_with_tokenizer(h: Any, tokenizer: str) -> None:
    """Add a tokenizer to a hash: its files' bytes for a local directory, the id for a hub tokenizer."""
    root = Path(tokenizer).expanduser()
    if not root.is_dir():
        hash_parts(h, "hub-tokenizer", tokenizer)
        return
    for file in sorted(p for p in root.iterdir() if p.is_file()):
        if file.suffix.lower() in WEIGHT_SUFFIXES or file.name.endswith(".index.json"):
            continue
        hash_parts(h, "tokenizer-file", file.name)
        _update_file(h, file)


def _format_options(data: DataSpec) -> dict[str, Any]:
    fields = {
        "text": {"text_field": data.text_field},
        "prompt_completion": {"prompt_field": data.prompt_field, "completion_field": data.completion_field},
        "chat": {"messages_field": data.messages_field},
    }[data.format]
    options: dict[str, Any] = {"format": data.format, "max_length": data.max_length, "packing": data.packing, **fields}
    if data.eval is None:
        options["eval_split"] = data.eval_split
    return options


def fingerprint_data(data: DataSpec, tokenizer: str, seed: int, *, token: str | None = None,
                     include_eval: bool = True) -> str:
    """sha256 of everything the tokenized dataset depends on.

    Data files' bytes (not their paths: moving a file keeps its fingerprint; a hub dataset by its
    commit), the tokenizer's files (or its hub id), the formatting options (format, the fields it reads,
    max_length, packing, eval_split), the seed and DATA_FORMAT_VERSION. With `include_eval=False`, what
    `train.parquet` alone depends on: `data.eval` is left out (a held-out split of train is not).
    Raises DataError when a data file is missing.
    """
    h = hashlib.sha256()
    hash_parts(h, "fulltune-data", str(DATA_FORMAT_VERSION))
    hash_parts(h, "train")
    update_hash_with_source(h, data.train, what="data.train", token=token)
    if data.eval is not None and include_eval:
        hash_parts(h, "eval")
        update_hash_with_source(h, data.eval, what="data.eval", token=token)
    hash_parts(h, "tokenizer")
    update_hash_with_tokenizer(h, tokenizer)
    hash_parts(h, "options", json.dumps(_format_options(data), sort_keys=True), "seed", str(seed))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# Formatting and tokenizing


def load_tokenizer(tokenizer: str, trust_remote_code: bool = False) -> Any:
    """AutoTokenizer.from_pretrained, with a ConfigError that names the tokenizer when it fails."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"tokenizer {tokenizer!r} could not be loaded ({_root_message(exc)}); check model.tokenizer "
            "(or model.name_or_path)"
        ) from None


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts a bos token in front of plain text (as the model saw in pretraining)."""
    if tokenizer.bos_token_id is None:
        return False
    return tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [tokenizer.bos_token_id]


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a prompt exactly as training saw it (`bos?` + prompt): what generation starts from."""
    bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    return bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def pad_token_id_of(tokenizer: Any) -> int:
    """The id collate pads with: the pad token, else eos (padding is never attended to or trained)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


class _Formatter:
    """Batched `datasets.map` function: records → input_ids, labels (first token -100), counts."""

    def __init__(self, tokenizer: Any, data: DataSpec, source: str, reference: str) -> None:
        self.tok = tokenizer
        self.data = data
        self.source = source
        self.reference = reference
        self.max_length = data.max_length
        self.bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
        if data.format in ("text", "prompt_completion"):
            if tokenizer.eos_token_id is None:
                raise ConfigError(
                    f"tokenizer {reference!r} has no eos token; formats text and prompt_completion end every "
                    "example with it — use a tokenizer that has one"
                )
            self.eos = [tokenizer.eos_token_id]
        if data.format == "chat":
            template = tokenizer.chat_template
            if not template:
                raise ConfigError(
                    f"tokenizer {reference!r} has no chat template; format chat needs one — use a chat "
                    "tokenizer, or model.tokenizer: {vocab_size: N} to train one with a template"
                )
            self.template_marks_assistant = bool(_GENERATION_TAG.search(str(template)))

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        fmt = self.data.format
        if fmt == "text":
            texts = self._strings(batch, self.data.text_field, indices)
            encoded = self.tok(texts, add_special_tokens=False)["input_ids"]
            pairs = [(self.bos + ids + self.eos, None) for ids in encoded]
            prompts = completions = [None] * len(texts)
        elif fmt == "prompt_completion":
            prompts = self._strings(batch, self.data.prompt_field, indices)
            completions = self._strings(batch, self.data.completion_field, indices)
            # Separately tokenized, then concatenated: the prompt/completion boundary is exact and
            # matches generation, which starts from the prompt's tokens.
            p_ids = self.tok(prompts, add_special_tokens=False)["input_ids"]
            c_ids = self.tok(completions, add_special_tokens=False)["input_ids"]
            pairs = [(self.bos + p + c + self.eos, len(self.bos) + len(p)) for p, c in zip(p_ids, c_ids)]
        else:
            conversations = [self._messages(m, i) for m, i in zip(batch[self.data.messages_field], indices)]
            pairs = self._chat(conversations, indices)
            prompts = completions = [None] * len(conversations)
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "num_labels": [], "truncated": []}
        for ids, mask_until in pairs:
            if isinstance(mask_until, list):  # chat: a per-token assistant mask
                labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask_until)]
            else:
                start = mask_until or 0
                labels = [IGNORE_INDEX] * start + ids[start:]
            if labels:
                labels[0] = IGNORE_INDEX  # never predicted: see the module docstring
            out["truncated"].append(len(ids) > self.max_length)
            ids, labels = ids[: self.max_length], labels[: self.max_length]
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["num_labels"].append(len(labels) - labels.count(IGNORE_INDEX))
        out["prompt"] = list(prompts)
        out["completion"] = list(completions)
        return out

    def _where(self, index: int) -> str:
        return f"{self.source}: record {index + 1}"

    def _strings(self, batch: dict[str, list[Any]], column: str, indices: list[int]) -> list[str]:
        values = batch[column]
        for value, index in zip(values, indices):
            if not isinstance(value, str):
                got = "missing (null)" if value is None else f"a {type(value).__name__}"
                raise DataError(f"{self._where(index)}: column '{column}' must be a string, got {got}; fix the record")
        return values

    def _messages(self, value: Any, index: int) -> list[dict[str, str]]:
        column = self.data.messages_field
        if not isinstance(value, list) or not value:
            got = "missing (null)" if value is None else f"a {type(value).__name__}" if value != [] else "empty"
            raise DataError(
                f"{self._where(index)}: column '{column}' must be a non-empty list of "
                f"{{role, content}} messages, got {got}; fix the record"
            )
        messages = []
        for n, message in enumerate(value, 1):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DataError(
                    f"{self._where(index)}: message {n} in '{column}' needs string 'role' and 'content' "
                    f"keys, got {message!r:.80}; fix the record"
                )
            messages.append({"role": message["role"], "content": message["content"]})
        return messages

    def _chat(self, conversations: list[list[dict[str, str]]], indices: list[int]) -> list[tuple[list[int], list[int]]]:
        from jinja2.exceptions import TemplateError

        if self.template_marks_assistant:
            try:
                out = self.tok.apply_chat_template(
                    conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                )
                return list(zip(out["input_ids"], out["assistant_masks"]))
            except TemplateError:
                pass  # find the record the template rejects, below
        return [self._chat_one(messages, index) for messages, index in zip(conversations, indices)]

    def _chat_one(self, messages: list[dict[str, str]], index: int) -> tuple[list[int], list[int]]:
        from jinja2.exceptions import TemplateError

        try:
            if self.template_marks_assistant:
                out = self.tok.apply_chat_template(
                    messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                )
                return out["input_ids"], out["assistant_masks"]
            text, spans = self._assistant_spans(messages)
        except TemplateError as exc:
            raise DataError(f"{self._where(index)}: the chat template rejects this conversation: {exc}") from None
        encoded = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [0] * len(encoded["input_ids"])
        # A token is an assistant token when it overlaps an assistant span (as transformers does for
        # `{% generation %}` templates).
        for n, (start, end) in enumerate(encoded["offset_mapping"]):
            if any(start < span_end and end > span_start for span_start, span_end in spans):
                mask[n] = 1
        return encoded["input_ids"], mask

    def _assistant_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """Character spans of the assistant turns, by rendering the conversation's prefixes.

        For templates without `{% generation %}`: turn i spans from the end of
        render(messages[:i], add_generation_prompt=True) to the end of render(messages[:i+1]), so the
        template's end-of-turn tokens are trained and the assistant header is not.
        """
        render = self.tok.apply_chat_template
        full = render(messages, tokenize=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = render(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            upto = render(messages[: i + 1], tokenize=False)
            if not (full.startswith(upto) and upto.startswith(prefix)):
                raise ConfigError(
                    f"the chat template of tokenizer {self.reference!r} does not render conversations "
                    "prefix by prefix, so the assistant turns cannot be located; use a template with "
                    "{% generation %} markers"
                )
            spans.append((len(prefix), len(upto)))
        return full, spans


def _tokenize_split(
    dataset: datasets.Dataset, formatter: _Formatter, source: str, what: str
) -> tuple[pa.Table, int, int]:
    """Format and tokenize one split. Returns (table, truncated, dropped) without zero-label examples."""
    import pyarrow.compute as pc

    require_columns(dataset, formatter.data, source=source, what=what)
    with _quiet_datasets():
        tokenized = dataset.map(
            formatter,
            batched=True,
            with_indices=True,
            remove_columns=dataset.column_names,
            keep_in_memory=True,
            load_from_cache_file=False,
        )
    table = tokenized.with_format("arrow")[:]
    truncated = int(pc.sum(table["truncated"]).as_py() or 0)
    keep = pc.greater(table["num_labels"], 0)
    dropped = len(table) - int(pc.sum(keep).as_py() or 0)
    return table.filter(keep), truncated, dropped


def _source_name(spec: str) -> str:
    return spec if Path(spec).expanduser().exists() else f"hub dataset {spec}"


# ---------------------------------------------------------------------------------------------------
# Writing


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
    # The most loss terms in one row bounds the output head's work per micro-batch (fulltune/loss.py).
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


def temp_dir_name(key: str) -> str:
    """A build directory name that says who is writing it: `.tmp-<key>-<host>-<pid>-<random>`."""
    return f".tmp-{key[:16]}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_temp_dirs(root: Path) -> None:
    """Delete build dirs left by dead processes on this host (a killed build leaves its temp dir)."""
    if not root.is_dir():
        return
    host = socket.gethostname()
    for entry in root.iterdir():
        if entry.name.startswith(".trash-"):
            shutil.rmtree(entry, ignore_errors=True)
            continue
        match = re.fullmatch(r"\.tmp-[0-9a-f]+-(.+)-(\d+)-[0-9a-f]+", entry.name)
        if not match or match.group(1) != host:
            continue
        if not pid_alive(int(match.group(2))):
            shutil.rmtree(entry, ignore_errors=True)


def publish_dir(tmp: Path, final: Path, is_intact: Any) -> None:
    """Rename a finished build dir into place. If another process got there first with an intact
    result, keep theirs; a broken leftover at `final` is moved aside and deleted."""
    fsync_tree(tmp)
    try:
        os.rename(tmp, final)
    except OSError:
        if is_intact(final):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        trash = final.parent / f".trash-{final.name[:16]}-{secrets.token_hex(4)}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
    fsync_dir(final.parent)


# ---------------------------------------------------------------------------------------------------
# The stage


def tokenize_dataset(data: DataSpec, tokenizer: str, workdir: str | Path, seed: int, *, token: str | None = None,
                     trust_remote_code: bool = False) -> TokenizedData:
    """Tokenize (and pack) `data` into `<workdir>/tokenized/<fingerprint>/`; a cache hit does no work.

    `tokenizer` is what `fulltune.tokenizer.prepare_tokenizer` returned (a directory, for hub tokenizers
    the snapshot's); `token` reads private hub datasets; `trust_remote_code` is `model.trust_remote_code`.

    Raises DataError for every problem with the data (missing/empty/broken files, missing columns,
    records of the wrong type, no example left with a label token) and ConfigError when the tokenizer
    cannot be loaded or lacks what the format needs (eos token, chat template).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    fingerprint = fingerprint_data(data, tokenizer, seed, token=token)
    root = Path(workdir) / "tokenized"
    final = root / fingerprint
    cached = _read_intact(final)
    if cached is not None:
        return cached
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(root)
    tmp = root / temp_dir_name(fingerprint)
    tmp.mkdir()
    try:
        _build(data, tokenizer, seed, fingerprint, tmp, token, trust_remote_code)
        publish_dir(tmp, final, lambda p: _read_intact(p) is not None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenized(str(final))


def _build(data: DataSpec, tokenizer_ref: str, seed: int, fingerprint: str, out: Path, token: str | None,
           trust_remote_code: bool) -> None:
    import numpy as np

    tokenizer = load_tokenizer(tokenizer_ref, trust_remote_code)
    arrow_cache = out / "datasets-cache"  # datasets' Arrow copy of the local files; deleted with the build
    train_source = _source_name(data.train)
    train_records = load_records(data.train, what="data.train", cache_dir=arrow_cache, token=token)
    train_table, truncated, dropped = _tokenize_split(
        train_records, _Formatter(tokenizer, data, train_source, tokenizer_ref), train_source, "data.train"
    )
    rng = np.random.default_rng(seed)
    if data.eval is not None:
        eval_source = _source_name(data.eval)
        eval_records = load_records(data.eval, what="data.eval", cache_dir=arrow_cache, token=token)
        eval_table, eval_truncated, eval_dropped = _tokenize_split(
            eval_records, _Formatter(tokenizer, data, eval_source, tokenizer_ref), eval_source, "data.eval"
        )
        truncated += eval_truncated
        dropped += eval_dropped
        if len(eval_table) == 0:
            raise DataError(_no_labels_message("data.eval", eval_source, data))
    else:
        n = len(train_table)
        if n == 0:
            raise DataError(_no_labels_message("data.train", train_source, data))
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
    if len(train_table) == 0:
        raise DataError(_no_labels_message("data.train", train_source, data))
    if data.packing:
        # Shuffle before packing so a sorted file does not pack similar examples together.
        train_table = train_table.take(rng.permutation(len(train_table)))

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
        train_fingerprint=fingerprint_data(data, tokenizer_ref, seed, token=token, include_eval=False),
    )
    meta = dataclasses.asdict(record)
    meta.pop("path")
    meta["data_format_version"] = DATA_FORMAT_VERSION
    meta["num_eval_rows"] = evaluation["rows"]
    meta["files"] = {name: (out / name).stat().st_size for name in TOKENIZED_FILES}
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def _no_labels_message(what: str, source: str, data: DataSpec) -> str:
    hint = {
        "text": f"check that column '{data.text_field}' holds text",
        "prompt_completion": f"prompts may fill all of data.max_length ({data.max_length}) — raise it",
        "chat": "conversations need an 'assistant' turn within data.max_length tokens",
    }[data.format]
    return f"{what}: no example in {source} has a token to train on after truncation; {hint}"


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


def _read_intact(path: Path) -> TokenizedData | None:
    if not path.is_dir():
        return None
    try:
        record = load_tokenized(str(path))
    except DataError:
        return None
    return record if record.fingerprint == path.name else None


# ---------------------------------------------------------------------------------------------------
# Batches


def collate(rows: Sequence[dict[str, Sequence[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Stack Parquet rows into int64 tensors, padding on the right to the longest row in the batch.

    Returns input_ids, labels (-100 on padding), position_ids, and attention_mask (1 real / 0 padding)
    only when a row needed padding.

    Packed rows (position_ids restart inside the row) are never given an attention_mask: transformers
    builds the SDPA/eager mask from position_ids only when attention_mask is None
    (`masking_utils.find_packed_sequence_indices`), and that is what keeps attention inside each
    document. Their padding gets position_ids 0, 1, … so it is a document of its own, which real
    tokens never see (it comes after them, and the mask is causal). transformers skips that mask when
    a KV cache exists, and the default `use_cache=True` creates one even in train mode: call the model
    with `use_cache=False` when training on packed rows (tests/test_data.py pins this).
    """
    import torch

    longest = max(len(row["input_ids"]) for row in rows)
    packed = any(0 in list(row["position_ids"])[1:] for row in rows)
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
