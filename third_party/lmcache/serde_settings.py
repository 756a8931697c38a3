"""A validated serde config (:class:`SerdeSettings`): codec, level, chunking, heads, slot
bound, padding; its identity hash (what a reader must share with the writer) and the
measured bits-per-element table the slot is sized from. Parsing LMCache's JSON into one
is :mod:`.serde_options`'s.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional

import codec
from codec import kvtc as codec_kvtc

from third_party.lmcache.serde_frame import FRAME_VERSION

# Upper bounds of whole-container bits per KV element, per (codec, chunk tokens, level),
# for the default model (SmolLM2-135M, 30 layers x 3 KV heads x 64, bf16): max over every
# chunk of three 4K-token pydoc contexts of (container bytes * 8 / elements), times 1.05,
# rounded up to 0.01, with the serde's defaults (sinks "auto", kvtc's positions
# estimated: serde_sinks, serde_rope). The max is a context's first chunk, the one that
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
# at the finest level whose frame fits (``serde_slot``). The goals (29): 8x for
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
    that start a context, :mod:`.serde_sinks`) or "every_object"; ``position_step`` /
    ``max_tokens``: kvtc's position estimate for the other objects (:mod:`.serde_rope`:
    a multiple of ``position_step`` tokens, LMCache's chunk size, below ``max_tokens``;
    ``position_step`` 0: code every object at position 0); ``slot_ratio``: the fixed slot
    as the ratio of the object's KV bytes to the slot (None: the ``bits_per_element`` bound,
    :mod:`.serde_slot`); ``fill``: code at the finest level that fits the slot (the slot's
    bytes are written anyway); ``always_fit``: the slot is at least what one step of the
    ladder needs for any values (:mod:`.serde_steps`), so every object is stored."""

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
