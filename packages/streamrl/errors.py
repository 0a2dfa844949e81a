"""Errors shared across layers."""

from __future__ import annotations

FATAL_EXIT_CODE = 3  # a worker that exits with this is not restarted: the run stops


class FatalError(RuntimeError):
    """A failure that restarting the worker cannot fix (a tripped circuit breaker,
    `trainer.max_nonfinite_steps` non-finite steps in a row): the worker exits with
    FATAL_EXIT_CODE and `streamrl up` stops the run with it."""
