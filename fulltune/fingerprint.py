"""The storage helpers' old import path, kept for modules not yet moved to `fulltune.storage`."""

from fulltune.storage import (  # noqa: F401 - re-exported
    atomic_dir,
    atomic_write_text,
    code_version,
    fsync_dir,
    fsync_tree,
    hash_json,
    pid_alive,
)
