"""Several sources in one dataset: each tokenized and cached on its own, then mixed by weight.

A source's examples (formatted, tokenized, truncated, examples without a target dropped; never packed)
are kept under `<workdir>/tokenized-sources/<source fingerprint>/` (Arrow IPC shards, memory-mapped when read). The source
fingerprint covers the source's data (file bytes or hub commit), the tokenizer, the options it is
formatted with and DATA_FORMAT_VERSION — not its weight, the other sources or the seed — so adding a
source or changing a weight re-tokenizes nothing; only the mix (hold-out, weights, packing) is redone.

A weight is how many times each of the source's examples is seen per epoch on average: every example
`floor(weight)` times, plus a seeded sample without replacement of `round(fraction × n)` of them, so
weight 2 doubles a source and 0.5 keeps a seeded half, exactly. The sample is seeded by the training
seed and the source's own fingerprint: it does not move when another source or weight changes.

Source caches are kept only while they may be used again (`prune_source_caches`, after every build of the
tokenize stage): those a build in progress reads (its temp dir lists them in SOURCES_FILE), those used in
the last IN_USE_SECONDS, and the KEEP_SOURCES most recently used; the others are deleted. A tokenized
dataset (`tokenized/<fingerprint>/`) does not read its sources' caches once built, so a cached stage never
needs one; mixing a deleted source again tokenizes it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.data.files import load_records, record_locator, update_hash_with_source
from fulltune.data.formats import check_target_text, format_columns, no_labels_message, start_encoding
from fulltune.data.sources import Source
from fulltune.data.workers import read_shards, tokenize_shards, worker_count
from fulltune.errors import DataError
from fulltune.storage import FileHashes, atomic_dir, hash_parts, remove_stale_temp_dirs

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

KEEP_SOURCES = 8  # source caches kept beyond those in use: the most recently used
IN_USE_SECONDS = 3600  # a source cache used this recently is never deleted: a run may still be mixing it
SOURCES_FILE = "sources.json"  # in a tokenized build's temp dir while it runs: the source caches it reads
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class SourceExamples:
    """One source's tokenized examples and what tokenizing them counted."""

    source: Source
    name: str  # the file or `hub dataset <id>`, for messages
    fingerprint: str
    table: pa.Table  # formats.EXAMPLE_COLUMNS, one row per example with a target
    truncated: int
    dropped: int


def source_fingerprint(source: Source, tokenizer_digest: str, version: int, *, token: str | None,
                       hashes: FileHashes) -> str:
    """sha256 of what a source's tokenized examples depend on (see the module docstring)."""

    h = hashlib.sha256()
    hash_parts(h, "fulltune-source", str(version))
    update_hash_with_source(h, source.reference, what=source.what, token=token, hashes=hashes)
    options = {"format": source.data.format, "max_length": source.data.max_length, **format_columns(source.data)}
    hash_parts(h, "tokenizer", tokenizer_digest, "options", json.dumps(options, sort_keys=True))
    return h.hexdigest()


