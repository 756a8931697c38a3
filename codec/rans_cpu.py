"""CPU rANS coder (numba) for many independent streams, plus a pure-Python reference.

Purpose: the arithmetic-coding stage of CacheGen (Liu et al., SIGCOMM 2024, section 5.2:
"arithmetic coding with a probability model per (layer, channel)") realised as the
32-bit-state / 16-bit-word rANS coder of docs/bitstream.md section 2, over the stream
layout of section 3. rANS itself: J. Duda, "Asymmetric numeral systems" (2013); coding
several independent streams in lockstep (interleaving) follows F. Giesen's ryg_rans.

Measured on this 2-core AMD EPYC (Zen 4) VM under heavy load from other jobs, real KV
symbols (30 layers x 1024 tokens x 192 channels x K/V, 2.4 bits/symbol), per CPU-second
of one core: encode ~300 Msym, decode ~375 Msym; constriction's RangeCoder on the same
symbols with ONE model: ~190 / ~50 (see `python -m bench.coder rans --npz ...`).

`decode_streams_into` is the same decoder writing, for each symbol, an entry of a
caller-given table (the dequantized value in the model dtype's bits) straight into a
destination (codec/fused.py, issue 14.2); `gather_into`, `lut8_into`, `kivi_into` are the
table decoders of the baselines quant8, fp8 and KIVI. `CPU_CODER` is this module as the
coder backend of codec/entropy.py; the constants and layout are codec/rans_spec.py's.

The numba kernels (`encode_streams`, `decode_streams`) run one work item (4 streams of
identical shape coded in lockstep, or 1 stream) at a time on every core (the encoder per
`prange` iteration; the decoder's workers take items from an atomic counter, so a thread
slowed by other work does not hold the others back; small chunks use a serial build) and must produce exactly the bytes of the pure-Python
reference (`rans_encode_ref`, `rans_decode_ref`, `encode_streams_ref`,
`decode_streams_ref`), which the Triton kernels (codec/triton_kernels.py) also match.

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_entropy*.py -q
Run the benchmark: nice -n 5 .venv/bin/python -m bench.coder rans   (Msym/s encode/decode)

Shapes and dtypes used throughout:
  sym_k, sym_v     uint8  [L, T, C]   symbols, sym < nbins of the model used
  cum              uint32 [n_models, 257]  cumulative frequencies (cum[m][nbins..256] = M)
  model_index      uint16 [2, L, C]   row of `cum` used by (kv, layer, channel)
  G, B             channels_per_stream, tokens_per_stream (B >= 1, G >= 1)
Stream i = ((kv * L + layer) * n_groups + g) * n_blocks + b, n_groups = ceil(C / G),
n_blocks = ceil(T / B); inside a stream symbols are channel-major (for c in group: for t
in block). Stream lengths are in bytes (always even, >= 4).
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from .errors import CodecError
from .scratch import np_empty
from .threads import run_kernel

try:  # numba is a hard requirement for speed, but keep the reference usable without it
    from numba import njit, prange

    # numba's threading layer is chosen at the first parallel kernel call, not here:
    # codec.threads.run_kernel calls codec.threads.configure_threading_layer() first
    # (no import-time side effects).
    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - numba is in requirements.txt
    HAVE_NUMBA = False

__all__ = [
    "PROB_BITS",
    "PROB_SCALE",
    "RANS_L",
    "ERR_MESSAGES",
    "stream_layout",
    "validate_cum_table",
    "rans_encode_ref",
    "rans_decode_ref",
    "encode_streams_ref",
    "decode_streams_ref",
    "encode_streams",
    "decode_streams",
    "decode_streams_into",
    "gather_into",
    "CPU_CODER",
]

# The coder's constants, error codes and stream layout are specified once, in
# codec.rans_spec (docs/bitstream.md sections 2-4); re-exported here for callers.
from .rans_spec import (ERR_FINAL, ERR_LEFTOVER, ERR_MESSAGES, ERR_OK, ERR_SHORT,  # noqa: E402,F401
                        ERR_STATE, ERR_SYMBOL, ERR_TRUNCATED, PROB_BITS, PROB_SCALE, RANS_L,
                        WORD_MASK as _MASK16, bad_stream_lengths, stream_layout,
                        stream_symbol_counts)

if sys.byteorder != "little":  # pragma: no cover - the numba kernels write native u16
    raise ImportError("codec.rans_cpu assumes a little-endian host")


# ---------------------------------------------------------------------------------------
# Layout helpers and validation
# ---------------------------------------------------------------------------------------
def validate_cum_table(cum: np.ndarray, nbins: np.ndarray | None = None) -> None:
    """Check a model table: uint32 [n_models, 257] with cum[:,0]=0, non-decreasing,
    cum[:,256]=M, and, when `nbins` (int [n_models]) is given, strictly increasing on
    [0, nbins] with cum[nbins:] == M. Raises CodecError otherwise."""
    if not isinstance(cum, np.ndarray) or cum.ndim != 2 or cum.shape[1] != 257 or cum.shape[0] < 1:
        raise CodecError(f"model table must be [n_models, 257], got {getattr(cum, 'shape', None)}")
    c = cum.astype(np.int64)
    if np.any(c[:, 0] != 0) or np.any(c[:, 256] != PROB_SCALE):
        raise CodecError("model table rows must start at 0 and end at 65536")
    d = np.diff(c, axis=1)
    if np.any(d < 0):
        raise CodecError("model table rows must be non-decreasing")
    if nbins is not None:
        nb = np.asarray(nbins, dtype=np.int64)
        if nb.shape != (c.shape[0],) or np.any(nb < 2) or np.any(nb > 256):
            raise CodecError("model nbins must be in [2, 256], one per model")
        j = np.arange(256)[None, :]
        inside = j < nb[:, None]
        if np.any(d[inside] < 1):
            raise CodecError("every symbol < nbins must have frequency >= 1")
        if np.any(d[~inside] != 0):
            raise CodecError("model table rows must be padded with 65536 past nbins")


# ---------------------------------------------------------------------------------------
# Pure-Python reference (the spec, literally). Slow: for tests and small shapes only.
# ---------------------------------------------------------------------------------------
def rans_encode_ref(symbols: Sequence[int], cum_rows: Sequence[Sequence[int]]) -> bytes:
    """Encode one stream (docs/bitstream.md section 2), literally as specified.

    Args:
      symbols: ints s_0..s_{n-1}.
      cum_rows: for each symbol i, the cumulative-frequency row (len >= s_i + 2) of its
        model, i.e. cum_rows[i][s] = cum[m_i][s].
    Returns: the stream bytes (4 + 2 * renorm_words).
    Raises: ValueError if a symbol has zero frequency.
    """
    stack: list[int] = []
    x = RANS_L
    for i in range(len(symbols) - 1, -1, -1):
        s = int(symbols[i])
        row = cum_rows[i]
        c = int(row[s])
        f = int(row[s + 1]) - c
        if f <= 0:
            raise ValueError(f"symbol {s} at position {i} has zero frequency in its model")
        x_max = f << 16  # ((L >> PROB_BITS) << 16) * f
        if x >= x_max:
            stack.append(x & _MASK16)
            x >>= 16
        x = ((x // f) << 16) + (x % f) + c
    stack.append(x >> 16)
    stack.append(x & _MASK16)
    out = bytearray()
    for w in reversed(stack):
        out += int(w).to_bytes(2, "little")
    return bytes(out)


def rans_decode_ref(stream: bytes, cum_rows: Sequence[Sequence[int]]) -> list[int]:
    """Decode one stream (docs/bitstream.md section 2), literally as specified.

    Args: stream bytes; cum_rows as for `rans_encode_ref` (one row per symbol to decode;
      rows must be valid models: cum[0] = 0, cum[nbins] = 65536, padded with 65536).
    Returns: the n decoded symbols.
    Raises: CodecError (truncated stream, x < L at start, final x != L, leftover bytes).
    """
    n_bytes = len(stream)
    if n_bytes < 4:
        raise CodecError(ERR_MESSAGES[ERR_SHORT])
    x = int.from_bytes(stream[0:4], "little")
    pos = 4
    if x < RANS_L:
        raise CodecError(ERR_MESSAGES[ERR_STATE])
    out = []
    for row in cum_rows:
        slot = x & _MASK16
        s = 0
        while int(row[s + 1]) <= slot:
            s += 1
        c = int(row[s])
        f = int(row[s + 1]) - c
        x = f * (x >> 16) + slot - c
        if x < RANS_L:
            if pos + 2 > n_bytes:
                raise CodecError(ERR_MESSAGES[ERR_TRUNCATED])
            x = (x << 16) | int.from_bytes(stream[pos : pos + 2], "little")
            pos += 2
        out.append(s)
    if x != RANS_L:
        raise CodecError(ERR_MESSAGES[ERR_FINAL])
    if pos != n_bytes:
        raise CodecError(ERR_MESSAGES[ERR_LEFTOVER])
    return out


def _iter_stream_positions(L: int, T: int, C: int, G: int, B: int):
    """Yield (kv, layer, [(t, c), ...]) per stream in section-3 order (reference only)."""
    n_groups, n_blocks, _ = stream_layout(L, T, C, G, B)
    for kv in range(2):
        for layer in range(L):
            for g in range(n_groups):
                for b in range(n_blocks):
                    pos = [
                        (t, c)
                        for c in range(g * G, min((g + 1) * G, C))
                        for t in range(b * B, min((b + 1) * B, T))
                    ]
                    yield kv, layer, pos


def encode_streams_ref(sym_k, sym_v, cum, model_index, G: int, B: int) -> tuple[bytes, np.ndarray]:
    """Reference for `encode_streams`: returns (payload bytes, lengths int64 [n_streams])."""
    sym = (np.asarray(sym_k), np.asarray(sym_v))
    L, T, C = sym[0].shape
    cum = np.asarray(cum)
    mi = np.asarray(model_index)
    parts, lengths = [], []
    for kv, layer, pos in _iter_stream_positions(L, T, C, G, B):
        syms = [int(sym[kv][layer, t, c]) for t, c in pos]
        rows = [cum[int(mi[kv, layer, c])].tolist() for t, c in pos]
        st = rans_encode_ref(syms, rows)
        parts.append(st)
        lengths.append(len(st))
    return b"".join(parts), np.asarray(lengths, dtype=np.int64)


def decode_streams_ref(payload: bytes, lengths, cum, model_index, L, T, C, G, B):
    """Reference for `decode_streams`: returns (sym_k, sym_v) uint8 [L, T, C]."""
    out = np.zeros((2, L, T, C), dtype=np.uint8)
    cum = np.asarray(cum)
    mi = np.asarray(model_index)
    off = 0
    lengths = [int(v) for v in lengths]
    for i, (kv, layer, pos) in enumerate(_iter_stream_positions(L, T, C, G, B)):
        st = payload[off : off + lengths[i]]
        off += lengths[i]
        rows = [cum[int(mi[kv, layer, c])].tolist() for t, c in pos]
        syms = rans_decode_ref(st, rows)
        for (t, c), s in zip(pos, syms):
            out[kv, layer, t, c] = s
    if off != len(payload):
        raise CodecError("stream lengths do not add up to the payload size")
    return out[0], out[1]


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
PARALLEL_MIN_SYMBOLS = 1 << 18  # below this, the serial kernels are used
LUT_SHIFT = 8  # decode: coarse table of 65536 >> 8 = 256 first-candidate symbols per model


def _dual(fn):
    """(parallel, serial) numba compilations of `fn` (distinct cache entries)."""
    if not HAVE_NUMBA:  # pragma: no cover
        return None, None
    import types

    par = njit(cache=True, nogil=True, parallel=True)(fn)
    ser_fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    ser_fn.__qualname__ = fn.__qualname__ + "_serial"
    ser = njit(cache=True, nogil=True)(ser_fn)
    return par, ser


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
    L = sym_k.shape[0]
    T = sym_k.shape[1]
    C = sym_k.shape[2]
    n_groups = (C + G - 1) // G
    n_blocks = (T + B - 1) // B
    for it in prange(items.shape[0]):
        i0 = items[it, 0]
        nl = items[it, 1]
        b = i0 % n_blocks
        r = i0 // n_blocks
        g = r % n_groups
        r = r // n_groups
        layer = r % L
        kv = r // L
        sym = sym_k if kv == 0 else sym_v
        t0 = b * B
        t1 = min(t0 + B, T)
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
            if bad:
                err[i0] = 6
                continue
            scratch[p0 - 1] = np.uint16(x0 >> 16)
            scratch[p0 - 2] = np.uint16(x0 & 0xFFFF)
            scratch[p1 - 1] = np.uint16(x1 >> 16)
            scratch[p1 - 2] = np.uint16(x1 & 0xFFFF)
            scratch[p2 - 1] = np.uint16(x2 >> 16)
            scratch[p2 - 2] = np.uint16(x2 & 0xFFFF)
            scratch[p3 - 1] = np.uint16(x3 >> 16)
            scratch[p3 - 2] = np.uint16(x3 & 0xFFFF)
            nwords[i0] = e0 - p0 + 2
            nwords[i0 + n_blocks] = e1 - p1 + 2
            nwords[i0 + 2 * n_blocks] = e2 - p2 + 2
            nwords[i0 + 3 * n_blocks] = e3 - p3 + 2
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
            if bad:
                err[i0] = 6
                continue
            scratch[p - 1] = np.uint16(x >> 16)
            scratch[p - 2] = np.uint16(x & 0xFFFF)
            nwords[i0] = end - p + 2


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
    L = out_k.shape[0]
    C = out_k.shape[2]
    n_groups = (C + G - 1) // G
    n_blocks = (T + B - 1) // B
    i0 = items[it, 0]
    nl = items[it, 1]
    b = i0 % n_blocks
    r = i0 // n_blocks
    g = r % n_groups
    r = r // n_groups
    layer = r % L
    kv = r // L
    out = out_k[layer] if kv == 0 else out_v[layer]
    dq = deq_k[layer] if kv == 0 else deq_v[layer]
    t0 = b * B
    t1 = min(t0 + B, T)
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

    Scheduling (issue 14): `n_workers` prange iterations each take the next work item
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


def _gather_impl(sym, out, deq, t_stride, hd, t_off):
    """Dequantize stored symbols (no entropy coding: quant8) in one pass:
    out[l, t_off + t, c] = deq[l, t * t_stride + c // hd, sym[l, t, c]], parallel over
    (layer, token)."""
    L = sym.shape[0]
    T = sym.shape[1]
    C = sym.shape[2]
    for lt in prange(L * T):
        layer = lt // T
        t = lt % T
        dq = deq[layer]
        rt = t * t_stride
        for c in range(C):
            out[layer, t + t_off, c] = dq[rt + c // hd, sym[layer, t, c]]


_encode_par, _encode_ser = _dual(_encode_impl)
_compact_par, _compact_ser = _dual(_compact_impl)
_decode_par, _decode_ser = _dual(_decode_impl)


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
    written to out (uint16); mode 1: the float32 bits (out uint32)."""
    L = sym.shape[0]
    T = sym.shape[1]
    C = sym.shape[2]
    for lt in prange(L * T):
        layer = lt // T
        t = lt % T
        buf = np.empty(C, np.float32)
        mm = m[layer]
        rt = t * t_stride
        for c in range(C):
            x = (np.float32(sym[layer, t, c]) - mm) * step[layer, rt + c // hd]
            if x > big:
                x = big
            elif x < -big:
                x = -big
            buf[c] = x
        bb = buf.view(np.uint32)
        for c in range(C):
            b = np.uint32(bb[c])
            if mode == 0:
                out[layer, t + t_off, c] = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            else:
                out[layer, t + t_off, c] = b


def _nonfinite_impl(bits, mask):
    """Number of elements of a flat float bit-pattern array whose exponent field is all
    ones (inf or NaN): (bits & mask) == mask; parallel over blocks of 64K elements."""
    n = bits.shape[0]
    nb = (n + 65535) // 65536
    bad = 0
    for blk in prange(nb):
        lo = blk * 65536
        hi = min(lo + 65536, n)
        c = 0
        for i in range(lo, hi):
            c += np.int64((bits[i] & mask) == mask)
        bad += c
    return bad


_dequant_direct_par, _dequant_direct_ser = _dual(_dequant_direct_impl)
_nonfinite_par, _nonfinite_ser = _dual(_nonfinite_impl)
_lut8_par, _lut8_ser = _dual(_lut8_impl)
_kivi_par, _kivi_ser = _dual(_kivi_impl)
_gather_par, _gather_ser = _dual(_gather_impl)


# ---------------------------------------------------------------------------------------
# Python wrappers
# ---------------------------------------------------------------------------------------
def _work_items(L: int, T: int, C: int, G: int, B: int) -> np.ndarray:
    """int64 [n_items, 2]: (first stream, lanes). Lanes are the streams of LANES
    consecutive FULL channel groups of one (kv, layer, token block) - stream ids
    i0, i0 + n_blocks, ...; everything else is a single-lane item."""
    n_groups, n_blocks, _ = stream_layout(L, T, C, G, B)
    n_full = C // G
    n_quads = n_full // LANES
    base = np.arange(2 * L, dtype=np.int64)[:, None] * (n_groups * n_blocks) + np.arange(n_blocks, dtype=np.int64)[None, :]
    base = base.reshape(-1)  # stream id of group 0 for each (kv, layer, block)
    quad_g = np.arange(n_quads, dtype=np.int64) * LANES
    single_g = np.arange(n_quads * LANES, n_groups, dtype=np.int64)
    quads = (base[:, None] + quad_g[None, :] * n_blocks).reshape(-1)
    singles = (base[:, None] + single_g[None, :] * n_blocks).reshape(-1)
    items = np_empty((quads.size + singles.size, 2), dtype=np.int64)
    items[: quads.size, 0] = quads
    items[: quads.size, 1] = LANES
    items[quads.size :, 0] = singles
    items[quads.size :, 1] = 1
    return items[np.argsort(items[:, 0], kind="stable")]


def _check_common(cum: np.ndarray, model_index: np.ndarray, L: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    cum = np.ascontiguousarray(cum, dtype=np.uint32)
    if cum.ndim != 2 or cum.shape[1] != 257 or cum.shape[0] < 1:
        raise CodecError(f"model table must be uint32 [n_models, 257], got {cum.shape}")
    mi = np.ascontiguousarray(model_index)
    if mi.shape != (2, L, C):
        raise CodecError(f"model index must be [2, {L}, {C}], got {mi.shape}")
    if mi.dtype.kind not in "ui":
        raise CodecError("model index must be an integer array")
    if mi.size and (int(mi.min()) < 0 or int(mi.max()) >= cum.shape[0]):
        raise CodecError("model index out of range of the model table")
    return cum, mi.astype(np.uint16, copy=False)


def encode_streams(
    sym_k: np.ndarray, sym_v: np.ndarray, cum: np.ndarray, model_index: np.ndarray, G: int, B: int,
    parallel: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Encode all streams of a chunk (docs/bitstream.md sections 2-3) with numba.

    Args:
      sym_k, sym_v: uint8 [L, T, C]; every symbol must have frequency >= 1 in its model.
      cum: uint32 [n_models, 257] (valid rows; see `validate_cum_table`).
      model_index: integer [2, L, C], values < n_models.
      G, B: channels_per_stream, tokens_per_stream (>= 1).
      parallel: force the parallel (True) or serial (False) kernel; None = by size.
    Returns: (payload uint8 [total_bytes], lengths int64 [n_streams] in bytes).
    Raises: ValueError on bad shapes or a zero-frequency symbol.
    Memory: one uint16 scratch of (total symbols + 2 * n_streams) words - the worst case
      (at most one renormalisation word per symbol plus the 2-word final state), so no
      stream can overflow its region - then a compaction pass into the output.
    """
    sym_k = np.ascontiguousarray(sym_k)
    sym_v = np.ascontiguousarray(sym_v)
    if sym_k.dtype != np.uint8 or sym_v.dtype != np.uint8:
        raise ValueError("symbols must be uint8")
    if sym_k.ndim != 3 or sym_k.shape != sym_v.shape:
        raise ValueError(f"sym_k and sym_v must both be [L, T, C], got {sym_k.shape} and {sym_v.shape}")
    L, T, C = sym_k.shape
    _, _, n_streams = stream_layout(L, T, C, G, B)
    try:
        cum, mi = _check_common(cum, model_index, L, C)
    except CodecError as e:
        raise ValueError(str(e)) from None
    cum64 = cum.astype(np.int64)
    freq = np.ascontiguousarray(cum64[:, 1:] - cum64[:, :-1])
    if np.any(freq < 0):
        raise ValueError("model table rows must be non-decreasing")
    counts = stream_symbol_counts(L, T, C, G, B)
    scr_off = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(counts + 2, out=scr_off[1:])
    scratch = np_empty(int(scr_off[-1]), dtype=np.uint16)
    nwords = np.zeros(n_streams, dtype=np.int64)
    err = np.zeros(n_streams, dtype=np.int64)
    items = _work_items(L, T, C, G, B)
    par = (2 * L * T * C >= PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    # run_kernel: thread-safe parallel/serial dispatch (codec.threads, issue 12.4)
    run_kernel(_encode_par, _encode_ser, par, sym_k, sym_v, freq, np.ascontiguousarray(cum64[:, :256]), mi, G, B, items, scratch, scr_off, nwords, err)
    if np.any(err):
        i = int(np.flatnonzero(err)[0])
        raise ValueError(f"stream {i}: {ERR_MESSAGES.get(int(err[i]), 'encode error')}")
    out_off = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(nwords, out=out_off[1:])
    out = np_empty(int(out_off[-1]), dtype=np.uint16)
    run_kernel(_compact_par, _compact_ser, par, scratch, scr_off, nwords, out_off, out)
    return out.view(np.uint8), nwords * 2


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
    _lut_par, _lut_ser = _dual(_lut_py)
else:  # pragma: no cover
    prange = range
    _lut_par = _lut_ser = _lut_py
LUT_PARALLEL_MODELS = 512  # models per chunk from which the decode tables use both cores


def build_decode_tables(cum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-model decode tables from a valid uint32 [n_models, 257] `cum`:
    packed int64 [n_models, 256] = freq | (cum << 16), and lut uint8 [n_models, 256]:
    lut[m][j] = the symbol s with cum[s] <= 256*j < cum[s+1] (first candidate for slots
    in [256*j, 256*j + 256); the decoder scans forward from it)."""
    c = np.ascontiguousarray(cum, dtype=np.int64)
    freq = c[:, 1:] - c[:, :-1]
    packed = freq | (c[:, :256] << 16)
    lut = np_empty((c.shape[0], 256), dtype=np.uint8)
    run_kernel(_lut_par, _lut_ser, c.shape[0] >= LUT_PARALLEL_MODELS, c, lut)
    return packed, lut


def decode_streams(
    payload, lengths, cum: np.ndarray, model_index: np.ndarray, L: int, T: int, C: int, G: int, B: int,
    parallel: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode all streams of a chunk with numba.

    Args:
      payload: bytes-like, the concatenated streams.
      lengths: integer [n_streams], bytes per stream (section-3 order).
      cum: uint32 [n_models, 257], VALID rows (call `validate_cum_table` first on
        untrusted tables); model_index [2, L, C]; L, T, C, G, B as in `encode_streams`.
      parallel: force the parallel (True) or serial (False) kernel; None = by size.
    Returns: (sym_k, sym_v), uint8 [L, T, C] each.
    Raises: CodecError on any inconsistency (lengths not adding up to the payload, odd or
      too-short or too-long streams, truncated/corrupt streams).
    """
    out_k = np_empty((L, T, C), dtype=np.uint8) if _dims_ok(L, T, C) else None
    out_v = np_empty((L, T, C), dtype=np.uint8) if out_k is not None else None
    ident = np.ascontiguousarray(np.broadcast_to(np.arange(256, dtype=np.uint8), (max(int(L), 1) if out_k is not None else 1, 1, 256)))
    decode_streams_into(payload, lengths, cum, model_index, L, T, C, G, B, out_k, out_v,
                        ident, ident, 0, C, 0, parallel=parallel)
    return out_k, out_v


def _num_workers() -> int:
    """numba's current thread count (the decode's prange workers)."""
    try:
        import numba

        return max(1, int(numba.get_num_threads()))
    except Exception:  # noqa: BLE001 - no numba / pool not available: one worker
        return 1


def _dims_ok(L, T, C) -> bool:
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in (L, T, C))


def max_symbols_of(cum: np.ndarray) -> np.ndarray:
    """int64 [n_models]: the largest symbol a valid model row can decode to (the last s
    with cum[s + 1] > cum[s])."""
    c = np.asarray(cum, dtype=np.int64)
    pos = np.diff(c, axis=1) > 0                                  # [n_models, 256]
    return 255 - np.argmax(pos[:, ::-1], axis=1)


def decode_streams_into(
    payload, lengths, cum: np.ndarray, model_index: np.ndarray, L: int, T: int, C: int, G: int, B: int,
    out_k: np.ndarray, out_v: np.ndarray, deq_k: np.ndarray, deq_v: np.ndarray,
    t_stride: int, hd: int, t_off: int = 0, parallel: bool | None = None,
) -> None:
    """Fused rANS decode + table dequantization of all streams of a chunk (numba, one
    pass, both cores): symbol s of (kv, layer, t, c) is written as
    ``out[layer, t_off + t, c] = deq[layer, t * t_stride + c // hd, s]``.

    Used by the cachegen decoder with ``deq`` = the dequantized values of every symbol for
    each scale row, already rounded to the model dtype and given as its bit pattern
    (uint16 for bf16/fp16, uint32 for fp32; computed by the reference torch arithmetic, so
    the result is bit-identical to decode -> dequantize -> cast), and ``out`` = a view of
    the destination tensor [L, T_out, C] (C = H * D). No full-size intermediate is made.

    Args:
      payload, lengths, cum, model_index, L, T, C, G, B: as `decode_streams`.
      out_k, out_v: C-contiguous writable arrays [L, T_out, C] of one dtype,
        T_out >= t_off + T (tokens [t_off, t_off + T) are written, the rest untouched).
      deq_k, deq_v: C-contiguous arrays [L, R, NS] of out's dtype; R > (T - 1) * t_stride
        + (C - 1) // hd; NS > the largest symbol any model used by that kv can decode.
      t_stride: table rows per token (0 = one row set for the whole chunk).
      hd: channels per scale row (head_dim for per-head scales, C for one row).
      t_off: first destination token.
    Raises: CodecError on corrupt input (as `decode_streams`, and a model whose alphabet
      exceeds the table); ValueError on inconsistent destination/table arguments.
    """
    try:
        n_groups, n_blocks, n_streams = stream_layout(L, T, C, G, B)
    except ValueError as e:
        raise CodecError(str(e)) from None
    L, T, C = int(L), int(T), int(C)
    cum, mi = _check_common(cum, model_index, L, C)
    for name, o in (("out_k", out_k), ("out_v", out_v)):
        if (not isinstance(o, np.ndarray) or o.ndim != 3 or o.shape[0] != L or o.shape[2] != C
                or not o.flags.c_contiguous or not o.flags.writeable):
            raise ValueError(f"{name} must be a writable C-contiguous array [{L}, T_out, {C}]")
    if out_k.dtype != out_v.dtype or out_k.shape != out_v.shape:
        raise ValueError("out_k and out_v must have one dtype and shape")
    t_stride, hd, t_off = int(t_stride), int(hd), int(t_off)
    if t_stride < 0 or hd < 1 or t_off < 0 or t_off + T > out_k.shape[1]:
        raise ValueError(f"bad t_stride={t_stride} / hd={hd} / t_off={t_off} for {out_k.shape[1]} tokens")
    msym = max_symbols_of(cum)
    for kv, (name, d) in enumerate((("deq_k", deq_k), ("deq_v", deq_v))):
        if (not isinstance(d, np.ndarray) or d.ndim != 3 or d.shape[0] != L or d.dtype != out_k.dtype
                or not d.flags.c_contiguous):
            raise ValueError(f"{name} must be a C-contiguous array [{L}, R, NS] of {out_k.dtype}")
        if d.shape[1] <= (T - 1) * t_stride + (C - 1) // hd:
            raise ValueError(f"{name} has {d.shape[1]} rows, the layout needs {(T - 1) * t_stride + (C - 1) // hd + 1}")
        if int(msym[mi[kv]].max()) >= d.shape[2]:
            raise CodecError(f"a model decodes symbol {int(msym[mi[kv]].max())} but {name} has {d.shape[2]}")
    lengths = np.asarray(lengths)
    if lengths.shape != (n_streams,) or lengths.dtype.kind not in "ui":
        raise CodecError(f"stream lengths must be an integer array of {n_streams} entries")
    lens = lengths.astype(np.int64)
    counts = stream_symbol_counts(L, T, C, G, B)
    badmask = bad_stream_lengths(lens, counts)
    if np.any(badmask):
        bad = int(np.flatnonzero(badmask)[0])
        raise CodecError(f"stream {bad}: invalid length {int(lens[bad])} bytes for {int(counts[bad])} symbols")
    try:
        buf = np.frombuffer(payload, dtype=np.uint8)
    except (TypeError, ValueError):
        raise CodecError("payload must be a bytes-like object") from None
    if int(lens.sum()) != buf.size:
        raise CodecError(f"stream lengths add up to {int(lens.sum())} bytes but the payload has {buf.size}")
    # zero padding so that unchecked reads stay inside the buffer: a stream starting at
    # word w reads indices < w + 2 + n_symbols <= len + max(n_symbols) + 2
    pad = int(counts.max()) + 4
    words = np.zeros(buf.size // 2 + pad, dtype=np.uint16)
    if buf.size:
        words[: buf.size // 2] = buf.view(np.uint16)
    w_off = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(lens // 2, out=w_off[1:])
    packed, lut = build_decode_tables(cum)
    err = np.zeros(n_streams, dtype=np.int64)
    items = _work_items(L, T, C, G, B)
    par = (2 * L * T * C >= PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    # run_kernel: thread-safe parallel/serial dispatch (codec.threads, issue 12.4)
    counter = np.zeros(1, dtype=np.int64)   # next work item (dynamic scheduling, `_decode_impl`)
    workers = _num_workers() if par else 1
    run_kernel(_decode_par, _decode_ser, par, words, w_off, packed, cum.astype(np.int64), lut, mi, G, B, T,
               items, out_k, out_v, deq_k, deq_v, t_stride, hd, t_off, err, counter, workers)
    if np.any(err):
        i = int(np.flatnonzero(err)[0])
        raise CodecError(f"stream {i} of {n_streams}: {ERR_MESSAGES.get(int(err[i]), 'decode error')}")


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
    par = (sym.size >= PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
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
    par = (c.size >= PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
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
    par = (n >= PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    run_kernel(_kivi_par, _kivi_ser, par, np.ascontiguousarray(qb), int(bits), tab,
               *[int(v) for v in strides], out, int(nq))


def dequant_direct_into(sym: np.ndarray, m: np.ndarray, step: np.ndarray, t_stride: int,
                        hd: int, t_off: int, big: float, dtype_name: str, out: np.ndarray,
                        parallel: bool | None = None) -> None:
    """quant8's decode without a table (issue 14.5; see ``_dequant_direct_impl``): sym
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
    par = (sym.size >= PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    run_kernel(_dequant_direct_par, _dequant_direct_ser, par, np.ascontiguousarray(sym), m,
               np.ascontiguousarray(step), int(t_stride), int(hd), int(t_off), np.float32(big),
               mode, out)


# exponent masks of the float formats: all ones = inf or NaN
_EXP_MASK = {"bfloat16": (np.uint16, 0x7F80), "float16": (np.uint16, 0x7C00),
             "float32": (np.uint32, 0x7F800000)}


def count_nonfinite(bits: np.ndarray, dtype_name: str, parallel: bool | None = None) -> int:
    """Number of inf/NaN elements of a float tensor given as its bit pattern (``bits``: the
    uint16 / uint32 view of a contiguous bf16 / fp16 / fp32 array, any shape): one pass,
    both cores, no temporary (replaces ``torch.isfinite(x).all()``, issue 14.6)."""
    want, mask = _EXP_MASK[dtype_name]
    flat = np.ascontiguousarray(bits).reshape(-1)
    if flat.dtype != want:
        raise ValueError(f"bits of {dtype_name} must be {np.dtype(want)}, got {flat.dtype}")
    if flat.size == 0:
        return 0
    par = (flat.size >= PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    return int(run_kernel(_nonfinite_par, _nonfinite_ser, par, flat, want(mask)))


class _CpuCoder:
    """The numba coder backend of ``codec.entropy`` (``entropy.CoderBackend``): numpy
    uint8 arrays in, host arrays out."""

    name = "cpu"

    @staticmethod
    def check_symbols(sym_k, sym_v):
        sym_k = np.asarray(sym_k)
        sym_v = np.asarray(sym_v)
        if sym_k.dtype != np.uint8 or sym_v.dtype != np.uint8:
            raise ValueError(f"symbols must be uint8, got {sym_k.dtype} and {sym_v.dtype}")
        if sym_k.ndim != 3 or sym_k.shape != sym_v.shape:
            raise ValueError(f"sym_k and sym_v must both be [L, T, C], got {sym_k.shape} and {sym_v.shape}")
        return sym_k, sym_v

    @staticmethod
    def histograms(sym):
        from .probability import histograms

        return histograms(sym)

    @staticmethod
    def encode_streams(sym_k, sym_v, cum, model_index, G, B):
        return encode_streams(sym_k, sym_v, cum, model_index, G, B)

    @staticmethod
    def decode_streams(payload, lengths, cum, model_index, L, T, C, G, B, **kw):
        return decode_streams(payload, lengths, cum, model_index, L, T, C, G, B, **kw)


CPU_CODER = _CpuCoder()
