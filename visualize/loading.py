"""Reading result files: a results.json (:func:`load_results`, :func:`schema_warnings`)
and any result document that must hold a list under a key (:func:`read_json_doc`: the
quality.json of ``bench.quality``, the adaptation.json of ``bench.adapt``), with one-line
errors naming the file. Standard library only, and separate from visualize.data (which
needs pandas) so that scripts/readme_tables.py reads the same files through the same code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

KNOWN_SCHEMA_VERSION = 1


class ResultsError(ValueError):
    """The results file is missing, unreadable, not JSON or not a JSON object."""


class SkipFigure(Exception):
    """A figure cannot be drawn from this results file; the message says why."""


def load_results(path: str | os.PathLike) -> dict:
    """Read and parse a results.json.

    Returns:
        The top-level JSON object as a dict.

    Raises:
        ResultsError: the file is missing or unreadable, is not UTF-8 JSON, or its top
            level is not an object. The message is one line naming the file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file (run run_benchmarks.py first, or pass --results)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: cannot read: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise ResultsError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise ResultsError(f"{path}: top level is a JSON {type(doc).__name__}, expected an object "
                           f"with 'schema_version', 'summaries', ... (docs/results-schema.md)")
    return doc


def schema_warnings(doc: dict) -> list[str]:
    """Warnings about the schema version (missing or not the version this script knows)."""
    version = doc.get("schema_version")
    if version is None:
        return [f"results file has no schema_version; assuming {KNOWN_SCHEMA_VERSION} and drawing what it can"]
    if version != KNOWN_SCHEMA_VERSION:
        return [f"results file has schema_version {version!r}, this script knows {KNOWN_SCHEMA_VERSION}; "
                f"drawing the figures it can"]
    return []


def read_json_doc(path: str | os.PathLike, what: str, key: str | None = None, *,
                  error: type[Exception] = ResultsError) -> dict:
    """The top-level JSON object of the ``what`` file ``path`` (e.g. "quality", "adaptation").

    Raises:
        ``error`` (ResultsError unless given), one line naming the file: unreadable, not
        JSON, not an object, or (``key`` given) without a list under ``key``.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {what} file {path}: {exc}") from None
    if not isinstance(doc, dict) or (key is not None and not isinstance(doc.get(key), list)):
        raise error(f"{path} is not {'an' if what[:1] in 'aeiou' else 'a'} {what} file" + (f" (no '{key}' list; docs/results-schema.md)" if key else ""))
    return doc
