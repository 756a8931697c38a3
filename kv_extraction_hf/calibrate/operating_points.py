"""Fit a model's operating points: measure every level of the codecs that have levels on
windows of the calibration text, store the table content-addressed, and read each
target's level off it (``codec.operating_points``: the targets, the chooser, the table).

The codec knows no model, so the model-facing half lives here, beside the kvtc
calibration: the calibration text (by default the offline standard-library docstring
prose of ``kv_extraction_hf.calibration_text``, the kvtc calibration's default text;
never WikiText-2 test, the evaluation text), its tokens, the windows, the cache index. The
measurement itself (prefill, encode + decode, continuation logits, KL and top-1 against
the lossless KV) is the quality benchmark's ``bench.quality.run_text_quality``, passed in
as ``measure`` (a stage package does not import the measurements).

Token layout of the calibration text: the first ``skip_tokens`` (the tokens the default
kvtc calibration is fitted on, ``DEFAULT_SETTINGS`` windows x window_tokens) are not used;
the rest is cut in two halves, the FIRST for fitting the operating points, the SECOND held
out (``heldout_ids``: the benchmark measures each point there too, the calibration text's
domain vs WikiText-2's). Windows inside a half: ``kv_extraction_hf.wikitext.token_windows``
(seeded, non-overlapping).

Cache: ``<cache>/operating-points/<table sha256>.json`` plus ``index-<key>.json`` naming
it, the key a sha256 of the model's weights hash, the text's sha256, the settings, the
codec list and the codecs' configs (the kvtc calibration hash). Deterministic and
independent of the caller's thread count (the measurement runs torch on one thread, since
a forward's float sums depend on the thread count; the table's floats are also rounded to
6 significant digits before hashing; tests/extraction/test_operating_points.py).

    python -m bench.quality --targets near-lossless lmcache      # fits (or loads) then measures
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

from kv_extraction_hf.errors import ExtractionError

__all__ = ["FIT_SETTINGS", "FIT_CODECS", "TARGET_FIT_SETTINGS", "fit_table", "fit_operating_points",
           "resolve_points", "find_table", "point_summary", "split_ids", "text_tokens", "resolve_text",
           "heldout_ids", "table_key", "one_thread"]

# 16 windows x (1024 + 128) tokens: ~18K calibration tokens per level; with the default
# model's ~50K-token text both halves hold them
FIT_SETTINGS = {"windows": 16, "context_tokens": 1024, "continuation_tokens": 128, "seed": 0,
                "skip_tokens": 4 * 1024}
FIT_CODECS = ("cachegen", "cachegen-ref", "kvtc")    # the codecs with levels (codec.level_table)
# what a quality target of a run or a store write is fitted on (resolve_points): 8 windows x
# (256 + 32) tokens, the sizes of the benchmarked table of docs/notes (cachegen's points held on
# WikiText-2 test there); cheaper than FIT_SETTINGS, its wider CIs are the chooser's margin
TARGET_FIT_SETTINGS = {"windows": 8, "context_tokens": 256, "continuation_tokens": 32, "seed": 0,
                       "skip_tokens": 4 * 1024}


def text_tokens(bundle, text: str, need: int) -> list[int]:
    """The first tokens of ``text`` (at least ``need`` when it has them), tokenised in
    200K-character blocks."""
    ids: list[int] = []
    pos, step = 0, 200_000
    while len(ids) < need and pos < len(text):
        ids.extend(bundle.tokenizer(text[pos:pos + step], add_special_tokens=False)["input_ids"])
        pos += step
    return ids


def split_ids(ids: Sequence[int], skip_tokens: int) -> tuple[list[int], list[int]]:
    """(fit half, held-out half) of ``ids[skip_tokens:]``. Raises ExtractionError when
    nothing is left after the skip."""
    rest = list(ids[skip_tokens:])
    if len(rest) < 2:
        raise ExtractionError(f"calibration text has {len(ids)} tokens, none left after the first "
                              f"{skip_tokens} (the kvtc calibration's)")
    half = len(rest) // 2
    return rest[:half], rest[half:]


def resolve_text(text: Optional[str], record: Optional[dict]) -> tuple[str, dict]:
    """(text, record) of the calibration text: ``text`` with ``record`` (or a "user"
    record with its sha256), or, ``text`` None, the default calibration text."""
    if text is None:
        from kv_extraction_hf.calibration_text import calibration_text

        return calibration_text()
    rec = record or {"source": "user", "description": "text given to fit_table",
                     "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
    return text, rec


def heldout_ids(bundle, settings: Optional[dict] = None, text: Optional[str] = None) -> list[int]:
    """The held-out half of the calibration text's tokens (``split_ids``): the other-domain
    text an operating point is also measured on. Raises ExtractionError as ``split_ids``."""
    s = dict(FIT_SETTINGS, **(settings or {}))
    text, _ = resolve_text(text, None)
    need = s["skip_tokens"] + 2 * s["windows"] * (s["context_tokens"] + s["continuation_tokens"]) + 1024
    return split_ids(text_tokens(bundle, text, 10 * need), s["skip_tokens"])[1]


def _config_id(cfg) -> str:
    """What names a codec config in the cache key: its calibration hash when it has one."""
    cal = getattr(cfg, "calibration", None)
    return str(getattr(cal, "hash", cal)) if cal is not None else repr(cfg)


def table_key(weights_hash: str, text_sha256: str, settings: dict, codecs: Sequence[str],
              configs: dict) -> str:
    """The index key of a table: sha256 (24 hex digits) of what determines it."""
    from codec import level_table, operating_points as op

    blob = json.dumps({"weights": weights_hash, "text_sha256": text_sha256, "settings": settings,
                       "codecs": {c: list(level_table.levels(c)) for c in codecs},
                       "configs": {c: _config_id(v) for c, v in sorted(configs.items()) if c in codecs},
                       "version": op.TABLE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def one_thread(fn: Callable, *args):
    """``fn(*args)`` with torch's intra-op threads set to 1 (restored after): a forward's
    float sums depend on how many threads split them (KL differed in the 6th digit between
    1 and 2 threads on the tiny test model), and the table must not."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _table_rows(rows: list[dict]) -> list[dict]:
    """Table rows (codec.operating_points.choose_level's form) from bench.quality rows."""
    return [{"codec": r["codec"], "level": r["level"], "kl": r["kl"], "kl_ci": list(r["kl_ci"]),
             "top1": r["top1_agreement"], "top1_ci": list(r["top1_agreement_ci"]),
             "ratio": r["ratio_vs_dtype"], "n": r["n_windows"]}
            for r in sorted(rows, key=lambda r: (r["codec"], r["level"]))]


