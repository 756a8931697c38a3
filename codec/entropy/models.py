"""Probability models for the entropy coder: per-(layer, channel) histograms, a per-chunk
codebook of 16-bit frequency tables, and its compact serialisation.

Purpose: CacheGen codes each (layer, channel) with its own distribution over the tokens
of a chunk (Liu et al., SIGCOMM 2024, section 5.2). Storing one 16-bit CDF per (layer,
channel) as LMCache does costs ~13% of the output at 256 tokens; instead we cluster the
per-(kv, layer, channel) histograms of each distinct `nbins` into K centroid
distributions (K-means under cross-entropy, i.e. the KL-divergence "Bregman" K-means
of Banerjee et al., JMLR 2005, with a deterministic farthest-point initialisation) and
store K frequency tables + one small index per (kv, layer, channel); the groups are
fitted side by side in threads when numba has several workers. K is chosen per
`nbins` group among {1, 4, 16, ..., 2048} (capped by the number of models) to minimise
the group's description length: payload + codebook + index bits (Rissanen's minimum
description length principle), unless that leaves the cross-entropy more than
XENT_TARGET over the empirical entropy and a larger K meets it within MDL_SLACK bytes;
K above K_SIZE_MAX is tried for that target only.
The codebook is sent compactly (format version 4): each table as codes
q = round(64 * sqrt(p)) (w = q^2, normalised to 16 bits) over its nonzero range (first
symbol and span), Rice-coded (R. F. Rice, JPL 79-22, 1979) as zigzag deltas along the
range; the indices Rice-coded with tables numbered by decreasing use. Versions 3 (no
ranges) and 2 (16-bit tables) are still read. See docs/bitstream.md 4.3.

Everything here is deterministic for a given input (fixed initialisation, fixed number
of iterations, lowest-index tie-breaking, integer-only frequency normalisation).

Layout: histograms, clustering and `build_models` here; the integer table arithmetic and
Rice / range coding in codec/entropy/codebook_codes.py, `ModelSet` and the codebook serialisation
in codec/entropy/codebook.py (import them from there).

Run: imported by codec/entropy/__init__.py; tests: .venv/bin/python -m pytest tests/codec/test_codec_entropy.py tests/codec/test_codec_tables.py -q
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from ..scratch import np_empty
from ..threads import num_workers, run_kernel

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover
    njit = None

__all__ = ["K_LADDER", "histograms", "build_models"]

# The integer table arithmetic and the codebook (ModelSet, serialisation) live in
# codec.entropy.codebook_codes and codec.entropy.codebook (modules stay under 600 lines).
from .codebook_codes import (MAX_K, MAX_MODELS, entropy_bits_of_counts,  # noqa: E402
                             freqs_from_codes, index_cost, normalize_freqs, normalize_rows,
                             ranged_cost, table_codes)
from .codebook import ModelSet, assemble_models, layer_nbins  # noqa: E402

K_LADDER = (1, 4, 16, 64, 256, 512, 768, 1024, 1536, 2048)  # candidate codebook sizes per nbins group
# Rungs above K_SIZE_MAX are tried only while no K tried so far meets XENT_TARGET (within
# MDL_SLACK): on real KV they lower the description by 0.01-0.02% of a chunk and took a
# third of the encode time (docs/codec.md section 5.1), so they serve the target only.
K_SIZE_MAX = 512
SPARSE_SEED_DENSITY = 0.15  # nonzero share below which _seed_kernel sums sparsely (same results, faster)
GROUP_THREADS = True   # fit the nbins groups side by side when numba has several workers
LLOYD_ITERS = 3  # fixed K-means iterations: 3 is within 0.05% of 6 on real KV at half the time
# Codebook size (docs/bitstream.md 4.3, informative): K minimises the group's description
# length (MDL); where that K leaves the cross-entropy more than XENT_TARGET above the
# group's empirical entropy, the smallest-description K that meets XENT_TARGET is taken
# instead among those that cost at most MDL_SLACK more bytes than the minimum (if none
# does, the one of lowest cross-entropy among them, so that the payload stays <= 1% over
# the empirical entropy; a measured trade, docs/bitstream.md 4.3).
# MDL_SLACK = 0 gives the pure minimum-description-length choice.
XENT_TARGET = 0.008
MDL_SLACK = 0.0015


# ---------------------------------------------------------------------------------------
# Histograms
# ---------------------------------------------------------------------------------------
if njit is not None:

    @njit(cache=True, nogil=True)
    def _hist_kernel(sym, out):
        """sym uint8 [L, T, C] -> out int64 [L, C, 256]. Counted per layer in an int32
        [256, C] scratch (symbol-major: consecutive channels of one token hit adjacent
        counters, cache- and TLB-friendly), then transposed into the layer's rows of
        ``out`` while it is in cache (a numpy transpose + int64 cast of the whole result
        afterwards took as long as the counting)."""
        L, T, C = sym.shape
        tmp = np.zeros((256, C), dtype=np.int32)
        for layer in range(L):
            tmp[:] = 0
            for t in range(T):
                for c in range(C):
                    tmp[sym[layer, t, c], c] += 1
            for c in range(C):
                for s in range(256):
                    out[layer, c, s] = tmp[s, c]


def histograms(sym: np.ndarray) -> np.ndarray:
    """Per-(layer, channel) symbol counts over tokens.

    Args: sym uint8 [L, T, C] (T < 2^31). Returns: int64 [L, C, 256].
    """
    sym = np.ascontiguousarray(sym)
    if sym.dtype != np.uint8 or sym.ndim != 3:
        raise ValueError("sym must be uint8 [L, T, C]")
    L, T, C = sym.shape
    if njit is not None:
        out = np.empty((L, C, 256), dtype=np.int64)   # every entry written by the kernel
        _hist_kernel(sym, out)
        return out
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
    (prange: rows are independent; the parallel build is used for big problems.)
    Each sum runs over the row's nonzero symbols in ascending order, one rounding per
    product and per addition; four symbols are added per pass over ``acc`` (written as
    one left-to-right expression: the same operations in the same order, so the same
    float64 results) so that ``acc`` is loaded and stored once per four products."""
    n, nb = H.shape
    K = W.shape[1]
    for i in prange(n):
        acc = np.zeros(K, np.float64)
        nz = np.empty(nb, np.int64)
        m = 0
        for s in range(nb):
            if H[i, s] != 0.0:
                nz[m] = s
                m += 1
        j = 0
        while j + 4 <= m:
            s0, s1, s2, s3 = nz[j], nz[j + 1], nz[j + 2], nz[j + 3]
            h0, h1, h2, h3 = H[i, s0], H[i, s1], H[i, s2], H[i, s3]
            for k in range(K):
                acc[k] = acc[k] + h0 * W[s0, k] + h1 * W[s1, k] + h2 * W[s2, k] + h3 * W[s3, k]
            j += 4
        while j < m:
            s0 = nz[j]
            h0 = H[i, s0]
            for k in range(K):
                acc[k] = acc[k] + h0 * W[s0, k]
            j += 1
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
        normalize_rows(row, f)
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
            s = 0
            while s + 4 <= nb:  # vectorises over i; four symbols per pass over cost
                w0, w1, w2, w3 = seed_nlq[k, s], seed_nlq[k, s + 1], seed_nlq[k, s + 2], seed_nlq[k, s + 3]
                for i in range(n):   # the same additions in the same order as one by one
                    cost[i] = cost[i] + Ht[s, i] * w0 + Ht[s + 1, i] * w1 + Ht[s + 2, i] * w2 + Ht[s + 3, i] * w3
                s += 4
            while s < nb:
                w0 = seed_nlq[k, s]
                for i in range(n):
                    cost[i] = cost[i] + Ht[s, i] * w0
                s += 1
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
    # the assignment to the first k_done seeds (argmin, lowest index on ties) and its cost:
    # a larger K only adds seeds, so only the new seeds' columns are summed (`_seed_assign`)
    seed_state = [0, np.zeros(n, np.int64), np.zeros(n, np.float64)]
    cost = np.empty(n, np.float64)
    ideal = entropy_bits_of_counts(Hi)
    choices = []   # (codes, freqs, assign, bits, est) per K tried
    trials = []
    for K in ks:
        if K > K_SIZE_MAX and choices:
            min_est = min(c[4] for c in choices)
            if any(c[3] <= (1 + XENT_TARGET) * ideal and c[4] <= (1 + MDL_SLACK) * min_est
                   for c in choices):
                break   # the target is met: larger K would only trim the description
        n_seeds = _seed_kernel(Hi, *forms, sparse, own_bits, best, seed_nlq, n_seeds, K)
        k_eff = min(K, n_seeds)
        if k_eff == 1:
            codes, freqs = pooled_codes, pooled
            _assign_kernel(Hf, np.ascontiguousarray(_neg_log2_q(freqs).T), assign, cost)
        else:
            # Lloyd: start from the seeds' assignment, then alternate update / assign,
            # always against the tables as transmitted (codes -> 16-bit)
            _seed_assign(Hf, seed_nlq, k_eff, seed_state, assign, cost)
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