def source_examples(source: Source, fingerprint: str, tokenizer: Any, reference: str, workdir: str | Path,
                    token: str | None) -> SourceExamples:
    """The source's examples from its cache (memory-mapped), tokenized into it first when absent (atomically,
    on `data.num_workers` processes: fulltune/data/workers.py).

    Raises DataError for every problem with the source's data, naming `source.what` (`data.train[2]`),
    and when no example of it has a token to train on.
    """
    local = Path(source.reference).expanduser().exists()
    name = source.reference if local else f"hub dataset {source.reference}"
    root = Path(workdir) / "tokenized-sources"
    final = root / fingerprint
    for attempt in (1, 2):
        if not _intact(final):
            root.mkdir(parents=True, exist_ok=True)
            remove_stale_temp_dirs(root)
            with atomic_dir(final, _intact) as tmp:
                _tokenize_into(tmp, source, name, tokenizer, reference, token)
        try:
            os.utime(final / "meta.json")  # used now: what `prune_source_caches` keeps
            meta = json.loads((final / "meta.json").read_text())
            return SourceExamples(source, name, fingerprint, read_shards(final, meta["shards"]), meta["truncated"],
                                  meta["dropped"])
        except FileNotFoundError:  # pruned by another run between the check and the read: tokenize it again
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _tokenize_into(out: Path, source: Source, name: str, tokenizer: Any, reference: str,
                   token: str | None) -> None:
    arrow_cache = out / "datasets-cache"  # datasets' Arrow copy of the local files; deleted with the build
    records = load_records(source.reference, what=source.what, cache_dir=arrow_cache, token=token)
    locate = record_locator(source.reference, source.what) if not name.startswith("hub dataset") else None
    encoder = start_encoding(records, tokenizer, source.data, source=name, what=source.what, reference=reference,
                             locate=locate)
    shards = tokenize_shards(encoder, records, out, worker_count(source.data.num_workers))
    check_target_text(any(s.has_target_text for s in shards), source.data, source=name, what=source.what)
    if not any(s.rows for s in shards):
        raise DataError(no_labels_message(source.what, name, source.data))
    shutil.rmtree(arrow_cache, ignore_errors=True)
    meta = {"what": source.what, "reference": source.reference, "truncated": sum(s.truncated for s in shards),
            "dropped": sum(s.dropped for s in shards), "shards": [{**dataclasses.asdict(s), "size": (out / s.file).stat().st_size}
                                                  for s in shards]}
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def _intact(path: Path) -> bool:
    """Whether a source's cache is whole: its meta.json and every shard of the size it records."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        return all((path / shard["file"]).stat().st_size == shard["size"] for shard in meta["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prune_source_caches(workdir: str | Path, keep: int | None = None) -> list[str]:
    """Delete the source caches under `<workdir>/tokenized-sources/` that no build in progress reads, that
    were not used in the last IN_USE_SECONDS, and that are not among the `keep` (KEEP_SOURCES) most recently
    used (module docstring). Returns the fingerprints deleted."""
    root = Path(workdir) / "tokenized-sources"
    if not root.is_dir():
        return []
    keep = KEEP_SOURCES if keep is None else keep
    in_use: set[str] = set()
    for build in (Path(workdir) / "tokenized").glob(".tmp-*"):
        try:
            in_use.update(str(fp) for fp in json.loads((build / SOURCES_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            continue
    caches = []
    for entry in root.iterdir():
        if _FINGERPRINT.fullmatch(entry.name) and entry.is_dir():
            try:
                caches.append(((entry / "meta.json").stat().st_mtime, entry))
            except OSError:
                continue  # not a whole cache: replaced when next used
    caches.sort(reverse=True)
    now, removed = time.time(), []
    for used, entry in caches[keep:]:
        if entry.name in in_use or now - used < IN_USE_SECONDS:
            continue
        trash = root / f".trash-{entry.name[:16]}-{secrets.token_hex(4)}"  # remove_stale_temp_dirs finishes a kill
        try:
            os.rename(entry, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(entry.name)
    return removed


def weighted_rows(counts: list[int], weights: list[float], seeds: list[list[int]]) -> np.ndarray | None:
    """Row indices of the mix: source s (rows `sum(counts[:s])` on) by `weights[s]` (module docstring),
    its fractional sample drawn with `np.random.default_rng(seeds[s])`; None when every weight is 1."""
    import numpy as np

    if all(weight == 1 for weight in weights):
        return None
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    parts = []
    for start, n, weight, seed in zip(starts, counts, weights, seeds):
        whole = math.floor(weight)
        sample = np.random.default_rng(seed).choice(n, round((weight - whole) * n), replace=False)
        parts.append(start + np.concatenate([np.tile(np.arange(n), whole), np.sort(sample)]))
    return np.concatenate(parts).astype(np.int64)
