"""Probability models for the entropy coder: per-(layer, channel) histograms, a per-chunk
codebook of 16-bit frequency tables, and its compact serialisation.

Purpose: CacheGen codes each (layer, channel) with its own distribution over the tokens
of a chunk (Liu et al., SIGCOMM 2024, section 5.2). Storing one 16-bit CDF per (layer,
channel) as LMCache does costs ~13% of the output at 256 tokens; instead we cluster the
per-(kv, layer, channel) histograms of each distinct `nbins` into K centroid
distributions (K-means under cross-entropy, i.e. the KL-divergence "Bregman" K-means
of Banerjee et al., JMLR 2005, with a deterministic farthest-point initialisation) and
store K frequency tables + one small index per (kv, layer, channel). K is chosen per
`nbins` group among {1, 4, 16, ..., 2048} (capped by the number of models) to minimise
the group's description length: payload + codebook + index bits (Rissanen's minimum
description length principle), unless that leaves the cross-entropy more than
XENT_TARGET over the empirical entropy and a larger K meets it within MDL_SLACK bytes.
The codebook is sent compactly (format version 4, issue 14.7): each table as codes
q = round(64 * sqrt(p)) (w = q^2, normalised to 16 bits) over its nonzero range (first
symbol and span), Rice-coded (R. F. Rice, JPL 79-22, 1979) as zigzag deltas along the
range; the indices Rice-coded with tables numbered by decreasing use. Versions 3 (no
ranges) and 2 (16-bit tables) are still read. See docs/bitstream.md 4.3.

Everything here is deterministic for a given input (fixed initialisation, fixed number
of iterations, lowest-index tie-breaking, integer-only frequency normalisation).

Run: imported by codec/entropy.py; tests: .venv/bin/python -m pytest tests/codec/test_codec_entropy.py tests/codec/test_codec_tables.py -q
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import CodecError
from .scratch import np_empty
from .threads import run_kernel

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover
    njit = None

__all__ = [
    "PROB_SCALE",
    "K_LADDER",
    "normalize_freqs",
    "histograms",
    "ModelSet",
    "build_models",
    "serialize_models",
    "deserialize_models",
    "entropy_bits_of_counts",
]

def _numba_or_py_early(fn):
    return njit(cache=True, nogil=True)(fn) if njit is not None else fn


from .rans_spec import PROB_SCALE  # noqa: E402  (M, defined once: codec/rans_spec.py)
K_LADDER = (1, 4, 16, 64, 256, 512, 768, 1024, 1536, 2048)  # candidate codebook sizes per nbins group
SPARSE_SEED_DENSITY = 0.15  # nonzero share below which _seed_kernel sums sparsely (same results, faster)
LLOYD_ITERS = 3  # fixed K-means iterations: 3 is within 0.05% of 6 on real KV at half the time
# Codebook size (docs/bitstream.md 4.3, informative): K minimises the group's description
# length (MDL); where that K leaves the cross-entropy more than XENT_TARGET above the
# group's empirical entropy, the smallest-description K that meets XENT_TARGET is taken
# instead among those that cost at most MDL_SLACK more bytes than the minimum (if none
# does, the one of lowest cross-entropy among them; issue 14.7: the payload <= 1% over
# the empirical entropy; a measured trade, docs/bitstream.md 4.3).
# MDL_SLACK = 0 gives the pure minimum-description-length choice.
XENT_TARGET = 0.008
MDL_SLACK = 0.0015
MAX_K = 4096  # tables per nbins group a decoder accepts
MAX_MODELS = 65535  # n_models: the coder's model index is uint16
TABLE_Q = 64  # table code q[s] = round(TABLE_Q * sqrt(p[s])) in [0, TABLE_QMAX]; weight q^2
#               (encoder-side only: the decoder needs q, not TABLE_Q; 64 beat 128 in the
#               description length of every level on real KV, docs/bitstream.md 4.3)
TABLE_QMAX = 255
RICE_MAX_K = 15  # Rice parameter of a group's table codes, in [0, RICE_MAX_K]


# ---------------------------------------------------------------------------------------
# 16-bit normalisation
# ---------------------------------------------------------------------------------------
def normalize_freqs(counts: np.ndarray) -> np.ndarray:
    """Quantize counts to 16-bit frequencies, row-wise, integer arithmetic only.

    Args: counts: integer array [..., nbins] (>= 0), nbins in [2, 65536].
    Returns: int64 array of the same shape with every entry >= 1 and each row summing
      to exactly 65536: f = 1 + floor(count * (M - nbins) / total), then the remaining
      r < nbins units go one each to the r entries with the largest remainders (ties to
      the lower symbol). An all-zero row becomes (nearly) uniform.
    Raises: ValueError on negative counts or nbins out of range.
    """
    c = np.asarray(counts)
    if c.dtype.kind not in "ui":
        raise ValueError("counts must be integers")
    c = c.astype(np.int64)
    nb = c.shape[-1]
    if nb < 2 or nb > PROB_SCALE:
        raise ValueError(f"nbins must be in [2, 65536], got {nb}")
    if np.any(c < 0):
        raise ValueError("counts must be >= 0")
    flat = np.ascontiguousarray(c.reshape(-1, nb))
    if np.any(flat.sum(axis=1) > (1 << 46)):  # keep count * (M - nb) inside int64
        raise ValueError("counts too large to normalise")
    out = np_empty(flat.shape, flat.dtype)
    _normalize_rows(flat, out)
    return out.reshape(c.shape)


def _normalize_rows_py(c, out):
    """Row-wise 16-bit normalisation (see normalize_freqs); c, out int64 [m, nb]."""
    m, nb = c.shape
    spare = 65536 - nb
    rem = np.empty(nb, np.int64)
    idx = np.empty(nb, np.int64)
    for i in range(m):
        total = 0
        for s in range(nb):
            total += c[i, s]
        allzero = total == 0
        if allzero:
            total = nb
        fsum = 0
        for s in range(nb):
            num = (1 if allzero else c[i, s]) * spare
            q = num // total
            out[i, s] = 1 + q
            rem[s] = num - q * total
            fsum += 1 + q
        r = 65536 - fsum  # in [0, nb)
        if r > 0:
            # the r largest remainders, ties to the lower symbol (what a stable sort of
            # -rem gives): only symbols with a count have rem > 0, so insertion-sort those
            # (no allocation per row), then take rem == 0 symbols in ascending order
            n = 0
            for s in range(nb):
                v = rem[s]
                if v > 0:
                    j = n
                    while j > 0 and rem[idx[j - 1]] < v:
                        idx[j] = idx[j - 1]
                        j -= 1
                    idx[j] = s
                    n += 1
            j = 0
            while j < r and j < n:
                out[i, idx[j]] += 1
                j += 1
            need = r - n
            s = 0
            while need > 0 and s < nb:
                if rem[s] == 0:
                    out[i, s] += 1
                    need -= 1
                s += 1


_normalize_rows = njit(cache=True, nogil=True)(_normalize_rows_py) if njit is not None else _normalize_rows_py


def entropy_bits_of_counts(counts: np.ndarray) -> float:
    """Sum over rows of (row total * empirical entropy of the row), in bits."""
    c = np.asarray(counts, dtype=np.float64).reshape(-1, np.shape(counts)[-1])
    tot = c.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.where(c > 0, np.log2(np.where(c > 0, c, 1.0) / np.where(tot > 0, tot, 1.0)), 0.0)
    return float(-(c * lg).sum())


# ---------------------------------------------------------------------------------------
# Compact model tables: square-root-domain codes (docs/bitstream.md section 4.3)
# ---------------------------------------------------------------------------------------
def table_codes(counts: np.ndarray) -> np.ndarray:
    """Table codes of count rows: q[s] = round(TABLE_Q * sqrt(count[s] / total)).

    Quantizing sqrt(p) uniformly spreads the coding loss evenly over the symbols (the
    loss of a probability error dp is ~dp^2 / p, and d(sqrt p) ~ dp / sqrt p); at
    TABLE_Q = 64 it costs 0.02-0.05% of the payload on real KV (0.01% at 128) and saves
    ~1 bit per code (docs/bitstream.md 4.3).
    Args: counts int [K, nbins] (>= 0). Returns: int64 [K, nbins] in [0, TABLE_Q]
      (an all-zero row gives all zeros, which decodes as uniform).
    """
    c = np.asarray(counts, dtype=np.float64)
    tot = c.sum(axis=1, keepdims=True)
    p = c / np.where(tot > 0, tot, 1.0)
    return np.rint(np.sqrt(p) * TABLE_Q).astype(np.int64)


def freqs_from_codes(q: np.ndarray) -> np.ndarray:
    """16-bit frequency tables of table codes: normalize_freqs(q * q) (integers only).
    Args: q int [K, nbins] in [0, TABLE_QMAX]. Returns: int64 [K, nbins], rows sum to M."""
    q = np.asarray(q, dtype=np.int64)
    return normalize_freqs(q * q)


def _zigzag_deltas(q: np.ndarray) -> np.ndarray:
    """Per row: d[s] = q[s] - q[s-1] (q[-1] = 0), zigzag-mapped to >= 0 (0,-1,1,-2 -> 0,1,2,3)."""
    d = np.diff(q, axis=1, prepend=0)
    return np.where(d >= 0, 2 * d, -2 * d - 1).reshape(-1)


def rice_cost(q: np.ndarray) -> tuple[int, int]:
    """(bits, k): the smallest Rice-coded size of the tables' zigzag deltas, k in
    [0, RICE_MAX_K] (lowest k on ties)."""
    zz = _zigzag_deltas(np.asarray(q, dtype=np.int64))
    best = None
    for k in range(RICE_MAX_K + 1):
        bits = int(((zz >> k) + 1 + k).sum())
        if best is None or bits < best[0]:
            best = (bits, k)
    return best


def index_cost(local: np.ndarray) -> tuple[int, int]:
    """(bits, k): the smallest Rice-coded size of model indices (int, >= 0), k in
    [0, RICE_MAX_K] (lowest k on ties). Tables are numbered by decreasing use, so small
    indices are the frequent ones."""
    v = np.asarray(local, dtype=np.int64).reshape(-1)
    best = None
    for k in range(RICE_MAX_K + 1):
        bits = int(((v >> k) + 1 + k).sum())
        if best is None or bits < best[0]:
            best = (bits, k)
    return best


@_numba_or_py_early
def _rice_write_plain(v, k, out, pos):
    """Append the Rice codes (parameter k) of v int64 [n] >= 0 at bit pos of out (zeroed
    uint8, MSB first); returns the new bit position."""
    for i in range(v.shape[0]):
        x = v[i]
        for _ in range(x >> k):
            out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
            pos += 1
        pos += 1
        for j in range(k - 1, -1, -1):
            if (x >> j) & 1:
                out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
            pos += 1
    return pos


@_numba_or_py_early
def _bits_read(buf, pos, w):
    """Read w bits (MSB first) of the bit buffer buf at bit pos (the caller checked that
    they exist); returns (value, new bit position)."""
    v = 0
    for _ in range(w):
        v = (v << 1) | ((buf[pos >> 3] >> (7 - (pos & 7))) & 1)
        pos += 1
    return v, pos


@_numba_or_py_early
def _rice_one(buf, pos, nbits, k, umax):
    """Read one Rice code (unary quotient of 1-bits ended by a 0, then k remainder bits,
    MSB first; the inverse of _rice_write) from bit pos of buf (nbits bits). Returns
    (value, new bit position), the position -1 when the buffer ends early or the quotient
    exceeds umax."""
    u = 0
    while True:
        if pos >= nbits:
            return 0, -1
        b = (buf[pos >> 3] >> (7 - (pos & 7))) & 1
        pos += 1
        if b == 0:
            break
        u += 1
        if u > umax:
            return 0, -1
    if pos + k > nbits:
        return 0, -1
    r, pos = _bits_read(buf, pos, k)
    return (u << k) | r, pos


@_numba_or_py_early
def _rice_read_plain(buf, pos, n, k, vmax, out):
    """Read n Rice codes (parameter k) with values in [0, vmax] from bit pos of buf into
    out int64 [n]; returns the new bit position or -1 (buffer ends early, value > vmax)."""
    nbits = buf.shape[0] * 8
    umax = vmax >> k
    for i in range(n):
        x, pos = _rice_one(buf, pos, nbits, k, umax)
        if pos < 0 or x > vmax:
            return -1
        out[i] = x
    return pos


@_numba_or_py_early
def _rice_write(zz, k, out, pos):
    """Append Rice codes (unary quotient of 1-bits ended by a 0, then k remainder bits,
    MSB first) of zz int64 [n] to the zeroed bit buffer out uint8 at bit pos; returns
    the new bit position."""
    for i in range(zz.shape[0]):
        v = zz[i]
        u = v >> k
        for _ in range(u):
            out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
            pos += 1
        pos += 1  # the terminating 0
        for j in range(k - 1, -1, -1):
            if (v >> j) & 1:
                out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
            pos += 1
    return pos


@_numba_or_py_early
def _rice_read(buf, pos, n, nb, k, qmax, out):
    """Decode n table codes (rows of nb) from the bit buffer buf starting at bit pos into
    out int64 [n]. Returns the bit position after them, or -1 if the buffer ends early /
    a quotient is longer than any valid code / a code leaves [0, qmax]."""
    nbits = buf.shape[0] * 8
    umax = (2 * qmax) >> k
    prev = 0
    for i in range(n):
        if i % nb == 0:
            prev = 0
        zz, pos = _rice_one(buf, pos, nbits, k, umax)
        if pos < 0:
            return -1
        d = (zz >> 1) if (zz & 1) == 0 else -((zz + 1) >> 1)
        q = prev + d
        if q < 0 or q > qmax:
            return -1
        out[i] = q
        prev = q
    return pos


def _range_bits(nb: int) -> int:
    """Bits of a table's first nonzero symbol (and of its span): bit_length(nb - 1)."""
    return max(1, int(nb - 1).bit_length())


