"""Per-layer K/V bits against the uniform levels at matched bytes:
``python -m bench.quality --targets lmcache near-lossless --per-layer-bits``.

Per target: the uniform-level operating point of ``cachegen`` (``codec.operating_points``
on the calibration table, ``kv_extraction_hf.calibrate.operating_points``), the model's
per-layer K/V sensitivity table (``kv_extraction_hf.calibrate.sensitivity``: forward KL
when only one layer's K or V is quantized, measured bytes; the fit half of the calibration
text, or ``--sensitivity-data FILE``) and two allocations of it
(``codec.bit_allocation``, on the KL in excess of each unit's floor: ``excess_table``): ``matched-bytes`` (the least summed KL estimate within the
uniform point's estimated bytes: compare KL at the same ratio) and ``matched-kl`` (the
fewest bytes whose summed KL estimate is within the uniform point's: compare ratio at the
same KL). All three and LMCache's schedule are measured on the same held-out WikiText-2
test windows (never the calibration text): ratio, KL and top-1 with 95% bootstrap CIs,
and the paired per-window KL and top-1 differences against the uniform point with their
95% bootstrap CIs. Verdicts: at matched bytes the allocation wins when its paired KL
difference's CI lies below 0 and its ratio is not below the uniform point's by more than
1%; at matched KL it wins when its ratio is higher and the KL difference's CI reaches 0 or
below. Part of bench.quality (the command is bench.quality.cli); writes
benchmarks/quality-per-layer-bits.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from bench.quality.config import QualityError

DEFAULT_OUT_NAME = "quality-per-layer-bits.json"
RATIO_SLACK = 0.01       # matched bytes: the allocation's ratio may be at most 1% below the uniform's


def _summary(r: dict) -> dict:
    return {"ratio": r["ratio_vs_dtype"], "bits_per_element": r["bits_per_element"], "kl": r["kl"],
            "kl_ci": r["kl_ci"], "top1": r["top1_agreement"], "top1_ci": r["top1_agreement_ci"],
            "n": r["n_windows"]}


def paired(a: dict, b: dict) -> dict:
    """Paired per-window differences ``a - b`` of two rows measured on the same windows:
    ``{"kl": mean, "kl_ci": [lo, hi], "top1": ..., "top1_ci": ..., "n"}`` (95% bootstrap CIs
    over windows, ``evaluation.stats.mean_ci``). Raises QualityError when the windows differ
    in number."""
    from evaluation.stats import mean_ci

    out = {}
    for k in ("kl", "top1"):
        x, y = a["per_window"][k], b["per_window"][k]
        if len(x) != len(y):
            raise QualityError(f"paired rows have {len(x)} and {len(y)} windows")
        s = mean_ci([p - q for p, q in zip(x, y)])
        out[k], out[k + "_ci"], out["n"] = s["mean"], s["ci"], s["n"]
    return out


def verdict(kind: str, alloc: dict, uniform: dict, diff: dict) -> dict:
    """Who wins one comparison (``kind`` "matched-bytes" or "matched-kl") of summaries
    ``alloc`` / ``uniform`` with the paired ``diff`` (alloc - uniform): ``{"winner":
    "per-layer" | "uniform" | "tie", "why": one line}``."""
    if kind == "matched-bytes":
        if alloc["ratio"] < (1 - RATIO_SLACK) * uniform["ratio"]:
            return {"winner": "uniform", "why": f"the allocation is {uniform['ratio'] / alloc['ratio']:.3f}x larger"}
        if diff["kl_ci"][1] < 0:
            return {"winner": "per-layer", "why": "KL lower at the same size (paired CI below 0)"}
        if diff["kl_ci"][0] > 0:
            return {"winner": "uniform", "why": "KL higher at the same size (paired CI above 0)"}
        return {"winner": "tie", "why": "paired KL CI contains 0 at the same size"}
    if alloc["ratio"] > uniform["ratio"] and diff["kl_ci"][0] <= 0:
        return {"winner": "per-layer", "why": f"{alloc['ratio'] / uniform['ratio']:.3f}x the ratio, KL not "
                                              "significantly higher"}
    if alloc["ratio"] <= uniform["ratio"]:
        return {"winner": "uniform", "why": "the allocation is not smaller"}
    return {"winner": "uniform", "why": "smaller but KL significantly higher (paired CI above 0)"}


def run_per_layer_bits(bundle, wt_ids: Sequence[int], targets: list, sizes: tuple, fit_windows: int,
                       measure: Callable, sensitivity_text: Optional[Path] = None,
                       sensitivity_settings: Optional[dict] = None, log=print) -> dict:
    """The ``per_layer_bits`` part of quality-per-layer-bits.json. ``sizes``: (held-out
    windows, context tokens, continuation tokens, seed); ``measure``: as in
    ``bench.quality.targets.run_targets``. ``sensitivity_text``: a text file the
    sensitivity is measured on (its fit half; default the calibration text);
    ``sensitivity_settings``: overrides of ``sensitivity.SENSITIVITY_SETTINGS``. Raises
    QualityError when the calibration or the sensitivity text is too short."""
    from codec import bit_allocation as ba
    from codec import operating_points as op
    from codec.config import CodecConfig
    from kv_extraction_hf.calibrate import operating_points as fit
    from kv_extraction_hf.calibrate import sensitivity as sens
    from kv_extraction_hf.errors import ExtractionError
    from kv_extraction_hf.model.fetch import sha256_file

    windows, context, continuation, seed = sizes
    L = bundle.info.num_layers
    settings = {"windows": fit_windows, "context_tokens": context, "continuation_tokens": continuation, "seed": seed}
    text = rec = None
    if sensitivity_text is not None:
        try:
            text = Path(sensitivity_text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise QualityError(f"--sensitivity-data: {exc}") from None
        rec = {"source": Path(sensitivity_text).name, "description": "--sensitivity-data",
               "sha256": sha256_file(sensitivity_text)}
    try:
        table = fit.fit_table(bundle, measure, ("cachegen",), settings, log=log)
        stab = sens.fit_sensitivity(bundle, text=text, text_record=rec, settings=sensitivity_settings, log=log)
    except ExtractionError as exc:
        raise QualityError(f"per-layer bits: {exc}") from None
    points = fit.fit_operating_points(table, targets, ("cachegen",))
    etab = ba.excess_table(stab)       # per-unit floors removed: the part of the KL that adds
    plans = []                 # (target, uniform level, {kind: Allocation})
    for p in points:
        if "error" in p:
            log(f"target {p['target']}: {p['error']}")
            continue
        u = p["point"]["level"]
        uni = CodecConfig.for_model(L, u)
        kl_u, bytes_u = ba.estimate(etab, uni.key_bins, uni.value_bins)
        allocs = {"matched-bytes": ba.allocate_bins(etab, byte_budget=bytes_u),
                  "matched-kl": ba.allocate_bins(etab, kl_target=kl_u)}
        plans.append((p, u, uni, (kl_u, bytes_u), allocs))
        log(f"target {p['target']}: uniform cachegen {u} (estimate KL {kl_u:.4g}, {bytes_u:.0f} B/window); "
            + "; ".join(f"{k}: K {list(a.key_bins)} V {list(a.value_bins)}" for k, a in allocs.items()))
    uni_pairs = sorted({("cachegen", u) for _, u, _, _, _ in plans} | {op.REFERENCE})
    log(f"held-out WikiText-2 test: {windows} windows x ({context} + {continuation}); uniform {uni_pairs}")
    held = {(r["codec"], r["level"]): r for r in measure(bundle, wt_ids, uni_pairs, windows, context,
                                                          continuation, seed, {})}
    rows = []
    for p, u, uni, (kl_u, bytes_u), allocs in plans:
        urow = held[("cachegen", u)]
        row = {"target": p["target"], "uniform": {"level": u, "key_bins": uni.key_bins, "value_bins": uni.value_bins,
                                                  "kl_estimate": kl_u, "bytes_estimate": bytes_u,
                                                  "heldout": _summary(urow)},
               "operating_point": p["point"]["hash"], "comparisons": {}}
        for kind, a in allocs.items():
            cfg = ba.config_from_bins(uni, a.key_bins, a.value_bins)
            log(f"  {p['target']} {kind}: {cfg.describe()}")
            (arow,) = measure(bundle, wt_ids, [("cachegen", None)], windows, context, continuation, seed,
                              {"cachegen": cfg})
            s, d = _summary(arow), paired(arow, urow)
            row["comparisons"][kind] = {"allocation": a.record(), "config": cfg.to_dict(), "heldout": s,
                                        "paired_vs_uniform": d,
                                        "verdict": verdict(kind, s, row["uniform"]["heldout"], d)}
        rows.append(row)
    ref = held.get(op.REFERENCE)
    return {"rows": rows, "reference": {"codec": op.REFERENCE[0], "level": op.REFERENCE[1],
                                        "heldout": _summary(ref) if ref else None},
            "operating_point_table": {"hash": table["hash"], "text": table["text"], "settings": table["settings"]},
            "sensitivity": dict({k: stab[k] for k in ("hash", "text", "settings", "bins", "n", "bytes_basis", "kl",
                                                      "kl_ci", "bytes", "dtype_bytes", "base")},
                                kl_floor=etab["kl_floor"],
                                estimate="sum over layers and K/V of the KL in excess of each unit's floor "
                                         "(its smallest KL over the candidates; codec.bit_allocation.excess_table)"),
            "rules": {"matched-bytes": f"least summed KL estimate within the uniform point's estimated bytes; wins "
                                       f"when the paired KL CI is below 0 and the ratio is within {RATIO_SLACK:.0%}",
                      "matched-kl": "fewest bytes with summed KL estimate within the uniform point's; wins when "
                                    "the ratio is higher and the paired KL CI reaches 0 or below"},
            "windows": {"heldout": windows, "sensitivity": stab["n"], "operating_points": fit_windows}}


def print_per_layer_bits(part: dict, out=None) -> None:
    """The console table of ``run_per_layer_bits``' result."""
    def ci(s, k, d=4):
        return f"{s[k]:.{d}f} [{s[k + '_ci'][0]:.{d}f}, {s[k + '_ci'][1]:.{d}f}]"

    print(f"{'target':<14} {'schedule':<22} {'ratio':>7}  {'KL [95% CI]':<28} {'top-1 [95% CI]':<26} "
          f"{'paired dKL vs uniform':<30} verdict", file=out)
    for r in part["rows"]:
        u = r["uniform"]["heldout"]
        print(f"{r['target']:<14} {'uniform cachegen ' + str(r['uniform']['level']):<22} {u['ratio']:>6.2f}x  "
              f"{ci(u, 'kl'):<28} {ci(u, 'top1', 3):<26} {'-':<30} (n={u['n']})", file=out)
        for kind, c in r["comparisons"].items():
            s, d = c["heldout"], c["paired_vs_uniform"]
            print(f"{'':<14} {'per-layer ' + kind:<22} {s['ratio']:>6.2f}x  {ci(s, 'kl'):<28} "
                  f"{ci(s, 'top1', 3):<26} {ci(d, 'kl'):<30} {c['verdict']['winner']}: {c['verdict']['why']}",
                  file=out)
    ref = part["reference"]["heldout"]
    if ref:
        print(f"{'(reference)':<14} {'cachegen-ref 0':<22} {ref['ratio']:>6.2f}x  {ci(ref, 'kl'):<28} "
              f"{ci(ref, 'top1', 3):<26}", file=out)


