"""Native (C) vs numba rANS decode, side by side, on the default model's KV shape.

Purpose: the figures behind docs/codec.md's native-decoder section (CacheGen, Liu et al.,
SIGCOMM 2024, section 5.3: decoding must keep up with the stream). Rows, each at 1 and 2
worker threads, for the native kernel (codec.entropy.rans_native) and the numba kernel it
replaces: the rANS core alone (``codec.entropy.rans_cpu.decode_streams``: bytes -> uint8 symbols)
on symbols of 3 alphabet sizes, and the end-to-end cachegen decode (``codec.decode_kv``:
container -> bf16 tensors) at 3 levels. Figures: Msym/s of wall time and Msym per
CPU-second (process CPU time, all threads), median of --repeat runs, and the 1-minute load
average before and after (the machine may be shared: say so when quoting them). Prints
figures only; nothing is asserted about speed.

Run it: .venv/bin/python -m bench.rans_native [--tokens 1024] [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

__all__ = ["main", "time_call"]

LAYERS, HEADS, HEAD_DIM = 30, 3, 64          # SmolLM2-135M: 30 layers, 3 KV heads x 64


def time_call(fn, repeat: int) -> tuple[float, float]:
    """(median wall seconds, median process CPU seconds) of `repeat` calls after one warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def _core_case(T: int, nbins: int, seed: int):
    from codec.entropy import models as prob
    from codec.entropy import rans_cpu

    rng = np.random.default_rng(seed)
    C = HEADS * HEAD_DIM
    sd = nbins / 6.0
    def sym():
        s = np.rint(rng.normal(nbins / 2 - 0.5, sd, (LAYERS, T, C)))
        return np.clip(s, 0, nbins - 1).astype(np.uint8)
    sk, sv = sym(), sym()
    ms = prob.build_models(prob.histograms(sk), prob.histograms(sv), [nbins] * LAYERS,
                           [nbins] * LAYERS)
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, 16, T)
    payload = pay.tobytes()
    return (lambda: rans_cpu.decode_streams(payload, lens, ms.cum, ms.model_index, LAYERS, T, C,
                                            16, T)), sk.size * 2, len(payload)


def _e2e_case(T: int, level: int, seed: int):
    import torch

    import codec

    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(LAYERS, 1, HEADS, HEAD_DIM, generator=g) * 2 + 0.1
    k = (torch.randn(LAYERS, T, HEADS, HEAD_DIM, generator=g) * scale).to(torch.bfloat16)
    v = torch.randn(LAYERS, T, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    data = codec.encode_kv(k, v, codec="cachegen", level=level)
    return (lambda: codec.decode_kv(data)), k.numel() * 2, len(data)


def main(argv: list[str] | None = None) -> int:
    """Print the side-by-side table; exit 0 (2 on bad arguments)."""
    ap = argparse.ArgumentParser(prog="python -m bench.rans_native", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per chunk (default 1024)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per cell (median; default 5)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.repeat < 1 or any(t < 1 for t in a.threads):
        ap.error("--tokens, --repeat and --threads must be >= 1")
    import numba

    from codec.entropy import rans_native

    os.environ["CACHEGEN_NATIVE"] = "1"       # on here (even without AVX2), `disabled()` for the numba rows
    if not rans_native.enabled():
        print("native decoder unavailable: only the numba figures would print", file=sys.stderr)
        return 1
    load0 = os.getloadavg()[0]
    cases = [(f"core nbins={n}", *_core_case(a.tokens, n, n)) for n in (4, 16, 64)]
    cases += [(f"cachegen {lv} e2e", *_e2e_case(a.tokens, lv, lv)) for lv in (0, 1, 5)]
    hdr = f"{'row':<18}{'kernel':<8}" + "".join(f"{f'{t}T Msym/s':>13}{f'{t}T Msym/cpu-s':>16}" for t in a.threads)
    print(f"shape: {LAYERS} layers x {a.tokens} tokens x {HEADS * HEAD_DIM} channels x K/V; "
          f"median of {a.repeat}; cpus={os.cpu_count()}")
    print(hdr)
    ratios = []
    for name, fn, n_sym, n_bytes in cases:
        rates = {}
        for kernel in ("native", "numba"):
            cells = ""
            for t in a.threads:
                numba.set_num_threads(min(t, numba.config.NUMBA_NUM_THREADS))
                if kernel == "native":
                    wall, cpu = time_call(fn, a.repeat)
                else:
                    with rans_native.disabled():
                        wall, cpu = time_call(fn, a.repeat)
                rates[(kernel, t)] = n_sym / wall / 1e6
                cells += f"{n_sym / wall / 1e6:>13.0f}{n_sym / max(cpu, 1e-9) / 1e6:>16.0f}"
            print(f"{name:<18}{kernel:<8}{cells}")
        for t in a.threads:
            ratios.append(f"{name} {t}T native/numba {rates[('native', t)] / rates[('numba', t)]:.2f}x")
        if len(a.threads) > 1:
            t0, t1 = a.threads[0], a.threads[-1]
            ratios.append(f"{name} native {t1}T/{t0}T {rates[('native', t1)] / rates[('native', t0)]:.2f}x")
    print("\n".join(ratios))
    print(f"load average (1 min): {load0:.2f} before, {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