def _ranged_deltas(q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, span, zz) of table codes q int64 [K, nb] (format version 4): lo = the first
    nonzero code's symbol, span = last nonzero - lo (0, 0 for an all-zero table); zz the
    zigzag deltas of q[lo .. lo + span] (q[lo - 1] taken as 0), tables concatenated."""
    q = np.asarray(q, dtype=np.int64)
    K, nb = q.shape
    nz = q > 0
    anyn = nz.any(axis=1)
    lo = np.where(anyn, np.argmax(nz, axis=1), 0)
    hi = np.where(anyn, nb - 1 - np.argmax(nz[:, ::-1], axis=1), 0)
    d = np.diff(q, axis=1, prepend=0)
    d[np.arange(K), lo] = q[np.arange(K), lo]          # the first code of the range: delta to 0
    zz = np.where(d >= 0, 2 * d, -2 * d - 1)
    inside = (np.arange(nb)[None, :] >= lo[:, None]) & (np.arange(nb)[None, :] <= hi[:, None])
    return lo, hi - lo, zz[inside]                      # row-major: tables, then symbols


def ranged_cost(q: np.ndarray) -> tuple[int, int]:
    """(bits, k): the smallest size of tables coded as in format version 4 (per table:
    first nonzero symbol and span in bit_length(nb - 1) bits each, then the zigzag deltas
    inside the span as Rice codes with one parameter k in [0, RICE_MAX_K], lowest on ties)."""
    q = np.asarray(q, dtype=np.int64)
    K, nb = q.shape
    _, _, zz = _ranged_deltas(q)
    fixed = 2 * K * _range_bits(nb)
    best = None
    for k in range(RICE_MAX_K + 1):
        bits = fixed + int(((zz >> k) + 1 + k).sum())
        if best is None or bits < best[0]:
            best = (bits, k)
    return best


@_numba_or_py_early
def _fixed_write(v, w, out, pos):
    """Append v (0 <= v < 2^w) in w bits, MSB first, at bit pos of out (zeroed uint8)."""
    for j in range(w - 1, -1, -1):
        if (v >> j) & 1:
            out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
        pos += 1
    return pos


@_numba_or_py_early
def _ranged_write(lo, span, zz, w, k, out, pos):
    """Append the version-4 tables (lo, span int64 [K], zz int64 [sum(span + 1)]) at bit
    pos of out (zeroed uint8); returns the new bit position."""
    j = 0
    for t in range(lo.shape[0]):
        pos = _fixed_write(lo[t], w, out, pos)
        pos = _fixed_write(span[t], w, out, pos)
        for _ in range(span[t] + 1):
            v = zz[j]
            j += 1
            for _ in range(v >> k):
                out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
                pos += 1
            pos += 1
            for b in range(k - 1, -1, -1):
                if (v >> b) & 1:
                    out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
                pos += 1
    return pos


@_numba_or_py_early
def _ranged_read(buf, pos, K, nb, w, k, qmax, out):
    """Read K version-4 tables of nb codes from bit pos of buf into out int64 [K, nb]
    (zeroed). Returns the new bit position or -1: buffer ends early, lo + span >= nb, a
    quotient longer than any valid code, a code outside [0, qmax]."""
    nbits = buf.shape[0] * 8
    umax = (2 * qmax) >> k
    for t in range(K):
        if pos + 2 * w > nbits:
            return -1
        lo, pos = _bits_read(buf, pos, w)
        span, pos = _bits_read(buf, pos, w)
        if lo + span >= nb:
            return -1
        prev = 0
        for s in range(lo, lo + span + 1):
            z, pos = _rice_one(buf, pos, nbits, k, umax)
            if pos < 0:
                return -1
            d = (z >> 1) if (z & 1) == 0 else -((z + 1) >> 1)
            q = prev + d
            if q < 0 or q > qmax:
                return -1
            out[t, s] = q
            prev = q
    return pos


# ---------------------------------------------------------------------------------------
# Histograms
# ---------------------------------------------------------------------------------------
if njit is not None:

    @njit(cache=True, nogil=True)
    def _hist_kernel(sym, out):
        """sym uint8 [L, T, C] -> out int32 [L, 256, C] (symbol-major: consecutive
        channels of one token hit adjacent counters, which keeps the counters of a layer
        (256 * C * 4 bytes) cache- and TLB-friendly)."""
        L, T, C = sym.shape
        for layer in range(L):
            for t in range(T):
                for c in range(C):
                    out[layer, sym[layer, t, c], c] += 1


def histograms(sym: np.ndarray) -> np.ndarray:
    """Per-(layer, channel) symbol counts over tokens.

    Args: sym uint8 [L, T, C] (T < 2^31). Returns: int64 [L, C, 256].
    """
    sym = np.ascontiguousarray(sym)
    if sym.dtype != np.uint8 or sym.ndim != 3:
        raise ValueError("sym must be uint8 [L, T, C]")
    L, T, C = sym.shape
    if njit is not None:
        tmp = np.zeros((L, 256, C), dtype=np.int32)
        _hist_kernel(sym, tmp)
        return tmp.transpose(0, 2, 1).astype(np.int64)  # [L, C, 256]
    idx = (np.arange(L)[:, None, None] * C + np.arange(C)[None, None, :]) * 256 + sym  # pragma: no cover
    return np.bincount(idx.reshape(-1), minlength=L * C * 256).reshape(L, C, 256)  # pragma: no cover


# ---------------------------------------------------------------------------------------
# Codebook (K-means under cross-entropy)
# ---------------------------------------------------------------------------------------


def _numba_or_py(fn):
    return njit(cache=True, nogil=True)(fn) if njit is not None else fn


def _assign_py(H, W, assign, best):
    """assign[i] = argmin_k sum_s H[i, s] * W[s, k] (lowest k on ties), best[i] = the min.
    H float64 [n, nb] counts; W float64 [nb, K] = -log2(freq / M) of each table.
    (prange: rows are independent; the parallel build is used for big problems.)"""
    n, nb = H.shape
    K = W.shape[1]
    for i in prange(n):
        acc = np.zeros(K, np.float64)
        for s in range(nb):
            h = H[i, s]
            if h != 0.0:
                for k in range(K):
                    acc[k] += h * W[s, k]
        b = 0
        bv = acc[0]
        for k in range(1, K):
            if acc[k] < bv:
                bv = acc[k]
                b = k
        assign[i] = b
        best[i] = bv


if njit is not None:
    import types as _types

    _assign_par = njit(cache=True, nogil=True, parallel=True)(_assign_py)
    _assign_ser_fn = _types.FunctionType(_assign_py.__code__, _assign_py.__globals__, "_assign_py_serial")
    _assign_ser_fn.__qualname__ = "_assign_py_serial"
    _assign_ser = njit(cache=True, nogil=True)(_assign_ser_fn)
else:  # pragma: no cover
    prange = range
    _assign_par = _assign_ser = _assign_py

PARALLEL_MIN_WORK = 1 << 24  # n * K * nbins multiply-adds above which both cores are used


def _assign_kernel(H, W, assign, best):
    """Serial or parallel (by problem size) `_assign_py`; results are identical."""
    run_kernel(_assign_par, _assign_ser, H.shape[0] * H.shape[1] * W.shape[1] >= PARALLEL_MIN_WORK,
               H, W, assign, best)   # thread-safe dispatch (codec.threads)


@_numba_or_py
def _centroid_kernel(Hi, assign, K):
    """Summed integer histograms per cluster: int64 [K, nb]."""
    n, nb = Hi.shape
    cent = np.zeros((K, nb), np.int64)
    for i in range(n):
        a = assign[i]
        for s in range(nb):
            cent[a, s] += Hi[i, s]
    return cent


@_numba_or_py
def _seed_kernel(Hi, Ht, indptr, idx, val, sparse, own_bits, best, seed_nlq, n_have, k_target):
    """Extend the farthest-point seed sequence up to k_target seeds.
    Hi int64 [n, nb] histograms; the costs are summed either densely over Ht float64
    [nb, n] (the transposed histograms; vectorises over models: fast for dense
    histograms) or, with ``sparse``, over the nonzeros row by row (CSR: indptr int64
    [n + 1], idx int64 [nnz] symbols ascending within a row, val float64 [nnz] counts;
    the gather does not vectorise, but the work is the histograms' density: fast for
    sparse ones); the unused form may be empty arrays. Both sum a model's symbols in
    ascending order, the dense one adding +0.0 for the zeros: the same float64 costs,
    seeds and results. seed_nlq float64 [kmax, nb] holds -log2(q) of the seeds (rows <
    n_have filled); best[i] = current min cost of model i over the seeds (updated).
    Returns the new number of seeds."""
    n, nb = Hi.shape
    k = n_have
    cost = np.empty(n, np.float64)
    row = np.empty((1, nb), np.int64)
    f = np.empty((1, nb), np.int64)
    while k < k_target:
        gi = 0
        gv = best[0] - own_bits[0]
        for i in range(1, n):
            g = best[i] - own_bits[i]
            if g > gv:
                gv = g
                gi = i
        if gv <= 1e-9:
            break  # every model is already coded at (about) its own entropy
        # the chosen model's own normalised histogram becomes the new seed
        for s in range(nb):
            row[0, s] = Hi[gi, s]
        _normalize_rows(row, f)
        for s in range(nb):
            seed_nlq[k, s] = 16.0 - np.log2(np.float64(f[0, s]))
        if sparse:
            for i in range(n):
                c = 0.0
                for j in range(indptr[i], indptr[i + 1]):
                    c += val[j] * seed_nlq[k, idx[j]]
                cost[i] = c
        else:
            for i in range(n):
                cost[i] = 0.0
            for s in range(nb):  # vectorises over i
                w = seed_nlq[k, s]
                for i in range(n):
                    cost[i] += Ht[s, i] * w
        for i in range(n):
            if cost[i] < best[i]:
                best[i] = cost[i]
        k += 1
    return k


def _neg_log2_q(freqs: np.ndarray) -> np.ndarray:
    """-log2(freq / M) as float64, same shape."""
    return 16.0 - np.log2(freqs.astype(np.float64))


def _cluster_group(H: np.ndarray, ladder: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, list]:
    """Choose the codebook for one nbins group (K-means under cross-entropy).

    Args: H int64 [n, nb] histograms (n models of this group). ladder: candidate K values.
    Returns: (codes int64 [K, nb] (table codes, `table_codes`), freqs int64 [K, nb] (their
      16-bit tables), assign int64 [n], coded_bits, trials) where trials is a list of
      (K, est_bytes) for the report. K minimises the estimated group size: the
      cross-entropy under the transmitted (code-quantized) tables + the range/Rice-coded
      tables + the Rice-coded index (minimum description length); if that K's
      cross-entropy exceeds the group's empirical entropy by more than XENT_TARGET, the
      smallest-size K within MDL_SLACK of the minimum size that meets it (none: the one
      of lowest cross-entropy within MDL_SLACK).
    Deterministic: farthest-point seeding from the pooled histogram, LLOYD_ITERS
    iterations, lowest-index tie-breaking, fixed float64 summation order.
    """
    n, nb = H.shape
    Hi = np.ascontiguousarray(H, dtype=np.int64)
    Hf = Hi.astype(np.float64)
    nz_rows, nz_idx = np.nonzero(Hi)   # row-major: symbols ascending within a row
    sparse = bool(nz_rows.size < SPARSE_SEED_DENSITY * n * nb)
    none_i, none_f = np.zeros(1, np.int64), np.zeros((1, 1), np.float64)
    if sparse:
        indptr = np.zeros(n + 1, np.int64)
        np.cumsum(np.bincount(nz_rows, minlength=n), out=indptr[1:])
        forms = (none_f, indptr, nz_idx.astype(np.int64), Hf[nz_rows, nz_idx])
    else:
        forms = (np.ascontiguousarray(Hf.T), none_i, none_i, none_f[0])
    del nz_rows, nz_idx
    ks = sorted({min(int(k), n, MAX_K) for k in ladder} | {1})
    kmax = ks[-1]
    own_bits = (Hf * _neg_log2_q(normalize_freqs(Hi))).sum(axis=1)
    seed_nlq = np_empty((kmax, nb), np.float64)
    pooled_codes = table_codes(Hi.sum(axis=0)[None, :])
    pooled = freqs_from_codes(pooled_codes)
    seed_nlq[0] = _neg_log2_q(pooled[0])
    best = Hf @ seed_nlq[0]
    n_seeds = 1
    assign = np.zeros(n, np.int64)
    cost = np.empty(n, np.float64)
    ideal = entropy_bits_of_counts(Hi)
    choices = []   # (codes, freqs, assign, bits, est) per K tried
    trials = []
    for K in ks:
        n_seeds = _seed_kernel(Hi, *forms, sparse, own_bits, best, seed_nlq, n_seeds, K)
        k_eff = min(K, n_seeds)
        if k_eff == 1:
            codes, freqs = pooled_codes, pooled
            _assign_kernel(Hf, np.ascontiguousarray(_neg_log2_q(freqs).T), assign, cost)
        else:
            # Lloyd: start from the seeds' assignment, then alternate update / assign,
            # always against the tables as transmitted (codes -> 16-bit)
            _assign_kernel(Hf, np.ascontiguousarray(seed_nlq[:k_eff].T), assign, cost)
            for _ in range(LLOYD_ITERS):
                cent = _centroid_kernel(Hi, assign, k_eff)
                used = np.flatnonzero(cent.sum(axis=1) > 0)  # drop empty clusters
                codes = table_codes(cent[used])
                freqs = freqs_from_codes(codes)
                _assign_kernel(Hf, np.ascontiguousarray(_neg_log2_q(freqs).T), assign, cost)
        bits = float(cost.sum())
        k_now = freqs.shape[0]
        est = (bits + ranged_cost(codes)[0] + (index_cost(_by_use(assign, k_now)[1])[0] if k_now > 1 else 0)) / 8.0
        trials.append((k_now, est))
        choices.append((codes, freqs, assign.copy(), bits, est))
        min_est = min(c[4] for c in choices)
        if est > min_est:
            # past the size minimum: go on only while the target is unmet and in reach
            met = any(c[3] <= (1 + XENT_TARGET) * ideal and c[4] <= (1 + MDL_SLACK) * min_est
                      for c in choices)
            if met or est > (1 + MDL_SLACK) * min_est:
                break  # larger K will not pay off (nor meet the target within the slack)
        if n_seeds < K:
            break  # ran out of distinct models
    min_est = min(c[4] for c in choices)
    best_choice = min(choices, key=lambda c: c[4])   # first minimum: the smallest K
    if best_choice[3] > (1 + XENT_TARGET) * ideal:
        near = [c for c in choices if c[4] <= (1 + MDL_SLACK) * min_est]
        ok = [c for c in near if c[3] <= (1 + XENT_TARGET) * ideal]
        # the smallest one that meets the target, else the lowest cross-entropy in reach
        best_choice = min(ok, key=lambda c: c[4]) if ok else min(near, key=lambda c: c[3])
    codes, freqs, assign, bits, _ = best_choice
    # drop tables no model uses after the final assignment (keeps K minimal)
    used = np.unique(assign)
    if used.size < freqs.shape[0]:
        remap = np.full(freqs.shape[0], -1, dtype=np.int64)
        remap[used] = np.arange(used.size)
        codes, freqs, assign = codes[used], freqs[used], remap[assign]
    order, assign = _by_use(assign, freqs.shape[0])   # tables numbered by decreasing use
    return codes[order], freqs[order], assign, bits, trials


def _by_use(assign: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, new assign): tables sorted by decreasing member count (stable), and the
    assignment renumbered accordingly (table order[j] becomes table j)."""
    cnt = np.bincount(assign, minlength=K)
    order = np.argsort(-cnt, kind="stable")
    rank = np_empty(K, dtype=np.int64)
    rank[order] = np.arange(K)
    return order, rank[assign]


