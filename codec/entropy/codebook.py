"""The chunk's model codebook: `ModelSet` and its compact serialisation
(docs/bitstream.md section 4.3, format version 4; versions 3 and 2 still read).

Purpose: `ModelSet` holds the coded models of one chunk (built by
codec.entropy.models.build_models); `serialize_models` writes it as header fields + uint8
arrays, `deserialize_models` rebuilds (cum, model_index) from untrusted fields with a
one-line CodecError on any inconsistency.

Shapes and dtypes: cum uint32 [n_models, 257]; model_index / local_index uint16
[2, L, C]; per-group tables int64 [K, nbins].

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_tables.py tests/codec/test_codec_entropy.py -q
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import CodecError
from .codebook_codes import (MAX_K, MAX_MODELS, RICE_MAX_K, TABLE_QMAX, range_bits, ranged_deltas,
                          ranged_read, ranged_write, rice_read, rice_read_plain, rice_write_plain,
                          freqs_from_codes, index_cost, ranged_cost)
from .rans_spec import PROB_SCALE
from ..scratch import np_empty


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


def layer_nbins(nbins_k: Sequence[int], nbins_v: Sequence[int], L: int) -> np.ndarray:
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


def assemble_models(groups_freqs: list, nb_layer: np.ndarray, local: np.ndarray, C: int) -> tuple[np.ndarray, np.ndarray]:
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
        chunks.append((ranged_deltas(q), range_bits(int(nb)), k))
        total += bits
    buf = np.zeros((total + 7) // 8, dtype=np.uint8)
    pos = 0
    for (lo, span, zz), w, k in chunks:
        pos = ranged_write(np.ascontiguousarray(lo, dtype=np.int64), np.ascontiguousarray(span, dtype=np.int64),
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
            pos = rice_write_plain(v, int(k), ib, pos)
        arrays["ent_model_index"] = ib
    return {"model_groups": groups}, arrays


def _ms_nb_layer(ms: ModelSet) -> np.ndarray:
    """The nbins of each (kv, layer) of a ModelSet: int64 [2, L] (its tables' width)."""
    nbr = [int(nb) for nb, K in ms.groups for _ in range(K)]
    return np.array(nbr, dtype=np.int64)[ms.model_index[:, :, 0].astype(np.int64)]


def _header_groups(hdr: dict, nbins_k: Sequence[int], nbins_v: Sequence[int], L: int,
                   width: int, what: str) -> tuple[np.ndarray, list]:
    """(nbins per (kv, layer) int64 [2, L], the header's ``model_groups``: lists of
    ``width`` ints, one per distinct nbins in increasing order; ``what`` names the entry
    in the error). Raises CodecError otherwise."""
    try:
        nb_layer = layer_nbins(nbins_k, nbins_v, L)
    except (ValueError, TypeError, OverflowError) as e:
        raise CodecError(str(e)) from None
    groups = hdr.get("model_groups") if isinstance(hdr, dict) else None
    expected = sorted(set(nb_layer.reshape(-1).tolist()))
    if (not isinstance(groups, list) or len(groups) != len(expected)
            or not all(isinstance(g, list) and len(g) == width and all(type(v) is int for v in g)
                       for g in groups)):
        raise CodecError(f"model_groups must be a list of {what}, one per distinct nbins")
    if [g[0] for g in groups] != expected:
        raise CodecError(f"model_groups nbins {[g[0] for g in groups]} do not match the chunk's {expected}")
    return nb_layer, groups


def _single_model_index(arrays: dict, L: int, C: int) -> np.ndarray:
    """The local model index (int64 [2, L, C], all 0) when every group has K == 1; the chunk
    must then carry no ``ent_model_index``. Raises CodecError otherwise."""
    if "ent_model_index" in arrays:
        raise CodecError("ent_model_index present although every group has K == 1")
    return np.zeros((2, L, C), dtype=np.int64)


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
    nb_layer, groups = _header_groups(hdr, nbins_k, nbins_v, L, 4, "[nbins, K, table_k, index_k]")
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
    need = sum(K * (2 * range_bits(nb) + 1) if v4 else nb * K for nb, K, _, _ in groups)
    if need > 8 * buf.size:
        raise CodecError(f"{tname} of {buf.size} bytes cannot hold the {sum(g[1] for g in groups)} tables declared")
    buf = np.ascontiguousarray(buf)
    tables, pos = [], 0
    for nb, K, k, _ in groups:
        if v4:
            q = np.zeros((K, nb), dtype=np.int64)
            pos = ranged_read(buf, pos, K, nb, range_bits(nb), k, TABLE_QMAX, q)
        else:
            q = np_empty(nb * K, dtype=np.int64)
            pos = rice_read(buf, pos, nb * K, nb, k, TABLE_QMAX, q)
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
                    pos = rice_read_plain(li, pos, C, ik, K - 1, row)
                    if pos < 0:
                        raise CodecError("ent_model_index: bad or truncated index codes "
                                         "(or an index out of range of its group's codebook)")
                    local[kv, layer] = row
        if (pos + 7) // 8 != li.size or (pos % 8 and int(li[-1]) & ((1 << (8 - pos % 8)) - 1)):
            raise CodecError("ent_model_index: bytes left over or non-zero padding")
    else:
        local = _single_model_index(arrays, L, C)
    return assemble_models(tables, nb_layer, local, C)


def _deserialize_models_v2(hdr: dict, arrays: dict, nbins_k: Sequence[int], nbins_v: Sequence[int],
                           L: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    """The version-2 codebook (docs/bitstream.md 4.3, "Versions"): `ent_freqs` uint16
    [sum K * nbins] 16-bit tables, `ent_model_index` uint8 [2, L, C], K <= 256.
    Raises CodecError on any inconsistency."""
    nb_layer, groups = _header_groups(hdr, nbins_k, nbins_v, L, 2, "[nbins, K] pairs")
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
        li = _single_model_index(arrays, L, C)
    return assemble_models(tables, nb_layer, li, C)
