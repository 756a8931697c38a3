"""Codec benchmark: size, entropy overhead, speed, reconstruction error and perplexity cost
of every codec / level on real KV caches (CacheGen, Liu et al., SIGCOMM 2024, section 7's
size-vs-quality trade-off; metrics of its section 7.1: size, quality drop, speed).

Not a test: it prints a table and writes JSON. Figures measured on a busy machine are
not final (timings especially); the lead reruns it on a quiet one.

    python -m bench.codec                       # default model, 4 pydoc contexts of 2K tokens
    python -m bench.codec --contexts 8 --out benchmarks/codec_bench.json
    python -m bench.codec --kv dumps/*.safetensors   # KV dumped by python -m kv_extraction_hf
    python -m bench.codec --quick               # synthetic KV, no model (ppl columns null)
    python -m bench.codec --device cuda         # the Triton GPU benchmark (bench.triton;
                                                # further options are passed to it)

Per (codec, level) row: bytes, bits_per_element, ratio_vs_dtype (vs the KV's own dtype,
never fp32), payload_over_entropy (coded payload / empirical entropy per (layer, channel)),
model/scale/sink/header shares, encode/decode Msym/s and MB/s (medians over --repeats after
one warm-up run), relative L2 error per layer, and with a model: perplexity increase (%)
of the held-out 256-token continuation when the context KV is replaced by the decoded one,
mean KL(lossless || decoded) in nats and top-1 agreement, averaged over contexts.

This measurement module is the one place that joins the codec with the model loader
(``kv_extraction_hf``); the ``codec`` package itself imports no model, engine or network
package (tests/project/test_architecture.py checks it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch

from codec import api
from codec.codecs import CODECS, DTYPE_NAMES
from codec.config import DEFAULT_CHUNK_TOKENS
from common import flags
from common.files import atomic_write_json
from common.header import environment as header_environment

# The measurements live in bench/codec_metrics.py (issue 27: modules under 600 lines);
# re-exported here.
from bench.codec_metrics import (  # noqa: F401
    _median_cpu, _median_time, _threads, continuation_stats, decode_breakdown, quality, rel_l2_per_layer
)

# (codec, level) rows run by default. cachegen-ref level 0 = LMCache's default schedule,
# 1-3 the CacheGen artifact's levels; cachegen = this project's quantizer.
DEFAULT_ROWS = [("raw", None), ("fp8", None), ("quant8", None), ("kivi4", None),
                ("kivi2", None), ("cachegen-ref", 3), ("cachegen-ref", 2),
                ("cachegen-ref", 0), ("cachegen-ref", 1), ("cachegen", 5), ("cachegen", 4),
                ("cachegen", 3), ("cachegen", 2), ("cachegen", 1), ("cachegen", 0),
                ("kvtc", 5), ("kvtc", 4), ("kvtc", 3), ("kvtc", 2), ("kvtc", 1), ("kvtc", 0)]
QUICK_SHAPE = (8, 1024, 2, 64)   # synthetic KV for --quick: L, T, H, D


# ------------------------------------------------------------------------- KV sources
def synthetic_kv(L: int, T: int, H: int, D: int, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
    """A KV with the structure of real ones: keys with a few large RoPE channel pairs
    rotating with position, a huge first (attention-sink) token, per-layer magnitudes;
    values smoother, heavier-tailed. [L, T, H, D] each."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(T, dtype=torch.float32)
    freqs = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))       # [D/2]
    ang = pos[:, None] * freqs[None]                                                # [T, D/2]
    base = torch.randn(L, 1, H, D // 2, generator=g) * torch.linspace(4, 0.5, D // 2)
    drift = torch.randn(L, T, H, D // 2, generator=g) * 0.6
    amp = base + drift                                                              # [L,T,H,D/2]
    k = torch.cat([amp * torch.cos(ang)[None, :, None], amp * torch.sin(ang)[None, :, None]], -1)
    k = k * torch.linspace(1.0, 2.0, L).reshape(L, 1, 1, 1)
    k[:, 0] *= 6
    v = torch.distributions.StudentT(4.0).sample((L, T, H, D)) * 0.3
    v = v + 0.2 * torch.randn(L, 1, H, D, generator=g)
    v[:, 0] *= 0.1
    return k.to(dtype).contiguous(), v.to(dtype).contiguous()


def load_contexts(args, log) -> tuple[list[dict], Optional[Any], dict]:
    """Returns (contexts [{name, k, v, context_ids, continuation_ids}], model bundle or
    None, model info dict)."""
    if args.quick:
        L, T, H, D = QUICK_SHAPE
        ctxs = [{"name": f"synthetic-{i}", "seed": args.seed + i,
                 **dict(zip(("k", "v"), synthetic_kv(L, T, H, D, seed=args.seed + i))),
                 "context_ids": None, "continuation_ids": None}
                for i in range(args.contexts)]
        return ctxs, None, {"model_id": "synthetic", "dtype": "bfloat16", "num_layers": L,
                            "num_kv_heads": H, "head_dim": D}
    bundle = None
    info: dict = {}
    if not args.no_model:
        from kv_extraction_hf.model import load_model

        log("loading model ...")
        bundle = load_model(args.model, log=lambda m: None)
        info = {key: getattr(bundle.info, key) for key in ("model_id", "weights_hash", "dtype",
                                                            "num_layers", "num_kv_heads",
                                                            "head_dim")}
    ctxs = []
    if args.kv:
        from kv_extraction_hf.dump import load_kv

        for path in args.kv:
            k, v, meta = load_kv(path)
            ids = json.loads(meta["token_ids"]) if "token_ids" in meta else None
            cont = json.loads(meta["continuation_ids"]) if meta.get("continuation_ids") else None
            ctxs.append({"name": Path(path).stem, "k": k, "v": v, "context_ids": ids,
                         "continuation_ids": cont or None})
            # (kv_extraction_hf.dump writes the model's fields as model_*; older dumps: bare)
            wh = meta.get("model_weights_hash") or meta.get("weights_hash")
            info = info or {"model_id": meta.get("model_id"),
                            "dtype": meta.get("model_dtype") or meta.get("dtype"),
                            **({"weights_hash": wh} if wh else {})}
        return ctxs, bundle, info
    if bundle is None:
        print("error: without --kv the benchmark needs the model (drop --no-model) or use "
              "--quick", file=sys.stderr)
        raise SystemExit(2)
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.prompts import build_prompt

    for i in range(args.contexts):
        p = build_prompt(args.task, bundle.tokenizer, args.context_tokens, args.seed, i)
        log(f"prefill {p.name} ({len(p.context_ids)} tokens)")
        k, v = prefill_kv(bundle, p.context_ids)
        ctxs.append({"name": p.name, "k": k, "v": v, "context_ids": list(p.context_ids),
                     "continuation_ids": list(p.continuation_ids) or None})
    return ctxs, bundle, info


# --------------------------------------------------------------------------------- run
def run_peer_row(name: str, ctxs: list[dict], bundle, bases: list, args
                 ) -> tuple[dict, list[dict]]:
    """One row computed by LMCache's own serde ``name`` (bench/lmcache_peers.py): each
    ``--chunk-tokens`` chunk serialised as LMCache stores it; the same size, speed, error
    and quality columns as ``run_row`` (coder-internal columns None)."""
    from bench import lmcache_peers

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
        enc_s += _median_time(lambda: [lmcache_peers.encode_with_stats(k[:, a:b], v[:, a:b], name)
                                       for a, b in spans], args.repeats)
        dec_s += _median_time(lambda: [lmcache_peers.decode(x) for x in blobs], args.repeats)
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


def run_row(name: str, level: Optional[int], ctxs: list[dict], bundle, bases: list,
            args, config=None) -> tuple[dict, list[dict]]:
    """Encode/decode every context with one (codec, level); aggregate one JSON row.
    ``config``: the codec's config object for every encode (kvtc: the ``KvtcConfig``
    naming its calibration), None = the level's preset."""
    from bench import lmcache_peers

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
            data, st = api._encode_one(k[:, a:b], v[:, a:b], name, level, config, a, T, i,
                                       n_chunks)
            chunks.append(data)
            for key in tot:
                tot[key] += st.get(key, 0) or 0
        enc_s += _median_time(lambda: api.encode_chunks(k, v, codec=name, level=level,
                                                        config=config,
                                                        chunk_tokens=args.chunk_tokens),
                              args.repeats)
        dec_s += _median_time(lambda: [api.decode_kv(c) for c in chunks], args.repeats)
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
        # issue 14.4: end-to-end decode (container -> tensors in the model dtype) with
        # every core (the figure above), with one thread, per CPU-second (robust on a
        # busy machine), the reference unfused path, and the rANS coder alone
        "decode_e2e_msym_s": n_el / dec_s / 1e6,
        **{f"decode_{key}_msym_s": n_el / val / 1e6 for key, val in dec_extra.items() if val > 0},
        # issue 16: decode time per 1K tokens (the yardstick across codecs whose symbol
        # counts differ), every core and one thread
        "decode_ms_per_1k_tokens": 1e6 * dec_s / (len(ctxs) * int(ctxs[0]["k"].shape[1])),
        **({"decode_1thread_ms_per_1k_tokens": 1e6 * dec_extra["e2e_1thread"]
            / (len(ctxs) * int(ctxs[0]["k"].shape[1]))} if dec_extra.get("e2e_1thread") else {}),
        # CPU milliseconds (all threads) per 1K tokens of the default decode: the figure
        # that moves least when other processes share the cores
        **({"decode_cpu_ms_per_1k_tokens": 1e6 * dec_extra["e2e_cpu"]
            / (len(ctxs) * int(ctxs[0]["k"].shape[1]))} if dec_extra.get("e2e_cpu") else {}),
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


def _fmt(v, nd=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def print_table(rows: list[dict], out=None) -> None:
    cols = [("label", "codec", 0), ("bytes", "bytes", 0), ("bits_per_element", "bits/el", 3),
            ("ratio_vs_dtype", "ratio", 2), ("payload_over_entropy", "pay/H", 4),
            ("model_share", "model%", 1), ("scale_share", "scale%", 1),
            ("encode_msym_s", "enc Msym/s", 1), ("decode_e2e_msym_s", "dec Msym/s", 1),
            ("decode_e2e_1thread_msym_s", "dec 1t", 1),
            ("decode_ms_per_1k_tokens", "dec ms/1Kt", 1),
            ("decode_1thread_ms_per_1k_tokens", "ms/1Kt 1t", 1),
            ("decode_cpu_ms_per_1k_tokens", "CPU ms/1Kt", 1),
            ("decode_e2e_cpu_msym_s", "dec /CPU-s", 1), ("decode_ref_msym_s", "dec ref", 1),
            ("decode_coder_msym_s", "rANS only", 1),
            ("encode_mb_s", "enc MB/s", 1), ("decode_mb_s", "dec MB/s", 1),
            ("rel_l2_k", "relL2 K", 4), ("rel_l2_v", "relL2 V", 4),
            ("ppl_increase_pct", "ppl +%", 2), ("kl", "KL", 4), ("top1_match", "top1", 3)]
    table = [[h for _, h, _ in cols]]
    for r in rows:
        cells = []
        for key, _, nd in cols:
            v = r.get(key)
            if key in ("model_share", "scale_share") and v is not None:
                v = 100 * v
            if key == "bytes":
                v = int(v)
            cells.append(_fmt(v, nd))
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for i, row in enumerate(table):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in
                        enumerate(zip(row, widths))), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)


def _environment() -> dict:
    """codec_bench.json's ``environment``: versions, CPU, threads, commit, load, and
    ``numerics`` (``common.machine``: CPU vendor and model, AMX / AVX512-BF16 / AVX2 flags,
    the ISA oneDNN uses); computed by :func:`common.header.environment`."""
    return header_environment(("python", "platform", "cpu", "num_cpus", "torch_threads",
                               "packages", "git_commit", "load_avg_1m", "numerics"),
                              packages=("torch", "numpy", "numba"))


def prepare_kvtc(args, bundle, log, info: Optional[dict] = None) -> str:
    """The calibration the ``kvtc`` rows encode with (registered, so their chunks decode);
    returns its hash, which the caller passes to every kvtc encode (``KvtcConfig``).

    ``--kvtc-calibration FILE``: that artifact, whatever else applies. With the model: its
    default calibration (kv_extraction_hf.calibrate.default_calibration, fitted on the
    default calibration text on first use, then cached). ``--quick``: a calibration fitted
    on synthetic KV of another seed than the measured contexts (never on them). ``--kv``
    without the model: the cached default calibration of the dump's model (its
    ``weights_hash``, ``info``), else ValueError naming the two ways to give one."""
    from codec import kvtc

    if getattr(args, "kvtc_calibration", None):
        return kvtc.register_calibration(args.kvtc_calibration)
    if bundle is not None:
        from kv_extraction_hf.calibrate import default_calibration

        return kvtc.register_calibration(default_calibration(bundle, log=log))
    if args.quick:
        L, T, H, D = QUICK_SHAPE
        k, v = synthetic_kv(L, T, H, D, seed=args.seed + 10_000)
        return kvtc.register_calibration(kvtc.fit_calibration(
            k[:, 4:].float(), v[:, 4:].float(), meta={"data": "synthetic (bench.codec --quick)"}))
    from kv_extraction_hf.calibrate import cached_default_calibration

    path = cached_default_calibration((info or {}).get("weights_hash"))
    if path is None:
        raise ValueError("the kvtc rows need a calibration: --kvtc-calibration FILE, or the "
                         "model (drop --no-model) for its default calibration")
    return kvtc.register_calibration(path)


def parse_rows(spec: Optional[list[str]]) -> list[tuple[str, Optional[int]]]:
    """``["raw", "cachegen:2", "cachegen-ref:0"]`` -> [(codec, level), ...]."""
    from bench import lmcache_peers

    if not spec:   # LMCache's own serdes too when lmcache imports (bench/lmcache_peers.py)
        return list(DEFAULT_ROWS) + [(n, None) for n in lmcache_peers.available()]
    out = []
    for s in spec:
        name, _, lv = s.partition(":")
        if lmcache_peers.is_peer(name):
            if name not in lmcache_peers.available() or lv:
                print(f"error: {name} needs lmcache (bash scripts/setup.sh lmcache; run with "
                      f".venv-lmcache/bin/python) and takes no level", file=sys.stderr)
                raise SystemExit(2)
            out.append((name, None))
            continue
        if name not in CODECS:
            print(f"error: unknown codec {name!r}; available: {sorted(CODECS)}",
                  file=sys.stderr)
            raise SystemExit(2)
        out.append((name, int(lv) if lv else None))
    return out


def _gpu_bench(device: str, rest: list[str]) -> int:
    """``--device cuda``: hand over to ``bench.triton`` (speed of the Triton kernels
    vs the CPU backend, docs/gpu.md); exit 2 with one line when CUDA is not available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        print(f"error: bad --device {device!r}: {e}", file=sys.stderr)
        return 2
    if dev.type != "cuda":
        print(f"error: --device must be cpu or cuda, got {device!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"error: --device {device} but CUDA is not available on this machine "
              "(the Triton GPU benchmark needs a CUDA GPU)", file=sys.stderr)
        return 2
    from bench import triton as triton_bench

    return triton_bench.main(["--device", device, *rest])


def main(argv: Optional[list[str]] = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cpu")
    known, rest = pre.parse_known_args(argv)
    if known.device != "cpu":
        return _gpu_bench(known.device, rest)
    ap = argparse.ArgumentParser(
        prog="python -m bench.codec", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m bench.codec --quick\n"
               "  python -m bench.codec --contexts 4 --out benchmarks/codec_bench.json\n"
               "  python -m bench.codec --kv d/*.safetensors --rows cachegen:2 quant8")
    ap.add_argument("--device", default="cpu",
                    help="cpu (this benchmark) or cuda: run the Triton GPU benchmark "
                    "(python -m bench.triton --device cuda; other options go to it)")
    flags.add_quick(ap, help=f"synthetic KV {QUICK_SHAPE} (L,T,H,D), no model, ppl columns null")
    ap.add_argument("--kv", nargs="+", help="KV dumps (python -m kv_extraction_hf); with the "
                    "model loaded, their continuation_ids give perplexity")
    ap.add_argument("--no-model", action="store_true", help="do not load a model (no ppl)")
    ap.add_argument("--kvtc-calibration", default=None, metavar="FILE",
                    help="kvtc calibration artifact for the kvtc rows (python -m "
                         "kv_extraction_hf.calibrate --out FILE); default: the model's "
                         "default calibration")
    flags.add_model(ap)
    ap.add_argument("--task", default="pydoc_ppl", help="prompt task (default pydoc_ppl: "
                    "natural text + held-out 256-token continuation)")
    ap.add_argument("--contexts", type=int, default=4,
                    help="contexts to average over (ppl of one context moves ~0.5%% by noise)")
    flags.add_context_tokens(ap, default=2048)
    ap.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    ap.add_argument("--rows", nargs="+", help="codec[:level] rows (default: all codecs and "
                    "levels)")
    flags.add_repeats(ap, default=3, help="timed repeats after a warm-up, count (default 3)")
    flags.add_seed(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    flags.add_out(ap, help="result file (JSON, atomically; default benchmarks/codec_bench.json, "
                  "--quick: benchmarks/tmp/codec_bench_quick.json)")
    args = ap.parse_args(argv)
    if args.contexts < 1 or args.repeats < 1 or args.context_tokens < 2:
        ap.error("--contexts, --repeats must be >= 1 and --context-tokens >= 2")
    if args.chunk_tokens < 16 or args.chunk_tokens % 16:
        ap.error("--chunk-tokens must be a positive multiple of 16")
    rows_spec = parse_rows(args.rows)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    log = lambda m: print(m, file=sys.stderr, flush=True)
    out = Path(args.out or ("benchmarks/tmp/codec_bench_quick.json" if args.quick
                            else "benchmarks/codec_bench.json"))
    try:
        ctxs, bundle, info = load_contexts(args, log)
    except Exception as e:  # model / dump problems: one line, exit 2
        if isinstance(e, SystemExit):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    bases = []
    if bundle is not None:
        for ctx in ctxs:
            if ctx["context_ids"] and ctx["continuation_ids"]:
                try:
                    bases.append(continuation_stats(bundle, ctx["k"], ctx["v"], ctx))
                except ValueError as e:   # ExtractionError: the dump does not fit the model
                    print(f"error: {ctx['name']}: {e}", file=sys.stderr)
                    return 2
            else:
                bases.append(None)
    configs: dict = {}     # codec -> the config its encodes get (kvtc: its calibration)
    if any(name == "kvtc" for name, _ in rows_spec):
        try:
            cal_hash = prepare_kvtc(args, bundle, log, info)
        except Exception as e:  # noqa: BLE001 - no calibration: one line, exit 2
            print(f"error: kvtc calibration: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        log(f"kvtc calibration {cal_hash[:16]}")
        from codec.kvtc import KvtcConfig

        configs["kvtc"] = KvtcConfig(calibration=cal_hash)
    rows, layer_rows = [], []
    started = time.time()
    for name, level in rows_spec:
        log(f"{name} level={level} ...")
        try:
            row, lr = run_row(name, level, ctxs, bundle, bases, args, config=configs.get(name))
        except ValueError as e:  # includes kv_extraction_hf.ExtractionError (model mismatch)
            print(f"error: {name} level {level}: {e}", file=sys.stderr)
            return 2
        rows.append(row)
        layer_rows.extend(lr)
        log(f"  ratio {row['ratio_vs_dtype']:.2f}x  ppl+ {_fmt(row['ppl_increase_pct'])}%  "
            f"KL {_fmt(row['kl'], 4)}")
    k0 = ctxs[0]["k"]
    doc = {
        "schema": "codec_bench/1",
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python -m bench.codec " + " ".join(argv if argv is not None
                                                       else sys.argv[1:]),
        "config": vars(args), "environment": _environment(), "model": info,
        "kv_shape": list(k0.shape), "kv_dtype": DTYPE_NAMES[k0.dtype],
        "contexts": [c["name"] for c in ctxs], "elapsed_s": time.time() - started,
        "notes": "ratio_vs_dtype is vs the KV's own dtype; timings are medians of --repeats "
                 "after one warm-up on this machine (busy machines give low figures).",
        "rows": rows, "codec_layers": layer_rows,
    }
    atomic_write_json(out, doc, indent=1)
    print_table(rows)
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
