"""How a benchmark run ends: signals unwind, a run registry, stale-run cleanup.

Every way a run ends must leave no process (vLLM's EngineCore/Worker, the store server,
redis-server, multiprocessing's resource tracker), shared memory (``/dev/shm/psm_*``),
temp folder (``cachegen-run-*``) or shaped-link namespace behind:

- normal end, error, SIGINT: the ``with`` blocks of ``harness.run`` unwind;
- SIGTERM, SIGHUP: :func:`install_signal_handlers` turns them into :class:`Terminated`
  (a ``SystemExit``), so they unwind the same way;
- the harness killed with SIGKILL (nothing of it runs): :class:`RunRegistry` keeps, in
  ``<cache>/runs/<pid>.json``, the run's temp folders, its descendant processes (pid +
  start time, so a reused pid is never killed) and the shared-memory segments they map; the
  next run's :func:`cleanup_stale_runs` removes what a dead run left and says so.

Run: used by ``python run_benchmarks.py``; ``python -m harness.lifecycle`` removes the
leftovers of dead runs now.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from cachegen_common.bounded_json import JsonBoundsError
from cachegen_common.bounded_json import parse as parse_bounded_json
from cachegen_common.files import atomic_write_json

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "psm_"  # multiprocessing.shared_memory's name prefix (vLLM's message queues)
TERM_GRACE_S = 3.0  # SIGTERM -> SIGKILL grace for a leftover process (vLLM exits in < 1 s)


class Terminated(SystemExit):
    """SIGTERM or SIGHUP received: raised in the main thread so every ``with`` unwinds.

    Exit status 128 + signal number, as a shell reports a signal death.
    """

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated by {signal.Signals(self.signum).name}"


def _raise_terminated(signum, _frame):
    # a second SIGTERM/SIGHUP during the unwinding must not cut the cleanup short
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise Terminated(signum)


def install_signal_handlers() -> None:
    """SIGTERM/SIGHUP -> :class:`Terminated` in the main thread (SIGINT stays
    KeyboardInterrupt). No-op outside the main thread."""
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_terminated)
    except ValueError:  # not the main thread
        pass


# ----------------------------------------------------------------------------- processes
def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (/proc/PID/stat field 22), None if
    gone or a zombie (exited, waiting to be reaped: nothing left to stop)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Pids of every live descendant of ``pid`` (children, grandchildren, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pp = _ppid(int(entry.name))
            if pp is not None:
                parents.setdefault(pp, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _same_process(rec: dict[str, Any]) -> bool:
    return proc_start_time(int(rec["pid"])) == rec.get("start_time")


def kill_processes(recs: list[dict[str, Any]], grace_s: float = TERM_GRACE_S) -> list[str]:
    """SIGTERM, then SIGKILL after ``grace_s`` seconds, every recorded process that is still
    the same process (pid and start time match). Returns descriptions of those killed."""
    live = [r for r in recs if _same_process(r)]
    for r in live:
        try:
            os.kill(int(r["pid"]), signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_same_process(r) for r in live):
        time.sleep(0.05)  # polling a process's exit, not standing in for a network
    for r in live:
        if _same_process(r):
            try:
                os.kill(int(r["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass
    return [f"process {r['pid']} ({r.get('cmd', '')[:60]})" for r in live]


def shm_mapped_by(pids: list[int]) -> set[str]:
    """Names of the ``/dev/shm/psm_*`` segments mapped by these processes (from
    /proc/PID/maps): the segments of this run only, never another run's."""
    out = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
            name = parts[5].strip().removesuffix(" (deleted)") if len(parts) == 6 else ""
            if name.startswith(f"{SHM_DIR}/{SHM_PREFIX}"):
                out.add(name.rsplit("/", 1)[1])
    return out


# ----------------------------------------------------------------------------- registry
def runs_dir(cache: Path | None = None) -> Path:
    """``<cache>/runs`` (cache: ``$CACHEGEN_CACHE`` or ``~/.cache/cachegen-harness``)."""
    root = cache or Path(os.environ.get("CACHEGEN_CACHE")
                         or Path.home() / ".cache" / "cachegen-harness")
    path = Path(root) / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path


