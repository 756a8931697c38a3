"""Coder benchmarks: throughput and overhead of the CPU entropy stage.

Purpose: the speed figures of CacheGen's arithmetic-coding stage (Liu et al., SIGCOMM 2024,
section 5.2) as this project realises it (the rANS coder of docs/bitstream.md sections 2-3;
J. Duda, "Asymmetric numeral systems", arXiv:1311.2540; interleaved streams after
F. Giesen's ryg_rans). Not a test: it prints figures (medians over --repeats after one
warm-up). Figures from a busy machine are not final.

    python -m bench.coder rans [--layers 30 --tokens 1024 --channels 192 --repeats 5]
        numba rANS (codec.entropy.rans_cpu) encode/decode Msym/s, 1 thread and parallel, vs
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

from bench.coder.rans import rans_bench
from codec.entropy import decode_symbols, encode_symbols
from cachegen_common import flags


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
