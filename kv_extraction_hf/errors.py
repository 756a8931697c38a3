"""Errors raised by kv_extraction_hf.

Every failure the user can cause (unknown model or dataset, missing or corrupt dump, a KV
that does not fit the model, a prompt longer than the model's context) is raised as
:class:`ExtractionError`, whose message is one line meant to be printed as-is by the CLIs
(which then exit with status 2).
"""


class ExtractionError(ValueError):
    """A user-facing error of the extraction / injection stage (one-line message)."""
