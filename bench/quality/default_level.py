"""The default-level rule of ``python -m bench.quality --choose-default``: the smallest
cachegen level whose KL and top-1 agreement are no worse than LMCache's schedule
(``cachegen-ref`` level 0) on the same windows, judged by 95% paired bootstrap CIs of the
per-window differences. Reads a quality.json document; measures nothing. Not runnable.
"""
from __future__ import annotations

import numpy as np

from bench.quality.config import FAMILY_DEFAULT, QualityError
from codec.operating_points import REFERENCE


def choose_default_level(doc: dict, family: str = FAMILY_DEFAULT, reference: tuple = REFERENCE,
                         n_resamples: int = 10000, seed: int = 0) -> dict:
    """The default-level rule on a quality.json document.

    Among ``family``'s rows measured on the same windows as ``reference`` (LMCache's
    schedule), a level qualifies when it is no worse than the reference within the 95%
    paired bootstrap CI: CI of per-window (KL_level - KL_ref) has lower end <= 0, and CI of
    per-window (top1_level - top1_ref) has upper end >= 0. The choice is the qualifying
    level with the largest ratio_vs_dtype (smallest size). Returns ``{"level", "ratio_vs_dtype",
    "candidates": [...], "rule"}`` (level None when none qualifies). Raises QualityError
    when the reference row or per-window values are missing or the windows differ.
    """
    from evaluation.stats import bootstrap_ci

    rows = doc.get("rows") or []
    ref = [r for r in rows if r.get("codec") == reference[0] and r.get("level") == reference[1]]
    if not ref or "per_window" not in ref[0]:
        raise QualityError(f"quality results lack the reference row {reference[0]} level {reference[1]} "
                           "with per-window values")
    ref = ref[0]
    cands = []
    for r in rows:
        if r.get("codec") != family or "per_window" not in r or any((r.get("anchors") or {}).values()):
            continue
        if len(r["per_window"]["kl"]) != len(ref["per_window"]["kl"]):
            raise QualityError(f"{family} {r['level']} and the reference were measured on different windows")
        dkl = np.asarray(r["per_window"]["kl"]) - np.asarray(ref["per_window"]["kl"])
        dtop = np.asarray(r["per_window"]["top1"]) - np.asarray(ref["per_window"]["top1"])
        kl_ci = bootstrap_ci(dkl, n_resamples=n_resamples, seed=seed)
        top_ci = bootstrap_ci(dtop, n_resamples=n_resamples, seed=seed)
        ok = kl_ci[0] <= 0.0 and top_ci[1] >= 0.0
        cands.append({"level": r["level"], "ratio_vs_dtype": r["ratio_vs_dtype"], "kl": r["kl"],
                      "top1_agreement": r["top1_agreement"], "kl_diff_ci": list(kl_ci),
                      "top1_diff_ci": list(top_ci), "qualifies": ok})
    cands.sort(key=lambda c: -c["ratio_vs_dtype"])
    best = next((c for c in cands if c["qualifies"]), None)
    return {"level": best["level"] if best else None,
            "ratio_vs_dtype": best["ratio_vs_dtype"] if best else None,
            "reference": {"codec": reference[0], "level": reference[1], "ratio_vs_dtype": ref["ratio_vs_dtype"],
                          "kl": ref["kl"], "top1_agreement": ref["top1_agreement"]},
            "candidates": cands,
            "rule": "smallest size whose 95% paired bootstrap CI of (KL - KL_ref) reaches <= 0 and of "
                    "(top1 - top1_ref) reaches >= 0, on the same windows"}


def print_choice(choice: dict) -> None:
    """The rule's choice as text on stdout: the reference, each candidate with its CIs, the level chosen."""
    ref = choice["reference"]
    print(f"reference {ref['codec']} {ref['level']}: {ref['ratio_vs_dtype']:.2f}x, KL {ref['kl']:.4f}, "
          f"top-1 {ref['top1_agreement']:.3f}")
    for c in choice["candidates"]:
        print(f"  {FAMILY_DEFAULT} {c['level']}: {c['ratio_vs_dtype']:.2f}x  KL {c['kl']:.4f} "
              f"(diff CI [{c['kl_diff_ci'][0]:+.4f}, {c['kl_diff_ci'][1]:+.4f}])  top-1 {c['top1_agreement']:.3f} "
              f"(diff CI [{c['top1_diff_ci'][0]:+.3f}, {c['top1_diff_ci'][1]:+.3f}])  "
              f"{'qualifies' if c['qualifies'] else 'worse'}")
    print(f"rule: {choice['rule']}")
    if choice["level"] is None:
        print("chosen default level: none qualifies")
    else:
        print(f"chosen default level: {FAMILY_DEFAULT} {choice['level']} ({choice['ratio_vs_dtype']:.2f}x)")
