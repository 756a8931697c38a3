"""The numba kernels of the CPU rANS coder (codec.entropy.rans_cpu): encode, compaction, decode
(dynamic scheduling over an atomic counter) and the decode tables, each compiled twice by
``codec.threads.dual_build`` (parallel and serial builds, numba cache=True). The table decoders of the
baselines (quant8, fp8, KIVI, the inf/NaN count) are codec/quant/tables.py's.

Purpose: the hot loops only; argument checks, layout and dispatch are codec.entropy.rans_cpu's
Python wrappers (`encode_streams`, `decode_streams_into`, ...), which are the public API.
Shapes and dtypes: see codec/entropy/rans_cpu.py's module docstring and each kernel's docstring.

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_entropy.py tests/codec/test_codec_fused.py -q
"""
from __future__ import annotations

import numpy as np

from ..threads import HAVE_NUMBA, dual_build, njit, prange

# ---------------------------------------------------------------------------------------
# numba kernels
#
# Every kernel is compiled twice from the same Python source: a `parallel=True` variant
# (prange over work items, both cores) for big chunks and a serial variant for small ones,
# where waking the thread pool would cost more than the work (tens of ms on a loaded
# 2-core machine). Work items bundle up to 4 streams of identical shape (4 consecutive
# full channel groups of the same kv/layer/token block) that are coded in lockstep, so
# the 4 independent rANS dependency chains overlap (instruction-level parallelism).
# ---------------------------------------------------------------------------------------
LANES = 4
LUT_SHIFT = 8  # decode: coarse table of 65536 >> 8 = 256 first-candidate symbols per model


