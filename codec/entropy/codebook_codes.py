"""Probability-model tables: integer 16-bit frequency normalisation and the compact
table codes of the model codebook (square-root-domain codes, Rice / range coding;
docs/bitstream.md section 4.3).

Purpose: the deterministic, integer-only building blocks shared by the model builder
(codec.entropy.models: clustering) and the codebook serialisation (codec.entropy.codebook):
`normalize_freqs` (counts -> frequencies summing to M = 65536), `table_codes` /
`freqs_from_codes` (q = round(64 * sqrt(p)), w = q^2), and the bit-level Rice / ranged
writers and readers (numba, cache=True; pure Python without numba).

Shapes and dtypes: counts int [K, nbins] (>= 0); codes q int64 [K, nbins] in
[0, TABLE_QMAX]; bit buffers uint8 (MSB first). Errors: readers return -1 on bad or
truncated input (callers raise CodecError); `normalize_freqs` raises ValueError.

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_tables.py -q
"""
from __future__ import annotations

import numpy as np

from ..scratch import np_empty

try:
    from numba import njit
except ImportError:  # pragma: no cover
    njit = None

def _numba_or_py_early(fn):
    return njit(cache=True, nogil=True)(fn) if njit is not None else fn


from .rans_spec import PROB_SCALE  # noqa: E402  (M, defined once: codec/entropy/rans_spec.py)
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
    normalize_rows(flat, out)
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
        ftot = np.float64(total)
        for s in range(nb):
            num = (1 if allzero else c[i, s]) * spare
            # floor(num / total) by a float64 division and an exact integer correction
            # (num, total < 2^53 are exact doubles, the quotient is off by at most one):
            # the same integer as num // total at a fraction of an int64 division's cost
            q = np.int64(np.float64(num) / ftot)
            if q * total > num:
                q -= 1
            elif (q + 1) * total <= num:
                q += 1
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


normalize_rows = njit(cache=True, nogil=True)(_normalize_rows_py) if njit is not None else _normalize_rows_py


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


def _best_rice_k(v: np.ndarray, fixed: int = 0) -> tuple[int, int]:
    """(fixed + bits, k): the smallest Rice-coded size of v (int64, >= 0) over k in
    [0, RICE_MAX_K], the lowest k on ties."""
    best = None
    for k in range(RICE_MAX_K + 1):
        bits = fixed + int(((v >> k) + 1 + k).sum())
        if best is None or bits < best[0]:
            best = (bits, k)
    return best


def rice_cost(q: np.ndarray) -> tuple[int, int]:
    """(bits, k): the smallest Rice-coded size of the tables' zigzag deltas, k in
    [0, RICE_MAX_K] (lowest k on ties)."""
    zz = _zigzag_deltas(np.asarray(q, dtype=np.int64))
    return _best_rice_k(zz)


def index_cost(local: np.ndarray) -> tuple[int, int]:
    """(bits, k): the smallest Rice-coded size of model indices (int, >= 0), k in
    [0, RICE_MAX_K] (lowest k on ties). Tables are numbered by decreasing use, so small
    indices are the frequent ones."""
    v = np.asarray(local, dtype=np.int64).reshape(-1)
    return _best_rice_k(v)


@_numba_or_py_early
def _fixed_write(v, w, out, pos):
    """Append v (0 <= v < 2^w) in w bits, MSB first, at bit pos of out (zeroed uint8)."""
    for j in range(w - 1, -1, -1):
        if (v >> j) & 1:
            out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
        pos += 1
    return pos


@_numba_or_py_early
def _rice_put(x, k, out, pos):
    """Append the Rice code of x >= 0 (parameter k: the unary quotient x >> k of 1-bits
    ended by a 0, then the k remainder bits, MSB first) at bit pos of out (zeroed uint8);
    returns the new bit position."""
    for _ in range(x >> k):
        out[pos >> 3] |= np.uint8(0x80 >> (pos & 7))
        pos += 1
    return _fixed_write(x, k, out, pos + 1)   # after the terminating 0: x's low k bits


@_numba_or_py_early
def rice_write_plain(v, k, out, pos):
    """Append the Rice codes (parameter k) of v int64 [n] >= 0 at bit pos of out (zeroed
    uint8, MSB first); returns the new bit position. Also ``_rice_write``: the table codes'
    zigzag deltas are written the same way."""
    for i in range(v.shape[0]):
        pos = _rice_put(v[i], k, out, pos)
    return pos


_rice_write = rice_write_plain


@_numba_or_py_early
def _unzig(z, prev, qmax):
    """The table code after ``prev`` given the zigzag delta z, or -1 outside [0, qmax]."""
    q = prev + ((z >> 1) if (z & 1) == 0 else -((z + 1) >> 1))
    return q if 0 <= q <= qmax else -1


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
def rice_read_plain(buf, pos, n, k, vmax, out):
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
def rice_read(buf, pos, n, nb, k, qmax, out):
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
        q = _unzig(zz, prev, qmax)
        if pos < 0 or q < 0:
            return -1
        out[i] = q
        prev = q
    return pos


def range_bits(nb: int) -> int:
    """Bits of a table's first nonzero symbol (and of its span): bit_length(nb - 1)."""
    return max(1, int(nb - 1).bit_length())


def ranged_deltas(q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    _, _, zz = ranged_deltas(q)
    fixed = 2 * K * range_bits(nb)
    return _best_rice_k(zz, fixed)


@_numba_or_py_early
def ranged_write(lo, span, zz, w, k, out, pos):
    """Append the version-4 tables (lo, span int64 [K], zz int64 [sum(span + 1)]) at bit
    pos of out (zeroed uint8); returns the new bit position."""
    j = 0
    for t in range(lo.shape[0]):
        pos = _fixed_write(lo[t], w, out, pos)
        pos = _fixed_write(span[t], w, out, pos)
        for _ in range(span[t] + 1):
            pos = _rice_put(zz[j], k, out, pos)
            j += 1
    return pos


@_numba_or_py_early
def ranged_read(buf, pos, K, nb, w, k, qmax, out):
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
            q = _unzig(z, prev, qmax)
            if pos < 0 or q < 0:
                return -1
            out[t, s] = q
            prev = q
    return pos
