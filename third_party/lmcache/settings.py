"""An LMCache serde config: the validated :class:`SerdeSettings` (codec, level, chunking,
heads, slot bound, padding), its identity hash (what a reader must share with the writer),
the measured bits-per-element table the slot is sized from, and :func:`parse_settings`,
the validation of the adapter JSON's ``"serde"`` dict into one (every option's type and
range, kvtc's calibration lookup, the ``pad: "auto"`` probe of the installed LMCache).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Optional

import codec
from codec import kvtc as codec_kvtc

from third_party.lmcache.frame import FRAME_VERSION
from third_party.lmcache.position import SINK_MODES

# Upper bounds of whole-container bits per KV element, per (codec, chunk tokens, level),
# for the default model (SmolLM2-135M, 30 layers x 3 KV heads x 64, bf16): max over every
# chunk of three 4K-token pydoc contexts of (container bytes * 8 / elements), times 1.05,
# rounded up to 0.01, with the serde's defaults (sinks "auto", kvtc's positions
# estimated: position, position). The max is a context's first chunk, the one that
# keeps 4 exact sink tokens (max / median: cachegen <= 1.10, kvtc <= 1.87 at 256 tokens,
# a short chunk's sinks weigh most in kvtc's smaller bitstream). An object of T
# tokens uses the entry of the largest chunk size <= T (else the smallest). Measured by
# `python -m bench.lmcache --estimate` (docs/lmcache.md); a serde config's
# "bits_per_element" replaces the table for other models.
BITS_PER_ELEMENT = {
    "cachegen": {256: {0: 1.85, 1: 2.24, 2: 2.39, 3: 2.69, 4: 3.14, 5: 4.75},
                 1024: {0: 1.64, 1: 2.04, 2: 2.18, 3: 2.50, 4: 2.95, 5: 4.58}},
    "kvtc": {256: {0: 0.56, 1: 0.68, 2: 0.80, 3: 0.92, 4: 1.05, 5: 1.79},
             1024: {0: 0.35, 1: 0.47, 2: 0.59, 3: 0.71, 4: 0.83, 5: 1.56}},
}
# the same, measured with "sinks": "every_object" (every object coded as its own context
# at position 0, the former coding)
BITS_PER_ELEMENT_EVERY_OBJECT = {
    "cachegen": {256: {0: 1.97, 1: 2.36, 2: 2.50, 3: 2.81, 4: 3.26, 5: 4.88},
                 1024: {0: 1.70, 1: 2.10, 2: 2.24, 3: 2.55, 4: 3.00, 5: 4.62}},
    "kvtc": {256: {0: 0.57, 1: 0.71, 2: 0.84, 3: 0.99, 4: 1.13, 5: 2.04},
             1024: {0: 0.36, 1: 0.49, 2: 0.62, 3: 0.76, 4: 0.90, 5: 1.80}},
}
# The fixed slot ("constant bitrate") targets: with ``slot_ratio`` "auto" and padding on
# (LMCache 0.5.6), an object's slot is its KV bytes / this ratio, and the serializer codes it
# at the finest level whose frame fits (:mod:`.slot`). The targets: 8x for
# cachegen, 20x for kvtc, vs the KV dtype. Both sit near the default level's MEAN frame on
# the default model's 4K pydoc contexts (8.07x / 20.98x at 256 tokens), not its max: the
# slot is paid by every object, so it is sized for the typical one, and the rare larger one
# (a context's first, with exact sink tokens) is coded one level coarser (docs/lmcache.md).
DEFAULT_SLOT_RATIO = {"cachegen": 8.0, "kvtc": 20.0}
# bytes a container may need beyond bits_per_element * elements (JSON header digits,
# alignment): a fixed allowance per container
CONTAINER_SLACK = 512


@dataclass(frozen=True)
class SerdeSettings:
    """A serde config, validated. ``level``: the codec's level (resolved: None -> the
    codec's default); ``chunk_tokens``: split each object's tokens into containers of
    this many (None: one container per kernel group); ``num_kv_heads``/``head_dim``:
    cachegen's view of a ``[2, L, T, H*D]`` plane (None: H = 1); ``calibration``: kvtc's
    calibration hash; ``bits_per_element``: the slot bound (None: ``BITS_PER_ELEMENT``);
    ``pad``: pad the frame to the slot; ``fallback``: re-encode at smaller levels when a
    bitstream does not fit its slot; ``sinks``: "auto" (exact sink tokens only in objects
    that start a context, :mod:`.position`) or "every_object"; ``position_step`` /
    ``max_tokens``: kvtc's position estimate for the other objects (:mod:`.position`:
    a multiple of ``position_step`` tokens, LMCache's chunk size, below ``max_tokens``;
    ``position_step`` 0: code every object at position 0); ``slot_ratio``: the fixed slot
    as the ratio of the object's KV bytes to the slot (None: the ``bits_per_element`` bound,
    :mod:`.slot`); ``fill``: code at the finest level that fits the slot (the slot's
    bytes are written anyway); ``always_fit``: the slot is at least what one step of the
    ladder needs for any values (:mod:`.slot`), so every object is stored."""

    codec: str
    level: int
    chunk_tokens: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    calibration: Optional[str] = None
    bits_per_element: Optional[float] = None
    pad: bool = True
    fallback: bool = True
    sinks: str = "auto"
    position_step: int = 256
    max_tokens: int = 131072
    slot_ratio: Optional[float] = None
    fill: bool = False
    always_fit: bool = False

    def table(self) -> dict:
        """The measured bits-per-element table for this codec and ``sinks`` mode."""
        src = BITS_PER_ELEMENT_EVERY_OBJECT if self.sinks == "every_object" else BITS_PER_ELEMENT
        return src[self.codec]

    def bound(self, tokens: int = 256) -> float:
        """Bits per element of the slot for an object (or sub-chunk) of ``tokens`` tokens."""
        if self.bits_per_element is not None:
            return self.bits_per_element
        table = self.table()
        fit = [c for c in table if c <= tokens]
        return table[max(fit) if fit else min(table)][self.level]

    def identity(self) -> str:
        """16 hex digits naming everything that changes the bytes this serde writes or
        accepts (codec config hash incl. kvtc's calibration, chunking, heads, slot)."""
        cfg = self.codec_config(self.level)
        ch = codec.config_hash(self.codec, None if cfg is not None else self.level, cfg)
        ident = {"frame": FRAME_VERSION, "codec": self.codec, "config": ch,
                 "chunk_tokens": self.chunk_tokens, "heads": self.num_kv_heads,
                 "head_dim": self.head_dim,
                 "bpe": self.bits_per_element if self.bits_per_element is not None
                 else self.table(),
                 "pad": self.pad, "sinks": self.sinks,
                 "positions": [self.position_step, self.max_tokens]}
        if self.slot_ratio is not None or self.fill:    # (absent: the identities before them)
            ident.update(slot_ratio=self.slot_ratio, fill=self.fill)
        if self.always_fit:     # (absent: the identities before it)
            ident.update(always_fit=True)
        blob = json.dumps(ident, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def codec_config(self, level: int, no_sinks_layers: Optional[int] = None):
        """The ``config=`` for ``codec.encode_kv`` (kvtc: its calibration and level;
        cachegen: None, the level's preset). ``no_sinks_layers``: the KV's layer count, for
        the config of an object that does not start a context (the same preset with
        ``sink_tokens`` 0)."""
        if self.codec == "kvtc":
            return codec_kvtc.KvtcConfig(calibration=self.calibration, level=level,
                                         sink_tokens=None if no_sinks_layers is None else 0)
        if no_sinks_layers is not None:
            return codec.CodecConfig.for_model(no_sinks_layers, level, sink_tokens=0)
        return None

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
    "every_object", :mod:`.position`), ``position_step`` (int >= 0, a multiple of
    16; default 256, LMCache's chunk size; 0: no position estimate) and ``max_tokens`` (int
    >= 16, default 131072) for kvtc's position estimate (:mod:`.position`), ``max_workers`` (int >= 1, read
    by the factory), ``slot_ratio`` ("auto" | number >= 1 | false: the fixed slot as KV
    bytes / slot; "auto": ``DEFAULT_SLOT_RATIO`` when padding and no ``bits_per_element``
    is given, else off), ``fill`` ("auto" | bool; "auto": on in the fixed-slot mode;
    :mod:`.slot`), ``always_fit`` ("auto" | bool; "auto": on for cachegen, off for
    kvtc, whose 20x slot is below the floor's worst case: :mod:`.slot`). Raises
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
