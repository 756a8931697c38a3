"""Tune KVTC's calibration on WikiText-2 VALIDATION windows (never the test split).

Prefills the calibration windows once (cached in --cache), fits calibration variants with
``codec.kvtc.fit_calibration`` and measures, on held-out validation windows (from token
--eval-from of the split, after the calibration text), the ratio vs bf16, KL(lossless ||
decoded) of the next-token distributions and top-1 agreement, as ``bench.quality`` does
(mean over windows, 95% CI half-width 1.96 sd / sqrt(n windows)).

    python scripts/kvtc_tune.py --variants base,metric,white1 --levels 3,5 --windows 6
    python scripts/kvtc_tune.py --variants white1 --levels 3,4 --targets 3=1.1,4=1.8
    python scripts/kvtc_tune.py --variants white1 --levels 3 --diag --cachegen ''
    python scripts/kvtc_tune.py --variants white1 --levels '' --tiers 2/128x5/384x3,3/128x5

--diag adds, per KVTC row, the KL with only K decoded (V exact) and with only V decoded
(K exact): where the distortion the model sees comes from. --tiers runs position-graded
precision, the codec's tail tiers (kvtc format 3, docs/codec.md 8.7): 'A/R1xB1/R2xB2'
codes the last R1 context tokens at level B1, the R2 tokens before them at level B2 and
the rest at level A, in ONE container (``KvtcConfig(level=A, tiers=((R1, B1), (R2,
B2)))``, one container per window as ``bench.quality`` makes it, or chunks of --chunk
tokens), with the first
variant's calibration. With --sim, the earlier simulation instead (docs/codec.md 8.6):
each span its own container (``codec.api.encode_one`` at the span's token offset).
A plain level A of the table is the tiered level when ``kvtc.DEFAULT_LEVEL_TIERS`` has
it; 'A/' is level A without tiers.

Variants (joined with +): default (the default calibration of the model,
``kv_extraction_hf.calibrate.default_calibration``: no samples, no fit), base
(orthonormal PCA, MSE water-filling with the per-(K/V, layer) sensitivity weights), metricP (per-component water levels / metric gain^P),
whiteP (PCA and water-filling in the metric-whitened space, power P), konlyP / vonlyP
(the metric on K or V only), relw (relative weighting instead of sensitivity), kxS (the
keys' water levels multiplied by S: coarser keys, finer values at the same rate),
kw<levels>xS (the same at the named levels only, ``fit_calibration(key_water=)``: e.g.
kw24x2 = levels 2 and 4). Results of the runs behind the default: docs/codec.md 8.5;
the later search: 8.6; the tail tiers: 8.7.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cachegen_common import flags  # noqa: E402
from cachegen_common.files import atomic_write_json  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command line of this script (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python scripts/kvtc_tune.py")
    ap.add_argument("--variants", default="base,metric")
    ap.add_argument("--levels", default="3,4,5")
    ap.add_argument("--targets", default="", help="level=bits,... overrides")
    ap.add_argument("--windows", type=int, default=6)
    flags.add_context_tokens(ap, default=2048, aliases=("--context",),
                             help="context tokens per evaluation window (default %(default)s)")
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--eval-from", type=int, default=120000)
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "kvtc_tune" / "samples.pt"),
                    help="where the calibration samples (and fitted variants) are cached")
    ap.add_argument("--cachegen", default="1")
    flags.add_out(ap, default="", help="also write the rows here (JSON)")
    ap.add_argument("--diag", action="store_true", help="also K-only / V-only error rows")
    ap.add_argument("--tiers", default="", help="position-graded precision simulations, "
                    "e.g. 2/128x5/384x3 (see the module docstring)")
    ap.add_argument("--sim", action="store_true", help="--tiers as the earlier simulation "
                    "(one container per span) instead of the codec's format-3 mode")
    ap.add_argument("--tier-sinks", type=int, default=None, help="sink_tokens of the "
                    "format-3 --tiers rows (default: the calibration's)")
    ap.add_argument("--chunk", type=int, default=0, help="chunk tokens of the "
                    "format-3 --tiers rows (encode_chunks; 0 = one container, as "
                    "bench.quality codes a window)")
    ap.add_argument("--sinks", default="", help="comma-separated sink_tokens overrides to "
                    "measure besides the calibration's (e.g. 1,2)")
    return ap


def _samples(args, bundle, text: str, cache: Path):
    """The calibration samples and model statistics (k, v, pos, sens, qe, wo tensors) the
    variants are fitted on: read from ``cache`` (tensors only), else measured on ``text``
    and saved there; None when only the default calibration is measured."""
    from kv_extraction_hf import calibrate as kc

    only_default = all(x == "default" for x in args.variants.split(","))
    if only_default:
        d = None
    elif cache.is_file():
        d = torch.load(cache, weights_only=True)  # tensors only: never unpickle arbitrary objects
    else:
        t0 = time.perf_counter()
        first: dict = {}
        with kc.query_energy(bundle) as qe:
            k, v, pos = kc.calibration_samples(bundle, text, 4, 1024, 4, first=first)
        sens = kc.measure_sensitivity(bundle, first["k"][:, :512], first["v"][:, :512],
                                      first["ids"][:512], sink_tokens=4, batch=12)
        d = {"k": k, "v": v, "pos": pos, "sens": torch.from_numpy(sens),
             "qe": torch.from_numpy(qe.result()),
             "wo": torch.from_numpy(kc.output_gram(bundle))}
        torch.save(d, cache)
        print(f"samples in {time.perf_counter() - t0:.0f} s")
    return d


def _tier_rows(args, first) -> list[tuple]:
    """The --tiers rows to measure, each (name, level, calibration, spans): spans the
    (start, end, level) list of the --sim simulation, else ("mode", tiers) of the format-3
    mode; ``first``: the first variant's calibration."""
    todo = []
    for spec in filter(None, args.tiers.split(",")):
        parts = spec.split("/")
        bounds, end = [], args.context_tokens
        for item in filter(None, parts[1:]):         # (tokens, level), from the end
            r_, b_ = (int(x) for x in item.split("x"))
            bounds.append((end - r_, end, b_))
            end -= r_
        bounds = [(0, end, int(parts[0]))] + bounds[::-1]
        tiers = tuple((int(x.split("x")[0]), int(x.split("x")[1]))
                      for x in filter(None, parts[1:]))
        todo.append((f"tiers:{spec}", int(parts[0]), first,
                     bounds if args.sim else ("mode", tiers)))
    return todo


