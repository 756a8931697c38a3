"""Whole-file writes and digests that several packages need done the one way.

- :func:`atomic_write` (and its ``_text`` / ``_json`` forms): replace a file so a reader
  sees the old file or the new one, never half of one (temporary file in the same folder,
  fsync, ``os.replace``). Every result file is written so (``cachegen_common.header`` re-exports
  these names), and so is every object of the local-folder KV store
  (``streaming.store.folder``: its own temporary-name prefix, mode 0600).
- :func:`files_sha256`: the sha256 over a list of files (name + NUL + bytes each), the
  weights hash of a model folder (``kv_extraction_hf.model.weights_hash``,
  ``streaming.identity.folder_weights_hash``).

Kept apart from ``cachegen_common.header`` (the environment of a run): these are file mechanics,
standard library only.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Optional

__all__ = ["atomic_write", "atomic_write_json", "atomic_write_text", "json_default",
           "files_sha256"]


def json_default(obj: Any) -> Any:
    """``json.dump``'s ``default``: numpy/torch scalars (``.item()``) and paths (str);
    TypeError otherwise."""
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def atomic_write(path: Path | str, write: Callable[[IO], Any], *, binary: bool = False,
                 keep_mode: bool = False, mode: Optional[int] = None,
                 prefix: Optional[str] = None, suffix: str = ".tmp") -> None:
    """Replace ``path`` atomically with what ``write(fh)`` writes to an open file: a
    temporary file in the same folder (made with its parents), fsync, ``os.replace``; the
    temporary file is removed on any error (``path`` is then unchanged). ``binary`` opens it
    "wb" (else "w", text). Permission bits: ``mode`` when given; else with ``keep_mode`` an
    existing file's bits; else a new file's usual 0o666 & ~umask. The temporary file is
    named ``prefix`` + random + ``suffix`` (default prefix ``.<name>.``).

    Raises:
        OSError: the folder cannot be written; whatever ``write`` raises.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None and keep_mode and path.exists():
        mode = path.stat().st_mode & 0o777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}." if prefix is None else prefix,
                               suffix=suffix, dir=path.parent)
    try:
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask   # mkstemp makes 0600: give the usual mode of a new file
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb" if binary else "w") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_text(path: Path | str, text: str, *, keep_mode: bool = False) -> None:
    """Replace ``path`` with ``text`` atomically (:func:`atomic_write`).

    Raises:
        OSError: the folder cannot be written.
    """
    atomic_write(path, lambda fh: fh.write(text), keep_mode=keep_mode)


def atomic_write_json(path: Path | str, doc: Any, *, indent: Optional[int] = 1,
                      default: Callable[[Any], Any] = json_default) -> None:
    """Write ``doc`` as JSON (``indent``, keys in insertion order, a final newline) to
    ``path`` atomically (:func:`atomic_write_text`).

    Raises:
        TypeError: ``doc`` holds a value ``default`` cannot convert (nothing is written).
        OSError: the folder cannot be written.
    """
    text = json.dumps(doc, indent=indent, default=default) + "\n"
    atomic_write_text(path, text)


def files_sha256(files: Iterable[Path]) -> str:
    """sha256 (hex) over ``files`` in the given order: name + NUL + bytes per file, read in
    1 MiB blocks. Raises OSError when a file cannot be read."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()
