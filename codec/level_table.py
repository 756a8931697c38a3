"""The codecs' level vocabulary, torch-free: which levels each codec has, what level=None
means, how a (codec, level) pair is spelled, and the order codecs are listed in.

One answer to "which levels, which default" for every entry point: the codec registry
(``codec.registry``, ``codec.api.levels`` / ``default_level``), harness/config.py (flag
checks that must not load torch), bench/quality/cli.py and scripts/readme_tables.py. Imports
only the standard library and ``codec.schedules`` (itself torch-free), so ``import
codec.level_table`` does not import torch (tests/codec/test_codec_level_table.py checks it in
a subprocess). Named ``level_table``, not ``levels``: ``codec.levels`` is the public
function ``codec.api.levels``, which a submodule of that name would shadow.

    from codec import level_table as LT
    LT.levels("cachegen")          # (0, 1, 2, 3, 4, 5)
    LT.default_level("kvtc")       # 4
    LT.label("cachegen", 1)        # "cachegen 1"; LT.label("raw", None) == "raw"

Scales (docs/codec.md "Levels"): cachegen 0 (smallest) .. 5 (near lossless), default 1
(``codec.schedules.HARNESS_LEVELS``); cachegen-ref 0 = LMCache's default schedule, 1-3 the
CacheGen artifact's, default 0; kvtc 0-5 (the default calibration's levels, targets in
``codec.kvtc.DEFAULT_LEVEL_TARGETS``), default 4; raw, fp8, quant8, kivi2, kivi4: no
levels (level must be None).
"""
from __future__ import annotations

from typing import Optional

from .schedules import HARNESS_DEFAULT_LEVEL, HARNESS_LEVELS, LEVELS as REFERENCE_LEVELS
from .schedules import REFERENCE_DEFAULT_LEVEL

__all__ = ["CODEC_LEVELS", "DEFAULT_LEVELS", "KVTC_DEFAULT_LEVEL", "KVTC_LEVELS", "MODE_ORDER",
           "default_level", "label", "levels"]

KVTC_LEVELS: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
KVTC_DEFAULT_LEVEL = 4

# codec name -> its levels (() = a codec without levels), in registry order
CODEC_LEVELS: dict[str, tuple[int, ...]] = {
    "raw": (),
    "fp8": (),
    "quant8": (),
    "kivi2": (),
    "kivi4": (),
    "cachegen": tuple(sorted(HARNESS_LEVELS)),
    "cachegen-ref": tuple(REFERENCE_LEVELS),
    "kvtc": KVTC_LEVELS,
}
# codec name -> what level=None means (None for codecs without levels)
DEFAULT_LEVELS: dict[str, Optional[int]] = {
    **{name: None for name, lv in CODEC_LEVELS.items() if not lv},
    "cachegen": HARNESS_DEFAULT_LEVEL,
    "cachegen-ref": REFERENCE_DEFAULT_LEVEL,
    "kvtc": KVTC_DEFAULT_LEVEL,
}
# Row order of the result tables (modes of the harness included: text = prefill from text,
# cachegen-adaptive = cachegen with the adaptive policy); modes not listed follow by name.
MODE_ORDER: tuple[str, ...] = ("text", "raw", "fp8", "quant8", "kivi4", "kivi2", "kvtc",
                               "cachegen-ref", "cachegen", "cachegen-adaptive")


def _known(codec: str) -> str:
    if not isinstance(codec, str) or codec not in CODEC_LEVELS:
        raise ValueError(f"unknown codec {codec!r}; available codecs: {sorted(CODEC_LEVELS)}")
    return codec


def levels(codec: str) -> tuple[int, ...]:
    """The valid levels of ``codec`` (() for codecs without levels). ValueError on an
    unknown codec name."""
    return CODEC_LEVELS[_known(codec)]


def default_level(codec: str) -> Optional[int]:
    """What ``level=None`` means for ``codec`` (None for codecs without levels).
    ValueError on an unknown codec name."""
    return DEFAULT_LEVELS[_known(codec)]


def label(codec: str, level: Optional[int]) -> str:
    """The spelling of a (codec, level) pair in results (bench/quality.json's ``codecs``
    keys, log lines): ``"cachegen 1"``; the bare name when ``level`` is None."""
    return codec if level is None else f"{codec} {level}"
