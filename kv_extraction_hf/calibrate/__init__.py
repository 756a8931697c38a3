"""Fit a KVTC calibration for a model: prefill calibration text, fit PCA bases + bit
allocation with ``codec.kvtc.fit_calibration``, write the safetensors artifact.

KVTC (arXiv 2511.01815, section 3.1) learns its decorrelating bases on calibration text.
The codec knows no model (house rule: ``codec`` imports nothing from the model side), so
the model-facing half lives here: this module loads the model, extracts the KV with
``kv_extraction_hf.extract.prefill_kv``, reads the model's rotary base (rope_theta) so
keys can be decorrelated before RoPE, and hands plain tensors to the codec's pure
``fit_calibration``. That is why the command is ``python -m kv_extraction_hf.calibrate``
and not ``python -m codec.calibrate``.

    python -m kv_extraction_hf.calibrate --model default --data-path wiki.valid.raw --out cal.safetensors
    python -m kv_extraction_hf.calibrate --model default --default   # (re)make the cached default

Calibrate on text you do not evaluate on (WikiText-2 *validation* for WikiText-2 test
measurements, with ``--data-path FILE``). ``default_calibration(bundle)`` returns the model's
default calibration, fitted on first use on the default calibration text (the standard
library's docstring prose, ``kv_extraction_hf.calibration_text``: on every machine
offline, no sentence shared with the pydoc_data.topics text the main job evaluates on)
and cached like the model: ``<cache>/kvtc/<hash>.safetensors`` plus an index keyed by
the model's weights hash, the calibration settings and the text's sha256. Every record
of a calibration names its text (source, description, sha256: ``text_record``).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from cachegen_common import flags
from cachegen_common.bounded_json import parse as parse_bounded_json
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.calibrate.stats import (
    measure_sensitivity, attn_modules, query_energy, output_gram, metric_from_stats,
)

__all__ = ["rope_theta_of", "calibration_samples", "measure_sensitivity", "calibrate", "default_calibration",
           "file_text", "text_record", "calibration_provenance", "cached_default_calibration",
           "calibration_index",
           "query_energy", "output_gram", "metric_from_stats",
           "DEFAULT_SETTINGS", "main"]

# window_tokens x windows calibration tokens; the measured choices of docs/codec.md (KVTC)
DEFAULT_SETTINGS = {"windows": 4, "window_tokens": 1024, "sensitivity_tokens": 512, "key_space": "pre_rope",
                    "per_head": False, "weighting": "sensitivity", "sink_tokens": 4,
                    "recent_tokens": 0, "default_level": 4, "centroid": False,
                    "rounding": 0.5, "sensitivity_batch": 12, "metric": "whitened",
                    "metric_power": 1.0, "group_layers": 2}


# An index file names a calibration hash or a few dozen layer groups; 1 MiB and 8 levels
# are far above what default_calibration or group_calibrations write.
MAX_INDEX_BYTES = 1 << 20
MAX_INDEX_DEPTH = 8
_HASH_CHARS = frozenset("0123456789abcdef")


def calibration_index(index: Path) -> dict:
    """The JSON object of a calibration index file (``default-*.json`` / ``groups-*.json``
    in ``$CACHEGEN_CACHE/kvtc``): read and parsed within MAX_INDEX_BYTES and
    MAX_INDEX_DEPTH (the cache folder may be shared), and every artifact hash it names
    (``hash``, or ``hash`` of each ``groups`` entry) checked to be 64 lowercase hex digits
    so that it can only name a file in that folder. Raises OSError when unreadable,
    ExtractionError (one line) when over a bound, not JSON or a hash is malformed."""
    with open(index, "rb") as fh:
        raw = fh.read(MAX_INDEX_BYTES + 1)
    doc = parse_bounded_json(raw, what=f"calibration index {index}", max_bytes=MAX_INDEX_BYTES,
                             max_depth=MAX_INDEX_DEPTH, expect=dict, error=ExtractionError)
    groups = doc.get("groups", [])
    named = ([doc["hash"]] if "hash" in doc else []) + \
        [g.get("hash") if isinstance(g, dict) else g for g in (groups if isinstance(groups, list) else [groups])]
    for h in named:
        if not (isinstance(h, str) and len(h) == 64 and set(h) <= _HASH_CHARS):
            raise ExtractionError(f"calibration index {index}: {str(h)[:80]!r} is not an artifact hash")
    return doc


def rope_theta_of(bundle) -> float | None:
    """The model's rotary base if it uses plain ("default") RoPE, else None (then keys are
    decorrelated after RoPE)."""
    cfg = bundle.model.config
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    rtype = params.get("rope_type", "default")
    scaling = getattr(cfg, "rope_scaling", None)
    if theta is None or rtype != "default" or (scaling and scaling.get("rope_type",
                                                                       "default") != "default"):
        return None
    if getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        return None
    return float(theta)


def _windows(bundle, text: str, windows: int, window_tokens: int) -> list[list[int]]:
    tok = bundle.tokenizer
    need = windows * window_tokens
    ids: list[int] = []
    # tokenise paragraph blocks until there are enough tokens (not the whole split)
    step = 200_000
    pos = 0
    while len(ids) < need and pos < len(text):
        ids.extend(tok(text[pos:pos + step], add_special_tokens=False)["input_ids"])
        pos += step
    if len(ids) < window_tokens:
        raise ExtractionError(f"calibration text has only {len(ids)} tokens; need at least "
                              f"{window_tokens}")
    n = min(windows, len(ids) // window_tokens)
    return [ids[i * window_tokens:(i + 1) * window_tokens] for i in range(n)]


def calibration_samples(bundle, text: str, windows: int, window_tokens: int,
                        sink_tokens: int = 4, log=print, first: dict | None = None):
    """Prefill ``windows`` consecutive windows of ``window_tokens`` tokens of ``text``.
    Returns (k [L, N, H, D], v [L, N, H, D], positions int64 [N]) with each window's first
    ``sink_tokens`` tokens left out (they are stored exactly by the codec). If ``first``
    is a dict, it receives the first window's full KV and token ids (keys "k", "v",
    "ids"), so the sensitivity probe needs no prefill of its own."""
    from kv_extraction_hf.extract import prefill_kv

    wins = _windows(bundle, text, windows, window_tokens)
    ks, vs, ps = [], [], []
    t0 = time.perf_counter()
    for i, ids in enumerate(wins):
        k, v = prefill_kv(bundle, ids)
        if first is not None and i == 0:
            first.update(k=k, v=v, ids=list(ids))
        ks.append(k[:, sink_tokens:])
        vs.append(v[:, sink_tokens:])
        ps.append(torch.arange(sink_tokens, len(ids)))
        log(f"[calibrate] prefill window {i + 1}/{len(wins)} ({len(ids)} tokens, "
            f"{time.perf_counter() - t0:.1f} s)")
    return torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ps)




def calibrate(bundle, text: str, *, windows: int = DEFAULT_SETTINGS["windows"],
              window_tokens: int = DEFAULT_SETTINGS["window_tokens"],
              key_space: str = DEFAULT_SETTINGS["key_space"], per_head: bool = False,
              weighting: str = DEFAULT_SETTINGS["weighting"],
              sink_tokens: int = DEFAULT_SETTINGS["sink_tokens"],
              recent_tokens: int = DEFAULT_SETTINGS["recent_tokens"],
              sensitivity_tokens: int = DEFAULT_SETTINGS["sensitivity_tokens"],
              default_level: int | None = None, centroid: bool = False,
              rounding: float = DEFAULT_SETTINGS["rounding"],
              sensitivity_batch: int = DEFAULT_SETTINGS["sensitivity_batch"],
              metric: str = DEFAULT_SETTINGS["metric"],
              metric_power: float = DEFAULT_SETTINGS["metric_power"],
              level_targets: dict | None = None, key_water: dict | None = None,
              group_layers: int = DEFAULT_SETTINGS["group_layers"], data_name: str = "",
              data_record: dict | None = None, layer_groups=None, log=print):
    """Fit a ``codec.kvtc.KvtcCalibration`` for ``bundle`` (a loaded ModelBundle) on
    ``text``. The defaults are ``DEFAULT_SETTINGS`` (those of the command line and of the
    cached default calibration). ``key_space``: "pre_rope" (falls back to "post_rope" when the model's RoPE
    is not the plain rotate-half kind) or "post_rope". ``weighting``: "sensitivity"
    (per-(K/V, layer) water levels from ``measure_sensitivity`` on the first
    ``sensitivity_tokens`` tokens), or "relative" / "absolute" (see
    ``codec.kvtc.fit_calibration``). ``centroid`` / ``rounding``: the reconstruction
    offsets and the encoder's quantizer (``fit_calibration``). ``sensitivity_batch``:
    noisy caches per forward pass of the sensitivity probe. ``metric``: how the model
    uses K and V (``metric_from_stats``: the query energy along each key channel, the
    output projection's gain for values, raised to ``metric_power``): "whitened" (PCA and
    water-filling in the metric's space, ``fit_calibration(whiten=True)``), "weights"
    (orthonormal PCA, per-component water levels divided by the metric's gain) or "none"
    (MSE per (K/V, layer)).
    ``level_targets``: level -> bits per element (None = the codec's defaults).
    ``key_water``: level -> factor on the keys' water level (None = the codec's
    ``DEFAULT_KEY_WATER`` with the default targets, else none).
    ``group_layers``: G > 0 = one joint basis for the K and V of G consecutive layers
    (``codec.kvtc.fit_calibration(group_layers=)``, kvtc format 4, docs/codec.md 8.8; the
    default calibration uses 2); needs ``metric`` "whitened" or "none".
    ``data_name`` / ``data_record``: the text's provenance, recorded in the artifact's
    ``meta`` (``data``; ``data_source``, ``data_description``, ``data_sha256`` from the
    record's source, description, sha256: ``text_record`` reads them back).
    ``layer_groups``: None = one calibration of every layer (returned); else a sequence
    of layer-index tuples (e.g. a hybrid model's sliding-window and full-attention
    layers, ``codec.window.layer_groups``): one prefill and sensitivity probe, then one
    calibration per group fitted on that group's layers only (``meta["layers"]``),
    returned as ``{tuple(layers): KvtcCalibration}`` (kv_extraction_hf.calibrate.groups).
    Raises ExtractionError."""
    from codec import kvtc

    if key_space not in ("pre_rope", "post_rope"):
        raise ExtractionError(f"key_space must be pre_rope or post_rope, got {key_space!r}")
    theta = rope_theta_of(bundle) if key_space == "pre_rope" else None
    if key_space == "pre_rope" and theta is None:
        log("[calibrate] model RoPE is not plain rotate-half: decorrelating keys after RoPE")
    if metric not in ("whitened", "weights", "none"):
        raise ExtractionError(f"metric must be whitened, weights or none, got {metric!r}")
    if isinstance(group_layers, bool) or not isinstance(group_layers, int) or \
            group_layers < 0:
        raise ExtractionError(f"group_layers must be an int >= 0, got {group_layers!r}")
    if group_layers and (metric == "weights" or per_head or centroid):
        raise ExtractionError("per-head bases, centroid offsets and metric 'weights' need "
                              f"group_layers=0 (got {group_layers})")
    n_layers = getattr(bundle.model.config, "num_hidden_layers", None)
    if isinstance(n_layers, int) and group_layers > n_layers:
        raise ExtractionError(f"group_layers {group_layers} exceeds the model's {n_layers} "
                              f"layers")
    if metric != "none":
        try:
            attn_modules(bundle)
        except ExtractionError as e:
            log(f"[calibrate] {e}: fitting without a metric")
            metric = "none"
    first: dict = {}
    with query_energy(bundle) if metric != "none" else contextlib.nullcontext() as qe:
        k, v, pos = calibration_samples(bundle, text, windows, window_tokens, sink_tokens,
                                        log, first=first)
    metric_kv = None
    if metric != "none":
        metric_kv = metric_from_stats(qe.result(), output_gram(bundle), bundle,
                                      pre_rope=theta is not None)
        want = (k.shape[0], k.shape[2], k.shape[3], k.shape[3])
        if metric_kv[0].shape != want or metric_kv[1].shape != want:
            log(f"[calibrate] query/output shapes {metric_kv[0].shape} do not match the KV "
                f"{want}: fitting without a metric")
            metric_kv, metric = None, "none"
    if weighting == "sensitivity":
        import numpy as np

        # the first calibration window's prefix: its KV is the prefill of these tokens
        # (causal attention), so no extra prefill
        m = min(len(first["ids"]), max(64, sensitivity_tokens))
        sens = measure_sensitivity(bundle, first["k"][:, :m], first["v"][:, :m],
                                   first["ids"][:m], sink_tokens=sink_tokens,
                                   batch=sensitivity_batch, log=log)
        # water level per (K/V, layer) inversely proportional to its sensitivity
        weighting = 1.0 / np.maximum(sens, 1e-6 * sens.max())
    meta = {"model_id": bundle.info.model_id, "weights_hash": bundle.info.weights_hash,
            "data": data_name or (data_record or {}).get("description", ""),
            **({"data_source": data_record.get("source", ""),
                "data_description": data_record.get("description", ""),
                "data_sha256": data_record.get("sha256", "")} if data_record else {}),
            "windows": windows, "window_tokens": window_tokens,
            **({"metric": metric, "metric_power": metric_power} if metric != "none" else {})}
    groups = None if layer_groups is None else [tuple(int(i) for i in g) for g in layer_groups]
    for g in groups or []:
        if not g or min(g) < 0 or max(g) >= k.shape[0] or len(set(g)) != len(g):
            raise ExtractionError(f"layer group {g} is not a set of the model's {k.shape[0]} layers")
    t0 = time.perf_counter()

    def fit(sel):
        whole = groups is None
        if whole and group_layers > len(sel):
            raise ExtractionError(f"group_layers {group_layers} exceeds the "
                                  f"{len(sel)} layers fitted")
        gl = group_layers if whole else min(group_layers, len(sel))   # a group of 1 full layer
        idx = torch.tensor(sel)
        w = weighting if whole or isinstance(weighting, str) else weighting[:, sel]
        mk = metric_kv if whole or metric_kv is None else (metric_kv[0][sel], metric_kv[1][sel])
        m = meta if whole else dict(meta, layers=list(sel))
        return kvtc.fit_calibration(k if whole else k[idx], v if whole else v[idx], positions=pos, rope_theta=theta, per_head=per_head,
                                    weighting=w, sink_tokens=sink_tokens,
                                    recent_tokens=recent_tokens, meta=m,
                                    default_level=kvtc.DEFAULT_LEVEL if default_level is None
                                    else default_level, centroid=centroid, rounding=rounding,
                                    metric=mk, metric_power=metric_power,
                                    whiten=metric == "whitened",
                                    level_targets=level_targets,
                                    key_water=(kvtc.DEFAULT_KEY_WATER if level_targets is None
                                               and not gl else None)
                                    if key_water is None else key_water,
                                    group_layers=gl,
                                    progress=lambda s: log(f"[calibrate] {s}"))

    if groups is not None:
        out = {g: fit(list(g)) for g in groups}
        log(f"[calibrate] fitted {len(out)} layer groups in {time.perf_counter() - t0:.1f} s: "
            + ", ".join(f"{len(g)} layers {c.hash[:12]}" for g, c in out.items()))
        return out
    cal = fit(list(range(k.shape[0])))
    log(f"[calibrate] fitted in {time.perf_counter() - t0:.1f} s: calibration {cal.hash}")
    return cal


# The fitting procedure's own version: part of the default-calibration cache key, so a
# default fitted by an older procedure is not served after the procedure changed (2: the
# sensitivity probe in float32 activations, each KL against its own pass's clean entry).
FIT_VERSION = 2


def settings_key(weights_hash: str, settings: dict, text_sha256: str = "") -> str:
    from codec import kvtc

    # the codec's level table is part of the key: new targets mean a new default fit; so is
    # the calibration text (its sha256): another text (another Python's docstrings) is
    # another default
    blob = json.dumps({"weights": weights_hash, "settings": settings,
                       "version": kvtc.CALIBRATION_VERSION,
                       "targets": {str(k): v for k, v in kvtc.DEFAULT_LEVEL_TARGETS.items()},
                       # the codec's per-level key water (absent when none: older keys hold)
                       **({"key_water": {str(k): v for k, v in kvtc.DEFAULT_KEY_WATER.items()}}
                          if kvtc.DEFAULT_KEY_WATER else {}),
                       **({"text_sha256": text_sha256} if text_sha256 else {}),
                       "fit_version": FIT_VERSION},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _default_text() -> tuple[str, dict]:
    """(text, record) of the default calibration text: the Python standard library's
    docstring prose (``kv_extraction_hf.calibration_text``; on every machine, offline, and
    disjoint from the pydoc_data.topics text the main job evaluates on). ``record``:
    source, description, sha256, chars."""
    from kv_extraction_hf.calibration_text import calibration_text

    return calibration_text()


def file_text(path: str | os.PathLike) -> tuple[str, dict]:
    """(text, record) of a user's calibration file (``--data-path FILE``: raw text, or WikiText-2
    ``.raw`` / ``.tokens`` / ``.parquet``). record: source "file", description (the file's
    name), sha256 (of the UTF-8 text used), chars. Raises ExtractionError."""
    from kv_extraction_hf.datasets_loaders import load_wikitext2

    p = Path(path)
    text = load_wikitext2(str(p), split="validation")
    return text, {"source": "file", "description": p.name,
                  "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                  "chars": len(text)}


def text_record(cal) -> dict:
    """The calibration text a ``codec.kvtc.KvtcCalibration`` was fitted on, from its
    ``meta``: {"source", "description", "sha256"} ("" for what an older artifact lacks;
    its free-form ``data`` name is then the description)."""
    m = getattr(cal, "meta", None) or {}
    return {"source": str(m.get("data_source", "")),
            "description": str(m.get("data_description", m.get("data", ""))),
            "sha256": str(m.get("data_sha256", ""))}


def calibration_provenance(cal, source: str) -> dict:
    """What a results file records about the kvtc calibration used (docs/results-schema.md
    "kvtc_calibration"): ``hash`` (the calibration hash every kvtc chunk names), ``source``
    ("default" | "--kvtc-calibration" | ...), ``group_layers`` and ``text`` (the
    calibration text's source, description, sha256: ``text_record``)."""
    return {"hash": cal.hash, "source": source, "group_layers": int(cal.group_layers),
            "text": text_record(cal)}


def default_calibration(bundle, log=print) -> Path:
    """Path of the default KVTC calibration for ``bundle``'s model, fitting it on first use
    (the default calibration text, ``_default_text``: the standard library's docstring
    prose, offline everywhere; ``DEFAULT_SETTINGS``) and caching it in ``<cache>/kvtc/``
    keyed by the model's weights hash + settings + the text's sha256. This is the
    documented default calibration of the kvtc codec: a caller that owns the model
    resolves it once and passes it to every encode (``codec.kvtc.KvtcConfig(calibration=
    ...)``); the artifact is also registered (``codec.kvtc.register_calibration``) so the
    chunks that name its hash decode. Raises ExtractionError if no calibration text."""
    from codec import kvtc
    from kv_extraction_hf.model import cache_dir
    from kv_extraction_hf.model.fetch import file_lock

    text, rec = _default_text()
    key = settings_key(bundle.info.weights_hash, DEFAULT_SETTINGS, rec["sha256"])
    folder = cache_dir() / "kvtc"
    folder.mkdir(parents=True, exist_ok=True)
    index = folder / f"default-{key}.json"
    with file_lock(f"kvtc-{key}"):
        if index.is_file():
            with contextlib.suppress(ValueError, OSError, KeyError, kvtc.CodecError):
                path = folder / f"{calibration_index(index)['hash']}.safetensors"
                kvtc.register_calibration(path)
                return path
        log(f"[calibrate] no default KVTC calibration for this model yet: fitting one on "
            f"{rec['source']} ({rec['chars']} characters, sha256 {rec['sha256'][:12]}; "
            f"key {key})")
        s = DEFAULT_SETTINGS
        cal = calibrate(bundle, text, **s, data_record=rec, log=log)
        path = cal.save(folder)
        tmp = index.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"hash": cal.hash, "weights_hash": bundle.info.weights_hash,
                                   "settings": DEFAULT_SETTINGS, "text": rec}))
        os.replace(tmp, index)
        kvtc.register_calibration(cal)
        return path