if HAVE_NUMBA:

    @njit(inline="always")
    def _enc_step(x, p, f, cc, scratch):
        # one rANS encode step (section 2), branch-free renormalisation: the word is
        # always stored at p-1 and p only moves when the renormalisation happens
        big = x >= (f << 16)
        scratch[p - 1] = np.uint16(x & 0xFFFF)
        p -= np.int64(big)
        x = (x >> 16) if big else x
        # 32-bit division: on the CPU we measured (AMD EPYC, Zen 4) it beats a 64-bit
        # division and, with 4 interleaved lanes, also a multiply-by-reciprocal (-13%)
        q = np.int64(np.uint32(x) // np.uint32(f))
        return (q << 16) + (x - q * f) + cc, p

    @njit(inline="always")
    def _enc_flush(x, p, end, scratch, nwords, i):
        # the final state (2 words) below the stream's words; nwords[i] = its length
        scratch[p - 1] = np.uint16(x >> 16)
        scratch[p - 2] = np.uint16(x & 0xFFFF)
        nwords[i] = end - p + 2

    @njit(inline="always")
    def _item_coords(items, it, L, T, C, G, B):
        # work item `it` -> (first stream i0, lanes nl, channel group g, layer, kv, tokens
        # t0..t1): streams are numbered ((kv * L + layer) * n_groups + g) * n_blocks + b
        n_groups = (C + G - 1) // G
        n_blocks = (T + B - 1) // B
        i0 = items[it, 0]
        r = i0 // n_blocks
        t0 = (i0 % n_blocks) * B
        return (i0, items[it, 1], r % n_groups, (r // n_groups) % L, (r // n_groups) // L,
                t0, min(t0 + B, T))

    @njit(inline="always")
    def _dec_step(x, pos, words, lu, cu, pk_):
        slot = x & 0xFFFF
        s = np.int64(lu[slot >> 8])
        while cu[s + 1] <= slot:  # scan forward from the coarse table's candidate
            s += 1
        pk = pk_[s]
        x = (pk & 0xFFFF) * (x >> 16) + slot - (pk >> 16)
        small = x < 65536
        w = np.int64(words[pos])  # padded buffer: always readable (see decode_streams)
        x = ((x << 16) | w) if small else x
        pos += np.int64(small)
        return x, pos, s


def _encode_impl(sym_k, sym_v, freq_tab, cum_tab, model_index, G, B, items, scratch, scr_off, nwords, err):
    """Encode the streams of every work item into their own regions of `scratch`
    (uint16), writing words backwards from each region's end (the stack of section 2, so
    the region's tail is the stream in reading order); nwords[i] = words of stream i;
    err[i] = 6 if a symbol has zero frequency."""
    T = sym_k.shape[1]
    C = sym_k.shape[2]
    n_blocks = (T + B - 1) // B
    for it in prange(items.shape[0]):
        i0, nl, g, layer, kv, t0, t1 = _item_coords(items, it, sym_k.shape[0], T, C, G, B)
        sym = sym_k if kv == 0 else sym_v
        if nl == 4:
            e0 = scr_off[i0 + 1]
            e1 = scr_off[i0 + n_blocks + 1]
            e2 = scr_off[i0 + 2 * n_blocks + 1]
            e3 = scr_off[i0 + 3 * n_blocks + 1]
            p0, p1, p2, p3 = e0, e1, e2, e3
            x0 = np.int64(65536)
            x1 = np.int64(65536)
            x2 = np.int64(65536)
            x3 = np.int64(65536)
            bad = False
            for k in range(G - 1, -1, -1):
                c0 = g * G + k
                c1 = c0 + G
                c2 = c1 + G
                c3 = c2 + G
                f0r = freq_tab[model_index[kv, layer, c0]]
                f1r = freq_tab[model_index[kv, layer, c1]]
                f2r = freq_tab[model_index[kv, layer, c2]]
                f3r = freq_tab[model_index[kv, layer, c3]]
                u0r = cum_tab[model_index[kv, layer, c0]]
                u1r = cum_tab[model_index[kv, layer, c1]]
                u2r = cum_tab[model_index[kv, layer, c2]]
                u3r = cum_tab[model_index[kv, layer, c3]]
                for t in range(t1 - 1, t0 - 1, -1):
                    s0 = sym[layer, t, c0]
                    s1 = sym[layer, t, c1]
                    s2 = sym[layer, t, c2]
                    s3 = sym[layer, t, c3]
                    f0 = f0r[s0]
                    f1 = f1r[s1]
                    f2 = f2r[s2]
                    f3 = f3r[s3]
                    if f0 == 0 or f1 == 0 or f2 == 0 or f3 == 0:
                        bad = True
                        break
                    x0, p0 = _enc_step(x0, p0, f0, u0r[s0], scratch)
                    x1, p1 = _enc_step(x1, p1, f1, u1r[s1], scratch)
                    x2, p2 = _enc_step(x2, p2, f2, u2r[s2], scratch)
                    x3, p3 = _enc_step(x3, p3, f3, u3r[s3], scratch)
                if bad:
                    break
            if not bad:
                _enc_flush(x0, p0, e0, scratch, nwords, i0)
                _enc_flush(x1, p1, e1, scratch, nwords, i0 + n_blocks)
                _enc_flush(x2, p2, e2, scratch, nwords, i0 + 2 * n_blocks)
                _enc_flush(x3, p3, e3, scratch, nwords, i0 + 3 * n_blocks)
        else:
            c_lo = g * G
            c_hi = min(c_lo + G, C)
            end = scr_off[i0 + 1]
            p = end
            x = np.int64(65536)
            bad = False
            for c in range(c_hi - 1, c_lo - 1, -1):
                fr = freq_tab[model_index[kv, layer, c]]
                cu = cum_tab[model_index[kv, layer, c]]
                for t in range(t1 - 1, t0 - 1, -1):
                    s = sym[layer, t, c]
                    f = fr[s]
                    if f == 0:
                        bad = True
                        break
                    x, p = _enc_step(x, p, f, cu[s], scratch)
                if bad:
                    break
            if not bad:
                _enc_flush(x, p, end, scratch, nwords, i0)
        if bad:          # a symbol of zero frequency: the item's streams are not written
            err[i0] = 6


def _compact_impl(scratch, scr_off, nwords, out_off, out):
    """Copy each stream's words from the tail of its scratch region to `out`."""
    for i in prange(nwords.shape[0]):
        src = scr_off[i + 1] - nwords[i]
        dst = out_off[i]
        for j in range(nwords[i]):
            out[dst + j] = scratch[src + j]


def _decode_item_py(it, words, w_off, packed_tab, cum_tab, lut_tab, model_index, G, B, T, items,
                 out_k, out_v, deq_k, deq_v, t_stride, hd, t_off, err):
    """Decode work item `it` (see `_decode_impl`)."""
    C = out_k.shape[2]
    n_blocks = (T + B - 1) // B
    i0, nl, g, layer, kv, t0, t1 = _item_coords(items, it, out_k.shape[0], T, C, G, B)
    out = out_k[layer] if kv == 0 else out_v[layer]
    dq = deq_k[layer] if kv == 0 else deq_v[layer]
    if nl == 4:
        i1 = i0 + n_blocks
        i2 = i1 + n_blocks
        i3 = i2 + n_blocks
        q0 = w_off[i0]
        q1 = w_off[i1]
        q2 = w_off[i2]
        q3 = w_off[i3]
        x0 = np.int64(words[q0]) | (np.int64(words[q0 + 1]) << 16)
        x1 = np.int64(words[q1]) | (np.int64(words[q1 + 1]) << 16)
        x2 = np.int64(words[q2]) | (np.int64(words[q2 + 1]) << 16)
        x3 = np.int64(words[q3]) | (np.int64(words[q3 + 1]) << 16)
        if x0 < 65536 or x1 < 65536 or x2 < 65536 or x3 < 65536:
            err[i0] = 2 if x0 < 65536 else 0
            err[i1] = 2 if x1 < 65536 else 0
            err[i2] = 2 if x2 < 65536 else 0
            err[i3] = 2 if x3 < 65536 else 0
            return
        q0 += 2
        q1 += 2
        q2 += 2
        q3 += 2
        for k in range(G):
            c0 = g * G + k
            c1 = c0 + G
            c2 = c1 + G
            c3 = c2 + G
            m0 = model_index[kv, layer, c0]
            m1 = model_index[kv, layer, c1]
            m2 = model_index[kv, layer, c2]
            m3 = model_index[kv, layer, c3]
            l0r, u0r, k0r = lut_tab[m0], cum_tab[m0], packed_tab[m0]
            l1r, u1r, k1r = lut_tab[m1], cum_tab[m1], packed_tab[m1]
            l2r, u2r, k2r = lut_tab[m2], cum_tab[m2], packed_tab[m2]
            l3r, u3r, k3r = lut_tab[m3], cum_tab[m3], packed_tab[m3]
            h0 = c0 // hd
            h1 = c1 // hd
            h2 = c2 // hd
            h3 = c3 // hd
            for t in range(t0, t1):
                x0, q0, s0 = _dec_step(x0, q0, words, l0r, u0r, k0r)
                x1, q1, s1 = _dec_step(x1, q1, words, l1r, u1r, k1r)
                x2, q2, s2 = _dec_step(x2, q2, words, l2r, u2r, k2r)
                x3, q3, s3 = _dec_step(x3, q3, words, l3r, u3r, k3r)
                rt = t * t_stride
                ot = t + t_off
                out[ot, c0] = dq[rt + h0, s0]
                out[ot, c1] = dq[rt + h1, s1]
                out[ot, c2] = dq[rt + h2, s2]
                out[ot, c3] = dq[rt + h3, s3]
        err[i0] = 3 if q0 > w_off[i0 + 1] else (4 if x0 != 65536 else (5 if q0 != w_off[i0 + 1] else 0))
        err[i1] = 3 if q1 > w_off[i1 + 1] else (4 if x1 != 65536 else (5 if q1 != w_off[i1 + 1] else 0))
        err[i2] = 3 if q2 > w_off[i2 + 1] else (4 if x2 != 65536 else (5 if q2 != w_off[i2 + 1] else 0))
        err[i3] = 3 if q3 > w_off[i3 + 1] else (4 if x3 != 65536 else (5 if q3 != w_off[i3 + 1] else 0))
    else:
        c_lo = g * G
        c_hi = min(c_lo + G, C)
        pos = w_off[i0]
        end = w_off[i0 + 1]
        x = np.int64(words[pos]) | (np.int64(words[pos + 1]) << 16)
        pos += 2
        if x < 65536:
            err[i0] = 2
            return
        for c in range(c_lo, c_hi):
            m = model_index[kv, layer, c]
            lr, ur, kr = lut_tab[m], cum_tab[m], packed_tab[m]
            h = c // hd
            for t in range(t0, t1):
                x, pos, s = _dec_step(x, pos, words, lr, ur, kr)
                out[t + t_off, c] = dq[t * t_stride + h, s]
        err[i0] = 3 if pos > end else (4 if x != 65536 else (5 if pos != end else 0))


if HAVE_NUMBA:
    from numba.core import cgutils as _cgutils
    from numba.core import types as _nbtypes
    from numba.extending import intrinsic as _intrinsic

    @_intrinsic
    def _atomic_next(typingctx, counter):
        """Atomic fetch-and-add of 1 on counter[0] (a C-contiguous int64 array); returns
        the previous value. LLVM's atomicrmw (monotonic ordering suffices: the items'
        outputs are disjoint and the parallel region's end synchronizes)."""
        if not (isinstance(counter, _nbtypes.Array) and counter.dtype == _nbtypes.int64):
            return None

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            zero = context.get_constant(_nbtypes.intp, 0)
            ptr = _cgutils.get_item_pointer(context, builder, aryty, ary, [zero])
            one = context.get_constant(_nbtypes.int64, 1)
            return builder.atomic_rmw("add", ptr, one, "monotonic")

        return _nbtypes.int64(counter), codegen

    _decode_item = njit(cache=True, nogil=True)(_decode_item_py)


def _decode_impl(words, w_off, packed_tab, cum_tab, lut_tab, model_index, G, B, T, items,
                 out_k, out_v, deq_k, deq_v, t_stride, hd, t_off, err, counter, n_workers):
    """Decode the streams of every work item and write each symbol s of (kv, layer, t, c)
    as out[layer, t_off + t, c] = deq[layer, t * t_stride + c // hd, s] (out = out_k for
    kv 0, out_v for kv 1; deq likewise): with an identity table (deq[l, 0, s] = s,
    t_stride 0, hd = C) this is plain symbol decoding; with a table of dequantized values
    in the model dtype's bit pattern it is the fused decode + dequantize + cast of
    `decode_streams_into` (one pass, no intermediate tensor).

    `words` is the payload as uint16 followed by enough zero padding that the hot loop
    needs no bounds checks (a stream reads at most one word per symbol): a stream that
    reads past its end finishes with pos > its end and is reported as truncated; err[i]
    per stream (0 = ok).

    Scheduling: `n_workers` prange iterations each take the next work item
    from a shared atomic counter (`counter[0]`, starts at 0) until none is left, instead
    of numba's static split of the items into one contiguous share per thread. Inside
    vLLM's worker a decode thread shares its core with the scheduler process's spin loop
    and the stream receiver; with a static split the whole kernel waited for the slowed
    thread's share, with this one the other thread takes the remaining items. Every item
    writes its own outputs, so the result does not depend on the assignment.
    """
    n_items = items.shape[0]
    for w in prange(n_workers):
        while True:
            it = _atomic_next(counter)
            if it >= n_items:
                break
            _decode_item(it, words, w_off, packed_tab, cum_tab, lut_tab, model_index, G, B, T, items,
                         out_k, out_v, deq_k, deq_v, t_stride, hd, t_off, err)


encode_par, encode_ser = dual_build(_encode_impl)
compact_par, compact_ser = dual_build(_compact_impl)
decode_par, decode_ser = dual_build(_decode_impl)


def _lut_py(c, lut):
    """lut[m, j] = last s in [0, 255] with c[m, s] <= j << 8 (c int64 [n, 257] valid rows).
    (prange: models are independent; both cores for codebooks of LUT_PARALLEL_MODELS+.)"""
    for m in prange(c.shape[0]):
        s = 0
        for j in range(256):
            start = j << 8
            while s < 255 and c[m, s + 1] <= start:
                s += 1
            lut[m, j] = s


if HAVE_NUMBA:
    lut_par, lut_ser = dual_build(_lut_py)
else:  # pragma: no cover
    prange = range
    lut_par = lut_ser = _lut_py
