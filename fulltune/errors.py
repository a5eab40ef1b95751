"""User-facing errors.

Every mistake a user can make — a bad config, a missing or broken data file, a budget that cannot
be met — raises a subclass of :class:`UserError`. The CLI turns it into one message on stderr and
exit code 2; nothing else in fulltune catches it.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class UserError(Exception):
    """An error the user can fix; the message names the field or file and says what to do."""

    exit_code = 2


class ConfigError(UserError):
    """pipelines.yaml (or an override) does not describe a valid pipeline."""


class DataError(UserError):
    """A data file is missing, empty, or has records without the needed columns."""


class BudgetError(UserError):
    """No training configuration fits the memory budget, or the configured one does not and
    `budget.on_overflow` is `fail`. `plan` is the plan that says so (the `plan --json` object, `fits` false for
    the first), so that a script reading `plan --json` gets the breakdown and the advice too."""

    def __init__(self, message: str, plan: dict | None = None) -> None:
        super().__init__(message)
        self.plan = plan


class TrainingError(UserError):
    """Training stopped for a reason the user must act on (for example repeated non-finite losses)."""


class DiskFull(UserError):
    """A filesystem the run writes to is full: retrying cannot help until someone frees space."""


# What a full disk says when it reaches us as text: torch's and safetensors' writers wrap the OS error
# in a RuntimeError, SQLite (the MLflow registry) says "database or disk is full", cloud stores their own.
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "database or disk is full", "StorageFull")


def disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is a write that failed for want of space."""
    return any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
               or any(text in str(e) for text in DISK_FULL_TEXT) for e in _chain(exc))


def disk_full_error(exc: BaseException, fallback: str | Path, rerun: str) -> DiskFull:
    """One line for a full disk: the filesystem (the mount point holding the file that failed, else
    `fallback`), its free space now, and what a rerun does (`rerun`)."""
    path = next((Path(e.filename) for e in _chain(exc) if isinstance(e, OSError) and e.filename), Path(fallback))
    mount = _mount_point(path)
    free = shutil.disk_usage(mount).free / 2**30 if mount.exists() else 0.0
    return DiskFull(f"{mount}: the filesystem is full ({free:.1f} GiB free) while writing {path}; free some space, "
                    f"then rerun: {rerun}")


def _chain(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in found:
        found.append(seen)
        seen = seen.__cause__ or seen.__context__
    return found


def _mount_point(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped a run; the message says what was stopped and where a rerun continues.

    A KeyboardInterrupt, so that Prefect treats it as a crash (no retry) and passes it on unchanged.
    """

    exit_code = 130


def root_message(exc: BaseException) -> str:
    """The innermost cause of an exception chain: what a library's wrapped error actually says."""
    seen = exc
    while seen.__cause__ is not None or seen.__context__ is not None:
        seen = seen.__cause__ or seen.__context__
    return str(seen) or type(seen).__name__
