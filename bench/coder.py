"""Coder benchmarks: throughput and overhead of the CPU entropy stage.

Purpose: the speed figures of CacheGen's arithmetic-coding stage (Liu et al., SIGCOMM 2024,
section 5.2) as this project realises it (the rANS coder of docs/bitstream.md sections 2-3;
J. Duda, "Asymmetric numeral systems", arXiv:1311.2540; interleaved streams after
F. Giesen's ryg_rans). Not a test: it prints figures (medians over --repeats after one
warm-up). Figures from a busy machine are not final.

    python -m bench.coder rans [--layers 30 --tokens 1024 --channels 192 --repeats 5]
        numba rANS (codec.rans_cpu) encode/decode Msym/s, 1 thread and parallel, vs
        constriction on the same symbols; --npz FILE for real symbols
    python -m bench.coder entropy [--npz FILE]
        sizes and Msym/s of codec.entropy.encode_symbols / decode_symbols (model table,
        length table and payload vs the empirical entropy)

FILE holds sym_k, sym_v (uint8 [L, T, C]) and nbins_k, nbins_v (int [L]).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import numpy as np

from codec import probability as prob
from codec.entropy import decode_symbols, encode_symbols
from codec.rans_cpu import PROB_SCALE, decode_streams, encode_streams
from common import flags


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
                    "(models from codec.probability.build_models); default: synthetic")
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
    try:
        import constriction
    except ImportError:  # pragma: no cover
        print("constriction not installed: skipped")
        return 0
    # constriction on the same symbols and models: one model per (kv, layer, channel),
    # i.e. one encode call per channel of T symbols (its per-model API), single thread.
    probs = [freq[m, : nbins_of[m]].astype(np.float64) / PROB_SCALE for m in range(cum.shape[0])]
    models = [constriction.stream.model.Categorical(p, perfect=False) for p in probs]
    chans = [(np.ascontiguousarray(s[layer, :, c]).astype(np.int32), int(mi[kv, layer, c]))
             for kv, s in enumerate((sk, sv)) for layer in range(L) for c in range(C)]
    for coder_name in ("RangeEncoder", "AnsCoder"):
        te, td = [], []
        for _ in range(max(2, a.repeats // 2)):
            if coder_name == "RangeEncoder":
                enc = constriction.stream.queue.RangeEncoder()
                t0 = time.perf_counter()
                for sym, m in chans:
                    enc.encode(sym, models[m])
                comp = enc.get_compressed()
                t1 = time.perf_counter()
                dec = constriction.stream.queue.RangeDecoder(comp)
                for sym, m in chans:
                    dec.decode(models[m], T)
                t2 = time.perf_counter()
            else:
                enc = constriction.stream.stack.AnsCoder()
                t0 = time.perf_counter()
                for sym, m in reversed(chans):
                    enc.encode_reverse(sym, models[m])
                comp = enc.get_compressed()
                t1 = time.perf_counter()
                dec = constriction.stream.stack.AnsCoder(comp)
                for sym, m in chans:
                    dec.decode(models[m], T)
                t2 = time.perf_counter()
            te.append(t1 - t0)
            td.append(t2 - t1)
        print(f"constriction {coder_name:12s} 1 thread, one call per channel: encode "
              f"{n / np.median(te) / 1e6:7.1f} Msym/s, decode {n / np.median(td) / 1e6:7.1f} Msym/s; "
              f"{comp.nbytes} B")
    # constriction's best case: one model, one call (no per-channel switching)
    flat = np.ascontiguousarray(sk.reshape(-1)).astype(np.int32)
    pooled = constriction.stream.model.Categorical(np.bincount(flat).astype(np.float64) + 0.5, perfect=False)
    enc = constriction.stream.queue.RangeEncoder()
    c0, t0 = time.process_time(), time.perf_counter()
    enc.encode(flat, pooled)
    comp = enc.get_compressed()
    c1, t1 = time.process_time(), time.perf_counter()
    constriction.stream.queue.RangeDecoder(comp).decode(pooled, flat.size)
    c2, t2 = time.process_time(), time.perf_counter()
    print(f"constriction RangeEncoder   1 thread, ONE model, one call ({flat.size} symbols): encode "
          f"{flat.size / (t1 - t0) / 1e6:7.1f} Msym/s wall ({flat.size / (c1 - c0) / 1e6:5.0f} per CPU-s), decode "
          f"{flat.size / (t2 - t1) / 1e6:7.1f} Msym/s wall ({flat.size / (c2 - c1) / 1e6:5.0f} per CPU-s)")
    return 0


def entropy_bench(argv=None) -> int:
    """python -m bench.coder entropy [--npz FILE] : sizes and Msym/s of encode/decode_symbols.

    FILE (optional) holds sym_k, sym_v (uint8 [L, T, C]) and nbins_k, nbins_v (int [L]);
    default: a synthetic chunk (30 layers x 1024 tokens x 192 channels, Laplace symbols
    with per-channel widths and offsets, LMCache's 32/16-bin schedule as 31/15 symbols).
    """
    ap = argparse.ArgumentParser(prog="python -m bench.coder entropy",
                                 description=entropy_bench.__doc__)
    ap.add_argument("--npz", default=None)
    ap.add_argument("--channels-per-stream", type=int, default=4)
    ap.add_argument("--tokens-per-stream", type=int, default=None)
    flags.add_repeats(ap, default=3)
    a = ap.parse_args(argv)
    if a.npz:
        d = np.load(a.npz)
        sk, sv = d["sym_k"], d["sym_v"]
        nbk, nbv = [int(x) for x in d["nbins_k"]], [int(x) for x in d["nbins_v"]]
    else:
        rng = np.random.default_rng(0)
        L, T, C = 30, 1024, 192
        nbk = [31] * 10 + [15] * 20
        nbv = [31] * 2 + [15] * 28
        syms = []
        for nbs in (nbk, nbv):
            s = np.empty((L, T, C), np.uint8)
            for layer, nb in enumerate(nbs):
                width = rng.lognormal(0.0, 0.5, C) * nb / 12
                centre = nb // 2 + rng.integers(-2, 3, C)
                s[layer] = np.clip(np.round(rng.laplace(0.0, width, (T, C)) + centre), 0, nb - 1)
            syms.append(s)
        sk, sv = syms
    L, T, C = sk.shape
    n = 2 * sk.size
    encode_symbols(sk[:, :2], sv[:, :2], nbk, nbv)  # compile / warm up
    te, td = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        enc = encode_symbols(sk, sv, nbk, nbv, a.channels_per_stream, a.tokens_per_stream)
        t1 = time.perf_counter()
        dk, dv = decode_symbols(enc.header, enc.arrays, enc.payload, L, T, C, nbk, nbv)
        t2 = time.perf_counter()
        te.append(t1 - t0)
        td.append(t2 - t1)
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)
    tot = enc.total_bytes
    print(f"chunk [L={L}, T={T}, C={C}] x K/V = {n} symbols; groups (nbins, K) = {enc.header['model_groups']}")
    print(f"ideal (per-channel empirical entropy): {enc.ideal_bits / n:.4f} bits/sym = {enc.ideal_bits / 8:.0f} B")
    print(f"coded-model cross-entropy: {enc.entropy_bits / 8:.0f} B "
          f"({100 * (enc.entropy_bits / enc.ideal_bits - 1):+.2f}% vs ideal)")
    print(f"payload {enc.payload_bytes} B + length table {enc.length_table_bytes} B "
          f"({100 * ((enc.payload_bytes + enc.length_table_bytes) * 8 / enc.entropy_bits - 1):+.2f}% vs cross-entropy)")
    print(f"models {enc.model_bytes} B = {100 * enc.model_bytes / tot:.2f}% of {tot} B; "
          f"total {100 * (tot * 8 / enc.ideal_bits - 1):+.2f}% vs ideal")
    print(f"encode_symbols {n / np.median(te) / 1e6:.1f} Msym/s, decode_symbols {n / np.median(td) / 1e6:.1f} Msym/s "
          f"(median of {a.repeats}; both include model building / table validation)")
    return 0


COMMANDS = {"rans": rans_bench, "entropy": entropy_bench}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(f"error: usage: python -m bench.coder {{{','.join(COMMANDS)}}} [options] "
              "(python -m bench.coder --help)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])

if __name__ == "__main__":
    sys.exit(main())
