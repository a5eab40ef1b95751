"""What every stage task shares: content-based cache keys, where results persist, when to retry."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect.locking.filesystem import FileSystemLockManager

from fulltune.errors import UserError, disk_full


def cache_key(stage: str):
    """Cache key = the stage's content key, computed by the flow from fingerprints (fulltune/stages/)."""

    def key_fn(context: Any, parameters: dict[str, Any]) -> str:
        return f"fulltune-{stage}-{parameters['key']}"

    return key_fn


def stage_policy(stage: str, workdir: str | None = None) -> Any:
    """Cache policy of a stage. With a workdir, cache records live there and runs that compute the same
    key at once are serialised by a file lock: the second waits, then finds the first one's result."""
    from prefect.cache_policies import CacheKeyFnPolicy
    from prefect.transactions import IsolationLevel

    policy = CacheKeyFnPolicy(cache_key_fn=cache_key(stage))
    if workdir is None:
        return policy
    return policy.configure(lock_manager=StageLockManager(locks_dir(workdir)),
                            isolation_level=IsolationLevel.SERIALIZABLE)


def locks_dir(workdir: str) -> Path:
    return Path(workdir) / "locks"


class StageLockManager(FileSystemLockManager):
    """Prefect's file locks, each naming the process that holds it, so that a dead holder's lock is cleared.

    Prefect's FileSystemLockManager writes only the transaction's holder, a random UUID, and waits for a
    lock as long as its file exists: a run killed while it held a lock (SIGKILL, the OOM killer, a
    preempted node) made every later run of that stage wait forever. Here the lock file also records
    `owner` (fulltune.storage.process_identity: host, pid, start time), and a lock whose owner provably
    ended counts as free: a new run, or one already waiting, removes it and goes on. A lock of a live
    process, or of one this host cannot check (another machine sharing the workdir), is respected.

    A lock file appears whole: written aside, then hard-linked to its name, which fails if another
    process holds it (Prefect creates it empty and writes it after, so a reader could see it empty).
    Removing a dead owner's lock happens under a flock on `locks/.guard`, so two runs clearing the same
    stale lock cannot remove the live lock a third one has just taken.
    """

    def acquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                     hold_timeout: float | None = None) -> bool:
        """Take the lock for `key`, waiting up to `acquire_timeout` seconds (None: as long as it takes)."""
        self._ensure_lock_files_directory_exists()
        deadline = None if acquire_timeout is None else time.monotonic() + acquire_timeout
        while True:
            if self.is_lock_holder(key, holder):
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            # wait_for_lock treats a timeout of 0 as none at all
            if not self.wait_for_lock(key, None if remaining is None else max(remaining, 0.1)):
                return False
            if self._create(key, holder, hold_timeout):
                return True

    async def aacquire_lock(self, key: str, holder: str, acquire_timeout: float | None = None,
                            hold_timeout: float | None = None) -> bool:
        import anyio

        return await anyio.to_thread.run_sync(self.acquire_lock, key, holder, acquire_timeout, hold_timeout)

    def is_locked(self, key: str, use_cache: bool = False) -> bool:
        """Whether a live process (or one that cannot be checked) holds `key`; a dead owner's lock is removed."""
        if not super().is_locked(key, use_cache=use_cache):
            return False
        info = self._get_lock_info(key)
        if info is None or not _owner_gone(info):
            return True
        self.remove_if_stale(Path(info["path"]))
        self._locks.pop(key, None)
        return super().is_locked(key)

    def remove_if_stale(self, lock: Path) -> bool:
        """Remove the lock file `lock` if its owner has ended; whether it was removed."""
        with self._guard():
            try:
                info = json.loads(lock.read_bytes())
            except (OSError, ValueError):
                return False
            if not _owner_gone(info):
                return False
            lock.unlink(missing_ok=True)
            return True

    def _create(self, key: str, holder: str, hold_timeout: float | None) -> bool:
        from datetime import timedelta

        from prefect.types._datetime import now

        from fulltune.storage import process_identity

        expiration = now("UTC") + timedelta(seconds=hold_timeout) if hold_timeout is not None else None
        record = {"holder": holder, "expiration": str(expiration) if expiration else None, "owner": process_identity()}
        path = self._lock_path_for_key(key)
        aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        aside.write_text(json.dumps(record))
        try:
            os.link(aside, path)
        except FileExistsError:
            return False
        finally:
            aside.unlink(missing_ok=True)
        self._locks[key] = {"holder": holder, "expiration": expiration, "path": path}
        return True

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        import fcntl

        self._ensure_lock_files_directory_exists()
        with open(self.lock_files_directory / ".guard", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)


def _owner_gone(info: dict[str, Any]) -> bool:
    from fulltune.storage import process_gone

    return "owner" in info and process_gone(info["owner"])


def clear_stale_locks(workdir: str) -> list[Path]:
    """Remove stage locks whose holder has ended (a run killed while it held one); returns them.

    Waiting runs clear such a lock themselves (StageLockManager.is_locked); this sweep at the start of a
    run only says so in its log. A lock that names no owner (written by an earlier fulltune) cannot be
    checked and is left alone: delete it by hand once no run uses the workdir.
    """
    manager = StageLockManager(locks_dir(workdir))
    return [lock for lock in sorted(locks_dir(workdir).glob("*.lock")) if manager.remove_if_stale(lock)]


def retry_unless_user_error(task: Any, task_run: Any, state: Any) -> bool:
    """Retry crashes and flaky I/O, never a user error nor a full disk: retrying a bad config, or a
    write to a filesystem with no space left, changes nothing (the run says which: fulltune/stages/runner.py)."""
    try:
        state.result()
    except UserError:
        return False
    except Exception as exc:  # noqa: BLE001 - any other failure is what retries are for
        return not disk_full(exc)
    return True


def results_dir(workdir: str) -> Path:
    """Task results (small records) persist beside the outputs they point to."""
    return Path(workdir) / "prefect-results"
