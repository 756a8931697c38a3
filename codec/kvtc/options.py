"""``KvtcConfig``: the per-call options of the ``kvtc`` codec (calibration, level, sink and
recent tokens, chunk size, tail tiers) and how they are described and hashed.

Separate from codec.kvtc.codec (the codec itself) because callers build and hash options
without encoding (``codec.api``'s config hash, the harness's presets).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from .calibration import KvtcCalibration


@dataclass(frozen=True)
class KvtcConfig:
    """Per-call options of the ``kvtc`` codec (pass as ``config=`` to ``encode_kv`` /
    ``encode_chunks``). ``calibration``: a KvtcCalibration, an artifact path or a hash
    naming the calibration this encode uses (required: None is refused with a ValueError
    naming the default, ``kv_extraction_hf.calibrate.default_calibration``; a hash is
    looked up like a decode's, registered then cache folder); ``level``: None =
    the calibration's default; ``recent_tokens`` / ``sink_tokens``: None = the
    calibration's (sinks: the level's ``DEFAULT_LEVEL_SINKS`` entry first);
    ``chunk_tokens``: ``encode_chunks``' default chunk size; ``tiers``:
    tail tiers ((tokens, level), ...) from the end of the context (kvtc format 3,
    docs/codec.md 8.7), None = the level's (``DEFAULT_LEVEL_TIERS``), () = none."""

    calibration: Any = None
    level: Optional[int] = None
    recent_tokens: Optional[int] = None
    sink_tokens: Optional[int] = None
    chunk_tokens: int = 1024
    tiers: Optional[tuple] = None

    def describe(self) -> dict:
        d = {"calibration": getattr(self.calibration, "hash", self.calibration),
             "level": self.level, "recent_tokens": self.recent_tokens,
             "sink_tokens": self.sink_tokens}
        if self.tiers is not None:
            d["tiers"] = [list(p) for p in self.tiers]
        return d

    def to_dict(self) -> dict:
        """The fields as a dict for ``codec.config_hash`` (``tiers`` only when set, so the
        hashes of configs made before it existed do not change)."""
        import dataclasses

        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(d["calibration"], KvtcCalibration):   # named by its hash
            d["calibration"] = d["calibration"].hash or d["calibration"].content_hash()
        elif isinstance(d["calibration"], os.PathLike):
            d["calibration"] = os.fspath(d["calibration"])
        if self.tiers is None:
            d.pop("tiers")
        else:
            d["tiers"] = [list(p) for p in self.tiers]
        return d
