"""The run's quality target: ``run_benchmarks.py --target NAME`` runs cachegen and kvtc at
the model's operating points instead of configured levels; without a target, cachegen's
default level is the model's ``lmcache`` operating point (``DEFAULT_TARGET``), resolved and
recorded while the configured levels run as given.

A target (``codec.operating_points``: ``near-lossless``, ``lmcache``, ``kl:X``) is
resolved per codec on the model in use by ``bench.quality.targets.resolve_target``: the
calibration table of the model (every level on windows of the offline calibration text,
never the evaluation text) is fitted on first use with one progress line, cached
content-addressed beside the kvtc calibration, and loaded by its key after. The chosen
points are recorded in results.json (``operating_points`` in the header, ``operating_point``
on each run row of a codec at its point) and in each store entry's manifest ``meta``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from harness.config import RunConfig
from harness.contexts import BenchmarkError, log

# the codecs a target picks a level of, and the RunConfig field holding each one's levels
TARGET_FIELDS = {"cachegen": "levels", "kvtc": "kvtc_levels"}
# level=None: the model's operating point of this target (cachegen only: kvtc's points do not
# carry over from the calibration text to other text, docs/notes/2026-12-07-operating-points.md)
DEFAULT_TARGET = "lmcache"
DEFAULT_CODECS = ("cachegen",)


def target_codecs(cfg: RunConfig, configs: dict[str, Any]) -> list[str]:
    """The codecs of ``cfg``'s modes a target applies to: cachegen (mode cachegen or
    cachegen-adaptive) and kvtc when its calibration is ready (``configs`` has it)."""
    out = []
    if "cachegen" in cfg.modes or "cachegen-adaptive" in cfg.modes:
        out.append("cachegen")
    if "kvtc" in cfg.modes and "kvtc" in configs:
        out.append("kvtc")
    return out


def apply_target(cfg: RunConfig, bundle, configs: dict[str, Any],
                 windows=None) -> tuple[RunConfig, dict[str, Any] | None]:
    """(cfg with each target codec's levels set to its operating point, the results
    header's ``operating_points`` record) for ``cfg.target``; without one (cfg unchanged,
    ``default_point``'s record: cachegen's ``lmcache`` point as its default level).

    ``configs``: codec -> encode config (kvtc's names its calibration, which enters the
    table's cache key); ``windows``: sliding-window storage (``store_layout``) or None.
    The record: ``{"target", "role" ("target" | "default"), "table" (sha256), "settings",
    "text", "points": [codec.operating_points.OperatingPoint.record(), ...]}``. Raises BenchmarkError (one line)
    when no level of a codec meets the target (the closest level and its KL) or the
    table cannot be fitted."""
    if cfg.target is None:
        return cfg, default_point(cfg, bundle, windows)
    from bench.quality.targets import resolve_target
    from codec import operating_points as op
    from codec.errors import CodecError
    from kv_extraction_hf.errors import ExtractionError

    codecs = target_codecs(cfg, configs)
    if not codecs:
        return cfg, {"target": cfg.target, "role": "target", "table": None, "points": []}
    try:
        table, points = resolve_target(bundle, cfg.target, codecs, configs, windows=windows, log=log)
    except op.TargetUnmet as exc:
        raise BenchmarkError(str(exc)) from None
    except (ExtractionError, ValueError, CodecError) as exc:
        raise BenchmarkError(f"operating points of target {cfg.target}: {exc}") from None
    _log_points(points, "target")
    new = dataclasses.replace(cfg, **{TARGET_FIELDS[c]: (p.level,) for c, p in points.items()})
    return new, _record(table, points, "target")


def default_point(cfg: RunConfig, bundle, windows=None) -> dict[str, Any] | None:
    """The results header's ``operating_points`` of a run without a target: cachegen's
    ``DEFAULT_TARGET`` point on the model (what ``level=None`` means; fitted on first use,
    then loaded), ``role`` "default"; the configured levels run unchanged. None when
    cachegen does not run. Never raises for the fit: a table that cannot be fitted, or a
    target no level meets, is logged and recorded as ``{"error": one line, "points": []}``
    (cachegen's default level then stays the codec's, ``codec.default_level``)."""
    if "cachegen" not in target_codecs(cfg, {}):
        return None
    from bench.quality.targets import resolve_target
    from codec.errors import CodecError
    from kv_extraction_hf.errors import ExtractionError

    try:
        table, points = resolve_target(bundle, DEFAULT_TARGET, DEFAULT_CODECS, {}, windows=windows, log=log)
    except (ExtractionError, ValueError, CodecError, OSError) as exc:   # TargetUnmet is a ValueError
        why = " ".join(str(exc).split())[:300]
        log(f"default level: no {DEFAULT_TARGET} operating point ({why}); cachegen's default level stays the codec's")
        return {"target": DEFAULT_TARGET, "role": "default", "table": None, "points": [], "error": why}
    _log_points(points, "default level")
    return _record(table, points, "default")


def _log_points(points: dict, what: str) -> None:
    for c, p in points.items():
        log(f"{what} {p.target}: {c} level {p.level} ({p.ratio:.2f}x, calibration KL {p.kl:.4g} "
            f"[{p.kl_ci[0]:.4g}, {p.kl_ci[1]:.4g}], n = {p.n}; operating point {p.hash[:12]}, "
            f"table {p.table[:12]})")


def _record(table: dict, points: dict, role: str) -> dict[str, Any]:
    return {"target": next(iter(points.values())).target, "role": role, "table": table["hash"],
            "settings": table["settings"], "text": table["text"],
            "points": [p.record() for p in points.values()]}


def point_summaries(record: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """codec -> ``{"target", "codec", "level", "hash", "table"}`` of an ``apply_target``
    record (empty for None): what run rows and manifests name."""
    return {r["codec"]: {k: r[k] for k in ("target", "codec", "level", "hash", "table")}
            for r in (record or {}).get("points", [])}
