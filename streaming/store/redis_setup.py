"""What a throw-away redis-server needs before it starts: the binary (find_redis_server,
redis_server_version, the install hint), its settings (parse_memory, EVICTION_POLICIES), a
free port, the parent-death signal for the child, and the removal of folders left by a
killed harness (cleanup_stale_dirs).

Apart from streaming.store.redis_server (the RedisServer process itself and its command line),
which re-exports every name here under its documented path. Not runnable.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from streaming.errors import StreamingError

INSTALL_HINT = "install with apt-get install redis-server, or run bash scripts/setup.sh"
EVICTION_POLICIES = (
    "noeviction",
    "allkeys-lru",
    "allkeys-lfu",
    "allkeys-random",
    "volatile-lru",
    "volatile-lfu",
    "volatile-random",
    "volatile-ttl",
)
_MEM_RE = re.compile(r"^\s*(\d+)\s*(b|k|kb|m|mb|g|gb)?\s*$", re.IGNORECASE)
_MEM_UNITS = {None: 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2,
              "g": 1000**3, "gb": 1024**3}  # Redis's own unit rules (k = 1000, kb = 1024)

class RedisServerError(StreamingError):
    """redis-server could not be started, did not answer PING, or could not be stopped."""


class RedisNotInstalledError(RedisServerError):
    """No redis-server executable on PATH."""


def find_redis_server() -> str | None:
    """Path of the redis-server executable, or None if it is not installed."""
    found = shutil.which("redis-server")
    if found:
        return found
    for cand in ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server"):
        if os.access(cand, os.X_OK):
            return cand
    return None


def redis_server_version() -> str | None:
    """Version string of the installed redis-server (e.g. "7.0.15"), None if absent."""
    exe = find_redis_server()
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"v=(\S+)", out)
    return m.group(1) if m else out.strip() or None


def parse_memory(value: int | str | None) -> int | None:
    """Bytes from an int or a Redis-style size ("4mb", "512kb", "1gb", "1000000").

    Raises ValueError for a negative, zero or malformed value.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"maxmemory must be bytes or a size like '64mb', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _MEM_RE.match(str(value))
        if not m:
            raise ValueError(f"maxmemory {value!r} is not a size like 65536, '512kb' or '64mb'")
        n = int(m.group(1)) * _MEM_UNITS[m.group(2).lower() if m.group(2) else None]
    if n <= 0:
        raise ValueError(f"maxmemory must be > 0 bytes, got {value!r}")
    return n


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pdeathsig_preexec():
    """preexec_fn giving the child PR_SET_PDEATHSIG(SIGTERM), or None where unsafe/unknown.

    The signal fires when the forking THREAD exits, so it is only set when starting from the
    main thread; libc is resolved here, in the parent, so the child only makes the call."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:  # runs in the child between fork and exec
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1

    return preexec


_DIR_PREFIX = "cg-redis-"


def cleanup_stale_dirs(tmp_root: str | os.PathLike | None = None) -> list[str]:
    """Remove data folders of RedisServers whose owning process is gone (SIGKILLed
    harness). Returns the removed paths."""
    root = Path(tmp_root or tempfile.gettempdir())
    removed = []
    for d in root.glob(_DIR_PREFIX + "*"):
        try:
            owner = int((d / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        try:
            os.kill(owner, 0)
            continue  # owner alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed
