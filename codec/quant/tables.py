"""Table decoders of the baselines and the inf/NaN count, on the CPU (numba): quant8's
gather / direct dequantization, fp8's byte lookup, KIVI's packed-code lookup, and
``count_nonfinite`` (used by codec.quant.fused's ``all_finite``).

Separate from codec.entropy.rans_cpu (the rANS coder) because no entropy coding is
involved: each maps stored symbols or codes straight into a destination in the model
dtype's bits. The numba kernels come first, each compiled twice by
``codec.threads.dual_build`` (parallel and serial builds, numba cache=True); then the
Python wrappers (argument checks and dispatch), the public API. Every wrapper switches to
the parallel build from ``codec.threads.PARALLEL_MIN_SYMBOLS`` elements up (both builds
give identical results).

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_fused.py -q
"""
from __future__ import annotations

import numpy as np

from .. import threads
from ..errors import CodecError
from ..threads import dual_build, njit, prange, run_kernel



@njit(inline="always")
def _layer_token(lt, T):
    """(layer, token) of the flat index ``lt`` of an [L, T, ...] loop."""
    return lt // T, lt % T


def _gather_impl(sym, out, deq, t_stride, hd, t_off):
    """Dequantize stored symbols (no entropy coding: quant8) in one pass:
    out[l, t_off + t, c] = deq[l, t * t_stride + c // hd, sym[l, t, c]], parallel over
    (layer, token)."""
    L, T, C = sym.shape
    nr = (C + hd - 1) // hd
    for lt in prange(L * T):
        layer, t = _layer_token(lt, T)
        dq = deq[layer]
        rt = t * t_stride
        for r in range(nr):     # one table row per run of hd channels: no division per element
            row = dq[rt + r]
            lo = r * hd
            srun = sym[layer, t, lo:lo + hd]
            orun = out[layer, t + t_off, lo:lo + hd]
            for d in range(srun.shape[0]):
                orun[d] = row[srun[d]]


def _lut8_impl(codes, tab, flag, out):
    """out[i] = tab[codes[i]] over flat arrays; returns how many codes have flag[c] != 0
    (fp8: NaN codes)."""
    n = codes.shape[0]
    bad = 0
    for i in prange(n):
        c = codes[i]
        out[i] = tab[c]
        bad += flag[c]
    return bad


