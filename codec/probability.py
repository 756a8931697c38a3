"""Probability models for the entropy coder: per-(layer, channel) histograms, a per-chunk
codebook of 16-bit frequency tables, and its compact serialisation.

Purpose: CacheGen codes each (layer, channel) with its own distribution over the tokens
of a chunk (Liu et al., SIGCOMM 2024, section 5.2). Storing one 16-bit CDF per (layer,
channel) as LMCache does costs ~13% of the output at 256 tokens; instead we cluster the
per-(kv, layer, channel) histograms of each distinct `nbins` into K centroid
distributions (K-means under cross-entropy, i.e. the KL-divergence "Bregman" K-means
of Banerjee et al., JMLR 2005, with a deterministic farthest-point initialisation) and
store K frequency tables + one small index per (kv, layer, channel). K is chosen per
`nbins` group among {1, 4, 16, 64, 256} (capped by the number of models) to minimise
estimated payload + codebook + index bytes. See docs/bitstream.md section 4.3.

Everything here is deterministic for a given input (fixed initialisation, fixed number
of iterations, lowest-index tie-breaking, integer-only frequency normalisation).

Run: imported by codec/entropy.py; tests: .venv/bin/python -m pytest tests/test_codec_entropy*.py -q
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import CodecError

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

PROB_SCALE = 1 << 16  # M
K_LADDER = (1, 4, 16, 64, 256)  # candidate codebook sizes per nbins group
LLOYD_ITERS = 6  # fixed number of K-means refinement iterations (determinism, speed)
MAX_K = 256  # the serialised index is uint8


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
    flat = c.reshape(-1, nb)
    total = flat.sum(axis=1, keepdims=True)
    zero = total[:, 0] == 0
    flat = np.where(zero[:, None], 1, flat)
    total = np.where(zero[:, None], nb, total)
    if np.any(total > (1 << 46)):  # keep count * (M - nb) inside int64
        raise ValueError("counts too large to normalise")
    spare = PROB_SCALE - nb
    num = flat * spare
    f = 1 + num // total
    rem = num % total
    r = PROB_SCALE - f.sum(axis=1)  # in [0, nbins)
    # rank entries by remainder descending, ties by index ascending (stable sort)
    order = np.argsort(-rem, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(nb)[None, :].repeat(flat.shape[0], 0), axis=1)
    f += rank < r[:, None]
    return f.reshape(c.shape)


def entropy_bits_of_counts(counts: np.ndarray) -> float:
    """Sum over rows of (row total * empirical entropy of the row), in bits."""
    c = np.asarray(counts, dtype=np.float64).reshape(-1, np.shape(counts)[-1])
    tot = c.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.where(c > 0, np.log2(np.where(c > 0, c, 1.0) / np.where(tot > 0, tot, 1.0)), 0.0)
    return float(-(c * lg).sum())


# ---------------------------------------------------------------------------------------
# Histograms
# ---------------------------------------------------------------------------------------
if njit is not None:

    @njit(cache=True, nogil=True, parallel=True)
    def _hist_kernel(sym, out):  # sym uint8 [L, T, C] -> out int64 [L, C, 256]
        L, T, C = sym.shape
        for layer in prange(L):
            for t in range(T):
                for c in range(C):
                    out[layer, c, sym[layer, t, c]] += 1


def histograms(sym: np.ndarray) -> np.ndarray:
    """Per-(layer, channel) symbol counts over tokens.

    Args: sym uint8 [L, T, C]. Returns: int64 [L, C, 256].
    """
    sym = np.ascontiguousarray(sym)
    if sym.dtype != np.uint8 or sym.ndim != 3:
        raise ValueError("sym must be uint8 [L, T, C]")
    L, T, C = sym.shape
    out = np.zeros((L, C, 256), dtype=np.int64)
    if njit is not None:
        _hist_kernel(sym, out)
    else:  # pragma: no cover
        idx = (np.arange(L)[:, None, None] * C + np.arange(C)[None, None, :]) * 256 + sym
        out[:] = np.bincount(idx.reshape(-1), minlength=L * C * 256).reshape(L, C, 256)
    return out


# ---------------------------------------------------------------------------------------
# Codebook (K-means under cross-entropy)
# ---------------------------------------------------------------------------------------
def _neg_log2_q(freqs: np.ndarray) -> np.ndarray:
    """-log2(freq / M) as float64, same shape."""
    return PROB_SCALE_LOG2 - np.log2(freqs.astype(np.float64))


PROB_SCALE_LOG2 = 16.0


def _centroids(H: np.ndarray, assign: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum the histograms of each cluster; drop empty clusters (returns counts [K', nb]
    and the remapped assignment)."""
    nb = H.shape[1]
    cent = np.empty((K, nb), dtype=np.int64)
    for s in range(nb):  # exact: float64 sums of integer counts < 2^53
        cent[:, s] = np.bincount(assign, weights=H[:, s], minlength=K).astype(np.int64)
    used = np.flatnonzero(cent.sum(axis=1) > 0)
    if used.size < K:
        remap = np.full(K, -1, dtype=np.int64)
        remap[used] = np.arange(used.size)
        return cent[used], remap[assign]
    return cent, assign