class RunRegistry:
    """This run's record in ``<cache>/runs/<pid>.json``, as a context manager.

    Record what a killed run would leave with :meth:`add_dir` and :meth:`snapshot`
    (descendant processes, the ``psm_*`` segments they map); on exit the leftovers still present
    are removed and the record deleted.
    """

    def __init__(self, cache: Path | None = None):
        self.pid = os.getpid()
        self.path = runs_dir(cache) / f"{self.pid}.json"
        self.rec: dict[str, Any] = {"pid": self.pid, "start_time": proc_start_time(self.pid),
                                    "cmd": _cmdline(self.pid), "dirs": [], "processes": [],
                                    "shm": []}

    def __enter__(self) -> "RunRegistry":
        self._write()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self) -> None:
        atomic_write_json(self.path, self.rec, indent=None)

    def add_dir(self, path: str | os.PathLike) -> None:
        """Record a temp folder of this run (removed by the next run if this one is killed)."""
        self.rec["dirs"].append(str(path))
        self._write()

    def snapshot(self) -> None:
        """Record the current descendant processes and new shared-memory segments."""
        known = {r["pid"] for r in self.rec["processes"]}
        children = descendants(self.pid)
        for pid in children:
            st = proc_start_time(pid)
            if pid not in known and st is not None:
                self.rec["processes"].append({"pid": pid, "start_time": st, "cmd": _cmdline(pid)})
        self.rec["shm"] = sorted(set(self.rec["shm"]) | shm_mapped_by([self.pid, *children]))
        self._write()

    def close(self) -> list[str]:
        """Remove what is left of this run (processes it started, shm, folders) and the
        record. Returns descriptions of what had to be removed."""
        self.snapshot()
        # multiprocessing's resource tracker exits by itself when this process does (and
        # then unlinks what it tracks); a dead run's tracker is killed by the next run
        own = dict(self.rec, processes=[r for r in self.rec["processes"]
                                        if "resource_tracker" not in r.get("cmd", "")])
        removed = remove_leftovers(own, skip_pid=self.pid)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        return removed


def remove_leftovers(rec: dict[str, Any], skip_pid: int | None = None) -> list[str]:
    """Kill the recorded processes still alive, unlink the recorded shm segments, remove
    the recorded folders. Returns descriptions of what was removed."""
    procs = [r for r in rec.get("processes", []) if r.get("pid") != skip_pid]
    removed = kill_processes(procs)
    for name in rec.get("shm", []):
        try:
            (SHM_DIR / name).unlink()
            removed.append(f"shared memory {name}")
        except OSError:
            pass
    for d in rec.get("dirs", []):
        if os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(f"folder {d}")
    return removed


def cleanup_stale_runs(cache: Path | None = None, log=None) -> list[str]:
    """Remove the leftovers of runs whose harness process is gone (killed with SIGKILL,
    power loss), and their records. Logs one line per dead run through ``log``.

    Returns descriptions of what was removed.
    """
    out: list[str] = []
    for path in sorted(runs_dir(cache).glob("*.json")):
        try:
            rec = parse_bounded_json(path.read_bytes(), what=str(path), max_bytes=1 << 20, expect=dict)
        except (OSError, JsonBoundsError):   # not a record this harness wrote: dropped
            path.unlink(missing_ok=True)
            continue
        if rec.get("pid") == os.getpid() or _same_process(rec):
            continue  # a live run (or this one)
        removed = remove_leftovers(rec)
        path.unlink(missing_ok=True)
        if removed and log is not None:
            log(f"removed leftovers of a killed run (pid {rec.get('pid')}): {'; '.join(removed)}")
        out.extend(removed)
    return out


def main() -> int:
    """CLI: remove the leftovers of dead runs now; prints what was removed."""
    removed = cleanup_stale_runs(log=lambda m: print(m, file=sys.stderr))
    print(f"removed {len(removed)} leftover(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
