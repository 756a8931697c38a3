"""Per-layer K/V sensitivity of a model to the cachegen quantizer: for every layer, K and V
apart, and every candidate number of bins, the forward KL (nats/token) of the next-token
distributions against the lossless KV when ONLY that layer's K (or V) is quantized, and the
bytes that choice costs; the table ``codec.bit_allocation`` allocates bins from.

CacheGen (Liu et al., SIGCOMM 2024, section 5.2) observed that shallow layers are more
sensitive and gave them more bins; KVTC (arXiv 2511.01815) allocates bits by a DP over
measured distortion and NVIDIA Model-Optimizer's KV AutoQuant by the forward KL on
calibration data. This module measures the KL itself instead of assuming a layer order.

Measurement, per calibration window of ``context + continuation`` tokens: the context is
prefilled once (``kv_extraction_hf.extract.prefill_kv``) and its lossless continuation
logits are the reference. For each layer l, K or V, and bins b, the one-layer slice x
(``[1, T, H, D]``) is encoded as a ONE-layer cachegen container holding x as both its K
and its V at b bins (``base`` config's scales, sinks and stream layout), and decoded; the
decoded slice replaces layer l's K (or V) of the lossless KV and the continuation is run
on it (``kv_extraction_hf.inject.continuation_logits_batch``, the candidates of one
(layer, K/V) in one batched forward, each entry bit for bit its own batch-1 forward).
KL: ``evaluation.metrics.kl_divergence`` (float64, mean over continuation tokens).
Bytes: MEASURED from the encoded size, half the one-layer container's length (it codes
x twice; the halved header and scales are a per-unit constant the allocation does not
depend on). Both are averaged over windows; ``kl_ci`` is the 95% bootstrap CI over
windows (``evaluation.stats.mean_ci``).

Text: the fit half (``operating_points.split_ids``) of the calibration text (default: the
offline standard-library docstring prose of ``kv_extraction_hf.calibration_text``; or any
text, e.g. WikiText-2 valid.txt; never WikiText-2 test). Deterministic and independent of
the caller's torch thread count: torch runs on one thread while measuring
(``operating_points.one_thread``); floats are rounded to 6 significant digits
(``codec.operating_points.canonical_json``) before the table is hashed. Cached in
``$CACHEGEN_CACHE/sensitivity/<key>.json`` (key: sha256 of the model's weights hash, the
text's sha256, the settings, the bins and the base config). Errors: ExtractionError (text
too short for the windows), ValueError (bad bins or base config).

    python -m bench.quality --targets lmcache near-lossless --per-layer-bits
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

__all__ = ["DEFAULT_BINS", "SENSITIVITY_SETTINGS", "TABLE_FORMAT", "layer_code", "measure_sensitivity",
           "fit_sensitivity", "sensitivity_key", "base_fields", "default_dir"]

# the 8..64 plus 10 and 128, the bins of the uniform levels 1 (32/10) and 5 (128/64)
DEFAULT_BINS = (8, 10, 12, 16, 24, 32, 48, 64, 128)
# 6 windows x (512 + 32) tokens: 60 units x 9 candidates = 540 continuation forwards per window
# (~3 min per window for SmolLM2-135M on one loaded core)
SENSITIVITY_SETTINGS = {"windows": 6, "context_tokens": 512, "continuation_tokens": 32, "seed": 0,
                        "skip_tokens": 4 * 1024}
TABLE_FORMAT = "kv-sensitivity-table"
TABLE_VERSION = 1


def default_dir() -> Path:
    """``$CACHEGEN_CACHE/sensitivity`` or ``~/.cache/cachegen-harness/sensitivity`` (not created)."""
    root = os.environ.get("CACHEGEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "cachegen-harness")
    return Path(root) / "sensitivity"


def _one_layer_config(base, bins: int):
    from codec.config import CodecConfig, QuantizationSpec

    spec = (QuantizationSpec(0, 1, int(bins)),)
    return CodecConfig(num_layers=1, key_specs=spec, value_specs=spec, level=None,
                       chunk_tokens=base.chunk_tokens, scale_group=base.scale_group,
                       scale_format=base.scale_format, sink_tokens=base.sink_tokens,
                       channels_per_stream=base.channels_per_stream,
                       tokens_per_stream=base.tokens_per_stream, variant="custom")


def layer_code(x, bins: int, base):
    """(decoded slice, bytes) of one layer's K or V ``x`` ``[1, T, H, D]`` (model dtype)
    quantized at ``bins`` with ``base``'s (a ``codec.CodecConfig``) scales, sinks and stream
    layout: a one-layer ``cachegen`` container holding ``x`` as K and V, decoded; bytes =
    half its length (float). Raises ValueError on a bad ``bins``."""
    import codec

    cfg = _one_layer_config(base, bins)
    data = codec.encode_kv(x, x, codec="cachegen", config=cfg, backend="cpu")
    x2, _ = codec.decode_kv(data)
    return x2.to(x.dtype), len(data) / 2.0


def measure_sensitivity(bundle, token_ids: Sequence[int], base, bins: Sequence[int] = DEFAULT_BINS,
                        n_windows: int = 8, context: int = 512, continuation: int = 64, seed: int = 0,
                        log: Callable[[str], None] = print) -> dict:
    """The sensitivity table of ``bundle``'s model on ``n_windows`` windows of ``token_ids``
    (``kv_extraction_hf.wikitext.token_windows``: seeded, non-overlapping).

    ``base``: the ``codec.CodecConfig`` whose non-bin fields every candidate uses (e.g.
    ``CodecConfig.for_model(L)``). Returns ``{"bins": [...], "kl": [L][2][nb] mean KL in
    nats/token, "kl_ci": [L][2][nb] [lo, hi], "bytes": [L][2][nb] mean bytes per window,
    "dtype_bytes": the lossless K+V bytes of a window (model dtype), "n": windows,
    "bytes_basis": ..., "offsets": [...]}`` (index 0 of the middle axis K, 1 V). Runs at
    the caller's torch thread count (``fit_sensitivity`` pins one). Raises ExtractionError
    when the text is too short, ValueError on a bad bins value."""
    from codec.config import QuantizationSpec
    from evaluation.metrics import kl_divergence
    from evaluation.stats import mean_ci
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits, continuation_logits_batch
    from kv_extraction_hf.wikitext import token_windows

    bins = [int(b) for b in bins]
    for b in bins:
        QuantizationSpec(0, 1, b)
    L = bundle.info.num_layers
    offsets = token_windows(len(token_ids), context + continuation, n_windows, seed)
    kl = [[[[] for _ in bins] for _ in range(2)] for _ in range(L)]
    nbytes = [[[0.0 for _ in bins] for _ in range(2)] for _ in range(L)]
    dtype_bytes = 0
    for w, off in enumerate(offsets):
        ctx = list(token_ids[off:off + context])
        cont = list(token_ids[off + context:off + context + continuation])
        k, v = prefill_kv(bundle, ctx)
        dtype_bytes = (k.numel() + v.numel()) * k.element_size()
        ref = continuation_logits(bundle, k, v, ctx, cont)
        for layer in range(L):
            for kind, x in enumerate((k, v)):
                kvs = []
                for i, b in enumerate(bins):
                    x2, size = layer_code(x[layer:layer + 1], b, base)
                    nbytes[layer][kind][i] += size
                    y = x.clone()
                    y[layer] = x2[0]
                    kvs.append((y, v) if kind == 0 else (k, y))
                for i, logits in enumerate(continuation_logits_batch(bundle, kvs, ctx, cont)):
                    kl[layer][kind][i].append(kl_divergence(ref, logits))
                del kvs
        log(f"  [sensitivity] window {w + 1}/{len(offsets)} (offset {off}) done")
        del k, v, ref
    n = len(offsets)
    stats = [[[mean_ci(kl[layer][kind][i]) for i in range(len(bins))] for kind in range(2)] for layer in range(L)]
    return {"bins": bins, "n": n, "offsets": offsets, "dtype_bytes": dtype_bytes,
            "kl": [[[s["mean"] for s in row] for row in unit] for unit in stats],
            "kl_ci": [[[list(s["ci"]) for s in row] for row in unit] for unit in stats],
            "bytes": [[[x / n for x in row] for row in unit] for unit in nbytes],
            "bytes_basis": "measured: half the length of a one-layer cachegen container holding the "
                           "layer's K (or V) as both its K and V, mean per window"}


def base_fields(base) -> dict:
    """The fields of a ``codec.CodecConfig`` a sensitivity table depends on: all but its
    layer count, bins, level and variant (scales, sinks, chunk and stream layout)."""
    return {k: x for k, x in base.to_dict().items()
            if k not in ("num_layers", "key_specs", "value_specs", "level", "variant")}


def sensitivity_key(weights_hash: str, text_sha256: str, settings: dict, bins: Sequence[int], base) -> str:
    """The cache key of a table: sha256 (24 hex digits) of what determines it."""
    blob = json.dumps({"weights": weights_hash, "text_sha256": text_sha256, "settings": settings,
                       "bins": [int(b) for b in bins], "base": base_fields(base), "version": TABLE_VERSION},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def fit_sensitivity(bundle, base=None, bins: Sequence[int] = DEFAULT_BINS, settings: Optional[dict] = None,
                    text: Optional[str] = None, text_record: Optional[dict] = None,
                    folder: Optional[Path] = None, log: Callable[[str], None] = print) -> dict:
    """The sensitivity table of ``bundle``'s model on the fit half of the calibration text:
    loaded from ``folder`` (default ``default_dir()``) when one with the same key exists,
    else measured on one torch thread (``measure_sensitivity``) and stored.

    ``base``: a ``codec.CodecConfig`` (default ``CodecConfig.for_model(L)``, the harness
    variant's scales and sinks); ``settings``: overrides of ``SENSITIVITY_SETTINGS``;
    ``text`` / ``text_record``: the calibration text (default: the default calibration
    text). Returns the table of ``measure_sensitivity`` plus ``format``, ``version``,
    ``model``, ``text``, ``settings``, ``base`` and ``hash`` (sha256 of its canonical JSON).
    Raises ExtractionError when the text is too short for the windows."""
    from codec import operating_points as op
    from codec.config import CodecConfig
    from kv_extraction_hf.calibrate.operating_points import one_thread, resolve_text, split_ids, text_tokens
    from kv_extraction_hf.model.fetch import file_lock
    from kv_extraction_hf.wikitext import token_windows

    s = dict(SENSITIVITY_SETTINGS, **(settings or {}))
    base = base if base is not None else CodecConfig.for_model(bundle.info.num_layers)
    text, rec = resolve_text(text, text_record)
    trec = {k: rec.get(k, "") for k in ("source", "description", "sha256")}
    folder = Path(folder) if folder is not None else default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    key = sensitivity_key(bundle.info.weights_hash, trec["sha256"], s, bins, base)
    path = folder / f"{key}.json"
    with file_lock(f"sensitivity-{key}"):
        if path.is_file():
            try:
                doc = json.loads(path.read_bytes()[:64 << 20])
                body = {k: x for k, x in doc.items() if k != "hash"}
                if isinstance(doc, dict) and doc.get("format") == TABLE_FORMAT and \
                        hashlib.sha256(op.canonical_json(body)).hexdigest() == doc.get("hash"):
                    return doc
            except (ValueError, OSError):
                pass                                   # unreadable or altered: measured again
        win = s["context_tokens"] + s["continuation_tokens"]
        ids = text_tokens(bundle, text, 10 * (s["skip_tokens"] + 2 * s["windows"] * win + 1024))
        fit_ids, _ = split_ids(ids, s["skip_tokens"])
        token_windows(len(fit_ids), win, s["windows"], s["seed"])     # too short: ExtractionError now
        log(f"[sensitivity] {s['windows']} windows x ({s['context_tokens']} + {s['continuation_tokens']}) tokens "
            f"of {trec['source']} (sha256 {trec['sha256'][:12]}), {bundle.info.num_layers} layers x K/V x "
            f"{len(bins)} bins (key {key})")
        table = one_thread(measure_sensitivity, bundle, fit_ids, base, bins, s["windows"], s["context_tokens"],
                           s["continuation_tokens"], s["seed"], log)
        table.update({"format": TABLE_FORMAT, "version": TABLE_VERSION,
                      "model": {"id": bundle.info.model_id, "weights_hash": bundle.info.weights_hash},
                      "text": trec, "settings": s, "base": base_fields(base)})
        body = json.loads(op.canonical_json(table))     # the rounded floats, as stored
        doc = dict(body, hash=hashlib.sha256(op.canonical_json(body)).hexdigest())
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, sort_keys=True))
        os.replace(tmp, path)
        return doc
