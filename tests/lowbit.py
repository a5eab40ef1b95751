"""torchao for the tests that prove what needs it (float8 training), without the rest of the suite paying for it.

`make test` installs `fulltune[lowbit]` into .lowbit/ (the Makefile): not into the test environment, where
transformers would import torchao with every model it builds. A test that needs torchao runs its work in processes
that put .lowbit/ on their PYTHONPATH (`environment`), and their children (trainers under torchrun too) inherit it.
Without .lowbit/ such a test is skipped, unless FULLTUNE_TEST_LOWBIT=required (`make test` sets it): then it
fails, so the suite `make test` runs always carries the proof.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import ROOT

LOWBIT = ROOT / ".lowbit"
REQUIRED_ENV = "FULLTUNE_TEST_LOWBIT"
MISSING = f"needs torchao in {LOWBIT}: `make test` installs it (fulltune[lowbit])"


def require() -> Path:
    """.lowbit/ (torchao installed there); skip the test without it, or fail where it is required."""
    if not available():
        pytest.skip(MISSING)
    return LOWBIT


def available() -> bool:
    """Whether .lowbit/ holds torchao, for a test with more to prove than what needs it; where it is required and
    missing, the test fails."""
    if (LOWBIT / "torchao").is_dir():
        return True
    if os.environ.get(REQUIRED_ENV) == "required":
        pytest.fail(MISSING)
    return False


def environment(**extra: str) -> dict[str, str]:
    """This process's environment with the repository and .lowbit/ first on PYTHONPATH (and `extra`)."""
    path = os.pathsep.join(filter(None, [str(ROOT), str(require()), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