def _kivi_impl(qb, bits, tab, sL, sT, gt, sH, sD, gd, sQ, out, nq):
    """KIVI dequantization by table (codec.quant.fused.decode_kivi_cpu): element (l, t, h, d)
    of the packed codes (``bits`` in {2, 4} per code, little-endian in bytes, C order over
    [L, nq, H, D]) becomes tab[l*sL + (t//gt)*sT + h*sH + (d//gd)*sD + q*sQ], written to
    out[l, t, h, d]; parallel over (layer, token). gd must divide D."""
    L = out.shape[0]
    H = out.shape[2]
    D = out.shape[3]
    lsh = 2 if bits == 2 else 1          # log2(codes per byte)
    pmask = (1 << lsh) - 1
    mask = (1 << bits) - 1
    ng = D // gd
    for lt in prange(L * nq):
        layer = lt // nq
        t = lt % nq
        base = layer * sL + (t // gt) * sT
        i = (layer * nq + t) * H * D
        for h in range(H):
            bh = base + h * sH
            for gi in range(ng):
                bg = bh + gi * sD
                for dd in range(gd):
                    q = (np.int64(qb[i >> lsh]) >> ((i & pmask) * bits)) & mask
                    out[layer, t, h, gi * gd + dd] = tab[bg + q * sQ]
                    i += 1


def _dequant_direct_impl(sym, m, step, t_stride, hd, t_off, big, mode, out):
    """Direct dequantization of stored symbols (quant8) for bf16 / fp32 outputs, in one
    pass: x = (float32(s) - M[l]) * step[l, t * t_stride + c // hd] in float32 (the
    reference arithmetic of codec.quant.reference.dequantize), clamped to +-big (the dtype's
    finite range, as quantize.to_dtype_clamped), then mode 0: bf16 bits by round to
    nearest even ((b + 0x7FFF + ((b >> 16) & 1)) >> 16, torch's rule for finite values),
    written to out (uint16); mode 1: the float32 bits (out uint32). Parallel over blocks
    of (layer, token) rows with one float32 row buffer per block; inside a row one step
    per run of ``hd`` channels (no division per element) and the dtype's branch hoisted
    out of the element loops, so both loops vectorize."""
    L, T, C = sym.shape
    rows = L * T
    nblk = min(rows, 256)
    per = (rows + nblk - 1) // nblk
    nr = (C + hd - 1) // hd
    for blk in prange(nblk):
        buf = np.empty(C, np.float32)
        bb = buf.view(np.uint32)
        for lt in range(blk * per, min(rows, (blk + 1) * per)):
            layer, t = _layer_token(lt, T)
            mm = m[layer]
            rt = t * t_stride
            orow = out[layer, t + t_off]
            # 1-D views indexed from 0 in the element loops: 3-D indexing, or an index
            # with a run-time start, kept LLVM from vectorizing them (measured ~10x slower)
            for r in range(nr):
                st = step[layer, rt + r]
                lo = r * hd
                srun = sym[layer, t, lo:lo + hd]
                brun = buf[lo:lo + hd]
                for d in range(srun.shape[0]):
                    x = (np.float32(srun[d]) - mm) * st
                    x = min(x, big)
                    x = max(x, -big)
                    brun[d] = x
            if mode == 0:
                for c in range(C):
                    b = np.uint32(bb[c])
                    orow[c] = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            else:
                for c in range(C):
                    orow[c] = bb[c]


def _nonfinite_impl(bits, mask, mag):
    """Number of elements of a flat float bit-pattern array whose exponent field is all
    ones (inf or NaN): (bits & mask) == mask, i.e. the magnitude bits ``bits & mag`` (all
    but the sign) are >= mask; per block of 64K elements a max of the magnitudes (a
    reduction LLVM vectorizes), counted only in a block that has one; parallel over
    blocks."""
    n = bits.shape[0]
    nb = (n + 65535) // 65536
    bad = 0
    for blk in prange(nb):
        lo = blk * 65536
        hi = min(lo + 65536, n)
        top = bits[lo] & mag
        for i in range(lo, hi):
            m = bits[i] & mag
            top = m if m > top else top
        if top >= mask:
            c = 0
            for i in range(lo, hi):
                c += np.int64((bits[i] & mask) == mask)
            bad += c
    return bad


def _copy_finite_impl(src, dst, mag, limit):
    """dst[i] = src[i] over flat bit-pattern arrays of one dtype, and the number of
    elements that are inf or NaN: their magnitude bits ``src[i] & mag`` are ``>= limit``
    (the all-ones exponent; 0x7F80 for bf16, 0x7C00 fp16, 0x7F800000 fp32). The raw
    codec's decode at memory speed: per run of 8K elements (L1-resident after the first
    read) a max of the magnitudes (a reduction LLVM vectorizes), then a memcpy of the
    run; the count is taken only in a run that has one. Parallel over the runs.
    (A single loop copying and checking did not vectorize: src and dst may alias.)"""
    n = src.shape[0]
    nb = (n + 8191) // 8192
    bad = 0
    for blk in prange(nb):
        lo = blk * 8192
        run = src[lo:min(n, lo + 8192)]
        top = run[0] & mag
        for i in range(run.shape[0]):
            m = run[i] & mag
            top = m if m > top else top
        dst[lo:lo + run.shape[0]] = run
        c = 0
        if top >= limit:
            for i in range(run.shape[0]):
                c += np.int64((run[i] & mag) >= limit)
        bad += c
    return bad


_dequant_direct_par, _dequant_direct_ser = dual_build(_dequant_direct_impl)
_copy_finite_par, _copy_finite_ser = dual_build(_copy_finite_impl)
_nonfinite_par, _nonfinite_ser = dual_build(_nonfinite_impl)
_lut8_par, _lut8_ser = dual_build(_lut8_impl)
_kivi_par, _kivi_ser = dual_build(_kivi_impl)
_gather_par, _gather_ser = dual_build(_gather_impl)


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
    caller exactly as codec.quant.reference.dequantize does); out the uint16 (bfloat16) or
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