def cached_default_calibration(weights_hash: str | None) -> Path | None:
    """The cached default calibration artifact of the model with ``weights_hash`` (made by
    ``default_calibration`` with the current settings and default text), without loading
    the model; None when there is none (or no hash)."""
    from kv_extraction_hf.model import cache_dir

    if not weights_hash:
        return None
    key = settings_key(weights_hash, DEFAULT_SETTINGS, _default_text()[1]["sha256"])
    index = cache_dir() / "kvtc" / f"default-{key}.json"
    try:
        path = index.parent / f"{calibration_index(index)['hash']}.safetensors"
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if path.is_file() else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kv_extraction_hf.calibrate",
        description="Fit a KVTC calibration (PCA bases + bit allocation) for a model on "
                    "calibration text and write it as a safetensors artifact.")
    flags.add_model(ap, default="default", help="HF id, local folder, GGUF, or 'default' "
                    "(the embedded SmolLM2-135M)")
    flags.add_data_path(ap, help="calibration text: a raw text file, or WikiText-2 validation "
                        "(.raw / .tokens / .parquet) if you have it (default: the standard "
                        "library's docstring prose, kv_extraction_hf.calibration_text, on every "
                        "machine offline)")
    flags.add_out(ap, help="artifact path or folder (default: the cache folder, "
                  "<cache>/kvtc/<hash>.safetensors)")
    ap.add_argument("--default", action="store_true", help="make (or show) the model's "
                    "cached default calibration instead")
    ap.add_argument("--windows", type=int, default=DEFAULT_SETTINGS["windows"],
                    help="calibration windows prefilled (default %(default)s)")
    ap.add_argument("--window-tokens", type=int, default=DEFAULT_SETTINGS["window_tokens"],
                    help="tokens per calibration window (default %(default)s)")
    ap.add_argument("--key-space", choices=("pre_rope", "post_rope"),
                    default=DEFAULT_SETTINGS["key_space"],
                    help="decorrelate keys before or after rotary position embedding "
                         "(default %(default)s; docs/codec.md 8.1)")
    ap.add_argument("--per-head", action="store_true", help="block-diagonal per-head bases")
    ap.add_argument("--weighting", choices=("sensitivity", "relative", "absolute"),
                    default=DEFAULT_SETTINGS["weighting"])
    ap.add_argument("--sink-tokens", type=int, default=DEFAULT_SETTINGS["sink_tokens"],
                    help="first tokens of a context stored exactly (attention sinks; "
                         "default %(default)s)")
    ap.add_argument("--recent-tokens", type=int, default=DEFAULT_SETTINGS["recent_tokens"],
                    help="last tokens of a context stored exactly (default %(default)s)")
    ap.add_argument("--sensitivity-tokens", type=int,
                    default=DEFAULT_SETTINGS["sensitivity_tokens"],
                    help="tokens of the window used to measure per-layer sensitivity")
    ap.add_argument("--sensitivity-batch", type=int,
                    default=DEFAULT_SETTINGS["sensitivity_batch"],
                    help="noisy caches per forward pass of the sensitivity probe")
    ap.add_argument("--centroid", action="store_true", help="store centroid "
                    "reconstruction offsets (non-zero coefficients decode at their bin's "
                    "conditional mean; measured worse in KL, docs/codec.md 8.3)")
    ap.add_argument("--metric", choices=("whitened", "weights", "none"),
                    default=DEFAULT_SETTINGS["metric"],
                    help="distortion metric of the fit from the model's use of K and V "
                         "(query energy per key channel, output projection gain for "
                         "values): whitened = PCA and bit allocation in the metric's space, "
                         "weights = per-component water levels only, none = plain MSE "
                         "(default %(default)s)")
    ap.add_argument("--metric-power", type=float, default=DEFAULT_SETTINGS["metric_power"],
                    help="exponent of the metric, in [0, 2] (default %(default)s)")
    ap.add_argument("--group-layers", type=int, default=DEFAULT_SETTINGS["group_layers"],
                    help="one joint basis for the K and V of this many consecutive layers "
                         "(0 = one basis per K/V and layer; default %(default)s; "
                         "docs/codec.md 8.8)")
    ap.add_argument("--rounding", type=float, default=DEFAULT_SETTINGS["rounding"],
                    help="encoder quantizer q = sign(u) floor(|u| + ROUNDING), in (0, 0.5]; "
                         "below 0.5 = dead zone (default %(default)s)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from codec import kvtc
    from codec.errors import CodecError
    from kv_extraction_hf.model import load_model

    try:
        for name in ("windows", "window_tokens"):
            if getattr(args, name) < 1:
                raise ExtractionError(f"--{name.replace('_', '-')} must be >= 1")
        if args.sink_tokens < 0 or args.recent_tokens < 0:
            raise ExtractionError("--sink-tokens / --recent-tokens must be >= 0")
        if args.sensitivity_batch < 1:
            raise ExtractionError("--sensitivity-batch must be >= 1")
        if not 0.0 <= args.metric_power <= 2.0:
            raise ExtractionError("--metric-power must be in [0, 2]")
        if not 0.0 < args.rounding <= 0.5:
            raise ExtractionError("--rounding must be in (0, 0.5]")
        if args.group_layers < 0:
            raise ExtractionError("--group-layers must be >= 0")
        if args.group_layers and (args.metric == "weights" or args.per_head or args.centroid):
            bad = ", ".join(f for f, on in (("--per-head", args.per_head),
                                            ("--centroid", args.centroid),
                                            ("--metric weights", args.metric == "weights"))
                            if on)
            raise ExtractionError(f"{bad} needs --group-layers 0 (one basis per K/V and "
                                  f"layer; the default is --group-layers "
                                  f"{DEFAULT_SETTINGS['group_layers']})")
        t0 = time.perf_counter()
        bundle = load_model(args.model)
        n_layers = getattr(bundle.model.config, "num_hidden_layers", None)
        if isinstance(n_layers, int) and args.group_layers > n_layers:
            raise ExtractionError(f"--group-layers {args.group_layers} exceeds the model's "
                                  f"{n_layers} layers")
        if args.default:
            fresh = not _default_index(bundle).is_file()
            path = default_calibration(bundle)
            print(f"[calibrate] default calibration {'written to' if fresh else 'cached at'} "
                  f"{path} ({time.perf_counter() - t0:.1f} s)")
            return 0
        else:
            if args.data_path:
                text, rec = file_text(args.data_path)
            else:
                text, rec = _default_text()
            cal = calibrate(bundle, text, windows=args.windows,
                            window_tokens=args.window_tokens, key_space=args.key_space,
                            per_head=args.per_head, weighting=args.weighting,
                            sink_tokens=args.sink_tokens, recent_tokens=args.recent_tokens,
                            sensitivity_tokens=args.sensitivity_tokens,
                            centroid=args.centroid, rounding=args.rounding,
                            sensitivity_batch=args.sensitivity_batch, metric=args.metric,
                            metric_power=args.metric_power,
                            group_layers=args.group_layers, data_record=rec)
            path = cal.save(args.out if args.out else _mkdir(kvtc.default_calibration_dir()))
        print(f"[calibrate] wrote {path} in {time.perf_counter() - t0:.1f} s")
        return 0
    except (ExtractionError, CodecError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _default_index(bundle) -> Path:
    """The default calibration's index file for ``bundle``'s model (may not exist)."""
    from kv_extraction_hf.model import cache_dir

    key = settings_key(bundle.info.weights_hash, DEFAULT_SETTINGS, _default_text()[1]["sha256"])
    return cache_dir() / "kvtc" / f"default-{key}.json"


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p

