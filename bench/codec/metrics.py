"""Measurements of ``python -m bench.codec``: median wall and CPU time, the decode-time
breakdown per stage, per-layer relative L2 error and the perplexity / KL / top-1 cost of a
decoded KV on its continuation."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Optional

import torch

from codec import api
from codec.registry import CODECS
from codec.config import CodecConfig


def median_time(fn, repeats: int, clock=time.perf_counter) -> float:
    """Median seconds of ``clock`` (wall by default) over ``repeats`` calls of ``fn`` after
    a warm-up call (JIT, allocator), which is excluded."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _threads(n: Optional[int]):
    """Set torch's and numba's thread counts (None = the machine's); returns the old pair."""
    import numba

    old = (torch.get_num_threads(), numba.get_num_threads())
    want = n or os.cpu_count() or 1
    torch.set_num_threads(max(1, min(want, os.cpu_count() or 1)))
    numba.set_num_threads(max(1, min(want, numba.config.NUMBA_NUM_THREADS)))
    return old


def _median_cpu(fn, repeats: int) -> float:
    """Median CPU seconds (all threads of this process) of ``fn`` after a warm-up."""
    return median_time(fn, repeats, clock=time.process_time)


def _into_fn(chunks: list[bytes]):
    """A call decoding every chunk into destination tensors allocated once (the
    connector's path: ``api.decode_kv_into``), so no output page is touched first."""
    outs = []
    for c in chunks:
        h = api.peek_header(c)
        shape = (h["L"], h["T"], h["H"], h["D"])
        dt = getattr(torch, h["dtype"])
        outs.append((torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)))
    return lambda: [api.decode_kv_into(c, *o) for c, o in zip(chunks, outs)]


def decode_breakdown(name: str, chunks: list[bytes], repeats: int) -> dict[str, float]:
    """Seconds to decode ``chunks``: ``e2e_1thread`` (container -> tensors
    in the model dtype, torch and numba on one thread), ``e2e_cpu`` (CPU seconds of the
    default multi-threaded decode: Msym per CPU-second), ``into`` / ``into_1thread``
    (the same into tensors allocated once, ``decode_kv_into``: without the first touch of
    fresh output pages), ``parse`` (the container parsed and its header checked,
    checksum included), ``checksum`` (the checksum alone), ``ref`` (the reference
    unfused path of cachegen/cachegen-ref/quant8: symbols, float32 dequantization, cast)
    and ``coder`` (rANS decoding of the symbols alone into uint8 arrays, entropy-coded
    codecs only: the entropy core)."""
    from codec import bitstream, entropy

    into = _into_fn(chunks)
    out = {"e2e_cpu": _median_cpu(lambda: [api.decode_kv(c) for c in chunks], repeats),
           "into": median_time(into, repeats),
           "parse": median_time(lambda: [api._read(c) for c in chunks], repeats),
           "checksum": median_time(lambda: [bitstream.checksum(c[4], memoryview(c)[
               :len(c) - bitstream.checksum_bytes(c[4])]) for c in chunks], repeats)}
    old = _threads(1)
    try:
        out["e2e_1thread"] = median_time(lambda: [api.decode_kv(c) for c in chunks], repeats)
        out["into_1thread"] = median_time(into, repeats)
    finally:
        torch.set_num_threads(old[0])
        import numba

        numba.set_num_threads(old[1])
    if getattr(CODECS[name], "fused_cpu", False):
        parsed = []
        for c in chunks:
            h, arrays, payload, cobj = api._read(c)
            parsed.append((h, arrays, payload, cobj))

        def ref():
            for h, arrays, payload, cobj in parsed:
                cobj.decode(h["codec_header"], arrays, payload,
                            (h["L"], h["T"], h["H"], h["D"]), h["dtype"], fused=False)

        out["ref"] = median_time(ref, repeats)
        if getattr(CODECS[name], "entropy", False):
            def coder():
                for h, arrays, payload, _ in parsed:
                    ch = h["codec_header"]
                    cfg = CodecConfig.from_dict(ch["config"])
                    tq = h["T"] - ch["n_sink"]
                    ea = {n: a for n, a in arrays.items() if n.startswith("ent_")}
                    entropy.decode_symbols(ch["entropy"], ea, payload, h["L"], tq,
                                           h["H"] * h["D"], [b - 1 for b in cfg.key_bins],
                                           [b - 1 for b in cfg.value_bins])

            out["coder"] = median_time(coder, repeats)
    return out


def rel_l2_per_layer(x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """||x - y|| / ||x|| per layer (x, y [L, T, H, D]); 0 where ||x|| = 0."""
    x32, y32 = x.float().flatten(1), y.float().flatten(1)
    num = (x32 - y32).norm(dim=1)
    den = x32.norm(dim=1)
    return [float(n / d) if d > 0 else 0.0 for n, d in zip(num, den)]


def continuation_stats(bundle, k, v, ctx) -> dict:
    from kv_extraction_hf.inject import continuation_logits

    logits = continuation_logits(bundle, k, v, ctx["context_ids"], ctx["continuation_ids"])
    return {"logp": torch.log_softmax(logits.float(), -1)}


def quality(base: dict, test: dict, cont: list[int]) -> dict:
    """Perplexity increase (%), KL(base || test) (nats, mean over positions), top-1 match."""
    tgt = torch.tensor(cont, dtype=torch.long)[:, None]
    lb, lt = base["logp"], test["logp"]
    nll_b = float(-lb.gather(1, tgt).mean())
    nll_t = float(-lt.gather(1, tgt).mean())
    kl = float((lb.exp() * (lb - lt)).sum(-1).mean())
    top1 = float((lb.argmax(-1) == lt.argmax(-1)).float().mean())
    return {"ppl_base": math.exp(nll_b), "ppl": math.exp(nll_t),
            "ppl_increase_pct": (math.exp(nll_t - nll_b) - 1) * 100, "kl": kl, "top1_match": top1}

