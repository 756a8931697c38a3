"""Our serdes inside LMCache, measured: bytes LMCache writes to its fs and Redis
backends through them vs no serde and vs LMCache's fp8, CPU decode time vs our own store
path on the same chunk, and the slot estimate's tightness (actual / estimate).

Needs the optional environment (``bash scripts/setup.sh lmcache``) and KV dumps of the
default model (``python -m kv_extraction_hf --task pydoc_ppl --context-tokens 4096
--num-contexts 3 --out DIR``). Not a test; figures on a busy machine are not final.

    .venv-lmcache/bin/python -m bench.lmcache --kv DIR/*.safetensors --estimate
    .venv-lmcache/bin/python -m bench.lmcache --kv DIR/*.safetensors --sizes \\
        --kvtc-calibration FILE [--chunk-size 256] [--redis]

``--estimate``: per codec and (starting) level, over every ``--chunk-size`` chunk of the
dumps, each chunk serialised with the serde's defaults plus ``--serde-json`` (e.g.
``'{"slot_ratio": false}'``: the max-bound slot; default with LMCache 0.5.6: the fixed
slot): written ratio (KV bytes / slot), frame bytes / slot (max, min), objects refused,
coded coarser / finer and at which levels, encodes and serialize ms per object; and each
level's own frame bits per element (max, median, mean) that
``third_party.lmcache.settings.BITS_PER_ELEMENT`` is made from (max * 1.05).
``--sizes``: each context's chunks stored through LMCache's ``SerdeL2AdapterWrapper`` on
its ``FSL2Adapter`` (and ``--redis``: its RESP adapter on a redis-server started here),
loaded back (hits counted; without a serde each chunk compared bit for bit), bytes on disk / in Redis
per serde vs none; decode ms per 1K tokens of LMCache's deserialize vs ``codec.decode_kv``
of the container our store path keeps for the same chunk.
"""
from __future__ import annotations

import argparse
import json
import math
import select
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from cachegen_common import flags
from cachegen_common.files import atomic_write_json


def _planes(k, v):
    import torch

    L, T = k.shape[:2]
    return torch.stack([k.reshape(L, T, -1), v.reshape(L, T, -1)])


def memory_obj(t):
    from bench.lmcache.peers import memory_obj as o

    return o(t)


def _contexts(paths: list[str]) -> list:
    from kv_extraction_hf.dump import load_kv

    return [load_kv(p)[:2] for p in paths]


def _serde_kwargs(name: str, level, cal: Optional[str], H: int, extra: Optional[dict] = None) -> dict:
    kw = {"level": level}
    if name == "kvtc":
        kw["calibration"] = cal
    else:
        kw["num_kv_heads"] = H
    return {**kw, **(extra or {})}


