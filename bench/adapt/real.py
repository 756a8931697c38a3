"""The real half of ``python -m bench.adapt``: the adaptive policy on the real shaped link
(:func:`run_real`: streaming.link.ShapedLink, the KV store server, stand-in chunks of the
real per-level sizes and a decoder doing calibrated CPU work, streaming.load.stream_load
unmodified) and its comparison with the simulation on the same requests
(:func:`sim_vs_real`). Separate from bench/adapt/cli.py (the command) and bench/adapt/sim.py
(the clock-model simulation) because it needs the link and the store.
"""
from __future__ import annotations

import statistics
import tempfile
import time

from bench.adapt.sim import TableManifest, request_row, clock_model, make_adaptive
from cachegen_common.units import mbps_to_bytes_per_s
from bench import standin_codec as standin
from streaming.adapt import oracle
from streaming.adapt.params import DEFAULT_PRESET
from streaming.adapt.traces import Trace, apply_trace


def _calibrate_rounds(nbytes: int, target_s: float) -> int:
    data = standin.make_chunk(max(nbytes, 64), 0)
    standin.decode(data, 2)
    t = time.perf_counter()
    standin.decode(data, 8)
    per = (time.perf_counter() - t) / 8
    return max(1, round(target_s / per))


def run_real(table, traces: list[tuple[str, Trace]], slo: float, prefill_tps: float, inject: float, kl,
             method: str, log=print, extra_cases=(), preset: str = DEFAULT_PRESET) -> tuple[list, list, dict, dict]:
    """The adaptive policy on the real shaped link for each (set, trace) at `slo`.
    Returns (request rows, timelines, link description, calibration)."""
    from streaming.load import stream_load
    from streaming.link import ShapedLink
    from streaming.store import start_store_server

    man = TableManifest(table)
    util = None if kl is None else {lv: -kl[lv] for lv in man.levels}
    model = clock_model(table, prefill_tps, inject, 0.0, 0.0, util)
    toks = list(table["tokens"])
    # stand-in decode: rounds per (level, chunk) so that decode takes the measured s/token
    by_len: dict[int, int] = {}
    for lv in man.levels:
        per_tok = float(table["decode_s_per_token"][str(lv)])
        for k, nb in enumerate(man.sizes[lv]):
            by_len[nb] = max(by_len.get(nb, 1), _calibrate_rounds(nb, per_tok * toks[k]))

    def decode_fn(data: bytes):
        return standin.decode(data, by_len.get(len(data), 1))

    reqs, timelines, wire_extra, man_s, dec_ratio = [], [], [], [], []
    cases = [(s, tr, slo, prefill_tps) for s, tr in traces] + list(extra_cases)
    max_rate = max(max(tr.mbps) for _, tr, _, _ in cases)
    with tempfile.TemporaryDirectory(prefix="cgh-adapt-") as d, ShapedLink(max_rate, method=method) as link:
        ld = link.describe()  # the shaper's burst rule: max(min bytes, rate * seconds)
        burst, burst_s = ld["burst_min_bytes"] or link.burst_bytes, ld["burst_rate_s"]
        with start_store_server(d, link) as h, h.client(timeout=120) as c:
            ids = list(range(sum(toks)))
            chunks = {lv: [standin.make_chunk(nb, seed=1000 * lv + i) for i, nb in enumerate(man.sizes[lv])]
                      for lv in man.levels}
            key = c.put_context("bench-model", "bench-weights", "standin-v1", ids, chunks, list(man.token_ranges))
            stream_load(c, key, 0, decode_fn, keep_decoded=False)  # warm-up (connection, page cache)
            for set_name, tr, slo_c, tps in cases:
                link.set_rate(tr.at(0))
                pol = make_adaptive(slo_c, tps, table, inject, util, tr.at(0), burst, burst_s=burst_s,
                                preset=preset)
                mod = clock_model(table, tps, inject, 0.0, 0.0, util)
                r = stream_load(c, key, pol, decode_fn, keep_decoded=False, before_chunk=apply_trace(link, tr))
                levels = [ch.level for ch in r.chunks]
                kv_tok = sum(b - a for (a, b), lv in zip(man.token_ranges, levels) if lv is not None)
                total = r.total_s + kv_tok * inject + r.recompute_tokens / tps
                man_s.append(r.manifest_s)
                for ch in r.chunks:
                    if ch.level is not None and not ch.refetched:
                        wire_extra.append(ch.transfer_s - ch.bytes / mbps_to_bytes_per_s(tr.at(ch.index)))
                        want = float(table["decode_s_per_token"][str(ch.level)]) * toks[ch.index]
                        if want > 0:
                            dec_ratio.append(ch.decode_s / want)
                rates = [mbps_to_bytes_per_s(tr.at(k)) for k in range(man.chunk_count)]
                orc = oracle(mod, rates, slo_c)
                ests = [dd.throughput_mbps_est for dd in r.decisions]
                hms = [dd.estimate_mbps for dd in r.decisions]
                reqs.append(request_row("adaptive", set_name, tr, slo_c, total, levels, mod, kl, orc.utility / sum(mod.tokens),
                                 "real", abandons=len(r.abandoned),
                                 extra={"load_s": round(r.total_s, 5),
                                        "recompute_s": round(r.recompute_tokens / tps, 5),
                                        "estimates_mbps": ests, "harmonic_mean_mbps": hms,
                                        "wire_s": [round(ch.transfer_s, 5) for ch in r.chunks],
                                        "error": r.error, "prefill_tps": tps}))
                dec_by_k = {dd.chunk: dd for dd in r.decisions}
                timelines.append({"policy": "adaptive", "trace": tr.name, "trace_set": set_name, "slo_s": slo_c,
                                  "link": "real", "abandoned": r.abandoned, "chunks": [
                                      {"chunk": ch.index, "level": ch.level, "bandwidth_mbps": tr.at(ch.index),
                                       "est_mbps": (dec_by_k[ch.index].throughput_mbps_est
                                                    if ch.index in dec_by_k else None),
                                       "harmonic_mean_mbps": (dec_by_k[ch.index].estimate_mbps
                                                              if ch.index in dec_by_k else None),
                                       "budget_s": dec_by_k[ch.index].budget_s if ch.index in dec_by_k else None,
                                       "reason": dec_by_k[ch.index].reason if ch.index in dec_by_k else None,
                                       "wire_s": round(ch.transfer_s, 5), "decode_s": round(ch.decode_s, 5),
                                       "start_s": round(ch.fetch_start_s, 5), "bytes": ch.bytes}
                                      for ch in r.chunks]})
                log(f"real {set_name:>9} {tr.name:>22} SLO {slo_c:g}: total {total:.3f} s "
                    f"{'VIOLATED' if total > slo_c else 'met'} levels {levels} abandons {len(r.abandoned)}")
        desc = link.describe()
    calib = {"request_overhead_s": max(0.0, statistics.median(wire_extra)) if wire_extra else 0.001,
             "start_s": statistics.median(man_s) if man_s else 0.0, "n_chunks": len(wire_extra),
             "decode_scale": statistics.median(dec_ratio) if dec_ratio else 1.0,
             "method": "request_overhead_s: median over the real run's KV chunks of (wire seconds - bytes / "
                       "trace rate); start_s: median manifest lookup seconds; decode_scale: median of (real "
                       "decode seconds / level table's), applied to the simulated decode clock (the CPU is "
                       "shared: decode under load is slower than when the table was measured)"}
    return reqs, timelines, desc, calib


