"""Thread safety of the codec's numba kernels.

Purpose: the codec's CPU kernels are compiled twice by numba (``codec.entropy.rans_cpu``,
``codec.entropy.models``): a ``parallel=True`` build and a serial build of the same source,
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

The numba availability helpers live here too: ``HAVE_NUMBA`` (with ``njit`` and ``prange``,
None without numba), ``dual_build`` (the parallel and serial builds of one kernel) and
``num_workers`` (numba's thread count).

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_threads.py -q
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

try:  # numba is a hard requirement for speed, but keep the references usable without it
    from numba import njit, prange

    # numba's threading layer is chosen at the first parallel kernel call, not here:
    # run_kernel calls configure_threading_layer() first (no import-time side effects).
    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is in requirements.txt
    HAVE_NUMBA = False
    njit = prange = None

__all__ = ["PARALLEL_LOCK", "PARALLEL_MIN_SYMBOLS", "run_kernel", "configure_threading_layer",
           "HAVE_NUMBA", "dual_build", "num_workers"]

# Symbols (or elements) per call below which the codec's kernels use their serial build:
# waking the thread pool costs more than the work (codec.entropy.rans_cpu, codec.quant.tables).
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


def dual_build(fn: Callable) -> tuple[Any, Any]:
    """(parallel, serial) numba compilations of `fn` (distinct cache entries, cache=True,
    nogil=True); (None, None) without numba."""
    if not HAVE_NUMBA:  # pragma: no cover
        return None, None
    import types

    par = njit(cache=True, nogil=True, parallel=True)(fn)
    ser_fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    ser_fn.__qualname__ = fn.__qualname__ + "_serial"
    ser = njit(cache=True, nogil=True)(ser_fn)
    return par, ser


def num_workers() -> int:
    """numba's current thread count (the parallel kernels' prange workers); 1 without numba.

    ``numba.get_num_threads()`` launches numba's thread pool, and with it numba picks its
    threading layer: the layer is configured first (``configure_threading_layer``), else
    numba takes OpenMP, which in a process that also runs torch resizes torch's own OpenMP
    team (measured in vLLM's CPU worker, one OpenMP thread bound to one core: a second
    OpenMP thread spun at that core's barrier and every forward ran ~10x slower)."""
    try:
        import numba

        configure_threading_layer()
        return max(1, int(numba.get_num_threads()))
    except Exception:  # noqa: BLE001 - no numba / pool not available: one worker
        return 1