def _machine() -> dict:
    """CPU model (``lscpu``'s "Model name", else /proc/cpuinfo) and the 1/5/15-minute load averages."""
    import os
    import subprocess

    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu_model": model, "cpu_count": os.cpu_count(),
            "load_avg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def per_layer_bits_part(args, argv, bundle, wt, targets, sizes, measure, doc, t_start, log) -> None:
    """--targets ... --per-layer-bits: run, print and write quality-per-layer-bits.json (or --out)."""
    import time

    from cachegen_common.files import atomic_write_json
    from bench.quality.config import DEFAULT_OUT

    machine_start = _machine()
    ids = bundle.tokenizer(wt.text)["input_ids"]
    part = run_per_layer_bits(bundle, ids, targets, sizes, args.fit_windows, measure, args.sensitivity_data, log=log)
    for k in ("rows", "tasks"):
        doc.pop(k, None)
    doc.update({"kind": "quality-per-layer-bits", "per_layer_bits": part,
                "data": dict(wt.record(), tokens=len(ids), corpus="WikiText-2 (Merity et al. 2016), CC BY-SA 3.0"),
                "config": {"n_windows": sizes[0], "context_tokens": sizes[1], "continuation_tokens": sizes[2],
                           "seed": sizes[3], "fit_windows": args.fit_windows, "codec": "cachegen",
                           "ci": "95% percentile bootstrap over windows, 10000 resamples, seed 0; paired "
                                 "differences per window"},
                "machine": {"start": machine_start, "end": _machine()},
                "wall_s": time.perf_counter() - t_start})
    out = args.out if any(a == "--out" or a.startswith("--out=") for a in argv) else \
        DEFAULT_OUT.with_name(DEFAULT_OUT_NAME)
    print()
    print_per_layer_bits(part)
    atomic_write_json(out, doc, indent=1)
    print(f"\nwrote {out} ({doc['wall_s']:.0f} s)")
