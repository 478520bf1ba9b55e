"""Runtime failures of ``swapkit train`` that the CLI reports in one line with exit status 1."""
from __future__ import annotations


class RunFailed(RuntimeError):
    """A run stopped for a reason the user can act on (NaN loss, disk full, out of memory).

    The message says what happened, where (step, file) and what to do; the CLI prints it without a
    traceback and exits with status 1.
    """