@dataclass
class ModelSet:
    """The coded models of one chunk.

    cum: uint32 [n_models, 257] cumulative tables (padded with M past nbins).
    model_index: uint16 [2, L, C] global row of `cum` per (kv, layer, channel).
    groups: list of (nbins, K) in ascending nbins; rows of `cum` are grouped in that order.
    local_index: uint16 [2, L, C] index inside the (kv, layer)'s nbins group.
    freqs: list of int64 [K, nbins] tables per group.
    codes: list of int64 [K, nbins] table codes per group (what is transmitted;
      freqs == freqs_from_codes(codes)).
    coded_bits: cross-entropy of the histograms under the coded models (bits).
    ideal_bits: sum of per-(kv, layer, channel) empirical entropies (bits).
    trials: per group, list of (K, estimated bytes) tried.
    """

    cum: np.ndarray
    model_index: np.ndarray
    groups: list
    local_index: np.ndarray
    freqs: list
    codes: list = field(default_factory=list)
    coded_bits: float = 0.0
    ideal_bits: float = 0.0
    trials: list = field(default_factory=list)


def _layer_nbins(nbins_k: Sequence[int], nbins_v: Sequence[int], L: int) -> np.ndarray:
    nb = np.array([list(nbins_k), list(nbins_v)], dtype=np.int64)
    if nb.shape != (2, L):
        raise ValueError(f"nbins_k and nbins_v must each have L={L} entries")
    if np.any(nb < 2) or np.any(nb > 256):
        raise ValueError("nbins must be in [2, 256]")
    return nb