def _seed_assign(Hf: np.ndarray, seed_nlq: np.ndarray, k: int, state: list,
                 assign: np.ndarray, cost: np.ndarray) -> None:
    """``_assign_kernel(Hf, seed_nlq[:k].T, assign, cost)`` computed incrementally: state
    = [k_done, assign int64 [n], cost float64 [n]] over the first k_done seeds (updated to
    k). Only the columns k_done..k-1 are summed; a model moves to a new seed when its cost
    is strictly lower (the lowest index wins ties, as in the full argmin). Each column's
    sum is the kernel's own, so the result is identical to the full assignment."""
    k_done, sa, sc = state
    if k < k_done:   # never with an ascending ladder; kept correct anyway
        _assign_kernel(Hf, np.ascontiguousarray(seed_nlq[:k].T), assign, cost)
        return
    if k > k_done:
        na, nc = np.empty_like(sa), np.empty_like(sc)
        _assign_kernel(Hf, np.ascontiguousarray(seed_nlq[k_done:k].T), na, nc)
        if k_done == 0:
            sa[:], sc[:] = na, nc
        else:
            better = nc < sc
            sa[better] = na[better] + k_done
            sc[better] = nc[better]
        state[0] = k
    assign[:] = sa
    cost[:] = sc


def _by_use(assign: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, new assign): tables sorted by decreasing member count (stable), and the
    assignment renumbered accordingly (table order[j] becomes table j)."""
    cnt = np.bincount(assign, minlength=K)
    order = np.argsort(-cnt, kind="stable")
    rank = np_empty(K, dtype=np.int64)
    rank[order] = np.arange(K)
    return order, rank[assign]


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
    nb_layer = layer_nbins(nbins_k, nbins_v, L)
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
    work = []   # (nb, the group's (kv, layer) pairs, its histograms [len(sel) * C, nb])
    for nb in sorted(set(nb_layer.reshape(-1).tolist())):
        sel = [(kv, layer) for kv in range(2) for layer in range(L) if nb_layer[kv, layer] == nb]
        work.append((nb, sel, np.concatenate([hists[kv][layer, :, :nb] for kv, layer in sel])))
    # the groups are independent: with several numba workers they are fitted side by side
    # (each fit is deterministic, so the codebook does not depend on the thread count)
    n_threads = min(len(work), num_workers()) if GROUP_THREADS else 1
    if n_threads > 1:
        order = sorted(range(len(work)), key=lambda g: -work[g][2].size)   # largest first
        with ThreadPoolExecutor(max_workers=n_threads) as ex:
            futs = {g: ex.submit(_cluster_group, work[g][2], ladder) for g in order}
            fits = [futs[g].result() for g in range(len(work))]
    else:
        fits = [_cluster_group(H, ladder) for _, _, H in work]
    for (nb, sel, H), (cd, fr, assign, bits, tr) in zip(work, fits):
        for j, (kv, layer) in enumerate(sel):
            local[kv, layer] = assign[j * C : (j + 1) * C]
        groups.append((int(nb), int(fr.shape[0])))
        freqs_list.append(fr)
        codes_list.append(cd)
        trials.append((int(nb), tr))
        coded += bits
        ideal += entropy_bits_of_counts(H)
    cum, model_index = assemble_models(list(zip([g[0] for g in groups], freqs_list)), nb_layer, local, C)
    return ModelSet(cum=cum, model_index=model_index, groups=groups, local_index=local.astype(np.uint16),
                    freqs=freqs_list, codes=codes_list, coded_bits=coded, ideal_bits=ideal, trials=trials)
