"""Streaming measurements over a real shaped link, with the stand-in codec (no model).

Paper: CacheGen section 5 (pipelined streaming, adaptation). Two experiments:

  pipeline: store a synthetic context, then load it (a) with stream_load (decode of chunk k
            overlaps the transfer of chunk k+1) and (b) sequentially (fetch, decode, fetch,
            ...), side by side in one run. Decode is the stand-in codec doing real CPU work
            (SHA-256 rounds calibrated to --decode-s per chunk).
      python -m bench.streaming pipeline --bandwidth-mbps 100 --chunks 8 --chunk-bytes 1000000 --decode-s 0.08
  adapt:    store a context at 3 levels, load it with AdaptivePolicy while the shaper follows
            a bandwidth trace (constant:MBPS, step:A,B,C[:PER] or artifact[:I], the artifact's
            Gbit/s scaled by 1/10 to Mbit/s); text chunks are charged tokens / --prefill-tps.
      python -m bench.streaming adapt --trace artifact --slo-s 5 --out adapt.json

Every output row records the link method. Figures measured on a shared 2-core machine are
indicative only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cachegen_common.cli import exit_status
from cachegen_common import flags
from cachegen_common.files import atomic_write_json
from bench import standin_codec as standin
from streaming.adapt.params import PolicyInputs
from streaming.adapt.policy import AdaptivePolicy
from streaming.load import stream_load
from streaming.link import ShapedLink
from streaming.store import start_store_server
from streaming.adapt.traces import Trace, apply_trace, constant, load_artifact_traces, step


def _calibrate(nbytes: int, target_s: float) -> int:
    data = standin.make_chunk(nbytes, 0)
    standin.decode(data, 3)
    t = time.perf_counter()
    standin.decode(data, 10)
    return max(1, round(target_s / ((time.perf_counter() - t) / 10)))


def _put(client, n: int, level_bytes: dict[int, int], tokens: int):
    ids = list(range(n * tokens))
    ranges = [(i * tokens, (i + 1) * tokens) for i in range(n)]
    chunks = {lv: [standin.make_chunk(b, seed=1000 * lv + i) for i in range(n)] for lv, b in level_bytes.items()}
    return client.put_context("bench-model", "bench-weights", "standin-v1", ids, chunks, ranges)


def run_pipeline(bandwidth_mbps: float, chunks: int, chunk_bytes: int, decode_s: float, method: str,
                 repeats: int) -> dict:
    rounds = _calibrate(chunk_bytes, decode_s)
    dec = standin.decoder(rounds)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cgh-bench-") as d, ShapedLink(bandwidth_mbps, method=method) as link:
        with start_store_server(d, link) as h, h.client(timeout=60) as c:
            key = _put(c, chunks, {1: chunk_bytes}, 100)
            stream_load(c, key, 1, dec)  # warm-up (connections, page cache), excluded
            gen = c.get_manifest(key).gen  # the sequential loop reads that generation, as stream_load
            for _ in range(repeats):
                r = stream_load(c, key, 1, dec, keep_decoded=False)
                t0 = time.perf_counter()  # sequential baseline on the same connection
                tx = dx = 0.0
                for k in range(chunks):
                    t = time.perf_counter()
                    data = c.get_chunk(key, 1, k, gen=gen)
                    tx += time.perf_counter() - t
                    t = time.perf_counter()
                    dec(data)
                    dx += time.perf_counter() - t
                seq = time.perf_counter() - t0
                rows.append({"pipelined_total_s": r.total_s, "transfer_s": r.transfer_s, "decode_s": r.decode_s,
                             "sequential_total_s": seq, "sequential_transfer_s": tx, "sequential_decode_s": dx})
        desc = link.describe()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med.update({
        "method": desc["method"], "rate_mbps": bandwidth_mbps, "chunks": chunks, "chunk_bytes": chunk_bytes,
        "decode_rounds": rounds, "repeats": repeats,
        "sum_transfer_decode_s": med["transfer_s"] + med["decode_s"],
        "max_transfer_decode_s": max(med["transfer_s"], med["decode_s"]),
    })
    return med


def parse_trace(spec: str, n: int) -> list[Trace]:
    kind, _, arg = spec.partition(":")
    if kind == "constant":
        return [constant(float(arg), n)]
    if kind == "step":
        vals, _, per = arg.partition(":")
        return [step([float(v) for v in vals.split(",")], int(per or max(1, n // 3)), n)]
    if kind == "artifact":
        trs = load_artifact_traces()
        return [trs[int(arg)]] if arg else trs
    raise ValueError(f"unknown trace {spec!r}: use constant:MBPS, step:A,B[:PER] or artifact[:I]")


def run_adapt(traces: list[Trace], level_bytes: dict[int, int], tokens: int, slo_s: float, prefill_tps: float,
              method: str, decode_s: float) -> tuple[list[dict], list[dict]]:
    n = len(traces[0].mbps)
    rounds = _calibrate(max(level_bytes.values()), decode_s)
    chunk_rows, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="cgh-bench-") as d, ShapedLink(traces[0].mbps[0], method=method) as link:
        with start_store_server(d, link) as h, h.client(timeout=120) as c:
            key = _put(c, n, level_bytes, tokens)
            for tr in traces:
                link.set_rate(tr.mbps[0])
                pol = AdaptivePolicy(PolicyInputs(slo_s, prefill_tps, tr.mbps[0], initial_decode_s=decode_s))
                r = stream_load(c, key, pol, standin.decoder(rounds), keep_decoded=False,
                                before_chunk=apply_trace(link, tr))
                recompute_s = r.recompute_tokens / prefill_tps
                total = r.total_s + recompute_s
                for ch, dcs in zip(r.chunks, r.decisions):
                    chunk_rows.append({
                        "trace": tr.name, "trace_scale": tr.scale, "chunk": ch.index, "bandwidth_mbps": tr.at(ch.index),
                        "throughput_mbps_est": round(dcs.throughput_mbps_est, 2), "level": ch.level,
                        "text_fallback": ch.text_fallback, "reason": dcs.reason, "elapsed_s": round(dcs.elapsed_s, 4),
                        "budget_s": None if dcs.budget_s is None else round(dcs.budget_s, 4), "slo_s": slo_s, "bytes": ch.bytes,
                        "transfer_s": round(ch.transfer_s, 4), "decode_s": round(ch.decode_s, 4),
                        "method": link.method,
                    })
                summaries.append({
                    "trace": tr.name, "trace_scale": tr.scale, "method": link.method, "slo_s": slo_s,
                    "load_s": round(r.total_s, 4), "recompute_s_est": round(recompute_s, 4), "total_s": round(total, 4),
                    "slo_violated": total > slo_s, "levels": [ch.level for ch in r.chunks], "bytes": r.bytes,
                    "prefill_tokens_per_s": prefill_tps, "error": r.error,
                })
                print(f"{tr.name:>22}  {link.method}  total {total:6.3f} s (load {r.total_s:.3f} + recompute {recompute_s:.3f})"
                      f"  SLO {slo_s} s {'VIOLATED' if total > slo_s else 'met'}  levels {[ch.level for ch in r.chunks]}", flush=True)
    return chunk_rows, summaries


def _write(path: Path | None, doc) -> None:
    if path:
        atomic_write_json(path, doc, indent=2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.streaming", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n")[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pipeline")
    flags.add_bandwidth(p, default=100.0)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-bytes", type=int, default=1_000_000)
    p.add_argument("--decode-s", type=float, default=0.08, help="target stand-in decode seconds per chunk")
    flags.add_repeats(p, default=3)
    flags.add_link_method(p)
    flags.add_out(p, type=Path, help="also write the row here (JSON, atomically)")
    a2 = sub.add_parser("adapt")
    a2.add_argument("--trace", default="artifact", help="constant:MBPS | step:A,B,C[:PER] | artifact[:I]")
    a2.add_argument("--chunks", type=int, default=10, help="chunks for constant/step traces")
    a2.add_argument("--level-bytes", type=int, nargs=3, default=[430_000, 540_000, 720_000],
                    help="bytes per chunk at levels 1,2,3 (default: 1/10 of a SmolLM2 1.5K-token chunk estimate)")
    a2.add_argument("--tokens-per-chunk", type=int, default=1500)
    a2.add_argument("--slo-s", type=float, default=0.5)
    a2.add_argument("--prefill-tps", type=float, default=30000.0, help="engine prefill tokens/s for text chunks")
    a2.add_argument("--decode-s", type=float, default=0.01)
    flags.add_link_method(a2)
    flags.add_out(a2, type=Path, help="also write the chunks and summaries here (JSON, atomically)")
    a = ap.parse_args(argv)
    from streaming.errors import StreamingError

    def run() -> None:
        if a.cmd == "pipeline":
            row = run_pipeline(a.bandwidth_mbps, a.chunks, a.chunk_bytes, a.decode_s, a.link_method,
                               a.repeats)
            print(json.dumps(row, indent=1))
            _write(a.out, row)
        else:
            traces = parse_trace(a.trace, a.chunks)
            rows, sums = run_adapt(traces, dict(zip((1, 2, 3), a.level_bytes)), a.tokens_per_chunk, a.slo_s,
                                   a.prefill_tps, a.link_method, a.decode_s)
            viol = sum(s["slo_violated"] for s in sums)
            print(f"SLO violations: {viol}/{len(sums)}")
            _write(a.out, {"chunks": rows, "summaries": sums})

    return exit_status(run, (StreamingError, ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
