"""Content hashes and atomic outputs: how stages name what they write and never leave half of it.

- Hashing: `file_sha256` is the one reader of file bytes; `tree_sha256` combines the digests of a file
  or a directory's files, optionally remembered by size, mtime and ctime in `<workdir>/file-hashes.json`
  so that a multi-GB checkpoint or data file is read once, not once per stage and run.
- Publishing: `atomic_dir` builds a directory beside its final name and renames it into place;
  `atomic_write_text` does the same for one file. A build killed half way leaves only a `.tmp-*`
  directory, which `remove_stale_temp_dirs` deletes once its process is gone.
- The machine cache: `cache_dir` is where fulltune keeps what any run on this machine may reuse (traced peaks,
  the model configs transformers has built), each entry a pure function of what its key names.
- Processes: `process_identity` / `process_gone` (host, PID namespace, pid and start time) are the one
  test of "has the process that wrote this ended", for stage locks, temp dirs and the trainer's launcher.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
HASH_CACHE = "file-hashes.json"


CACHE_DIR_ENV = "FULLTUNE_CACHE_DIR"


def cache_dir() -> Path:
    """Where fulltune keeps what any run on this machine may reuse: $FULLTUNE_CACHE_DIR, else
    $XDG_CACHE_HOME/fulltune, else ~/.cache/fulltune."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fulltune"


# ---------------------------------------------------------------------------------------------------
# Hashing


def file_sha256(file: str | Path) -> str:
    """sha256 of a file's bytes, streamed."""
    h = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class FileHashes:
    """File digests remembered under each file's path, size, mtime, ctime and inode.

    Any change to a file (its bytes rewritten, even with the old mtime restored, changes its ctime)
    hashes it again. Without a workdir nothing is remembered. Use as a context manager: the cache is
    written back (atomically, without deleted files) on exit, and only into an existing workdir
    (`fulltune plan` creates none).
    """

    def __init__(self, workdir: str | Path | None) -> None:
        self.file = Path(workdir) / HASH_CACHE if workdir is not None else None
        self.entries: dict[str, Any] = {}
        self.changed = False
        if self.file is not None:
            try:
                loaded = json.loads(self.file.read_text())
            except (OSError, ValueError):
                loaded = {}
            self.entries = loaded if isinstance(loaded, dict) else {}

    def sha256(self, file: Path) -> str:
        """The digest of `file`, read only when it changed since it was last hashed."""
        stat = file.stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        entry = self.entries.get(str(file))
        if not (isinstance(entry, dict) and entry.get("stamp") == stamp):
            entry, self.changed = {"stamp": stamp, "sha256": file_sha256(file)}, True
            self.entries[str(file)] = entry
        return entry["sha256"]

    def __enter__(self) -> FileHashes:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is None:
            return
        kept = {name: entry for name, entry in self.entries.items() if os.path.exists(name)}
        if (self.changed or len(kept) < len(self.entries)) and self.file.parent.is_dir():
            atomic_write_text(self.file, json.dumps(kept))


def tree_sha256(path: str | Path, workdir: str | Path | None = None) -> str:
    """sha256 of a file, or of a directory's files (relative names and digests); with a workdir each
    file's digest is remembered there (see FileHashes)."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
    digest = hashlib.sha256()
    with FileHashes(workdir) as hashes:
        for file in files:
            name = str(file.relative_to(root)) if root.is_dir() else ""
            digest.update(f"{name}\0{hashes.sha256(file)}\0".encode())
    return digest.hexdigest()


def hash_parts(h: Any, *parts: str | bytes) -> None:
    """Add parts to a running hash, length-prefixed so that concatenations cannot collide
    ("ab"+"c" vs "a"+"bc")."""
    for part in parts:
        raw = part.encode() if isinstance(part, str) else part
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)


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


# ---------------------------------------------------------------------------------------------------
# Durable, atomic outputs


def fsync_dir(path: Path) -> None:
    """Persist a directory entry (a rename into it) across a crash."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    """Persist every file under `path`, then the directory itself."""
    for file in (p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb+") as handle:
            os.fsync(handle.fileno())
    fsync_dir(path)


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _host() -> str:
    """This host, and its PID namespace where there is one: containers that share a hostname and a
    workdir volume do not see each other's processes, so their pids must not be compared."""
    namespace = _pid_namespace()
    return socket.gethostname() if namespace is None else f"{socket.gethostname()}/pidns-{namespace}"


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """This process (or `pid`) as {"host", "pid", "started", "ticks", "boot"}: enough to tell later whether it
    still runs. The start tells a reused pid from the original: `ticks` (clock ticks since boot) and `boot` (the
    boot's id) where Linux gives them, else `started` (seconds since the epoch)."""
    import psutil

    process = psutil.Process(pid)
    identity: dict[str, Any] = {"host": _host(), "pid": process.pid, "started": process.create_time()}
    ticks, boot = _start_ticks(process.pid), _boot_id()
    if ticks is not None and boot is not None:
        identity.update(ticks=ticks, boot=boot)
    return identity


