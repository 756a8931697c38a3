"""One row of ``python -m bench.codec``: every context encoded and decoded with one (codec,
level) chunk by chunk as ``codec.api.encode_chunks`` does (:func:`run_row`), aggregated into
the size, entropy-overhead, speed, error and perplexity columns (docs/codec.md). Separate
from bench/codec/cli.py (the command, the table, the JSON file) because it is the measurement
itself; LMCache's peer rows are bench.codec.peer_row's.
"""
from __future__ import annotations

import statistics
from typing import Optional

from bench.codec.metrics import median_time, continuation_stats, decode_breakdown, quality, rel_l2_per_layer
from bench.codec.peer_row import run_peer_row
from codec import api
from codec.registry import CODECS


def _split_ms(dec_s: float, extra: dict, n_ctx: int) -> dict:
    """``decode_<part>_ms`` per context from the summed seconds of ``decode_breakdown``."""
    out = {f"decode_{key}_ms": 1e3 * extra[key] / n_ctx
           for key in ("parse", "checksum", "into", "coder") if extra.get(key)}
    if extra.get("into"):
        out["decode_alloc_ms"] = 1e3 * (dec_s - extra["into"]) / n_ctx
        out["decode_other_ms"] = 1e3 * (extra["into"] - extra.get("parse", 0.0)
                                       - extra.get("coder", 0.0)) / n_ctx
    return out


def _break_even(nbytes: float, dec_s: float, extra: dict, n_ctx: int) -> dict:
    """``break_even_mbps*``: 8 * bytes / decode seconds / 1e6 for one context."""
    out = {"break_even_mbps": 8 * nbytes / dec_s / 1e6}
    for key in ("e2e_1thread", "into", "into_1thread"):
        if extra.get(key):
            out[f"break_even_{key}_mbps"] = 8 * nbytes / (extra[key] / n_ctx) / 1e6
    return out


