"""The result header and the atomic write of every result file, in one place.

Every result file (``benchmarks/results.json``, ``quality.json``, ``codec_bench.json``,
``adaptation.json``, the link and streaming checks) records the machine and software it
ran on under ``"environment"`` and is written atomically (a temporary file in the same
folder, fsync, ``os.replace``: a reader sees the old file or the new one, never half of
one). Each file keeps its documented keys (docs/results-schema.md): a command names the
fields it records, :func:`environment` computes them the one way.

Standard library only; torch and other packages are imported inside the functions that
report them (None where absent).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Optional

from common.machine import numerics

__all__ = ["utc_now", "git_commit", "cpu_name", "package_versions", "environment",
           "atomic_write", "atomic_write_json", "atomic_write_text", "json_default", "FIELDS"]

_REPO = Path(__file__).resolve().parent.parent


def utc_now() -> str:
    """Current UTC time as ISO-8601 with a trailing ``Z`` (seconds resolution)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def git_commit(repo: Path | None = None) -> str | None:
    """The repository's HEAD commit hash (40 hex digits), or None outside git / without
    commits / without git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo or _REPO,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo ``model name``; ``platform.processor()`` or
    "unknown" where that cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def package_versions(names: Iterable[str]) -> dict[str, str]:
    """{distribution name: installed version} of the installed ones among ``names``."""
    got = {}
    for name in names:
        try:
            got[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return got


def _version(module: str) -> Optional[str]:
    try:
        return getattr(__import__(module), "__version__", None)
    except Exception:  # noqa: BLE001 - a missing or broken package is "no version"
        return None


def _gpu() -> Optional[str]:
    try:
        import torch  # local import: writing a result file must not require torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - any torch problem just means "no GPU info"
        return None


def _torch_threads() -> Optional[int]:
    try:
        import torch

        return torch.get_num_threads()
    except Exception:  # noqa: BLE001
        return None


def _load_1m() -> Optional[float]:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


FIELDS: dict[str, Callable[[], Any]] = {
    "python": platform.python_version,         # e.g. "3.12.3"
    "platform": platform.platform,             # OS, kernel, libc
    "cpu": cpu_name,                           # CPU model name
    "num_cpus": os.cpu_count,                  # logical CPUs
    "cpu_count": os.cpu_count,                 # the same, as quality.json and gpu records spell it
    "gpu": _gpu,                               # CUDA device 0's name, None without one
    "torch": lambda: _version("torch"),
    "transformers": lambda: _version("transformers"),
    "numpy": lambda: _version("numpy"),
    "triton": lambda: _version("triton"),
    "numba": lambda: _version("numba"),
    "torch_threads": _torch_threads,           # torch's intra-op threads
    "git_commit": git_commit,                  # HEAD of this checkout, None outside git
    "load_avg_1m": _load_1m,                   # 1-minute load average when the header was made
    "load_avg_1m_at_start": _load_1m,          # the same, as adaptation.json spells it
    "date": lambda: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "numerics": numerics,                      # common.machine.numerics(): what sets bf16 results
}
"""The fields a header may record: name -> how it is computed (called once per header)."""


def environment(fields: Iterable[str], *, packages: Iterable[str] = (),
                **given: Any) -> dict[str, Any]:
    """The ``"environment"`` header of a result file: the named ``fields`` in that order.

    A field in ``given`` takes that value (e.g. ``link_method=``, or a command's own field);
    ``"packages"`` is :func:`package_versions` of ``packages``; any other name must be a key
    of :data:`FIELDS`. Raises KeyError on an unknown field (a programming error).
    """
    env: dict[str, Any] = {}
    for name in fields:
        if name in given:
            env[name] = given[name]
        elif name == "packages":
            env[name] = package_versions(packages)
        else:
            env[name] = FIELDS[name]()
    return env


def json_default(obj: Any) -> Any:
    """``json.dump``'s ``default``: numpy/torch scalars (``.item()``) and paths (str);
    TypeError otherwise."""
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def atomic_write(path: Path | str, write: Callable[[IO], Any], *, binary: bool = False,
                 keep_mode: bool = False) -> None:
    """Replace ``path`` atomically with what ``write(fh)`` writes to an open file: a
    temporary file in the same folder (made with its parents), fsync, ``os.replace``; the
    temporary file is removed on any error (``path`` is then unchanged). ``binary`` opens it
    "wb" (else "w", text). With ``keep_mode`` an existing file's permission bits are kept
    (else a new file's usual 0o666 & ~umask).

    Raises:
        OSError: the folder cannot be written; whatever ``write`` raises.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = None
    if keep_mode and path.exists():
        mode = path.stat().st_mode & 0o777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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


if __name__ == "__main__":  # pragma: no cover - a quick look at this machine's header
    json.dump(environment(("python", "platform", "cpu", "num_cpus", "git_commit")), sys.stdout, indent=1)
    print()
