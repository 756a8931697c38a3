"""Validation of an LMCache serde config (the adapter JSON's ``"serde"`` dict) into
:class:`~third_party.lmcache.serde_settings.SerdeSettings`: every option's type and range,
kvtc's calibration lookup, the ``pad: "auto"`` probe of the installed LMCache.
"""
from __future__ import annotations

import math
from typing import Optional

import codec
from codec import kvtc as codec_kvtc

from third_party.lmcache.serde_settings import DEFAULT_SLOT_RATIO, SerdeSettings
from third_party.lmcache.serde_sinks import SINK_MODES


def _installed_adapters_report_sizes() -> bool:
    """Whether the installed LMCache's L2 adapters can load an object shorter than its
    slot (newer LMCache: ``get_object_sizes``); 0.5.6: no."""
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

    return hasattr(L2AdapterInterface, "get_object_sizes")


def opt_int(kw: dict, name: str, lo: int) -> Optional[int]:
    """``kw[name]`` as an int >= ``lo`` (None when absent). Raises ValueError."""
    v = kw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"serde option {name!r} must be an integer >= {lo}, got {v!r}")
    return v


def parse_settings(name: str, kwargs: dict) -> SerdeSettings:
    """Validate an LMCache serde config (the ``"serde"`` dict less ``"type"``).

    Options: ``level`` (int, the codec's levels; default the codec's default),
    ``chunk_tokens`` (int >= 16, multiple of 16), ``num_kv_heads``, ``head_dim`` (cachegen),
    ``calibration`` (kvtc, required: a calibration hash, found by the codec's lookup),
    ``calibration_path`` (kvtc: an artifact file registered first; its hash must match
    ``calibration`` when both are given), ``bits_per_element`` (float > 0),
    ``pad`` ("auto" | true | false), ``fallback`` (bool), ``sinks`` ("auto" |
    "every_object", :mod:`.serde_sinks`), ``position_step`` (int >= 0, a multiple of
    16; default 256, LMCache's chunk size; 0: no position estimate) and ``max_tokens`` (int
    >= 16, default 131072) for kvtc's position estimate (:mod:`.serde_rope`), ``max_workers`` (int >= 1, read
    by the factory), ``slot_ratio`` ("auto" | number >= 1 | false: the fixed slot as KV
    bytes / slot; "auto": ``DEFAULT_SLOT_RATIO`` when padding and no ``bits_per_element``
    is given, else off), ``fill`` ("auto" | bool; "auto": on in the fixed-slot mode;
    :mod:`.serde_slot`), ``always_fit`` ("auto" | bool; "auto": on for cachegen, off for
    kvtc, whose 20x slot is below the floor's worst case: :mod:`.serde_steps`). Raises
    ValueError naming the bad option."""
    kw = dict(kwargs)
    known = {"level", "chunk_tokens", "num_kv_heads", "head_dim", "calibration",
             "calibration_path", "bits_per_element", "pad", "fallback", "sinks",
             "position_step", "max_tokens", "max_workers", "slot_ratio", "fill",
             "always_fit"}
    bad = sorted(set(kw) - known)
    if bad:
        raise ValueError(f"unknown {name} serde option(s) {bad}; known: {sorted(known)}")
    if name == "cachegen" and ({"calibration", "calibration_path"} & set(kw)):
        raise ValueError("the cachegen serde takes no calibration (that is kvtc's)")
    if name == "kvtc" and ({"num_kv_heads", "head_dim"} & set(kw)):
        raise ValueError("the kvtc serde takes its heads from its calibration")
    lvl = kw.get("level")
    if lvl is not None and (isinstance(lvl, bool) or not isinstance(lvl, int)
                            or lvl not in codec.levels(name)):
        raise ValueError(f"{name} serde level must be one of {list(codec.levels(name))}, "
                         f"got {lvl!r}")
    level = codec.resolve_level(name, lvl)
    ct = opt_int(kw, "chunk_tokens", 16)
    if ct is not None and ct % 16:
        raise ValueError(f"serde option 'chunk_tokens' must be a multiple of 16, got {ct}")
    bpe = kw.get("bits_per_element")
    if bpe is not None and (isinstance(bpe, bool) or not isinstance(bpe, (int, float))
                            or not 0 < bpe <= 64 or not math.isfinite(bpe)):
        raise ValueError(f"serde option 'bits_per_element' must be in (0, 64], got {bpe!r}")
    pad = kw.get("pad", "auto")
    if pad == "auto":
        pad = not _installed_adapters_report_sizes()
    elif not isinstance(pad, bool):
        raise ValueError(f"serde option 'pad' must be \"auto\", true or false, got {pad!r}")
    fallback = kw.get("fallback", True)
    if not isinstance(fallback, bool):
        raise ValueError(f"serde option 'fallback' must be true or false, got {fallback!r}")
    ratio = kw.get("slot_ratio", "auto")
    if ratio == "auto":
        ratio = DEFAULT_SLOT_RATIO[name] if pad and bpe is None else None
    elif ratio is False or ratio is None:
        ratio = None
    elif isinstance(ratio, bool) or not isinstance(ratio, (int, float)) \
            or not math.isfinite(ratio) or not 1 <= ratio <= 1e6:
        raise ValueError(f"serde option 'slot_ratio' must be \"auto\", false or a number in "
                         f"[1, 1e6], got {ratio!r}")
    elif bpe is not None:
        raise ValueError("serde options 'slot_ratio' and 'bits_per_element' both size the "
                         "slot: give one")
    fill = kw.get("fill", "auto")
    if fill == "auto":
        fill = ratio is not None and pad
    elif not isinstance(fill, bool):
        raise ValueError(f"serde option 'fill' must be \"auto\", true or false, got {fill!r}")
    always = kw.get("always_fit", "auto")
    if always == "auto":
        always = name == "cachegen"
    elif not isinstance(always, bool):
        raise ValueError(f"serde option 'always_fit' must be \"auto\", true or false, "
                         f"got {always!r}")
    sinks = kw.get("sinks", "auto")
    if sinks not in SINK_MODES:
        raise ValueError(f"serde option 'sinks' must be one of {list(SINK_MODES)}, got {sinks!r}")
    step = opt_int(kw, "position_step", 0)
    step = 256 if step is None else step
    if step % 16:
        raise ValueError(f"serde option 'position_step' must be a multiple of 16, got {step}")
    max_tokens = opt_int(kw, "max_tokens", 16)
    max_tokens = 131072 if max_tokens is None else max_tokens
    cal = None
    if name == "kvtc":
        path = kw.get("calibration_path")
        cal = kw.get("calibration")
        if path is not None:
            try:
                h = codec_kvtc.register_calibration(str(path))
            except (codec.CodecError, OSError, ValueError) as e:
                raise ValueError(f"kvtc serde: calibration_path {path!r}: {e}") from None
            if cal is not None and cal != h:
                raise ValueError(f"kvtc serde: {path} holds calibration {h}, not {cal}")
            cal = h
        if not isinstance(cal, str) or not cal:
            raise ValueError("the kvtc serde needs \"calibration\": the hash of its "
                             "calibration (python -m kv_extraction_hf.calibrate), reachable "
                             "by every reader, or \"calibration_path\"")
        try:
            codec_kvtc.get_calibration(cal)
        except codec.CodecError as e:
            raise ValueError(f"kvtc serde: {e}") from None
    return SerdeSettings(codec=name, level=level, chunk_tokens=ct,
                         num_kv_heads=opt_int(kw, "num_kv_heads", 1),
                         head_dim=opt_int(kw, "head_dim", 1), calibration=cal,
                         bits_per_element=None if bpe is None else float(bpe), pad=pad,
                         fallback=fallback, sinks=sinks,
                         position_step=step, max_tokens=max_tokens,
                         slot_ratio=None if ratio is None else float(ratio), fill=fill,
                         always_fit=always)