def run_estimate(ctxs, chunk: int, cal: Optional[str], log, extra: Optional[dict] = None,
                 levels: str = "all") -> list[dict]:
    """Frame bytes / slot per (codec, level) over every chunk (serde with padding and the
    options ``extra``), the levels the serializer chose (fixed-slot mode: fallback, fill),
    its encodes and ms per object; and each level's own frame bits per element."""
    import torch
    import codec
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from third_party.lmcache import serde as S
    from third_party.lmcache.layout import frame_overhead
    from third_party.lmcache.settings import BITS_PER_ELEMENT

    rows = []
    names = ["cachegen"] + (["kvtc"] if cal else [])
    for name in names:
        for lvl in codec.levels(name) if levels == "all" else [codec.default_level(name)]:
            H = ctxs[0][0].shape[2]
            ser, _ = S.make_pair(name, {**_serde_kwargs(name, lvl, cal, H, extra), "pad": True})
            big, _ = S.make_pair(name, {**_serde_kwargs(name, lvl, cal, H),
                                        "bits_per_element": 16.0, "fallback": False})
            ratios, bpe, used, ms, refused = [], [], [], [], 0
            for ci, (k, v) in enumerate(ctxs):
                for a in range(0, k.shape[1] - chunk + 1, chunk):
                    x = _planes(k[:, a:a + chunk], v[:, a:a + chunk])
                    key = ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(ci * 100000 + a),
                                    model_name="m", kv_rank=0)
                    lay = MemoryLayoutDesc([x.shape], [x.dtype])
                    slot = ser.estimate_serialized_size(lay)
                    before = ser.stats["bytes"]
                    t0 = time.perf_counter()
                    try:
                        ser.serialize(memory_obj(x), memory_obj(torch.zeros(slot, dtype=torch.uint8)), key)
                    except ValueError:
                        refused += 1
                    else:
                        ms.append(1e3 * (time.perf_counter() - t0))
                        used.append(ser.stats["bytes"] - before)
                        ratios.append(used[-1] / slot)
                    frame = big.encode_frame(memory_obj(x), key, 1 << 40, lvl)
                    ov = frame_overhead(big.settings, big.ident_hash, [x.shape], [x.dtype])
                    bpe.append((len(frame) - ov) * 8 / x.numel())
            st = ser.stats
            raw = x.numel() * x.element_size()
            row = {"codec": name, "level": lvl, "chunk_tokens": chunk, "chunks": len(bpe),
                   "options": extra or {}, "slot_ratio": ser.settings.slot_ratio,
                   "fill": ser.settings.fill, "slot_bytes": slot, "written_ratio": raw / slot,
                   "actual_over_estimate_max": max(ratios, default=None),
                   "actual_over_estimate_min": min(ratios, default=None),
                   "refused": refused, "coarser": st["coarser"], "finer": st["finer"],
                   "levels_used": dict(sorted(st["levels"].items(), key=lambda kv: str(kv[0]))),
                   "encodes_per_object": st["encodes"] / max(1, st["objects"]),
                   "fill_misses": st["fill_misses"],
                   "serialize_ms_median": statistics.median(ms) if ms else None,
                   "serialize_ms_max": max(ms, default=None),
                   "bits_per_element_max": max(bpe),
                   "bits_per_element_median": statistics.median(bpe),
                   "bits_per_element_mean": statistics.fmean(bpe),
                   "table_entry": BITS_PER_ELEMENT[name], "default": lvl == codec.default_level(name)}
            rows.append(row)
            log(f"{name} l{lvl} chunk {chunk} (slot_ratio {ser.settings.slot_ratio}, fill "
                f"{ser.settings.fill}): written {raw / slot:.2f}x; actual/estimate max "
                f"{row['actual_over_estimate_max']:.3f} min {row['actual_over_estimate_min']:.3f}; "
                f"refused {refused}, coarser {st['coarser']}, finer {st['finer']}, levels "
                f"{row['levels_used']}, {row['encodes_per_object']:.2f} encodes and "
                f"{row['serialize_ms_median']:.0f} ms (median) per object; own frames: bpe max "
                f"{max(bpe):.4f} median {statistics.median(bpe):.4f} mean {statistics.fmean(bpe):.4f}")
    return rows


def _wait(fd: int) -> None:
    import os

    r, _, _ = select.select([fd], [], [], 300)
    if not r:
        raise RuntimeError("LMCache task did not complete in 300 s")
    os.read(fd, 8)