def sim_vs_real(sim_reqs: list[dict], real_reqs: list[dict]) -> list[dict]:
    """Real vs simulated on the SAME requests (trace name incl. start offset, SLO, policy):
    per (trace_set, slo_s, policy) of the real rows, both violation rates over those requests
    only, the points between them, and how many requests agree on met/violated."""
    sim = {(r["trace"], r["slo_s"], r["policy"]): r for r in sim_reqs}
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for rr in real_reqs:
        sr = sim.get((rr["trace"], rr["slo_s"], rr["policy"]))
        if sr is not None:
            groups.setdefault((rr["trace_set"], rr["slo_s"], rr["policy"]), []).append((rr, sr))
    out = []
    for (ts, slo, pol), pairs in sorted(groups.items()):
        n = len(pairs)
        vr = sum(r["violated"] for r, _ in pairs) / n
        vs = sum(s["violated"] for _, s in pairs) / n
        out.append({"trace_set": ts, "slo_s": slo, "policy": pol, "n": n, "paired": True,
                    "violation_rate_real": round(vr, 4), "violation_rate_sim": round(vs, 4),
                    "diff_points": round(100 * abs(vr - vs), 1),
                    "same_outcome": sum(r["violated"] == s["violated"] for r, s in pairs),
                    "total_s_real_minus_sim_mean": round(statistics.fmean(r["total_s"] - s["total_s"]
                                                                          for r, s in pairs), 5)})
    return out
