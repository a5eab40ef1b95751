"""Content hashes and atomic writes: how stages name their outputs and never leave half of one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


def hash_path(path: str | Path) -> str:
    """sha256 over a file's bytes, or over every file of a directory (relative names and bytes)."""
    path = Path(path)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def hash_json(value: Any) -> str:
    """sha256 of a JSON-serialisable value, independent of key order."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@lru_cache(maxsize=None)
def code_version(*modules: str) -> str:
    """Version plus a hash of engine source: of the named modules (paths relative to the package, a
    directory for a sub-package), or of the whole engine. Stage cache keys name the modules the stage
    runs, so changing the trainer re-runs training but not tokenization."""
    from fulltune import __version__

    package = Path(__file__).parent
    files: list[Path] = []
    for module in modules or (".",):
        target = package / module
        files += sorted(target.rglob("*.py")) if target.is_dir() else [target]
    digest = hashlib.sha256(__version__.encode())
    for file in files:
        digest.update(str(file.relative_to(package)).encode() + file.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:12]}"


def fsync_dir(path: Path) -> None:
    """Persist a directory entry (a rename into it) across a crash."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    for file in (p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb+") as handle:
            os.fsync(handle.fileno())
    fsync_dir(path)


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it is fsynced and renamed to `target`.

    If `target` already exists (another run finished first) the new copy is dropped: outputs are
    content-addressed, so both are the same. On error the temporary directory is removed.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pid_alive(pid: int) -> bool:
    """Whether a process of this host still exists (a stale lock or temp dir names a dead one)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a file through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
