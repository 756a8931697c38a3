"""The numba kernels of the table decoders of the quant8, fp8 and KIVI codecs (their Python
wrappers are codec.dequant_cpu): quant8 gather / direct dequantization, the fp8 byte
lookup, KIVI's packed-code lookup and the inf/NaN count, each compiled twice by
``codec.rans_kernels._dual`` (parallel and serial builds, numba cache=True).

Separate from codec.rans_kernels (the rANS coder's loops) because no entropy coding is
involved: they map stored symbols or codes to the model dtype's bit patterns.

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_fused.py -q
"""
from __future__ import annotations

import numpy as np

from .rans_kernels import _dual, njit, prange


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
    """KIVI dequantization by table (codec.fused.decode_kivi_cpu): element (l, t, h, d)
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
    reference arithmetic of codec.quantize.dequantize), clamped to +-big (the dtype's
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


_dequant_direct_par, _dequant_direct_ser = _dual(_dequant_direct_impl)
_copy_finite_par, _copy_finite_ser = _dual(_copy_finite_impl)
_nonfinite_par, _nonfinite_ser = _dual(_nonfinite_impl)
_lut8_par, _lut8_ser = _dual(_lut8_impl)
_kivi_par, _kivi_ser = _dual(_kivi_impl)
_gather_par, _gather_ser = _dual(_gather_impl)
