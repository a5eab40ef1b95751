"""User-facing errors.

Every mistake a user can make — a bad config, a missing or broken data file, a budget that cannot
be met — raises a subclass of :class:`UserError`. The CLI turns it into one message on stderr and
exit code 2; nothing else in fulltune catches it.
"""

from __future__ import annotations


class UserError(Exception):
    """An error the user can fix; the message names the field or file and says what to do."""

    exit_code = 2


class ConfigError(UserError):
    """pipelines.yaml (or an override) does not describe a valid pipeline."""


class DataError(UserError):
    """A data file is missing, empty, or has records without the needed columns."""


class BudgetError(UserError):
    """No training configuration fits the memory budget and `budget.on_overflow` is `fail`."""


class TrainingError(UserError):
    """Training stopped for a reason the user must act on (for example repeated non-finite losses)."""


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
