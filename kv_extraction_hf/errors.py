"""Errors raised by kv_extraction_hf.

Every failure the user can cause (unknown model or dataset, missing or corrupt dump, a KV
that does not fit the model, a prompt longer than the model's context) is raised as
:class:`ExtractionError`, whose message is one line meant to be printed as-is by the CLIs
(which then exit with status 2, through :func:`run_cli`).
"""

from __future__ import annotations

from collections.abc import Callable

from cachegen_common.cli import exit_status


class ExtractionError(ValueError):
    """A user-facing error of the extraction / injection stage (one-line message)."""


def run_cli(body: Callable[[], None]) -> int:
    """Run a CLI's ``body``: exit status 0 when it returns, 2 when it raises
    :class:`ExtractionError` (its message printed to stderr as ``error: <message>``;
    ``cachegen_common.cli.exit_status``)."""
    return exit_status(body, (ExtractionError,))