def _level_targets(spec: str) -> dict[int, float]:
    """The kvtc level targets (level -> bits per element) with --targets' level=bits,...
    overrides applied."""
    from codec import kvtc

    targets = dict(kvtc.DEFAULT_LEVEL_TARGETS)
    for item in filter(None, spec.split(",")):
        a, b = item.split("=")
        targets[int(a)] = float(b)
    return targets


def _print_summary(args, rows: dict, n_windows: int) -> None:
    """Per row: mean compression ratio, KL and top-1 agreement with 1.96 sd/sqrt(n)."""
    print(f"n = {n_windows} validation windows x {args.continuation} tokens "
          f"(context {args.context_tokens}); mean +- 1.96 sd/sqrt(n)")
    for key, r in rows.items():
        n = len(r["kl"])
        kl, t1 = np.array(r["kl"]), np.array(r["top1"])
        h = lambda a: 1.96 * a.std(ddof=1) / math.sqrt(n) if n > 1 else float("nan")
        print(f"{key:24s} {np.mean(r['ratio']):6.2f}x  KL {kl.mean():.4f} +- {h(kl):.4f}  "
              f"top-1 {t1.mean():.3f} +- {h(t1):.3f}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    import codec
    from codec import kvtc
    from kv_extraction_hf import calibrate as kc
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits
    from kv_extraction_hf.model import load_model
    from kv_extraction_hf.wikitext import token_windows
    from bench.quality import reference_scores, window_scores

    bundle = load_model("default", log=lambda m: None)
    # WikiText-2 validation (data path, hub or ../shared; one-line error naming them): the
    # tuning corpus of docs/codec.md 8.x (the default calibration itself is fitted on the
    # standard library's docstring prose, kv_extraction_hf.calibration_text)
    from kv_extraction_hf.wikitext import load_wikitext2_split

    text = load_wikitext2_split("valid", None).text
    cache = Path(args.cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    d = _samples(args, bundle, text, cache)
    theta = kc.rope_theta_of(bundle)
    sens = d["sens"].numpy() if d is not None else None
    weighting = 1.0 / np.maximum(sens, 1e-6 * sens.max()) if d is not None else None
    levels = [int(x) for x in filter(None, args.levels.split(","))]
    targets = _level_targets(args.targets)
    mk, mv = kc.metric_from_stats(d["qe"].numpy(), d["wo"].numpy(), bundle) \
        if d is not None else (None, None)

    def variant(name: str):
        kw = {}
        for part in name.split("+"):
            if part == "base":
                pass
            elif part.startswith("metric"):
                p = float(part[6:] or 1.0)
                kw["metric"] = (mk, mv)
                kw["metric_power"] = p
            elif part.startswith("white"):
                kw["metric"] = (mk, mv)
                kw["metric_power"] = float(part[5:] or 1.0)
                kw["whiten"] = True
            elif part.startswith("konly"):
                p = float(part[5:] or 1.0)
                kw["metric"] = (mk, np.broadcast_to(np.eye(mk.shape[-1]), mk.shape).copy())
                kw["metric_power"] = p
            elif part.startswith("vonly"):
                p = float(part[5:] or 1.0)
                kw["metric"] = (np.broadcast_to(np.eye(mk.shape[-1]), mk.shape).copy(), mv)
                kw["metric_power"] = p
            elif part.startswith("grp"):               # grpG: joint basis of G layers' K+V
                kw["group_layers"] = int(part[3:])
            elif part == "relw":
                kw["weighting"] = "relative"
            elif part.startswith("kw"):     # kw<levels>x<S>: key_water, e.g. kw24x2
                lv_, s_ = part[2:].split("x")
                kw["key_water"] = {int(c): float(s_) for c in lv_}
            elif part.startswith("kx"):                  # keys' water levels x S
                w = weighting.copy()
                w[0] *= float(part[2:])
                kw["weighting"] = w
            else:
                raise SystemExit(f"unknown variant part {part}")
        kw.setdefault("weighting", weighting)
        t0 = time.perf_counter()
        cal = kvtc.fit_calibration(d["k"], d["v"], positions=d["pos"], rope_theta=theta,
                                   level_targets={x: targets[x] for x in targets},
                                   default_level=4, **kw)
        print(f"variant {name}: fit {time.perf_counter() - t0:.0f} s, keep "
              f"{[int(cal.n_keep(x).sum()) for x in levels]}", flush=True)
        return cal

    def cached(name: str):
        if name == "default":
            return kvtc.load_calibration(kc.default_calibration(bundle, log=lambda m: None))
        tag = name + "|" + json.dumps(sorted(targets.items()))
        import hashlib
        f = cache.parent / ("cal_" + hashlib.sha256(tag.encode()).hexdigest()[:16] + ".txt")
        if f.is_file():
            return kvtc.load_calibration(f.read_text().strip())
        cal = variant(name)
        f.write_text(str(cal.save(cache.parent)))
        return cal

    cals = {name: cached(name) for name in args.variants.split(",")}
    ids = bundle.tokenizer(text, add_special_tokens=False)["input_ids"]
    ev = ids[args.eval_from:]
    win = args.context_tokens + args.continuation
    offs = token_windows(len(ev), win, args.windows, seed=0)
    rows: dict = {}
    cg = [int(x) for x in filter(None, args.cachegen.split(","))]
    for w, off in enumerate(offs):
        ctx = ev[off:off + args.context_tokens]
        cont = ev[off + args.context_tokens:off + win]
        k, v = prefill_kv(bundle, ctx)
        ref = reference_scores(continuation_logits(bundle, k, v, ctx, cont), cont)
        sinks = [None] + [int(x) for x in filter(None, args.sinks.split(","))]
        todo = [("cachegen", lv, None, None) for lv in cg] + \
               [(name, lv, cal, sk) for name, cal in cals.items() for lv in levels
                for sk in sinks]
        from codec.api import encode_one    # per-span encode at the span's token offset
        todo += _tier_rows(args, next(iter(cals.values())))
        for name, lv, cal, sk in todo:
            if isinstance(sk, tuple):                    # --tiers: the format-3 mode
                cfg = kvtc.KvtcConfig(calibration=cal, level=lv, tiers=sk[1],
                                      chunk_tokens=args.chunk or 1024,
                                      sink_tokens=args.tier_sinks)
                blobs = codec.encode_chunks(k, v, codec="kvtc", config=cfg) if args.chunk \
                    else [codec.encode_kv(k, v, codec="kvtc", config=cfg)]
                k2, v2 = codec.decode_chunks(blobs)
                data = b"".join(blobs)
                modes = [(name, None)]
            elif isinstance(sk, list):                   # --tiers --sim: the simulation
                cfg = kvtc.KvtcConfig(calibration=cal)
                blobs = [encode_one(k[:, a:b], v[:, a:b], "kvtc", b_, cfg, a, args.context_tokens, i,
                                     len(sk))[0] for i, (a, b, b_) in enumerate(sk)]
                dec = [codec.decode_kv(x) for x in blobs]
                k2 = torch.cat([x[0] for x in dec], 1)
                v2 = torch.cat([x[1] for x in dec], 1)
                data = b"".join(blobs)
                modes = [(name, None)]
            else:
                if sk is not None:
                    name = f"{name}-sink{sk}"
                if cal is None:
                    data = codec.encode_kv(k, v, codec="cachegen", level=lv)
                else:
                    data = codec.encode_kv(k, v, codec="kvtc", level=lv,
                                           config=kvtc.KvtcConfig(calibration=cal,
                                                                  sink_tokens=sk))
                k2, v2 = codec.decode_kv(data)
                name = f"{name}:{lv}"
                modes = [(name, None)] + ([(name + ":Konly", "K"), (name + ":Vonly", "V")]
                                          if args.diag and cal is not None else [])
            for key, mode in modes:
                kk = k if mode == "V" else k2.to(k.dtype)
                vv = v if mode == "K" else v2.to(v.dtype)
                s = window_scores(ref, continuation_logits(bundle, kk, vv, ctx, cont), cont)
                r = rows.setdefault(key, {"kl": [], "top1": [], "ratio": []})
                r["kl"].append(s["kl"]); r["top1"].append(s["top1"])
                r["ratio"].append(2 * k.numel() * 2 / len(data))
                print(f"  {key} {r['ratio'][-1]:.2f}x KL {s['kl']:.4f} top1 {s['top1']:.3f}",
                      flush=True)
        print(f"window {w + 1}/{len(offs)} done", flush=True)
    _print_summary(args, rows, len(offs))
    if args.out:
        atomic_write_json(args.out, rows, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
