"""What every stage task shares: content-based cache keys, where results persist, when to retry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fulltune.errors import UserError


def cache_key(stage: str):
    """Cache key = the stage's content key, computed by the flow from fingerprints (DESIGN.md)."""

    def key_fn(context: Any, parameters: dict[str, Any]) -> str:
        return f"fulltune-{stage}-{parameters['key']}"

    return key_fn


def stage_policy(stage: str, workdir: str | None = None) -> Any:
    """Cache policy of a stage. With a workdir, cache records live there and runs that compute the same
    key at once are serialised by a file lock: the second waits, then finds the first one's result."""
    from prefect.cache_policies import CacheKeyFnPolicy
    from prefect.locking.filesystem import FileSystemLockManager
    from prefect.transactions import IsolationLevel

    policy = CacheKeyFnPolicy(cache_key_fn=cache_key(stage))
    if workdir is None:
        return policy
    return policy.configure(lock_manager=FileSystemLockManager(locks_dir(workdir)),
                            isolation_level=IsolationLevel.SERIALIZABLE)


def locks_dir(workdir: str) -> Path:
    return Path(workdir) / "locks"


def clear_stale_locks(workdir: str) -> list[Path]:
    """Remove stage locks whose holder process on this host is gone (a run killed while it held one);
    otherwise the next run of the same stage would wait for it forever."""
    import json
    import socket

    from fulltune.fingerprint import pid_alive

    removed = []
    for lock in locks_dir(workdir).glob("*.lock"):
        try:
            holder = json.loads(lock.read_text())["holder"]
            host, pid = holder.split(":")[:2]
        except (OSError, ValueError, KeyError):
            continue
        if host != socket.gethostname() or pid_alive(int(pid)):
            continue
        lock.unlink(missing_ok=True)
        removed.append(lock)
    return removed


def retry_unless_user_error(task: Any, task_run: Any, state: Any) -> bool:
    """Retry crashes and flaky I/O, never a user error: retrying a bad config changes nothing."""
    try:
        state.result()
    except UserError:
        return False
    except Exception:  # noqa: BLE001 - any other failure is what retries are for
        return True
    return True


def results_dir(workdir: str) -> Path:
    """Task results (small records) persist beside the outputs they point to."""
    return Path(workdir) / "prefect-results"