def process_gone(identity: Any) -> bool:
    """Whether the process `identity` (from process_identity) has ended: no such pid, a zombie, or a
    pid reused by a later process. False when it cannot be told (another host, a malformed record), so
    only a provably dead process is ever treated as gone.

    The start is compared in clock ticks since boot where the record has them: the epoch start time psutil
    derives from the boot time moves by as much as the system clock is stepped (NTP, a VM's clock), and a
    live process — the run holding a stage lock, the launcher a trainer watches — must never look gone."""
    import psutil

    try:
        if identity["host"] != _host():
            return False
        pid = int(identity["pid"])
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return True
        boot = _boot_id()
        if identity.get("ticks") is not None and identity.get("boot") is not None and boot is not None:
            return identity["boot"] != boot or _start_ticks(pid) != int(identity["ticks"])
        # An older record: psutil's start time, which drifts with the boot time it is derived from.
        return abs(process.create_time() - float(identity["started"])) > 1.0
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat); None without /proc or
    without such a process. A clock step does not move it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat.rpartition(b")")[2].split()  # the name, in parentheses, may hold spaces
    return int(fields[19]) if len(fields) > 19 else None


def _boot_id() -> str | None:
    """This boot's id (a reboot restarts the clock ticks); None where Linux does not give it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


# `.tmp-<key>-<hostname>-<pid namespace or 0>-<pid>-<start>-<random>`: a process identity in a name. The start is
# `t<clock ticks since boot>` (this boot's), or in older names the start time in ms since the epoch.
TEMP_DIR = re.compile(r"\.tmp-[0-9a-f]+-(?P<host>.+)-(?P<pidns>\d+)-(?P<pid>\d+)-(?P<started>t?\d+)-[0-9a-f]{8}")


def temp_dir_name(key: str) -> str:
    """A build directory name that says who is writing it (TEMP_DIR): host, pid namespace, pid and start
    time, so that a sweep can tell a dead writer from a live one whose pid was reused."""
    me = process_identity()
    started = f"t{me['ticks']}" if "ticks" in me else str(int(me["started"] * 1000))
    return f".tmp-{key[:16]}-{socket.gethostname()}-{_pid_namespace() or 0}-{me['pid']}-{started}-{secrets.token_hex(4)}"


def remove_stale_temp_dirs(root: Path) -> None:
    """Delete build dirs whose writer provably ended (process_gone; a killed build leaves its temp dir).

    A directory named by another host, another PID namespace, or in an older naming is left alone."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith(".trash-"):
            shutil.rmtree(entry, ignore_errors=True)
            continue
        match = TEMP_DIR.fullmatch(entry.name)
        if not match:
            continue
        namespace = int(match["pidns"])
        host = match["host"] if namespace == 0 else f"{match['host']}/pidns-{namespace}"
        started = match["started"]
        writer: dict[str, Any] = {"host": host, "pid": int(match["pid"])}
        writer.update({"ticks": int(started[1:]), "boot": _boot_id()} if started.startswith("t")
                      else {"started": int(started) / 1000})
        if process_gone(writer):
            shutil.rmtree(entry, ignore_errors=True)


def _exists(path: Path) -> bool:
    return path.exists()


def publish_dir(tmp: Path, final: Path, is_intact: Callable[[Path], bool] = _exists) -> None:
    """Rename a finished build dir into place. If another process got there first with an intact
    result, keep theirs (outputs are content-addressed: both are the same); a broken leftover at
    `final` is moved aside and deleted."""
    fsync_tree(tmp)
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.exists():
            raise
        if is_intact(final):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        trash = final.parent / f".trash-{final.name[:16]}-{secrets.token_hex(4)}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_dir(target: str | Path, is_intact: Callable[[Path], bool] = _exists) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it is fsynced and renamed to `target`.

    If `target` already exists and `is_intact` accepts it (another run finished first), the new copy is
    dropped; a broken one is replaced (see publish_dir). On error the temporary directory is removed.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / temp_dir_name(target.name)
    tmp.mkdir()
    try:
        yield tmp
        publish_dir(tmp, target, is_intact)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a text file (UTF-8) through a temporary file and a rename."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write a file through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
