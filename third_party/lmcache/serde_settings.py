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
# rounded up to 0.01 (the measured spread, max / median, is <= 1.04). An object of T
# tokens uses the entry of the largest chunk size <= T (else the smallest). Measured by
# `python -m bench.lmcache --estimate` (docs/lmcache.md); a serde config's
# "bits_per_element" replaces the table for other models.
BITS_PER_ELEMENT = {
    "cachegen": {256: {0: 1.97, 1: 2.36, 2: 2.50, 3: 2.81, 4: 3.26, 5: 4.88},
                 1024: {0: 1.70, 1: 2.10, 2: 2.24, 3: 2.55, 4: 3.00, 5: 4.62}},
    "kvtc": {256: {0: 0.57, 1: 0.71, 2: 0.84, 3: 0.99, 4: 1.13, 5: 2.04},
             1024: {0: 0.36, 1: 0.49, 2: 0.62, 3: 0.76, 4: 0.90, 5: 1.80}},
}
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
    bitstream does not fit its slot."""

    codec: str
    level: int
    chunk_tokens: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    calibration: Optional[str] = None
    bits_per_element: Optional[float] = None
    pad: bool = True
    fallback: bool = True

    def bound(self, tokens: int = 256) -> float:
        """Bits per element of the slot for an object (or sub-chunk) of ``tokens`` tokens."""
        if self.bits_per_element is not None:
            return self.bits_per_element
        table = BITS_PER_ELEMENT[self.codec]
        fit = [c for c in table if c <= tokens]
        return table[max(fit) if fit else min(table)][self.level]

    def identity(self) -> str:
        """16 hex digits naming everything that changes the bytes this serde writes or
        accepts (codec config hash incl. kvtc's calibration, chunking, heads, slot)."""
        cfg = self.codec_config(self.level)
        ch = codec.config_hash(self.codec, None if cfg is not None else self.level, cfg)
        blob = json.dumps({"frame": FRAME_VERSION, "codec": self.codec, "config": ch,
                           "chunk_tokens": self.chunk_tokens, "heads": self.num_kv_heads,
                           "head_dim": self.head_dim,
                           "bpe": self.bits_per_element if self.bits_per_element is not None
                           else BITS_PER_ELEMENT[self.codec],
                           "pad": self.pad}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def codec_config(self, level: int):
        """The ``config=`` for ``codec.encode_kv`` (kvtc: its calibration and level)."""
        if self.codec == "kvtc":
            return codec_kvtc.KvtcConfig(calibration=self.calibration, level=level)
        return None
