"""A resumable text-fidelity run: the per-window accumulators of
:func:`bench.quality.text.run_text_quality` saved after every window, so a long run (32
windows of a 1.5B model take over an hour on two cores) that is stopped resumes at the
next window instead of starting over.

The state file is plain JSON (never pickle), written atomically (a temporary file in the
same folder, then ``os.replace``), so a reader sees the state after some whole window or
no file. It is named by the run's settings: ``key`` is the sha256 of the canonical JSON of
the run's identity (model weights hash, data sha256, codec/level/anchor list, window
offsets, context and continuation tokens, seed, codec configs, window storage), and a state
whose key differs is refused, never mixed into another run's figures. Windows measured
before and after a resume are the same windows of the same seeded draw; the state records
each segment's environment (CPU, load) because they may differ.

``save_doc`` / ``load_doc`` are the same atomic, key-checked state for any other resumable
run (the answer suite keeps its finished contexts' records in one).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

__all__ = ["STATE_FORMAT", "CheckpointMismatch", "run_key", "save_doc", "load_doc", "save_state", "load_state",
           "partial_path"]

STATE_FORMAT = 1


class CheckpointMismatch(ValueError):
    """A state file that is not a state of this run (other settings, another format, or not
    JSON). One line; the caller says how to start over."""


def partial_path(out: Path) -> Path:
    """Where the state of a run writing ``out`` lives: ``<out>.partial`` beside it."""
    return out.with_name(out.name + ".partial")


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()


def run_key(identity: dict) -> str:
    """sha256 (hex) of ``identity``'s canonical JSON (sorted keys, no whitespace; values
    that are not JSON types by ``str``)."""
    return hashlib.sha256(_canonical(identity)).hexdigest()


def _acc_to_json(acc: dict) -> list:
    out = []
    for (name, level, anchors), a in acc.items():
        a = dict(a)
        if "serde" in a:                    # int level keys: kept as [level, count] pairs
            sd = dict(a["serde"])
            sd["levels"] = [[lv, c] for lv, c in sd["levels"].items()]
            a["serde"] = sd
        out.append([[name, level, list(anchors)], a])
    return out


def _acc_from_json(items: list) -> dict:
    acc = {}
    for (name, level, anchors), a in items:
        if "serde" in a:
            a["serde"]["levels"] = {lv: c for lv, c in a["serde"]["levels"]}
        acc[(name, level, tuple(anchors))] = a
    return acc


def save_state(path: Path, key: str, windows_done: int, acc: dict, extra: dict) -> None:
    """Write the state after ``windows_done`` whole windows, atomically.

    ``acc``: run_text_quality's accumulators ``{(codec, level, (sink, recent)): {...}}``;
    ``extra``: JSON-able run state (skipped codecs, reference perplexities, timings,
    environments). Raises OSError when the folder cannot be written."""
    save_doc(path, key, {"windows_done": int(windows_done), "acc": _acc_to_json(acc), **extra})


def save_doc(path: Path, key: str, payload: dict) -> None:
    """Write ``payload`` (JSON-able) as the state of the run named ``key``, atomically: a
    reader sees the previous state or this one, never a part. Raises OSError when the
    folder cannot be written."""
    doc = {**payload, "format": STATE_FORMAT, "key": key}
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_canonical(doc))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_doc(path: Path, key: str) -> Optional[dict]:
    """The saved state (a dict) of the run named ``key``, or None when ``path`` does not
    exist. Raises CheckpointMismatch for a file of another run, another format, or one that
    is not a JSON object."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointMismatch(f"{path} is not a readable run state ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
        raise CheckpointMismatch(f"{path} is not a run state of format {STATE_FORMAT}")
    if doc.get("key") != key:
        raise CheckpointMismatch(f"{path} holds a partial run of other settings (key "
                                 f"{str(doc.get('key'))[:12]}, this run {key[:12]})")
    return doc


def load_state(path: Path, key: str) -> Optional[dict]:
    """The saved state of the text-fidelity run named ``key`` (``acc`` rebuilt with tuple
    keys), or None when ``path`` does not exist. Raises CheckpointMismatch as
    :func:`load_doc`, and for a state without the accumulators."""
    doc = load_doc(path, key)
    if doc is None:
        return None
    if not isinstance(doc.get("acc"), list):
        raise CheckpointMismatch(f"{path} is not a run state of format {STATE_FORMAT}")
    try:
        doc["acc"] = _acc_from_json(doc["acc"])
    except (TypeError, ValueError, KeyError, AttributeError):
        raise CheckpointMismatch(f"{path} is not a run state of format {STATE_FORMAT}") from None
    return doc
