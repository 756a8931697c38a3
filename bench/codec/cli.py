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
one warm-up run; decode end to end on all cores and on one, into tensors allocated once,
the entropy core alone, and the split: parse, checksum, first touch of the output, the
rest), the break-even bandwidth (the link rate at which the transfer of a context takes
as long as its decode), relative L2 error per layer, and with a model: perplexity increase (%)
of the held-out 256-token continuation when the context KV is replaced by the decoded one,
mean KL(lossless || decoded) in nats and top-1 agreement, averaged over contexts.

This measurement module is the one place that joins the codec with the model loader
(``kv_extraction_hf``); the ``codec`` package itself imports no model, engine or network
package (tests/project/test_architecture.py checks it).
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import torch

from codec.base import DTYPE_NAMES
from codec.registry import CODECS
from codec.config import DEFAULT_CHUNK_TOKENS
from cachegen_common import flags
from cachegen_common.files import atomic_write_json
from cachegen_common.header import environment as header_environment

from bench.codec.contexts import QUICK_SHAPE, load_contexts, prepare_kvtc
from bench.codec.metrics import continuation_stats
from bench.codec.rows import run_row

# (codec, level) rows run by default. cachegen-ref level 0 = LMCache's default schedule,
# 1-3 the CacheGen artifact's levels; cachegen = this project's quantizer.
DEFAULT_ROWS = [("raw", None), ("fp8", None), ("quant8", None), ("kivi4", None),
                ("kivi2", None), ("cachegen-ref", 3), ("cachegen-ref", 2),
                ("cachegen-ref", 0), ("cachegen-ref", 1), ("cachegen", 5), ("cachegen", 4),
                ("cachegen", 3), ("cachegen", 2), ("cachegen", 1), ("cachegen", 0),
                ("kvtc", 5), ("kvtc", 4), ("kvtc", 3), ("kvtc", 2), ("kvtc", 1), ("kvtc", 0)]


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
            ("decode_into_msym_s", "into", 1), ("decode_into_1thread_msym_s", "into 1t", 1),
            ("decode_parse_ms", "parse ms", 1), ("decode_checksum_ms", "xxh3 ms", 2),
            ("decode_alloc_ms", "alloc ms", 1), ("decode_other_ms", "other ms", 1),
            ("break_even_mbps", "brk-even Mb/s", 0),
            ("break_even_e2e_1thread_mbps", "brk 1t", 0),
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
    ``numerics`` (``cachegen_common.machine``: CPU vendor and model, AMX / AVX512-BF16 / AVX2 flags,
    the ISA oneDNN uses); computed by :func:`cachegen_common.header.environment`."""
    return header_environment(("python", "platform", "cpu", "num_cpus", "torch_threads",
                               "packages", "git_commit", "load_avg_1m", "numerics"),
                              packages=("torch", "numpy", "numba"))


def parse_rows(spec: Optional[list[str]]) -> list[tuple[str, Optional[int]]]:
    """``["raw", "cachegen:2", "cachegen-ref:0"]`` -> [(codec, level), ...]."""
    from bench.lmcache import peers as lmcache_peers

    if not spec:   # LMCache's own serdes too when lmcache imports (bench/lmcache/peers.py)
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