def fit_table(bundle, measure: Callable, codecs: Sequence[str] = FIT_CODECS,
              settings: Optional[dict] = None, configs: Optional[dict] = None,
              text: Optional[str] = None, text_record: Optional[dict] = None,
              folder: Optional[Path] = None, log=print) -> dict:
    """The calibration table of ``bundle``'s model: loaded from the cache when one with the
    same key exists, else measured and stored.

    ``measure(bundle, token_ids, pairs, n_windows, context, continuation, seed, configs)``
    -> rows as ``bench.quality.run_text_quality``'s first result (``kl``, ``kl_ci``,
    ``top1_agreement``, ``top1_agreement_ci``, ``ratio_vs_dtype``, ``n_windows`` per
    (codec, level)). ``codecs``: codec names whose every level is measured (those without
    levels are refused: ValueError); LMCache's schedule (``cachegen-ref`` 0) always is. ``settings``: overrides of ``FIT_SETTINGS``.
    ``configs``: codec -> config (kvtc: ``KvtcConfig`` naming its calibration). ``text``:
    calibration text (default: the default calibration text). ``folder``: default
    ``codec.operating_points.default_dir()``. Returns the table (``rows``, ``model``,
    ``text``, ``settings``, ``hash``). Raises ExtractionError when the text is too short
    for the windows, ValueError on a codec without levels."""
    from codec import level_table, operating_points as op
    from kv_extraction_hf.model.fetch import file_lock
    from kv_extraction_hf.wikitext import token_windows

    s = dict(FIT_SETTINGS, **(settings or {}))
    configs = configs or {}
    for c in codecs:
        if not level_table.levels(c):
            raise ValueError(f"codec {c!r} has no levels to choose from")
    text, rec = resolve_text(text, text_record)
    trec = {k: rec.get(k, "") for k in ("source", "description", "sha256")}
    folder = Path(folder) if folder is not None else op.default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    key = table_key(bundle.info.weights_hash, trec["sha256"], s, codecs, configs)
    index = folder / f"index-{key}.json"
    with file_lock(f"operating-points-{key}"):
        if index.is_file():
            with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
                raw = json.loads(index.read_bytes()[:4096])
                return op.load_table(raw["hash"], folder)
        win = s["context_tokens"] + s["continuation_tokens"]
        ids = text_tokens(bundle, text, 10 * (s["skip_tokens"] + 2 * s["windows"] * win + 1024))
        fit_ids, _ = split_ids(ids, s["skip_tokens"])
        token_windows(len(fit_ids), win, s["windows"], s["seed"])   # too short: ExtractionError now
        pairs = [(c, lv) for c in codecs for lv in level_table.levels(c)]
        if op.REFERENCE not in pairs:      # the lmcache target reads LMCache's schedule off the table
            pairs.append(op.REFERENCE)
        log(f"[operating points] fitting on {s['windows']} windows x ({s['context_tokens']} + "
            f"{s['continuation_tokens']}) tokens of {trec['source']} (sha256 {trec['sha256'][:12]}), "
            f"{len(pairs)} codec levels (key {key})")
        rows = one_thread(measure, bundle, fit_ids, pairs, s["windows"], s["context_tokens"],
                           s["continuation_tokens"], s["seed"], configs)
        table = {"format": op.TABLE_FORMAT, "version": op.TABLE_VERSION,
                 "model": {"id": bundle.info.model_id, "weights_hash": bundle.info.weights_hash},
                 "text": trec, "settings": s, "codecs": list(codecs),
                 "configs": {c: _config_id(v) for c, v in sorted(configs.items()) if c in codecs},
                 "rows": _table_rows(rows)}
        h = op.save_table(table, folder)
        tmp = index.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"hash": h, "weights_hash": bundle.info.weights_hash, "settings": s}))
        os.replace(tmp, index)
        return op.load_table(h, folder)


