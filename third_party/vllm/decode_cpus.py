"""Where the CacheGen vLLM connector's load (receive + decode) runs: the CPUs it may use
(extra-config key ``decode_cpus``), a context manager widening the calling thread's CPU
affinity to them, and a probe of the cores and threads the decode gets (put in the load
record). No vLLM import. Not runnable by itself.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from codec.threads import num_workers


def decode_cpus(setting: Any = "all") -> set[int] | None:
    """CPUs the connector's load (receive + decode) may run on, from the extra-config key
    ``decode_cpus``: "all" (default: every CPU of the machine, as the kernel's cpuset
    allows), "inherit" (keep the worker's binding: None), or a list of CPU ids.

    Why (measured): vLLM's CPU worker binds itself to the cores left after the
    scheduler's reserved one (ENGINE_ENV reserves 1 of this machine's 2, so the worker runs
    on {0}), and every thread it starts inherits that, so the decode got ONE core inside
    the engine although the engine does nothing else while it waits for the load (the
    scheduler process waits on the worker's step, in a sched_yield spin loop: the second
    core is shared with it). Raises ValueError on a bad setting."""
    if setting in (None, "all"):
        n = os.cpu_count() or 1
        return set(range(n))
    if setting == "inherit":
        return None
    if (isinstance(setting, (list, tuple)) and setting
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in setting)):
        return set(setting)
    raise ValueError(f'decode_cpus must be "all", "inherit" or a list of CPU ids, got {setting!r}')


class DecodeAffinity:
    """Context manager: widen the CALLING thread's CPU affinity to ``cpus`` (Linux
    sched_setaffinity on pid 0 = this thread) and restore it on exit. Threads started
    inside (the stream receiver, numba's pool when it is launched here) inherit the wide
    set; the forward pass later runs on the worker's own binding again. A no-op where
    affinity is not supported or ``cpus`` is None / already allowed."""

    def __init__(self, cpus: set[int] | None):
        self._cpus = cpus
        self._old: set[int] | None = None

    def __enter__(self):
        if not self._cpus or not hasattr(os, "sched_setaffinity"):
            return self
        try:
            old = os.sched_getaffinity(0)
            if not self._cpus <= old:
                os.sched_setaffinity(0, self._cpus | old)
                self._old = old
        except (OSError, ValueError):   # e.g. CPU ids outside the machine / cpuset
            self._old = None
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            try:
                os.sched_setaffinity(0, self._old)
            except OSError:
                pass
            self._old = None
        return False


def thread_probe() -> dict[str, Any]:
    """Cores and threads the decode gets in this (worker) process: the CPU
    affinity the worker's threads inherit, torch's and numba's thread counts."""
    import sys

    out: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    try:
        out["affinity"] = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        out["affinity"] = None
    try:   # every thread of the process by its allowed CPUs (numba's pool included)
        census: dict[str, int] = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        key = line.split(":", 1)[1].strip()
                        census[key] = census.get(key, 0) + 1
                        break
        out["threads_by_cpus"] = census
    except OSError:
        out["threads_by_cpus"] = None
    nb = sys.modules.get("numba")
    if nb is not None:
        # through codec.threads: numba's own get_num_threads would launch its pool with
        # the OpenMP layer if no kernel has chosen the layer yet
        out["numba_threads"] = num_workers()
        try:
            out["numba_layer"] = nb.threading_layer()
        except ValueError:   # no parallel kernel has run yet in this process
            out["numba_layer"] = None
    return out
