"""kvtc calibrations per layer group, for sliding-window storage.

``codec.window`` codes each group of layers that share a window (Gemma 3 270M: the 15
sliding-window layers, W = 512, and the 3 full-attention layers) as its own container,
so a kvtc calibration of the whole model does not apply to a group (``codec.window``
refuses it in one line). This module fits one calibration per group from ONE prefill
of the calibration text and one sensitivity probe (``kv_extraction_hf.calibrate.
calibrate(layer_groups=...)``: each group's PCA bases and bit allocation are fitted on
its own layers' KV, with their sensitivity water levels and metric), and caches them
like the default calibration: ``<cache>/kvtc/<hash>.safetensors`` per group plus an
index ``groups-<key>.json`` keyed by the model's weights hash, the calibration settings
(``DEFAULT_SETTINGS``), the text's sha256 and the groups.

    from kv_extraction_hf.calibrate.groups import group_configs
    cfg = group_configs(bundle, windows)          # {layers tuple: KvtcConfig}
    data = codec.window.encode_windowed(k, v, windows, codec="kvtc", config=cfg)

The text is the default calibration text (the standard library's docstring prose,
offline everywhere) or a user's file (``text_path``: WikiText-2 validation for
WikiText-2 test measurements); never the text evaluated on.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

__all__ = ["group_calibrations", "group_configs", "groups_record"]


def _groups(windows: Sequence[Optional[int]]) -> list[tuple[Optional[int], tuple[int, ...]]]:
    from codec.window import layer_groups

    return layer_groups(list(windows))


def _key(weights_hash: str, text_sha256: str, groups) -> str:
    from kv_extraction_hf.calibrate import DEFAULT_SETTINGS, settings_key

    base = settings_key(weights_hash, DEFAULT_SETTINGS, text_sha256)
    blob = json.dumps({"base": base, "groups": [[w, list(g)] for w, g in groups]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _load_index(index: Path, folder: Path, groups) -> Optional[dict]:
    """{layers: hash} from a valid index whose every artifact registers; else None."""
    from codec import kvtc
    from kv_extraction_hf.calibrate import calibration_index

    with contextlib.suppress(ValueError, OSError, KeyError, TypeError, kvtc.CodecError):
        doc = calibration_index(index)
        got = {tuple(int(i) for i in e["layers"]): str(e["hash"]) for e in doc["groups"]}
        if set(got) != {g for _, g in groups}:
            return None
        for h in got.values():      # an artifact that is not what the index names: refit
            if kvtc.register_calibration(folder / f"{h}.safetensors") != h:
                return None
        return got
    return None


def group_calibrations(bundle, windows: Sequence[Optional[int]], text_path: Optional[str] = None,
                       log: Callable[[str], None] = print) -> dict[tuple[int, ...], str]:
    """``{layers tuple: calibration hash}`` of ``bundle``'s model, one per layer group of
    ``windows`` (one int or None per layer, ``codec.window``), each registered with
    ``codec.kvtc`` so its chunks decode. Fitted on first use on the default calibration
    text or ``text_path`` (raw text or WikiText-2 validation, ``calibrate.file_text``),
    with ``DEFAULT_SETTINGS``; then served from the cache. Raises ExtractionError (no
    text, a bad group) or ValueError (``windows`` does not match the model's layers)."""
    from codec import kvtc
    from kv_extraction_hf import calibrate as cal_mod
    from kv_extraction_hf.model import cache_dir
    from kv_extraction_hf.model.fetch import file_lock

    if len(list(windows)) != bundle.info.num_layers:
        raise ValueError(f"windows has {len(list(windows))} entries for the model's "
                         f"{bundle.info.num_layers} layers")
    groups = _groups(windows)
    text, rec = cal_mod.file_text(text_path) if text_path else cal_mod._default_text()
    key = _key(bundle.info.weights_hash, rec["sha256"], groups)
    folder = cache_dir() / "kvtc"
    folder.mkdir(parents=True, exist_ok=True)
    index = folder / f"groups-{key}.json"
    with file_lock(f"kvtc-groups-{key}"):
        got = _load_index(index, folder, groups) if index.is_file() else None
        if got is not None:
            return got
        log(f"[calibrate] fitting {len(groups)} kvtc layer-group calibrations on {rec['source']} "
            f"{rec.get('description', '')} (sha256 {rec['sha256'][:12]}; key {key})")
        s = cal_mod.DEFAULT_SETTINGS
        cals = cal_mod.calibrate(bundle, text, **s, data_record=rec,
                                 layer_groups=[g for _, g in groups], log=log)
        entries = []
        for w, g in groups:
            c = cals[g]
            c.save(folder)
            kvtc.register_calibration(c)
            entries.append({"layers": list(g), "window": w, "hash": c.hash})
        tmp = index.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"weights_hash": bundle.info.weights_hash, "settings": s,
                                   "text": rec, "groups": entries}))
        os.replace(tmp, index)
        return {g: cals[g].hash for _, g in groups}


def group_configs(bundle, windows: Sequence[Optional[int]], text_path: Optional[str] = None,
                  log: Callable[[str], None] = print) -> dict:
    """``{layers tuple: codec.kvtc.KvtcConfig}`` for ``codec.window``'s ``config=``
    (:func:`group_calibrations`)."""
    from codec.kvtc import KvtcConfig

    return {g: KvtcConfig(calibration=h) for g, h in group_calibrations(bundle, windows, text_path, log).items()}


def groups_record(hashes: dict, source: str) -> dict:
    """What a results file records about per-group calibrations (docs/results-schema.md
    "kvtc_calibration"): ``groups`` (layers, hash, group_layers, text per group) and
    ``source``."""
    from codec import kvtc
    from kv_extraction_hf.calibrate import calibration_provenance

    out = []
    for g, h in hashes.items():
        out.append({"layers": list(g), **calibration_provenance(kvtc.get_calibration(h), source)})
    return {"source": source, "groups": out}
