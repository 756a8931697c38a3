"""The LMCache peer rows of ``python -m bench.codec``: each ``--chunk-tokens``
chunk serialised by LMCache's own serde (bench/lmcache/peers.py) and measured with the
same size, speed, error and quality columns as our codecs' rows (coder-internal columns
None). Separate from bench.codec.rows because LMCache is optional (its own venv) and its
serde has no coder statistics.
"""
from __future__ import annotations

import statistics

import torch

from bench.codec.metrics import median_time, continuation_stats, quality, rel_l2_per_layer


def run_peer_row(name: str, ctxs: list[dict], bundle, bases: list, args
                 ) -> tuple[dict, list[dict]]:
    """One row computed by LMCache's own serde ``name`` (bench/lmcache/peers.py): each
    ``--chunk-tokens`` chunk serialised as LMCache stores it; the same size, speed, error
    and quality columns as ``run_row`` (coder-internal columns None)."""
    from bench.lmcache import peers as lmcache_peers

    by = n_el = dtype_b = 0
    enc_s = dec_s = 0.0
    q_rows, rel_k_all, rel_v_all = [], [], []
    for ci, ctx in enumerate(ctxs):
        k, v = ctx["k"], ctx["v"]
        T = k.shape[1]
        spans = [(a, min(T, a + args.chunk_tokens)) for a in range(0, T, args.chunk_tokens)]
        blobs = []
        for a, b in spans:
            blob, st = lmcache_peers.encode_with_stats(k[:, a:b], v[:, a:b], name)
            blobs.append(blob)
            by, n_el, dtype_b = by + st["bytes"], n_el + st["elements"], dtype_b + st["dtype_bytes"]
        enc_s += median_time(lambda: [lmcache_peers.encode_with_stats(k[:, a:b], v[:, a:b], name)
                                       for a, b in spans], args.repeats)
        dec_s += median_time(lambda: [lmcache_peers.decode(x) for x in blobs], args.repeats)
        parts = [lmcache_peers.decode(x) for x in blobs]
        k2, v2 = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
        rel_k_all.append(rel_l2_per_layer(k, k2))
        rel_v_all.append(rel_l2_per_layer(v, v2))
        if bundle is not None and bases[ci] is not None:
            q = quality(bases[ci], continuation_stats(bundle, k2, v2, ctx), ctx["continuation_ids"])
            q["context"] = ctx["name"]
            q_rows.append(q)
    L = ctxs[0]["k"].shape[0]
    mean_k = [statistics.fmean(r[i] for r in rel_k_all) for i in range(L)]
    mean_v = [statistics.fmean(r[i] for r in rel_v_all) for i in range(L)]
    tokens = int(ctxs[0]["k"].shape[1])
    row = {"codec": name, "level": None, "label": name, "peer": "lmcache",
           "contexts": len(ctxs), "tokens": tokens, "chunk_tokens": args.chunk_tokens,
           "bytes": by / len(ctxs), "bits_per_element": 8 * by / n_el,
           "ratio_vs_dtype": dtype_b / by, "payload_over_entropy": None,
           "payload_over_coded_entropy": None, "payload_share": None, "model_share": 0.0,
           "length_table_share": 0.0, "scale_share": 0.0, "sink_share": 0.0,
           "encode_s": enc_s / len(ctxs), "decode_s": dec_s / len(ctxs),
           "encode_msym_s": n_el / enc_s / 1e6, "decode_msym_s": n_el / dec_s / 1e6,
           "decode_e2e_msym_s": n_el / dec_s / 1e6,
           "encode_ms_per_1k_tokens": 1e6 * enc_s / (len(ctxs) * tokens),
           "decode_ms_per_1k_tokens": 1e6 * dec_s / (len(ctxs) * tokens),
           "encode_mb_s": dtype_b / enc_s / 1e6, "decode_mb_s": dtype_b / dec_s / 1e6,
           "rel_l2_k": statistics.fmean(mean_k), "rel_l2_v": statistics.fmean(mean_v),
           "rel_l2_per_layer": {"k": mean_k, "v": mean_v},
           "ppl_increase_pct": None, "kl": None, "top1_match": None}
    if q_rows:
        row.update(ppl_increase_pct=statistics.fmean(q["ppl_increase_pct"] for q in q_rows),
                   ppl_increase_pct_each=[q["ppl_increase_pct"] for q in q_rows],
                   kl=statistics.fmean(q["kl"] for q in q_rows), kl_each=[q["kl"] for q in q_rows],
                   top1_match=statistics.fmean(q["top1_match"] for q in q_rows),
                   ppl_base=[q["ppl_base"] for q in q_rows])
    layer_rows = [{"mode": name, "level": None, "layer": i, "kv": kv, "rel_l2": vals[i]}
                  for i in range(L) for kv, vals in (("k", mean_k), ("v", mean_v))]
    return row, layer_rows
