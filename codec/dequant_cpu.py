"""Table decoders of the baselines and the inf/NaN count, on the CPU (numba): quant8's
gather / direct dequantization, fp8's byte lookup, KIVI's packed-code lookup, and
``count_nonfinite`` (used by codec.fused's ``all_finite``).

Separate from codec.rans_cpu (the rANS coder) because no entropy coding is involved: each
maps stored symbols or codes straight into a destination in the model dtype's bits. The
argument checks and dispatch are here, the kernels in codec/dequant_kernels.py. Every
function switches to the parallel build from ``codec.threads.PARALLEL_MIN_SYMBOLS``
elements up (both builds give identical results).

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_fused.py -q
"""
from __future__ import annotations

import numpy as np

from . import threads
from .dequant_kernels import (_copy_finite_par, _copy_finite_ser,
                              _dequant_direct_par, _dequant_direct_ser, _gather_par, _gather_ser,
                              _kivi_par, _kivi_ser, _lut8_par, _lut8_ser, _nonfinite_par,
                              _nonfinite_ser)
from .errors import CodecError
from .threads import run_kernel


def gather_into(sym: np.ndarray, out: np.ndarray, deq: np.ndarray, t_stride: int, hd: int,
                t_off: int = 0, parallel: bool | None = None) -> None:
    """Table dequantization of stored symbols (quant8) in one pass, both cores:
    ``out[l, t_off + t, c] = deq[l, t * t_stride + c // hd, sym[l, t, c]]``.

    Args: sym uint8 [L, T, C]; out, deq, t_stride, hd, t_off as `decode_streams_into`
      (deq [L, R, NS] of out's dtype, NS > sym.max()).
    Raises: CodecError if a symbol is outside the table; ValueError on bad arguments.
    """
    if not isinstance(sym, np.ndarray) or sym.dtype != np.uint8 or sym.ndim != 3:
        raise ValueError("sym must be uint8 [L, T, C]")
    sym = np.ascontiguousarray(sym)
    L, T, C = sym.shape
    if (not isinstance(out, np.ndarray) or out.ndim != 3 or out.shape[0] != L or out.shape[2] != C
            or not out.flags.c_contiguous or not out.flags.writeable or t_off + T > out.shape[1] or t_off < 0):
        raise ValueError(f"out must be a writable C-contiguous array [{L}, >= {t_off + T}, {C}]")
    if (not isinstance(deq, np.ndarray) or deq.ndim != 3 or deq.shape[0] != L or deq.dtype != out.dtype
            or not deq.flags.c_contiguous or t_stride < 0 or hd < 1
            or (T and deq.shape[1] <= (T - 1) * t_stride + (C - 1) // hd)):
        raise ValueError("deq must be a C-contiguous [L, R, NS] table of out's dtype covering the layout")
    if sym.size == 0:
        return
    if int(sym.max()) >= deq.shape[2]:
        raise CodecError(f"symbol {int(sym.max())} outside the dequantization table ({deq.shape[2]} entries)")
    par = (sym.size >= threads.PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    run_kernel(_gather_par, _gather_ser, par, sym, out, deq, int(t_stride), int(hd), int(t_off))


def lut8_into(codes: np.ndarray, tab: np.ndarray, flag: np.ndarray, out: np.ndarray,
              parallel: bool | None = None) -> int:
    """Byte-code table lookup in one pass, both cores (fp8 decode): out.flat[i] =
    tab[codes.flat[i]]. codes uint8 (any shape, C-contiguous), tab [256] of out's dtype,
    flag uint8 [256]; out C-contiguous with codes' size. Returns the number of codes c
    with flag[c] != 0."""
    c = np.ascontiguousarray(codes).reshape(-1)
    o = out.reshape(-1)
    if c.dtype != np.uint8 or tab.shape != (256,) or flag.shape != (256,) or o.size != c.size \
            or tab.dtype != out.dtype:
        raise ValueError("lut8_into: codes uint8, tab/flag [256], out of codes' size and tab's dtype")
    par = (c.size >= threads.PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    return int(run_kernel(_lut8_par, _lut8_ser, par, c, tab, flag.astype(np.int64), o))


def kivi_into(qb: np.ndarray, bits: int, tab: np.ndarray, strides: tuple, out: np.ndarray,
              nq: int, parallel: bool | None = None) -> None:
    """KIVI table dequantization in one pass, both cores (see ``_kivi_impl``); ``strides`` =
    (sL, sT, gt, sH, sD, gd, sQ) into the flat table ``tab`` (out's dtype); out [L, T, H,
    D] C-contiguous, tokens [0, nq) written. Callers check the table covers every index."""
    if bits not in (2, 4) or strides[5] < 1 or out.shape[3] % strides[5]:
        raise ValueError("kivi_into: bits must be 2 or 4 and the channel group must divide D")
    if tab.dtype != out.dtype or tab.ndim != 1 or out.ndim != 4 or not out.flags.c_contiguous:
        raise ValueError("kivi_into: flat table of out's dtype and a C-contiguous [L, T, H, D] out")
    n = out.shape[0] * nq * out.shape[2] * out.shape[3]
    if qb.dtype != np.uint8 or qb.size * (8 // bits) < n:
        raise ValueError("kivi_into: packed codes too short")
    par = (n >= threads.PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    run_kernel(_kivi_par, _kivi_ser, par, np.ascontiguousarray(qb), int(bits), tab,
               *[int(v) for v in strides], out, int(nq))


def dequant_direct_into(sym: np.ndarray, m: np.ndarray, step: np.ndarray, t_stride: int,
                        hd: int, t_off: int, big: float, dtype_name: str, out: np.ndarray,
                        parallel: bool | None = None) -> None:
    """quant8's decode without a table (see ``_dequant_direct_impl``): sym
    uint8 [L, T, C]; m float32 [L]; step float32 [L, R] (scale / M, computed by the
    caller exactly as codec.quantize.dequantize does); out the uint16 (bfloat16) or
    uint32 (float32) bits view [L, >= t_off + T, C]. fp16 has no direct path (use a
    table). Raises ValueError on bad arguments."""
    mode = {"bfloat16": 0, "float32": 1}.get(dtype_name)
    if mode is None or out.dtype != (np.uint16 if mode == 0 else np.uint32):
        raise ValueError(f"dequant_direct_into: bfloat16/float32 only, out of the bits dtype")
    L, T, C = sym.shape
    if (m.dtype != np.float32 or step.dtype != np.float32 or m.shape != (L,) or step.ndim != 2
            or step.shape[0] != L or (T and step.shape[1] <= (T - 1) * t_stride + (C - 1) // hd)
            or out.ndim != 3 or out.shape[0] != L or out.shape[2] != C or out.shape[1] < t_off + T
            or not out.flags.c_contiguous):
        raise ValueError("dequant_direct_into: inconsistent shapes")
    par = (sym.size >= threads.PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    run_kernel(_dequant_direct_par, _dequant_direct_ser, par, np.ascontiguousarray(sym), m,
               np.ascontiguousarray(step), int(t_stride), int(hd), int(t_off), np.float32(big),
               mode, out)


# exponent masks of the float formats: all ones = inf or NaN
_EXP_MASK = {"bfloat16": (np.uint16, 0x7F80), "float16": (np.uint16, 0x7C00),
             "float32": (np.uint32, 0x7F800000)}


def count_nonfinite(bits: np.ndarray, dtype_name: str, parallel: bool | None = None) -> int:
    """Number of inf/NaN elements of a float tensor given as its bit pattern (``bits``: the
    uint16 / uint32 view of a contiguous bf16 / fp16 / fp32 array, any shape): one pass,
    both cores, no temporary (replaces ``torch.isfinite(x).all()``)."""
    want, mask = _EXP_MASK[dtype_name]
    flat = np.ascontiguousarray(bits).reshape(-1)
    if flat.dtype != want:
        raise ValueError(f"bits of {dtype_name} must be {np.dtype(want)}, got {flat.dtype}")
    if flat.size == 0:
        return 0
    par = (flat.size >= threads.PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    mag = (1 << (8 * np.dtype(want).itemsize - 1)) - 1     # every bit but the sign
    return int(run_kernel(_nonfinite_par, _nonfinite_ser, par, flat, want(mask), want(mag)))


def copy_finite_into(src: np.ndarray, out: np.ndarray, dtype_name: str,
                     parallel: bool | None = None) -> int:
    """Copy a float tensor's bit pattern and count its inf/NaN elements in one pass, both
    cores (the raw codec's decode: a copy at memory speed, no separate check pass).

    Args: src: the uint16 (bf16/fp16) or uint32 (fp32) bits, any shape, C-contiguous
      (e.g. a read-only view of a container); out: a writable C-contiguous array of the
      same dtype and size; dtype_name: "bfloat16" | "float16" | "float32".
    Returns: the number of inf/NaN elements (``out`` holds the copy either way).
    Raises: ValueError on a dtype or size mismatch or a non-contiguous array."""
    want, mask = _EXP_MASK[dtype_name]
    if (not isinstance(src, np.ndarray) or not isinstance(out, np.ndarray) or src.dtype != want
            or out.dtype != want or src.size != out.size or not src.flags.c_contiguous
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"copy_finite_into: C-contiguous {np.dtype(want)} arrays of one size, out writable")
    if src.size == 0:
        return 0
    par = (src.size >= threads.PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    mag = (1 << (8 * np.dtype(want).itemsize - 1)) - 1     # every bit but the sign
    return int(run_kernel(_copy_finite_par, _copy_finite_ser, par, src.reshape(-1),
                          out.reshape(-1), want(mag), want(mask)))
