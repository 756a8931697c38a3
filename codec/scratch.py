"""Scratch buffers of the codec: one allocator, with a test mode that poisons them.

Purpose: every buffer the codec allocates without initialising it (``torch.empty`` /
``np.empty``: decode destinations, per-worker GEMM operands, symbol arrays) comes from
``empty`` / ``np_empty`` here, so that one switch can fill all of them with a value no
correct result depends on. A correct codec writes every element it later reads; a test
run with ``mode("nan")`` (float buffers filled with NaN, integer ones with all bits set)
must then give the same bytes and values as a run with ``mode("zero")``
(tests/codec/test_codec_scratch.py, every registered codec, level and dtype).

Why it exists: on an Intel Xeon with AMX, oneDNN's bf16 GEMM reads a row-major operand's
whole rows up to its leading dimension (row stride), not only its first K columns: a
column slice ``buf[:, :k]`` of an uninitialised buffer passed to ``torch.addmm`` let the
NaN/garbage in columns k.. into the sum (kvtc's bf16 decode returned NaN there; measured
with torch 2.13.0+cpu: 33 of 54 shapes wrong with the rest of the rows NaN, 0 of 54 with
a contiguous operand or zero padding, 0 of 54 under ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``;
float32 / float16 operands and column slices of the other operand were not affected).
The rule the codec keeps: every operand of a matmul-like op (mm, addmm, bmm, matmul,
einsum, linear, numpy ``@``) is either a contiguous tensor whose every element was
written, or a slice whose padding is defined (docs/codec.md section 8.4b).

The mode is process-wide (the codec's decode workers are threads), read at each call:
``mode()`` sets it (returns the previous one), ``poisoned(m)`` is a context manager, and
the environment variable ``CACHEGEN_SCRATCH`` (``nan`` | ``zero``) sets it for a whole
process (e.g. a test run) when ``mode()`` was never called. Nothing happens at import.
The default (no mode) is plain ``torch.empty`` / ``np.empty``: no cost.
Buffers allocated inside numba-compiled kernels (``np.empty`` in a jitted function,
``codec.entropy.rans_cpu`` / ``codec.quant.fused``) cannot call Python: they are filled completely by
the kernel before any read and reach no BLAS call.

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_scratch.py -q
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Optional

import numpy as np

__all__ = ["MODES", "empty", "np_empty", "mode", "current_mode", "poisoned"]

MODES = ("nan", "zero")
_LOCK = threading.Lock()
_MODE: Optional[str] = None
_SET = False          # mode() called: the environment variable is no longer read


def _check(m: Optional[str]) -> Optional[str]:
    if m is not None and m not in MODES:
        raise ValueError(f"scratch mode must be one of {MODES} or None, got {m!r}")
    return m


def current_mode() -> Optional[str]:
    """The mode in force: the last ``mode()`` value, else ``$CACHEGEN_SCRATCH`` (``nan`` /
    ``zero``; empty or unset = None). Raises ValueError for another value of the variable."""
    if _SET:
        return _MODE
    return _check(os.environ.get("CACHEGEN_SCRATCH") or None)


def mode(m: Optional[str]) -> Optional[str]:
    """Set the process-wide scratch mode (``"nan"``, ``"zero"`` or None = uninitialised,
    the default) and return the previous one. Raises ValueError for another value."""
    global _MODE, _SET
    _check(m)
    with _LOCK:
        prev = current_mode()
        _MODE, _SET = m, True
    return prev


@contextlib.contextmanager
def poisoned(m: Optional[str] = "nan") -> Iterator[None]:
    """``with poisoned("nan"): ...`` runs the block with scratch mode ``m`` and restores the
    previous mode afterwards (also on an exception)."""
    prev = mode(m)
    try:
        yield
    finally:
        mode(prev)


def _poison_torch(dtype):
    import torch

    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return -1 if dtype.is_signed else torch.iinfo(dtype).max    # all bits set


def empty(shape, dtype=None, device=None):
    """A torch tensor of ``shape`` and ``dtype`` (on ``device``; None = CPU) whose values the
    caller must write before reading: ``torch.empty`` by default; in mode "nan" filled with
    NaN (float dtypes) or all bits set (integer dtypes; True for bool), in mode "zero" with
    zeros. ``dtype`` None = float32. (torch is imported here: ``np_empty`` users, the numpy-only
    coder modules, do not import it.)"""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    m = current_mode()
    if m == "zero":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    if m == "nan":
        t.fill_(_poison_torch(dtype))
    return t


def np_empty(shape, dtype=np.float32) -> np.ndarray:
    """``np.empty(shape, dtype)`` under the same modes as ``empty`` (NaN for floats, all
    bits set for integers, zeros in mode "zero")."""
    m = current_mode()
    if m == "zero":
        return np.zeros(shape, dtype=dtype)
    a = np.empty(shape, dtype=dtype)
    if m == "nan":
        if a.dtype.kind in "fc":
            a.fill(np.nan)
        elif a.dtype.kind == "b":
            a.fill(True)
        else:
            a.fill(np.iinfo(a.dtype).max if a.dtype.kind == "u" else -1)   # all bits set
    return a
