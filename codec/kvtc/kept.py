"""The "kept" column layout of KVTC symbols (formats 2-4, docs/bitstream.md 4.5): only each
(K/V, layer)'s (or layer group's) kept coefficient columns are coded, concatenated into
[Tq, S] and split into two equal halves (the entropy stage's K and V arrays). Here: S,
the halves' alphabet sizes, the split (``kept_halves``), its decode (``decode_kept``)
and ``KeptSymbols``, a decoded (K/V) side read back per layer.

Separate from codec.kvtc.layout (formats, spans, the row coders) because both the
per-layer and the grouped row coders of codec.kvtc.layout build on it.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import scratch
from ..base import need_int
from ..errors import CodecError


def n_kept(keep: list) -> int:
    """S: kept columns of all (K/V, layer) together."""
    return int(sum(keep[0]) + sum(keep[1]))


def kept_nbins(keep: list, offs: list, half: int) -> tuple[int, int]:
    """Alphabet sizes of the two halves of the kept layout: max(2, 2M + 1) with M the
    largest offset of a (K/V, layer) that has a column in that half (the pad column of an
    odd S is symbol 0)."""
    nb, col = [2, 2], 0
    for kv in (0, 1):
        for nl, o in zip(keep[kv], offs[kv]):
            if nl:
                for hf in {min(col // half, 1), min((col + nl - 1) // half, 1)}:
                    nb[hf] = max(nb[hf], 2 * int(o) + 1)
            col += nl
    return nb[0], nb[1]


def kept_halves(syms: list, keep: list, offs: list, Tq: int
                 ) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The kept layout of symbols ``syms`` = [K, V] uint8 [L, Tq, n]: (half_a, half_b)
    uint8 [1, Tq, ceil(S/2)] (columns (kv, layer, component) in order, a zero pad column
    at the end of an odd S) and their alphabet sizes."""
    S = n_kept(keep)
    half = max(1, (S + 1) // 2)
    flat = np.zeros((Tq, 2 * half), np.uint8)
    col = 0
    for kv in (0, 1):
        for layer, nl in enumerate(keep[kv]):
            flat[:, col:col + nl] = syms[kv][layer, :, :nl]
            col += nl
    nba, nbb = kept_nbins(keep, offs, half)
    return (np.ascontiguousarray(flat[None, :, :half]),
            np.ascontiguousarray(flat[None, :, half:]), nba, nbb)


class KeptSymbols:
    """The decoded symbols of one of K/V in the kept layout: the two halves a, b uint8
    [Tq, half] and each layer's first column in their concatenation."""

    def __init__(self, a: np.ndarray, b: np.ndarray, keep: list, kv: int):
        self.a, self.b = torch.from_numpy(a), torch.from_numpy(b)
        self.half = a.shape[1]
        self.keep = keep[kv]
        start = sum(keep[0]) if kv == 1 else 0
        self.start = [start + sum(self.keep[:i]) for i in range(len(self.keep))]

    def pieces(self, layer: int) -> list:
        """[(first, last, uint8 view [Tq, last - first])]: the kept columns of ``layer``
        (two pieces when they straddle the halves)."""
        s, nl, h = self.start[layer], self.keep[layer], self.half
        e = s + nl
        if e <= h:
            return [(0, nl, self.a[:, s:e])]
        if s >= h:
            return [(0, nl, self.b[:, s - h:e - h])]
        return [(0, h - s, self.a[:, s:]), (h - s, nl, self.b[:, :e - h])]

    def padded(self, offs: list, n: int) -> np.ndarray:
        """The same symbols in the padded layout, uint8 [L, Tq, n] (dropped columns = the
        layer's offset symbol): for tests and the reference decode."""
        L, Tq = len(self.keep), self.a.shape[0]
        out = scratch.np_empty((L, Tq, n), np.uint8)
        for layer in range(L):
            out[layer] = offs[layer]
            for lo, hi, src in self.pieces(layer):
                out[layer, :, lo:hi] = src.numpy()
        return out


def decode_kept(hdr: dict, ent: dict, ent_arrays: dict, payload, keep: list, offs: list,
                 max_kept: int, lvl: int, Tq: int) -> tuple[np.ndarray, np.ndarray]:
    """The two halves (uint8 [Tq, ceil(S/2)] each) of Tq rows in a kept layout: header
    ``n_kept`` = S (<= ``max_kept``) must be the level's kept columns. Raises CodecError."""
    from ..entropy import decode_symbols

    S = need_int(hdr, "n_kept", 0, max_kept)
    if S != n_kept(keep):
        raise CodecError(f"kvtc: header has {S} kept columns, level {lvl} of the "
                         f"calibration keeps {n_kept(keep)}")
    half = max(1, (S + 1) // 2)
    nba, nbb = kept_nbins(keep, offs, half)
    sa, sb = decode_symbols(ent, ent_arrays, payload, 1, Tq, half, [nba], [nbb])
    if sa.shape != (1, Tq, half) or sb.shape != (1, Tq, half):
        raise CodecError(f"kvtc: decoded symbols have shape {sa.shape}")
    return sa[0], sb[0]
