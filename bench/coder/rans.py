"""``python -m bench.coder rans``: the numba rANS coder (codec.entropy.rans_cpu) encode/decode Msym/s,
1 thread and parallel, on a synthetic chunk or real symbols (--npz), then the same symbols
through constriction (bench.coder.constriction). Separate from bench/coder/cli.py (the command
and the entropy-stage figures) because it owns the synthetic symbol source and the
renormalisation-rate measurement of the bare coder (J. Duda, arXiv:1311.2540)."""
from __future__ import annotations

import argparse
import time
from typing import Optional

import numpy as np

from bench.coder.constriction import compare_constriction
from codec.entropy import models as prob
from codec.entropy.rans_cpu import PROB_SCALE, decode_streams, encode_streams
from cachegen_common import flags


def _numba_threads() -> Optional[int]:
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is in requirements.txt
        return None
    return numba.get_num_threads()


def _synthetic_chunk(L: int, T: int, C: int, nbins: int, n_models: int, seed: int = 0):
    """Laplace-like symbols per (kv, layer, channel) drawn from `n_models` quantized tables
    of varying width (a stand-in for real KV symbols; the figures depend on the symbol
    statistics only through the renormalisation rate)."""
    rng = np.random.default_rng(seed)
    xs = np.arange(nbins) - (nbins - 1) / 2
    cums = []
    for sc in np.linspace(0.4, 3.0, n_models):
        p = np.exp(-np.abs(xs) / sc)
        p /= p.sum()
        f = 1 + np.floor(p * (PROB_SCALE - nbins)).astype(np.int64)
        f[np.argmax(f)] += PROB_SCALE - f.sum()
        c = np.full(257, PROB_SCALE, np.int64)
        c[0] = 0
        c[1 : nbins + 1] = np.cumsum(f)
        cums.append(c)
    cum = np.stack(cums).astype(np.uint32)
    mi = rng.integers(0, n_models, size=(2, L, C)).astype(np.uint16)
    syms = []
    for kv in range(2):
        cdf = cum[mi[kv]].astype(np.float64)[..., 1 : nbins + 1] / PROB_SCALE  # [L, C, nbins]
        u = rng.random((L, C, T))
        s = (u[..., None] >= cdf[:, :, None, :]).sum(axis=-1).clip(0, nbins - 1)
        syms.append(np.ascontiguousarray(s.transpose(0, 2, 1)).astype(np.uint8))  # [L, T, C]
    return syms[0], syms[1], cum, mi


def rans_bench(argv=None) -> int:
    """``python -m bench.coder rans``: numba rANS encode/decode Msym/s (1 thread and
    parallel) on a chunk, against constriction's RangeEncoder/AnsCoder on the same symbols."""
    ap = argparse.ArgumentParser(prog="python -m bench.coder rans",
                                 description="rANS CPU coder throughput (Msym/s) vs constriction")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--channels", type=int, default=192)
    ap.add_argument("--nbins", type=int, default=16)
    ap.add_argument("--channels-per-stream", type=int, default=4)
    flags.add_repeats(ap, default=5)
    ap.add_argument("--no-constriction", action="store_true")
    ap.add_argument("--npz", default=None, help="real symbols: sym_k, sym_v [L, T, C], nbins_k, nbins_v "
                    "(models from codec.entropy.models.build_models); default: synthetic")
    a = ap.parse_args(argv)
    if a.npz:
        d = np.load(a.npz)
        sk, sv = np.ascontiguousarray(d["sym_k"]), np.ascontiguousarray(d["sym_v"])
        ms = prob.build_models(prob.histograms(sk), prob.histograms(sv), list(d["nbins_k"]), list(d["nbins_v"]))
        cum, mi = ms.cum, ms.model_index
        L, T, C = sk.shape
    else:
        L, T, C = a.layers, a.tokens, a.channels
        sk, sv, cum, mi = _synthetic_chunk(L, T, C, a.nbins, 64)
    G = a.channels_per_stream
    n = 2 * sk.size
    freq = np.diff(cum.astype(np.int64), axis=1)
    nbins_of = (freq > 0).sum(axis=1)
    bits = 0.0
    for kv, s in enumerate((sk, sv)):
        m = np.broadcast_to(mi[kv][:, None, :], s.shape)
        bits += float(-np.log2(freq[m, s] / PROB_SCALE).sum())
    print(f"chunk: {L} layers x {T} tokens x {C} channels x K/V = {n} symbols, "
          f"{bits / n:.3f} bits/symbol, {G} channels per stream, numba threads={_numba_threads()}")
    for par in (False, True):
        encode_streams(sk, sv, cum, mi, G, T, parallel=par)  # warm-up / compile
        te, td, ce, cd = [], [], [], []
        for _ in range(a.repeats):
            c0, t0 = time.process_time(), time.perf_counter()
            pay, lens = encode_streams(sk, sv, cum, mi, G, T, parallel=par)
            c1, t1 = time.process_time(), time.perf_counter()
            dk, dv = decode_streams(pay, lens, cum, mi, L, T, C, G, T, parallel=par)
            c2, t2 = time.process_time(), time.perf_counter()
            te.append(t1 - t0)
            td.append(t2 - t1)
            ce.append(c1 - c0)
            cd.append(c2 - c1)
        assert np.array_equal(dk, sk) and np.array_equal(dv, sv)
        tag = "parallel" if par else "1 thread"
        # CPU seconds are reported beside wall time: on a shared machine they show what
        # the code costs per core regardless of how long it waited for one
        print(f"numba rANS {tag:8s}: encode {n / np.median(te) / 1e6:7.1f} Msym/s wall "
              f"({n / np.median(ce) / 1e6:5.0f} Msym per CPU-s), decode {n / np.median(td) / 1e6:7.1f} Msym/s wall "
              f"({n / np.median(cd) / 1e6:5.0f} Msym per CPU-s) (median of {a.repeats}); payload "
              f"{pay.size} B = {100 * (pay.size * 8 / bits - 1):+.3f}% vs cross-entropy, "
              f"+{lens.size * 2} B length table")
    if a.no_constriction:
        return 0
    return compare_constriction(sk, sv, cum, mi, a.repeats)
