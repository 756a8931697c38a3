"""Operating points on held-out text: ``python -m bench.quality --targets near-lossless lmcache``.

Per model: fit (or load from the cache) the calibration table of every level of the codecs
with levels on the calibration text (``kv_extraction_hf.calibrate.operating_points``, the
offline docstring prose, never WikiText-2 test), read each target's operating point off it
(``codec.operating_points``: the smallest-size level whose calibration KL's 95% CI upper
bound is within the target), then measure each point with the text-fidelity measurement
(``bench.quality.text.run_text_quality``) on held-out WikiText-2 test windows and on the
held-out half of the calibration text (the other domain): ratio, KL and top-1 with 95%
bootstrap CIs and n. A target counts as met on held-out text when the held-out KL's CI
upper bound is <= 1.25x the target's KL. LMCache's schedule (``cachegen-ref`` 0) is
measured beside them on the same windows.
Part of bench.quality (the command is bench.quality.cli); schema: docs/results-schema.md.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from bench.quality.config import QualityError

HELDOUT_FACTOR = 1.25     # a target is met on held-out text when KL CI upper <= 1.25 x target
DEFAULT_TARGETS_OUT = "quality-targets.json"


def parse_targets(names: Optional[Sequence[str]], kl: Optional[float]) -> list:
    """``codec.operating_points.Target`` list of ``--targets`` names plus ``--target-kl``.
    Raises QualityError (one line) on a bad name or KL."""
    from codec import operating_points as op

    specs = list(names or []) + ([f"kl:{kl}"] if kl is not None else [])
    try:
        out = [op.parse_target(s) for s in specs]
    except ValueError as exc:
        raise QualityError(str(exc)) from None
    return list({t.name: t for t in out}.values())


def _summary(r: Optional[dict]) -> Optional[dict]:
    if r is None:
        return None
    return {"ratio": r["ratio_vs_dtype"], "kl": r["kl"], "kl_ci": r["kl_ci"], "top1": r["top1_agreement"],
            "top1_ci": r["top1_agreement_ci"], "n": r["n_windows"]}


def run_targets(bundle, wt_ids: Sequence[int], targets: list, codecs: Sequence[str], sizes: tuple,
                fit_windows: int, measure: Callable, configs: dict, ws, log=print) -> dict:
    """The ``targets`` part of quality-targets.json. ``sizes``: (held-out windows, context
    tokens, continuation tokens, seed); the fit uses the same window geometry on
    ``fit_windows`` calibration windows. ``measure``: as ``run_text_quality`` with
    (bundle, ids, pairs, n, context, continuation, seed, configs) -> rows. Returns
    ``{"table", "points", "rows", "reference"}``; a codec that meets no target has an
    ``error`` row (the closest level and its KL)."""
    from codec import operating_points as op
    from kv_extraction_hf.calibrate import operating_points as fit
    from kv_extraction_hf.errors import ExtractionError

    windows, context, continuation, seed = sizes
    settings = {"windows": fit_windows, "context_tokens": context, "continuation_tokens": continuation,
                "seed": seed, **({"window_storage": list(ws)} if ws is not None else {})}
    try:
        table = fit.fit_table(bundle, measure, codecs, settings, configs, log=log)
    except ExtractionError as exc:
        raise QualityError(f"operating points: {exc}") from None
    log(f"operating-point table {table['hash'][:16]} ({len(table['rows'])} codec levels, "
        f"n = {fit_windows} calibration windows)")
    points = fit.fit_operating_points(table, targets, codecs)
    pairs = sorted({(p["point"]["codec"], p["point"]["level"]) for p in points if "point" in p}
                   | {op.REFERENCE})
    log(f"held-out WikiText-2 test: {windows} windows x ({context} + {continuation}), {len(pairs)} codec levels")
    held = {(r["codec"], r["level"]): r for r in measure(bundle, wt_ids, pairs, windows, context,
                                                          continuation, seed, configs)}
    other_ids = fit.heldout_ids(bundle, settings)
    # cheap: half the held-out windows (at least 2)
    n_other = min(max(2, windows // 2), len(other_ids) // (context + continuation))
    other = {}
    if n_other >= 2:
        log(f"held-out calibration text (other domain): {n_other} windows")
        other = {(r["codec"], r["level"]): r for r in measure(bundle, other_ids, pairs, n_other, context,
                                                               continuation, seed, configs)}
    ref_held = held.get(op.REFERENCE)
    rows = []
    for p in points:
        if "error" in p:
            rows.append(p)
            continue
        pt = p["point"]
        key = (pt["codec"], pt["level"])
        h = held.get(key)
        row = {"target": p["target"], "codec": pt["codec"], "level": pt["level"],
               "operating_point": pt["hash"], "table": table["hash"], "target_kl": pt["target_kl"],
               "min_top1": pt["min_top1"],
               "calibration": {"ratio": pt["ratio"], "kl": pt["kl"], "kl_ci": pt["kl_ci"], "top1": pt["top1"],
                               "top1_ci": pt["top1_ci"], "n": pt["n"]},
               "heldout": _summary(h), "other_domain": _summary(other.get(key)),
               "heldout_met": None if h is None else bool(h["kl_ci"][1] <= HELDOUT_FACTOR * pt["target_kl"])}
        if h is not None and pt["min_top1"] is not None:
            row["heldout_top1_met"] = bool(h["top1_agreement_ci"][0] >= pt["min_top1"])
        if h is not None and ref_held is not None:
            row["vs_lmcache"] = {"ratio_x": h["ratio_vs_dtype"] / ref_held["ratio_vs_dtype"],
                                 "kl_within_or_below_ci": bool(h["kl"] <= ref_held["kl_ci"][1])}
        rows.append(row)
    return {"table": {"hash": table["hash"], "text": table["text"], "settings": table["settings"],
                      "rows": table["rows"]},
            "points": points, "rows": rows,
            "reference": {"codec": op.REFERENCE[0], "level": op.REFERENCE[1], "heldout": _summary(ref_held),
                          "other_domain": _summary(other.get(op.REFERENCE))},
            "rule": f"smallest-size level whose calibration KL 95% CI upper bound <= target KL (and mean top-1 "
                    f">= the floor); met on held-out text when its KL CI upper bound <= "
                    f"{HELDOUT_FACTOR}x the target KL",
            "windows": {"heldout": windows, "other_domain": n_other, "fit": fit_windows}}


def calibration_measure(windows=None) -> Callable:
    """The ``measure`` of ``kv_extraction_hf.calibrate.operating_points.fit_table``: the
    text-fidelity measurement (``run_text_quality``: rows of KL, top-1 and ratio per codec
    level) with its default batch and codec workers, quiet (the fit prints its own line).
    ``windows``: per-layer sliding windows (sliding-window storage) or None."""
    from bench.quality.config import DEFAULT_BATCH, DEFAULT_CODEC_WORKERS
    from bench.quality.text import run_text_quality

    def measure(bundle, ids, pairs, n, context, continuation, seed, configs):
        return run_text_quality(bundle, ids, pairs, n, context, continuation, seed, log=lambda m: None,
                                batch=DEFAULT_BATCH, codec_workers=DEFAULT_CODEC_WORKERS, configs=configs,
                                windows=windows)[0]

    return measure


def resolve_target(bundle, target, codecs: Sequence[str], configs: Optional[dict] = None, windows=None,
                   settings: Optional[dict] = None, text: Optional[str] = None, log=print) -> tuple[dict, dict]:
    """(table, {codec: OperatingPoint}) of a quality target on ``bundle``'s model, the
    table fitted on first use with ``calibration_measure`` and cached
    (``kv_extraction_hf.calibrate.operating_points.resolve_points``, its arguments and
    errors: ValueError, ``codec.operating_points.TargetUnmet``, ExtractionError). With
    ``windows`` (sliding-window storage) the table's settings name the layout."""
    from kv_extraction_hf.calibrate import operating_points as fit

    s = dict(settings or fit.TARGET_FIT_SETTINGS)
    if windows is not None:
        s["window_storage"] = list(windows)
    return fit.resolve_points(bundle, target, codecs, calibration_measure(windows), configs, s, text, log=log)