def _cum_from_freqs(freqs: np.ndarray) -> np.ndarray:
    K, nb = freqs.shape
    cum = np.full((K, 257), PROB_SCALE, dtype=np.int64)
    cum[:, 0] = 0
    cum[:, 1 : nb + 1] = np.cumsum(freqs, axis=1)
    return cum


def _assemble(groups_freqs: list, nb_layer: np.ndarray, local: np.ndarray, C: int) -> tuple[np.ndarray, np.ndarray]:
    """cum table + global model index from per-group tables and local indices."""
    offsets = {}
    rows = []
    off = 0
    for nb, fr in groups_freqs:
        offsets[nb] = off
        rows.append(_cum_from_freqs(fr))
        off += fr.shape[0]
    cum = np.concatenate(rows).astype(np.uint32)
    base = np.vectorize(lambda v: offsets[int(v)], otypes=[np.int64])(nb_layer)  # [2, L]
    model_index = (base[:, :, None] + local.astype(np.int64)).astype(np.uint16)
    return cum, model_index


def build_models(hist_k: np.ndarray, hist_v: np.ndarray, nbins_k: Sequence[int], nbins_v: Sequence[int],
                 ladder: Sequence[int] = K_LADDER) -> ModelSet:
    """Build the chunk's codebook of models from histograms.

    Args: hist_k, hist_v int64 [L, C, 256] from `histograms`; nbins per layer (len L).
      Counts at symbols >= nbins of their layer must be zero (else ValueError).
    Returns: ModelSet. Raises: ValueError on inconsistent input.
    """
    L, C, _ = hist_k.shape
    if hist_k.shape != (L, C, 256) or hist_v.shape != (L, C, 256):
        raise ValueError("hist_k and hist_v must both be [L, C, 256]")
    nb_layer = _layer_nbins(nbins_k, nbins_v, L)
    hists = (hist_k, hist_v)
    for kv in range(2):
        for layer in range(L):
            if hists[kv][layer, :, nb_layer[kv, layer]:].any():
                raise ValueError(f"{'KV'[kv]} layer {layer}: symbol >= nbins={nb_layer[kv, layer]}")
    local = np.zeros((2, L, C), dtype=np.int64)
    distinct = sorted(set(nb_layer.reshape(-1).tolist()))
    kcap = max(1, MAX_MODELS // len(distinct))  # keep n_models within the uint16 index
    ladder = [min(int(k), kcap) for k in ladder]
    groups, freqs_list, codes_list, trials = [], [], [], []
    coded = ideal = 0.0
    for nb in sorted(set(nb_layer.reshape(-1).tolist())):
        sel = [(kv, layer) for kv in range(2) for layer in range(L) if nb_layer[kv, layer] == nb]
        H = np.concatenate([hists[kv][layer, :, :nb] for kv, layer in sel])  # [len(sel) * C, nb]
        cd, fr, assign, bits, tr = _cluster_group(H, ladder)
        for j, (kv, layer) in enumerate(sel):
            local[kv, layer] = assign[j * C : (j + 1) * C]
        groups.append((int(nb), int(fr.shape[0])))
        freqs_list.append(fr)
        codes_list.append(cd)
        trials.append((int(nb), tr))
        coded += bits
        ideal += entropy_bits_of_counts(H)
    cum, model_index = _assemble(list(zip([g[0] for g in groups], freqs_list)), nb_layer, local, C)
    return ModelSet(cum=cum, model_index=model_index, groups=groups, local_index=local.astype(np.uint16),
                    freqs=freqs_list, codes=codes_list, coded_bits=coded, ideal_bits=ideal, trials=trials)


# ---------------------------------------------------------------------------------------
# Serialisation (docs/bitstream.md section 4.3)
# ---------------------------------------------------------------------------------------
def serialize_models(ms: ModelSet) -> tuple[dict, dict]:
    """Return (header fields, arrays) for the model codebook (docs/bitstream.md 4.3,
    format version 4).

    header: {"model_groups": [[nbins, K, table_k, index_k], ...]} (ascending nbins;
      table_k / index_k = the Rice parameters of the group's table codes / indices).
    arrays: "ent_codebook" uint8 [bytes]: bit stream (MSB first) of every table, groups
      in header order, tables in order, each as its first nonzero symbol `lo` and its
      span (last nonzero - lo) in bit_length(nbins - 1) bits each, then the codes
      q[lo .. lo + span], each as the Rice code (parameter table_k) of the zigzag delta to
      the previous code (0 before q[lo]); codes outside the span are 0; zero-padded to a
      whole byte. "ent_model_index" uint8 [bytes]: for every (kv, layer) whose group has
      K > 1, in order, the C local indices as Rice codes (parameter index_k of the
      group), zero-padded; omitted when every K == 1.
    """
    nb_layer = _ms_nb_layer(ms)
    groups, chunks, total = [], [], 0
    idx_k = {}
    for (nb, K), q in zip(ms.groups, ms.codes):
        bits, k = ranged_cost(q)
        ik = index_cost(ms.local_index[nb_layer == nb])[1] if K > 1 else 0
        idx_k[int(nb)] = (int(K), ik)
        groups.append([int(nb), int(K), int(k), int(ik)])
        chunks.append((_ranged_deltas(q), _range_bits(int(nb)), k))
        total += bits
    buf = np.zeros((total + 7) // 8, dtype=np.uint8)
    pos = 0
    for (lo, span, zz), w, k in chunks:
        pos = _ranged_write(np.ascontiguousarray(lo, dtype=np.int64), np.ascontiguousarray(span, dtype=np.int64),
                            np.ascontiguousarray(zz, dtype=np.int64), int(w), int(k), buf, pos)
    assert pos == total
    arrays = {"ent_codebook": buf}
    if any(K > 1 for _, K in ms.groups):
        rows = []
        for kv in range(2):
            for layer in range(nb_layer.shape[1]):
                K, ik = idx_k[int(nb_layer[kv, layer])]
                if K > 1:
                    rows.append((np.ascontiguousarray(ms.local_index[kv, layer], dtype=np.int64), ik))
        nbits = sum(int(((v >> k) + 1 + k).sum()) for v, k in rows)
        ib = np.zeros((nbits + 7) // 8, dtype=np.uint8)
        pos = 0
        for v, k in rows:
            pos = _rice_write_plain(v, int(k), ib, pos)
        arrays["ent_model_index"] = ib
    return {"model_groups": groups}, arrays


def _ms_nb_layer(ms: ModelSet) -> np.ndarray:
    """The nbins of each (kv, layer) of a ModelSet: int64 [2, L] (its tables' width)."""
    nbr = [int(nb) for nb, K in ms.groups for _ in range(K)]
    return np.array(nbr, dtype=np.int64)[ms.model_index[:, :, 0].astype(np.int64)]


def deserialize_models(hdr: dict, arrays: dict, nbins_k: Sequence[int], nbins_v: Sequence[int],
                       L: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    """Rebuild (cum uint32 [n_models, 257], model_index uint16 [2, L, C]) from the
    serialised codebook (docs/bitstream.md 4.3: range-coded `ent_codebook` + Rice-coded
    `ent_model_index`, format version 4; the version-3 codebook, `ent_tables` with every
    code Rice-coded, and the version-2 one, `ent_freqs` uint16 + uint8 index, are read
    too), validating everything. Allocation is bounded by the input: every table takes
    at least one bit per code (version 3) or its range fields plus a bit (version 4).
    Raises CodecError on any inconsistency."""
    if not isinstance(arrays, dict):
        raise CodecError("entropy arrays must be a dict")
    present = [nm for nm in ("ent_freqs", "ent_tables", "ent_codebook") if nm in arrays]
    if len(present) > 1:
        raise CodecError(f"codebooks of two format versions in one chunk: {present}")
    if present == ["ent_freqs"]:
        return _deserialize_models_v2(hdr, arrays, nbins_k, nbins_v, L, C)
    v4 = present == ["ent_codebook"]
    tname = "ent_codebook" if v4 else "ent_tables"
    try:
        nb_layer = _layer_nbins(nbins_k, nbins_v, L)
    except (ValueError, TypeError, OverflowError) as e:
        raise CodecError(str(e)) from None
    groups = hdr.get("model_groups") if isinstance(hdr, dict) else None
    expected = sorted(set(nb_layer.reshape(-1).tolist()))
    if (not isinstance(groups, list) or len(groups) != len(expected)
            or not all(isinstance(g, list) and len(g) == 4 and all(type(v) is int for v in g) for g in groups)):
        raise CodecError("model_groups must be a list of [nbins, K, table_k, index_k], one per distinct nbins")
    if [g[0] for g in groups] != expected:
        raise CodecError(f"model_groups nbins {[g[0] for g in groups]} do not match the chunk's {expected}")
    if any(not (1 <= g[1] <= MAX_K) for g in groups) or sum(g[1] for g in groups) > MAX_MODELS:
        raise CodecError(f"model_groups K must be in [1, {MAX_K}] with at most {MAX_MODELS} tables in all")
    if any(not (0 <= g[2] <= RICE_MAX_K and 0 <= g[3] <= RICE_MAX_K) for g in groups) \
            or any(g[1] == 1 and g[3] != 0 for g in groups):
        raise CodecError(f"model_groups Rice parameters must be in [0, {RICE_MAX_K}] (index_k 0 when K == 1)")
    buf = arrays.get(tname)
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
        raise CodecError(f"{tname} must be a 1-D uint8 array")
    # every table code takes at least one bit (version 3); every version-4 table at least
    # its two range fields and one code: bounds the allocation by the input's size
    need = sum(K * (2 * _range_bits(nb) + 1) if v4 else nb * K for nb, K, _, _ in groups)
    if need > 8 * buf.size:
        raise CodecError(f"{tname} of {buf.size} bytes cannot hold the {sum(g[1] for g in groups)} tables declared")
    buf = np.ascontiguousarray(buf)
    tables, pos = [], 0
    for nb, K, k, _ in groups:
        if v4:
            q = np.zeros((K, nb), dtype=np.int64)
            pos = _ranged_read(buf, pos, K, nb, _range_bits(nb), k, TABLE_QMAX, q)
        else:
            q = np_empty(nb * K, dtype=np.int64)
            pos = _rice_read(buf, pos, nb * K, nb, k, TABLE_QMAX, q)
        if pos < 0:
            raise CodecError(f"{tname}: bad or truncated table codes for nbins={nb}")
        tables.append((nb, freqs_from_codes(q.reshape(K, nb))))
    if (pos + 7) // 8 != buf.size or (pos % 8 and int(buf[-1]) & ((1 << (8 - pos % 8)) - 1)):
        raise CodecError(f"{tname}: bytes left over or non-zero padding after the table codes")
    kmap = {nb: (K, ik) for nb, K, _, ik in groups}
    if any(K > 1 for _, K, _, _ in groups):
        li = arrays.get("ent_model_index")
        if not isinstance(li, np.ndarray) or li.dtype != np.uint8 or li.ndim != 1:
            raise CodecError("ent_model_index must be a 1-D uint8 array")
        li = np.ascontiguousarray(li)
        nread = sum(C for kv in range(2) for layer in range(L) if kmap[int(nb_layer[kv, layer])][0] > 1)
        if nread > 8 * li.size:
            raise CodecError(f"ent_model_index of {li.size} bytes cannot hold {nread} indices")
        local = np.zeros((2, L, C), dtype=np.int64)
        pos = 0
        row = np_empty(C, dtype=np.int64)
        for kv in range(2):
            for layer in range(L):
                K, ik = kmap[int(nb_layer[kv, layer])]
                if K > 1:
                    pos = _rice_read_plain(li, pos, C, ik, K - 1, row)
                    if pos < 0:
                        raise CodecError("ent_model_index: bad or truncated index codes "
                                         "(or an index out of range of its group's codebook)")
                    local[kv, layer] = row
        if (pos + 7) // 8 != li.size or (pos % 8 and int(li[-1]) & ((1 << (8 - pos % 8)) - 1)):
            raise CodecError("ent_model_index: bytes left over or non-zero padding")
    else:
        if "ent_model_index" in arrays:
            raise CodecError("ent_model_index present although every group has K == 1")
        local = np.zeros((2, L, C), dtype=np.int64)
    return _assemble(tables, nb_layer, local, C)


def _deserialize_models_v2(hdr: dict, arrays: dict, nbins_k: Sequence[int], nbins_v: Sequence[int],
                           L: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    """The version-2 codebook (docs/bitstream.md 4.3, "Versions"): `ent_freqs` uint16
    [sum K * nbins] 16-bit tables, `ent_model_index` uint8 [2, L, C], K <= 256.
    Raises CodecError on any inconsistency."""
    try:
        nb_layer = _layer_nbins(nbins_k, nbins_v, L)
    except (ValueError, TypeError, OverflowError) as e:
        raise CodecError(str(e)) from None
    groups = hdr.get("model_groups") if isinstance(hdr, dict) else None
    expected = sorted(set(nb_layer.reshape(-1).tolist()))
    if (not isinstance(groups, list) or len(groups) != len(expected)
            or not all(isinstance(g, list) and len(g) == 2 and all(type(v) is int for v in g) for g in groups)):
        raise CodecError("model_groups must be a list of [nbins, K] pairs, one per distinct nbins")
    if [g[0] for g in groups] != expected:
        raise CodecError(f"model_groups nbins {[g[0] for g in groups]} do not match the chunk's {expected}")
    if any(not (1 <= g[1] <= 256) for g in groups):
        raise CodecError("model_groups K must be in [1, 256]")
    fr = arrays.get("ent_freqs")
    need = sum(nb * k for nb, k in groups)
    if not isinstance(fr, np.ndarray) or fr.dtype != np.uint16 or fr.shape != (need,):
        raise CodecError(f"ent_freqs must be uint16 [{need}]")
    fr = fr.astype(np.int64)
    tables, off = [], 0
    for nb, k in groups:
        t = fr[off : off + nb * k].reshape(k, nb)
        off += nb * k
        if np.any(t < 1) or np.any(t.sum(axis=1) != PROB_SCALE):
            raise CodecError(f"model table for nbins={nb}: frequencies must be >= 1 and sum to 65536")
        tables.append((nb, t))
    kmap = {nb: k for nb, k in groups}
    if any(k > 1 for _, k in groups):
        li = arrays.get("ent_model_index")
        if not isinstance(li, np.ndarray) or li.dtype != np.uint8 or li.shape != (2, L, C):
            raise CodecError(f"ent_model_index must be uint8 [2, {L}, {C}]")
        li = li.astype(np.int64)
        kl = np.vectorize(lambda v: kmap[int(v)], otypes=[np.int64])(nb_layer)
        if np.any(li >= kl[:, :, None]):
            raise CodecError("ent_model_index out of range of its group's codebook")
    else:
        if "ent_model_index" in arrays:
            raise CodecError("ent_model_index present although every group has K == 1")
        li = np.zeros((2, L, C), dtype=np.int64)
    return _assemble(tables, nb_layer, li, C)
