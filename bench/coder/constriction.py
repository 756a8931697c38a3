"""The constriction library's coders (RangeEncoder, AnsCoder; https://github.com/bamler-lab/constriction)
on the symbols and models of ``python -m bench.coder rans``: one encode call per channel
(its per-model API) and its best case (one model, one call), single thread. Separate from
bench/coder/rans.py because it is the optional comparison (skipped when constriction is
not installed or with --no-constriction), not our coder."""
from __future__ import annotations

import time

import numpy as np

from codec.entropy.rans_cpu import PROB_SCALE


def compare_constriction(sk: np.ndarray, sv: np.ndarray, cum: np.ndarray, mi: np.ndarray, repeats: int) -> int:
    """Print constriction's Msym/s and bytes on ``sk``, ``sv`` (uint8 ``[L, T, C]`` symbols)
    coded with the quantized tables ``cum`` (uint32 ``[n_models, 257]``, scale PROB_SCALE)
    picked by ``mi`` (``[2, L, C]`` model index). Returns 0 (also when constriction is absent)."""
    L, T, C = sk.shape
    n = 2 * sk.size
    freq = np.diff(cum.astype(np.int64), axis=1)
    nbins_of = (freq > 0).sum(axis=1)
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
    q, st = constriction.stream.queue, constriction.stream.stack
    # name: (encoder, encode one channel, decoder of the compressed words, encode order);
    # the ANS stack encodes in reverse so that it decodes in order
    coders = {"RangeEncoder": (q.RangeEncoder, lambda enc, sym, m: enc.encode(sym, m), q.RangeDecoder, chans),
              "AnsCoder": (st.AnsCoder, lambda enc, sym, m: enc.encode_reverse(sym, m), st.AnsCoder,
                           chans[::-1])}
    for coder_name, (make_enc, encode, make_dec, enc_order) in coders.items():
        te, td = [], []
        for _ in range(max(2, repeats // 2)):
            enc = make_enc()
            t0 = time.perf_counter()
            for sym, m in enc_order:
                encode(enc, sym, models[m])
            comp = enc.get_compressed()
            t1 = time.perf_counter()
            dec = make_dec(comp)
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