def print_targets(part: dict, out=None) -> None:
    """The console table of ``run_targets``' result."""
    def ci(s, k, d=4):
        return "-" if s is None else f"{s[k]:.{d}f} [{s[k + '_ci'][0]:.{d}f}, {s[k + '_ci'][1]:.{d}f}] n={s['n']}"

    print(f"{'target':<14} {'codec / level':<16} {'ratio':>7}  {'held-out KL [95% CI]':<34} "
          f"{'top-1':<30} {'met':<5} {'calibration KL':<34} {'other domain KL':<34}", file=out)
    for r in part["rows"]:
        if "error" in r:
            print(f"{r['target']:<14} {r['codec']:<16} unmet: {r['error']}", file=out)
            continue
        h = r["heldout"]
        print(f"{r['target']:<14} {r['codec'] + ' ' + str(r['level']):<16} "
              f"{(h['ratio'] if h else float('nan')):>6.2f}x  {ci(h, 'kl'):<34} {ci(h, 'top1', 3):<30} "
              f"{str(r['heldout_met']):<5} {ci(r['calibration'], 'kl'):<34} {ci(r['other_domain'], 'kl'):<34}",
              file=out)
    ref = part["reference"]
    if ref["heldout"]:
        print(f"{'(reference)':<14} {'cachegen-ref 0':<16} {ref['heldout']['ratio']:>6.2f}x  "
              f"{ci(ref['heldout'], 'kl'):<34} {ci(ref['heldout'], 'top1', 3):<30}", file=out)
    print(f"rule: {part['rule']}", file=out)