def _store_load_all(adapter, proc, ctxs, chunk: int, check) -> tuple[int, int]:
    """Store every chunk of every context through the wrapper (or the bare adapter when
    proc is None), load them all back; returns (hits, chunks). ``check(i, tensor)``."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
    from lmcache.v1.distributed.l1_manager import L1Manager
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper

    l1 = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(
        size_in_bytes=1 << 30, use_lazy=False, init_size_in_bytes=1 << 30)))
    w = SerdeL2AdapterWrapper(adapter, proc, l1) if proc is not None else adapter
    keys, xs = [], []
    for ci, (k, v) in enumerate(ctxs):
        for a in range(0, k.shape[1] - chunk + 1, chunk):
            keys.append(ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(ci * 100000 + a),
                                  model_name="smollm2", kv_rank=0))
            xs.append(_planes(k[:, a:a + chunk], v[:, a:a + chunk]))
    lay = MemoryLayoutDesc([xs[0].shape], [xs[0].dtype])
    hits = 0
    try:
        for i, (key, x) in enumerate(zip(keys, xs)):
            tmpk = ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(10**9 + i), model_name="s",
                             kv_rank=0)
            obj = l1.reserve_write([tmpk], [True], lay)[tmpk][1]
            obj.tensor.copy_(x)
            tid = w.submit_store_task([key], [obj])
            while tid not in (done := w.pop_completed_store_tasks()):
                _wait(w.get_store_event_fd())
            if not done[tid].is_successful():
                raise RuntimeError(f"store of chunk {i} failed")
            l1.finish_write_and_delete([tmpk])
        for i, key in enumerate(keys):
            tmpk = ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(2 * 10**9 + i), model_name="s",
                             kv_rank=0)
            obj = l1.reserve_write([tmpk], [True], lay)[tmpk][1]
            tid = w.submit_load_task([key], [obj])
            while (bits := w.query_load_result(tid)) is None:
                _wait(w.get_load_event_fd())
            if bits.test(0):
                hits += 1
                check(i, obj.tensor)
            l1.finish_write_and_delete([tmpk])
    finally:
        w.close()
    return hits, len(keys)


def run_sizes(ctxs, chunk: int, cal: Optional[str], use_redis: bool, repeats: int,
              log, extra: Optional[dict] = None) -> list[dict]:
    import torch
    import codec
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor
    import third_party.lmcache as plugin
    from third_party.lmcache import serde as S

    plugin.register()
    H = ctxs[0][0].shape[2]
    configs = [("none", None), ("lmcache-fp8", {"type": "fp8"}),
               ("cachegen", {"type": "cachegen", **_serde_kwargs("cachegen", None, cal, H, extra)})]
    if cal:
        configs.append(("kvtc", {"type": "kvtc", **_serde_kwargs("kvtc", None, cal, H, extra)}))
    backends = ["fs"] + (["redis"] if use_redis else [])
    srv = None
    if use_redis:
        from streaming.store.redis_server import RedisServer

        srv = RedisServer().__enter__()
    rows = []
    try:
        for label, cfg in configs:
            expect = {}
            if label in ("cachegen", "kvtc"):
                ser, de = S.make_pair(label, {k: v for k, v in cfg.items() if k != "type"})
            for be in backends:
                base = Path(tempfile.mkdtemp(prefix="lmc-bench-"))
                if be == "fs":
                    adapter = FSL2Adapter(FSL2AdapterConfig(base_path=str(base)))
                else:
                    import redis
                    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import (
                        RESPL2AdapterConfig, _create_resp_l2_adapter)

                    r = redis.Redis(host=srv.host, port=srv.port)
                    r.flushdb()
                    adapter = _create_resp_l2_adapter(RESPL2AdapterConfig(
                        host=srv.host, port=srv.port, num_workers=2))
                proc = None if cfg is None else create_serde_processor(
                    SerdeConfig(type=cfg["type"], kwargs={k: v for k, v in cfg.items()
                                                          if k != "type"}))
                bad = []

                def check(i, t, label=label):
                    if label == "none" and not torch.equal(t, xs_ref[i]):
                        bad.append(i)

                xs_ref = [_planes(k[:, a:a + chunk], v[:, a:a + chunk]) for k, v in ctxs
                          for a in range(0, k.shape[1] - chunk + 1, chunk)]
                t0 = time.perf_counter()
                hits, n = _store_load_all(adapter, proc, ctxs, chunk, check)
                wall = time.perf_counter() - t0
                if be == "fs":
                    stored = sum(p.stat().st_size for p in base.glob("*.data"))
                else:
                    stored = sum(r.strlen(kk) for kk in r.keys("*"))
                raw = sum(x.numel() * x.element_size() for x in xs_ref)
                rows.append({"serde": label, "backend": be, "chunk_tokens": chunk,
                             "chunks": n, "hits": hits, "mismatches": len(bad),
                             "stored_bytes": stored, "raw_bytes": raw,
                             "ratio_vs_none": raw / stored, "store_load_wall_s": wall})
                log(f"{label:12s} {be:5s}: {stored / 1e6:8.2f} MB stored for {raw / 1e6:.1f} MB "
                    f"of KV ({raw / stored:.2f}x), {hits}/{n} chunks loaded")
            # decode speed: LMCache deserialize (ours) vs codec.decode_kv of the store path's
            # container for the same chunk
            if label in ("cachegen", "kvtc"):
                k, v = ctxs[0]
                x = _planes(k[:, :chunk], v[:, :chunk])
                key = ObjectKey(chunk_hash=b"\1" * 32, model_name="m", kv_rank=0)
                slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
                buf = memory_obj(torch.zeros(slot, dtype=torch.uint8))
                ser.serialize(memory_obj(x), buf, key)
                out = memory_obj(torch.zeros_like(x))
                # the store path's container at the level the serde coded this chunk at
                # (fixed-slot mode may code it coarser or finer than settings.level): the same
                # bytes, so the comparison is of the two paths, not of two levels
                from third_party.lmcache.frame import parse_frame

                lvl = codec.peek_header(bytes(parse_frame(memoryview(buf.tensor.numpy()))[1][0]))["level"]
                cfgc = ser.settings.codec_config(lvl)
                blob = codec.encode_chunks(k, v, codec=label, level=None if cfgc else lvl,
                                           config=cfgc, chunk_tokens=chunk)[0]

                fails = {"n": 0}

                def one(fn):
                    """Seconds of one call, None when it raised CodecError (counted)."""
                    t = time.perf_counter()
                    try:
                        fn()
                    except codec.CodecError:
                        fails["n"] += 1
                        return None
                    return time.perf_counter() - t

                # the two decodes alternate (one untimed warm-up each), so a load change on
                # this shared machine hits both alike; medians of ``repeats`` successes each
                fns = (lambda: de.deserialize(buf, out, key), lambda: codec.decode_kv(blob))
                ts: tuple[list, list] = ([], [])
                ratios = []      # per adjacent pair: store-path s / LMCache s
                for f in fns:
                    one(f)
                for i in range(3 * repeats):
                    # which goes first alternates too (cache state, turbo after idle)
                    pair = [one(f) for f in fns] if i % 2 == 0 else [one(f) for f in fns[::-1]][::-1]
                    if None not in pair:
                        ts[0].append(pair[0])
                        ts[1].append(pair[1])
                        ratios.append(pair[1] / pair[0])
                    if len(ratios) >= repeats:
                        break
                if not ratios:
                    raise RuntimeError(f"{label}: every timed decode failed")
                from evaluation.stats import mean_ci

                rci = mean_ci(ratios)
                t_ser, t_own = statistics.median(ts[0]), statistics.median(ts[1])
                rows.append({"serde": label, "decode_chunk_tokens": chunk, "decode_level": lvl,
                             "decode_failures": fails["n"],
                             "lmcache_deserialize_ms_per_1k_tokens": 1e3 * t_ser * 1024 / chunk,
                             "store_path_decode_ms_per_1k_tokens": 1e3 * t_own * 1024 / chunk,
                             "speed_vs_store_path": t_own / t_ser,
                             "paired_speed_mean": rci["mean"], "paired_speed_ci": rci["ci"],
                             "pairs": len(ratios)})
                log(f"{label}: decode {1e3 * t_ser * 1024 / chunk:.1f} ms/1K tokens through "
                    f"LMCache vs {1e3 * t_own * 1024 / chunk:.1f} ms/1K on our store path "
                    f"({t_own / t_ser:.2f}x; paired mean {rci['mean']:.3f} [{rci['ci'][0]:.3f}, "
                    f"{rci['ci'][1]:.3f}], n {len(ratios)})")
    finally:
        if srv is not None:
            srv.__exit__(None, None, None)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lmcache",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", nargs="+", required=True, help="KV dumps (python -m kv_extraction_hf)")
    ap.add_argument("--estimate", action="store_true", help="slot tightness per codec/level")
    ap.add_argument("--sizes", action="store_true", help="bytes on fs (and Redis) and decode speed")
    ap.add_argument("--redis", action="store_true", help="--sizes on Redis too (redis-server)")
    ap.add_argument("--chunk-size", type=int, default=256,
                    help="LMCache chunk size in tokens (default 256, LMCache's)")
    ap.add_argument("--kvtc-calibration", default=None, metavar="FILE",
                    help="kvtc calibration artifact (kvtc rows only with it)")
    ap.add_argument("--serde-json", default=None, metavar="JSON",
                    help="extra options for our serdes, e.g. '{\"slot_ratio\": false}' "
                         "(the max-bound slot, the former default) or '{\"slot_ratio\": 9}'")
    ap.add_argument("--levels", choices=("all", "default"), default="all",
                    help="--estimate: every level (default) or the codecs' default levels")
    flags.add_repeats(ap, default=3)
    flags.add_out(ap, type=Path, default=Path("benchmarks/tmp/lmcache_bench.json"),
                  help="result file (JSON, atomically; default %(default)s)")
    args = ap.parse_args(argv)
    if not (args.estimate or args.sizes):
        ap.error("give --estimate and/or --sizes")
    if args.chunk_size < 16 or args.chunk_size % 16 or args.repeats < 1:
        ap.error("--chunk-size must be a positive multiple of 16, --repeats >= 1")
    try:
        extra = json.loads(args.serde_json) if args.serde_json else {}
        if not isinstance(extra, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        ap.error(f"--serde-json: {e}")
    log = lambda m: print(m, file=sys.stderr, flush=True)
    try:
        import lmcache  # noqa: F401
    except ImportError:
        print("error: lmcache is not installed (bash scripts/setup.sh lmcache; run with "
              ".venv-lmcache/bin/python)", file=sys.stderr)
        return 2
    try:
        ctxs = _contexts(args.kv)
        cal = None
        if args.kvtc_calibration:
            from codec import kvtc

            cal = kvtc.register_calibration(args.kvtc_calibration)
    except Exception as e:  # noqa: BLE001 - bad dump / calibration: one line, exit 2
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    doc = {"schema": "lmcache_bench/1", "command": "python -m bench.lmcache " +
           " ".join(argv if argv is not None else sys.argv[1:]),
           "kv": args.kv, "kv_shape": list(ctxs[0][0].shape), "calibration": cal}
    if args.estimate:
        doc["estimate"] = run_estimate(ctxs, args.chunk_size, cal, log, extra, args.levels)
    if args.sizes:
        doc["sizes"] = run_sizes(ctxs, args.chunk_size, cal, args.redis, args.repeats, log, extra)
    atomic_write_json(args.out, doc, indent=1, default=str)
    print(f"wrote {args.out}")
    return 0