def _cluster_group(H: np.ndarray, ladder: Sequence[int]) -> tuple[np.ndarray, np.ndarray, float, list]:
    """Choose the codebook for one nbins group.

    Args: H int64 [n, nb] histograms (n models of this group). ladder: candidate K values.
    Returns: (freqs int64 [K, nb], assign int64 [n], coded_bits, trials) where trials is
      a list of (K, est_bytes) for the report.
    """
    n, nb = H.shape
    Hf = H.astype(np.float64)
    ks = sorted({min(int(k), n, MAX_K) for k in ladder} | {1})
    # deterministic farthest-point seeding: start from the global distribution, then
    # repeatedly add the model whose cost gap (cross-entropy minus own entropy) is largest
    own_bits = (Hf * _neg_log2_q(normalize_freqs(H))).sum(axis=1)
    seeds = [normalize_freqs(H.sum(axis=0))]
    best = Hf @ _neg_log2_q(seeds[0])
    best_choice = None
    trials = []
    for K in ks:
        while len(seeds) < K:  # extend the (nested) farthest-point seed sequence
            gap = best - own_bits
            i = int(np.argmax(gap))
            if gap[i] <= 1e-9:
                break  # every model is already coded at its own entropy
            f = normalize_freqs(H[i])
            seeds.append(f)
            best = np.minimum(best, Hf @ _neg_log2_q(f))
        freqs = np.stack(seeds[:K])
        for _ in range(LLOYD_ITERS if freqs.shape[0] > 1 else 0):
            cost = Hf @ _neg_log2_q(freqs).T  # [n, K] bits
            assign = np.argmin(cost, axis=1)
            cent, assign = _centroids(H, assign, freqs.shape[0])
            freqs = normalize_freqs(cent)
        cost = Hf @ _neg_log2_q(freqs).T
        assign = np.argmin(cost, axis=1)
        bits = float(cost[np.arange(n), assign].sum())
        Keff = freqs.shape[0]
        est = bits / 8.0 + Keff * nb * 2 + (n if Keff > 1 else 0)
        trials.append((Keff, est))
        if best_choice is not None and est >= best_choice[3]:
            break  # estimated size stopped improving: larger K will not pay off either
        best_choice = (freqs, assign, bits, est)
        if len(seeds) < K:
            break  # ran out of distinct models
    freqs, assign, bits, _ = best_choice
    # drop tables no model uses after the final assignment (keeps K minimal)
    used = np.unique(assign)
    if used.size < freqs.shape[0]:
        remap = np.full(freqs.shape[0], -1, dtype=np.int64)
        remap[used] = np.arange(used.size)
        freqs, assign = freqs[used], remap[assign]
    return freqs, assign, bits, trials


@dataclass
class ModelSet:
    """The coded models of one chunk.

    cum: uint32 [n_models, 257] cumulative tables (padded with M past nbins).
    model_index: uint16 [2, L, C] global row of `cum` per (kv, layer, channel).
    groups: list of (nbins, K) in ascending nbins; rows of `cum` are grouped in that order.
    local_index: uint8 [2, L, C] index inside the (kv, layer)'s nbins group.
    freqs: list of int64 [K, nbins] tables per group.
    coded_bits: cross-entropy of the histograms under the coded models (bits).
    ideal_bits: sum of per-(kv, layer, channel) empirical entropies (bits).
    trials: per group, list of (K, estimated bytes) tried.
    """

    cum: np.ndarray
    model_index: np.ndarray
    groups: list
    local_index: np.ndarray
    freqs: list
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
    groups, freqs_list, trials = [], [], []
    coded = ideal = 0.0
    for nb in sorted(set(nb_layer.reshape(-1).tolist())):
        sel = [(kv, layer) for kv in range(2) for layer in range(L) if nb_layer[kv, layer] == nb]
        H = np.concatenate([hists[kv][layer, :, :nb] for kv, layer in sel])  # [len(sel) * C, nb]
        fr, assign, bits, tr = _cluster_group(H, ladder)
        for j, (kv, layer) in enumerate(sel):
            local[kv, layer] = assign[j * C : (j + 1) * C]
        groups.append((int(nb), int(fr.shape[0])))
        freqs_list.append(fr)
        trials.append((int(nb), tr))
        coded += bits
        ideal += entropy_bits_of_counts(H)
    cum, model_index = _assemble(list(zip([g[0] for g in groups], freqs_list)), nb_layer, local, C)
    return ModelSet(cum=cum, model_index=model_index, groups=groups, local_index=local.astype(np.uint8),
                    freqs=freqs_list, coded_bits=coded, ideal_bits=ideal, trials=trials)


# ---------------------------------------------------------------------------------------
# Serialisation (docs/bitstream.md section 4.3)
# ---------------------------------------------------------------------------------------
def serialize_models(ms: ModelSet) -> tuple[dict, dict]:
    """Return (header fields, arrays) for the model codebook.

    header: {"model_groups": [[nbins, K], ...]} (ascending nbins).
    arrays: "ent_freqs" uint16 [sum K*nbins] (each group's K tables of nbins frequencies,
      groups in header order); "ent_model_index" uint8 [2, L, C] (local index in the
      group of the (kv, layer)), omitted when every group has K == 1.
    """
    hdr = {"model_groups": [[int(nb), int(k)] for nb, k in ms.groups]}
    freqs = np.concatenate([f.reshape(-1) for f in ms.freqs]).astype(np.uint16)
    arrays = {"ent_freqs": freqs}
    if any(k > 1 for _, k in ms.groups):
        arrays["ent_model_index"] = np.ascontiguousarray(ms.local_index, dtype=np.uint8)
    return hdr, arrays


def deserialize_models(hdr: dict, arrays: dict, nbins_k: Sequence[int], nbins_v: Sequence[int],
                       L: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    """Rebuild (cum uint32 [n_models, 257], model_index uint16 [2, L, C]) from the
    serialised codebook, validating everything. Raises CodecError on any inconsistency."""
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
    if any(not (1 <= g[1] <= MAX_K) for g in groups):
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
