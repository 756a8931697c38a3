"""The result header of every result file, in one place (its atomic write: cachegen_common.files).

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
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from cachegen_common.machine import numerics

__all__ = ["utc_now", "git_commit", "cpu_name", "package_versions", "environment", "FIELDS"]

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
    "numerics": numerics,                      # cachegen_common.machine.numerics(): what sets bf16 results
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


if __name__ == "__main__":  # pragma: no cover - a quick look at this machine's header
    json.dump(environment(("python", "platform", "cpu", "num_cpus", "git_commit")), sys.stdout, indent=1)
    print()
