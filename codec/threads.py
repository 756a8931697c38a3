"""Thread safety of the codec's numba kernels.

Purpose: the codec's CPU kernels are compiled twice by numba (``codec.rans_cpu``,
``codec.probability``): a ``parallel=True`` build and a serial build of the same source,
producing identical results. numba's "workqueue" threading layer (chosen by
``configure_threading_layer`` at the first parallel call, because OpenMP clashes with
torch's OpenMP runtime) is not reentrant:
two threads entering parallel kernels at once abort the whole process ("Numba
workqueue threading layer is terminating: Concurrent access has been detected"; numba
docs, "The Threading Layers", section "workqueue"). ``run_kernel`` makes every call
safe: the calling thread takes a process-wide lock without waiting and runs the parallel
build; if another thread holds the lock, it runs the serial build instead (compiled with
``nogil=True``, so threads still run side by side). The bytes and values are identical
either way, and a single-threaded caller always gets the parallel build (no slowdown).

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_threads.py -q
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

__all__ = ["PARALLEL_LOCK", "PARALLEL_MIN_SYMBOLS", "run_kernel", "configure_threading_layer"]

# Symbols (or elements) per call below which the codec's kernels use their serial build:
# waking the thread pool costs more than the work (codec.rans_cpu, codec.dequant_cpu).
PARALLEL_MIN_SYMBOLS = 1 << 18

# Held while a parallel numba kernel runs; at most one at a time per process.
PARALLEL_LOCK = threading.Lock()
_LAYER_SET = False


def configure_threading_layer() -> None:
    """Select numba's "workqueue" threading layer unless the user set
    ``NUMBA_THREADING_LAYER``. An explicit side effect, called by ``run_kernel`` before the
    first parallel kernel (numba picks its layer at the first parallel launch), never at
    import. Why: numba's default OpenMP layer clashes with torch's own OpenMP runtime in
    one process: after a parallel decode, every later torch op ran ~13x slower (HF
    forward of 128 tokens: 0.47 s -> 6.3 s; measured, docs/codec.md); numba's own
    "workqueue" layer has no such effect. Idempotent; a no-op without numba."""
    global _LAYER_SET
    if _LAYER_SET:
        return
    _LAYER_SET = True
    if "NUMBA_THREADING_LAYER" in os.environ:
        return
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is in requirements.txt
        return
    numba.config.THREADING_LAYER = "workqueue"


def run_kernel(parallel_fn: Callable, serial_fn: Callable, use_parallel: bool,
               *args: Any) -> Any:
    """Call ``parallel_fn(*args)`` if ``use_parallel`` and no other thread is inside a
    parallel kernel, else ``serial_fn(*args)`` (same results by construction: both are
    numba builds of one Python function). Exceptions propagate unchanged; the lock is
    always released."""
    if use_parallel and parallel_fn is not serial_fn and PARALLEL_LOCK.acquire(blocking=False):
        try:
            configure_threading_layer()
            return parallel_fn(*args)
        finally:
            PARALLEL_LOCK.release()
    return serial_fn(*args)