def fit_operating_points(table: dict, targets: Sequence, codecs: Sequence[str]) -> list[dict]:
    """Per target and codec: ``{"target", "codec", "point": OperatingPoint record}`` or
    ``{"target", "codec", "error": one line}`` when no level meets it (``TargetUnmet``:
    the closest level and its KL). ``targets``: ``codec.operating_points.Target`` or their
    spellings (ValueError on a bad one)."""
    from codec import operating_points as op

    out = []
    for t in targets:
        t = t if isinstance(t, op.Target) else op.parse_target(t)
        for c in codecs:
            try:
                out.append({"target": t.name, "codec": c, "point": op.operating_point(table, c, t).record()})
            except op.TargetUnmet as exc:
                out.append({"target": t.name, "codec": c, "error": str(exc)})
    return out


def resolve_points(bundle, target, codecs: Sequence[str], measure: Callable, configs: Optional[dict] = None,
                   settings: Optional[dict] = None, text: Optional[str] = None,
                   folder: Optional[Path] = None, log=print) -> tuple[dict, dict]:
    """(table, {codec: OperatingPoint}) of ``target`` for each codec of ``codecs`` that has
    levels on ``bundle``'s model: the table fitted on first use (``fit_table`` with
    ``TARGET_FIT_SETTINGS`` unless ``settings``; one progress line), loaded by its key after.
    The table always holds cachegen's levels and LMCache's schedule (``cachegen-ref`` 0, the
    ``lmcache`` target's reference), plus kvtc's when it is asked for (``configs["kvtc"]``
    then names its calibration). ``target``: a
    ``codec.operating_points.Target`` or its spelling. Raises ValueError (bad spelling, a
    codec without levels), ``codec.operating_points.TargetUnmet`` (no level meets it: one
    line naming the closest level), ExtractionError (text too short)."""
    from codec import level_table, operating_points as op

    t = target if isinstance(target, op.Target) else op.parse_target(target)
    bad = [c for c in codecs if not level_table.levels(c)]
    if bad:
        raise ValueError(f"codec {bad[0]!r} has no levels to choose from")
    fit_codecs = tuple(c for c in FIT_CODECS if c == "cachegen" or c in codecs)
    table = fit_table(bundle, measure, fit_codecs, dict(settings or TARGET_FIT_SETTINGS), configs, text=text,
                      folder=folder, log=log)
    return table, {c: op.operating_point(table, c, t) for c in codecs}


def point_summary(point) -> dict:
    """What results rows and store manifests name of an ``OperatingPoint``: ``{"target",
    "codec", "level", "hash", "table"}`` (both hashes sha256 hex)."""
    return {"target": point.target, "codec": point.codec, "level": point.level, "hash": point.hash,
            "table": point.table}


def find_table(weights_hash: str, codec: str, folder: Optional[Path] = None) -> Optional[dict]:
    """A stored table of the model ``weights_hash`` that has rows of ``codec``, without
    fitting: the indexes ``index-*.json`` of ``folder`` (default
    ``codec.operating_points.default_dir()``) that name the model, a table fitted with
    ``TARGET_FIT_SETTINGS`` first, then the most codecs, the most windows, the smallest hash (the choice
    does not depend on the order files were written). None when there is none; a table file
    that does not verify is skipped."""
    from codec import operating_points as op
    from codec.errors import CodecError

    folder = Path(folder) if folder is not None else op.default_dir()
    found = []
    for index in sorted(folder.glob("index-*.json")) if folder.is_dir() else []:
        try:
            raw = json.loads(index.read_bytes()[:4096])
            if raw.get("weights_hash") != weights_hash:
                continue
            table = op.load_table(raw["hash"], folder)
        except (ValueError, OSError, KeyError, TypeError, AttributeError, CodecError):
            continue
        if any(r["codec"] == codec for r in table["rows"]):
            s = table.get("settings") or {}
            found.append((s != TARGET_FIT_SETTINGS, -len({r["codec"] for r in table["rows"]}),
                          -int(s.get("windows", 0) or 0), table["hash"], table))
    return min(found, key=lambda f: f[:4])[4] if found else None