def run_row(name: str, level: Optional[int], ctxs: list[dict], bundle, bases: list,
            args, config=None) -> tuple[dict, list[dict]]:
    """Encode/decode every context with one (codec, level); aggregate one JSON row.
    ``config``: the codec's config object for every encode (kvtc: the ``KvtcConfig``
    naming its calibration), None = the level's preset."""
    from bench.lmcache import peers as lmcache_peers

    if lmcache_peers.is_peer(name):
        return run_peer_row(name, ctxs, bundle, bases, args)
    tot = {"bytes": 0, "elements": 0, "dtype_bytes": 0, "payload_bytes": 0, "ideal_bits": 0.0,
           "entropy_bits": 0.0, "model_bytes": 0, "length_table_bytes": 0, "scale_bytes": 0,
           "sink_bytes": 0}
    enc_s = dec_s = 0.0
    dec_extra: dict[str, float] = {}
    q_rows, layer_rows = [], []
    rel_k_all, rel_v_all = [], []
    for ci, ctx in enumerate(ctxs):
        k, v = ctx["k"], ctx["v"]
        # encode chunk by chunk exactly as api.encode_chunks does, keeping coder stats
        T = k.shape[1]
        n_chunks = -(-T // args.chunk_tokens)
        chunks = []
        for i in range(n_chunks):
            a, b = i * args.chunk_tokens, min(T, (i + 1) * args.chunk_tokens)
            data, st = api.encode_one(k[:, a:b], v[:, a:b], name, level, config, a, T, i,
                                       n_chunks)
            chunks.append(data)
            for key in tot:
                tot[key] += st.get(key, 0) or 0
        enc_s += median_time(lambda: api.encode_chunks(k, v, codec=name, level=level,
                                                        config=config,
                                                        chunk_tokens=args.chunk_tokens),
                              args.repeats)
        dec_s += median_time(lambda: [api.decode_kv(c) for c in chunks], args.repeats)
        for key, val in decode_breakdown(name, chunks, args.repeats).items():
            dec_extra[key] = dec_extra.get(key, 0.0) + val
        k2, v2 = api.decode_chunks(chunks)
        rk, rv = rel_l2_per_layer(k, k2), rel_l2_per_layer(v, v2)
        rel_k_all.append(rk)
        rel_v_all.append(rv)
        if bundle is not None and bases[ci] is not None:
            q = quality(bases[ci], continuation_stats(bundle, k2, v2, ctx),
                        ctx["continuation_ids"])
            q["context"] = ctx["name"]
            q_rows.append(q)
    L = ctxs[0]["k"].shape[0]
    mean_k = [statistics.fmean(r[layer] for r in rel_k_all) for layer in range(L)]
    mean_v = [statistics.fmean(r[layer] for r in rel_v_all) for layer in range(L)]
    for layer in range(L):
        for kv, vals in (("k", mean_k), ("v", mean_v)):
            layer_rows.append({"mode": name, "level": level, "layer": layer, "kv": kv,
                               "rel_l2": vals[layer]})
    n_el, by = tot["elements"], tot["bytes"]
    # the calibration artifact a codec names in its headers (kvtc), so a row says which
    calib = (api.peek_header(chunks[0]).get("config") or {}).get("calibration")
    row = {
        "codec": name, "level": level,
        "label": name if level is None else f"{name}-l{level}",
        **({"calibration": calib} if isinstance(calib, str) else {}),
        "contexts": len(ctxs), "tokens": int(ctxs[0]["k"].shape[1]),
        "chunk_tokens": args.chunk_tokens,
        "bytes": by / len(ctxs),
        "bits_per_element": 8 * by / n_el,
        "ratio_vs_dtype": tot["dtype_bytes"] / by,
        "payload_over_entropy": (8 * tot["payload_bytes"] / tot["ideal_bits"]
                                 if tot["ideal_bits"] else None),
        "payload_over_coded_entropy": (8 * tot["payload_bytes"] / tot["entropy_bits"]
                                       if tot["entropy_bits"] else None),
        "payload_share": tot["payload_bytes"] / by if tot["payload_bytes"] else None,
        "model_share": tot["model_bytes"] / by,
        "length_table_share": tot["length_table_bytes"] / by,
        "scale_share": tot["scale_bytes"] / by,
        "sink_share": tot["sink_bytes"] / by,
        "encode_s": enc_s / len(ctxs), "decode_s": dec_s / len(ctxs),
        "encode_msym_s": n_el / enc_s / 1e6, "decode_msym_s": n_el / dec_s / 1e6,
        # end-to-end decode (container -> tensors in the model dtype) with
        # every core (the figure above), with one thread, per CPU-second (robust on a
        # busy machine), the reference unfused path, and the rANS coder alone
        "decode_e2e_msym_s": n_el / dec_s / 1e6,
        **{f"decode_{key}_msym_s": n_el / val / 1e6 for key, val in dec_extra.items() if val > 0},
        # decode time per 1K tokens (the yardstick across codecs whose symbol
        # counts differ), every core and one thread
        "decode_ms_per_1k_tokens": 1e6 * dec_s / (len(ctxs) * int(ctxs[0]["k"].shape[1])),
        **({"decode_1thread_ms_per_1k_tokens": 1e6 * dec_extra["e2e_1thread"]
            / (len(ctxs) * int(ctxs[0]["k"].shape[1]))} if dec_extra.get("e2e_1thread") else {}),
        # CPU milliseconds (all threads) per 1K tokens of the default decode: the figure
        # that moves least when other processes share the cores
        **({"decode_cpu_ms_per_1k_tokens": 1e6 * dec_extra["e2e_cpu"]
            / (len(ctxs) * int(ctxs[0]["k"].shape[1]))} if dec_extra.get("e2e_cpu") else {}),
        # where the decode time goes (ms per context): the container parse (checksum
        # included) and the checksum alone, decode into tensors allocated once (no first
        # touch of fresh pages; ``alloc`` = the rest of the end-to-end figure), the
        # entropy core alone, and ``other`` = into - parse - entropy core (dequantization
        # and scatter, or raw's copy)
        **_split_ms(dec_s, dec_extra, len(ctxs)),
        # break-even bandwidth (LMCache users' metric): the link rate at which moving the
        # bytes takes as long as decoding them; above it the decoder, not the link, sets
        # the time (Mbit/s, end to end and into tensors allocated once, all cores and one)
        **_break_even(by / len(ctxs), dec_s / len(ctxs), dec_extra, len(ctxs)),
        "encode_mb_s": tot["dtype_bytes"] / enc_s / 1e6,
        "decode_mb_s": tot["dtype_bytes"] / dec_s / 1e6,
        "rel_l2_k": statistics.fmean(mean_k), "rel_l2_v": statistics.fmean(mean_v),
        "rel_l2_per_layer": {"k": mean_k, "v": mean_v},
        "ppl_increase_pct": None, "kl": None, "top1_match": None,
    }
    if q_rows:
        row.update(
            ppl_increase_pct=statistics.fmean(q["ppl_increase_pct"] for q in q_rows),
            ppl_increase_pct_each=[q["ppl_increase_pct"] for q in q_rows],
            kl=statistics.fmean(q["kl"] for q in q_rows),
            kl_each=[q["kl"] for q in q_rows],
            top1_match=statistics.fmean(q["top1_match"] for q in q_rows),
            ppl_base=[q["ppl_base"] for q in q_rows])
    if name in ("cachegen", "cachegen-ref"):
        row["config"] = CODECS[name].resolve_config(L, level, None).describe()
    return row, layer_rows
