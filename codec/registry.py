"""The codec registry: ``CODECS`` (name -> codec instance), ``get_codec`` (lookup with a
did-you-mean ValueError) and ``resolve_level`` (what level=None means; the one place).
"""
from __future__ import annotations

import difflib
from typing import Optional

from .base import Codec
from .codecs.baselines import Fp8Codec, KiviCodec, RawCodec
from .codecs.cachegen import CacheGenCodec
from .kvtc import KvtcCodec   # transform coding (arXiv 2511.01815), codec/kvtc/


def _build_registry() -> dict[str, Codec]:
    regs = [RawCodec(), Fp8Codec(), CacheGenCodec("quant8", "reference", entropy=False),
            KiviCodec(2), KiviCodec(4), CacheGenCodec("cachegen", "harness"),
            CacheGenCodec("cachegen-ref", "reference")]
    regs.append(KvtcCodec())
    return {c.name: c for c in regs}


CODECS: dict[str, Codec] = _build_registry()


def resolve_level(codec: str, level: Optional[int] = None) -> Optional[int]:
    """THE one place where "default level" is resolved.

    ``level=None`` means the codec's default (``default_level``: cachegen 1, cachegen-ref 0;
    codecs without levels: None); an int must be one of the codec's ``levels``.
    Returns the level (int) or None for codecs without levels.
    Raises ValueError on an unknown codec, a non-int level, a level outside the codec's
    scale, or any level for a codec without levels."""
    c = get_codec(codec)
    if level is None:
        return c.default_level
    if isinstance(level, bool) or not isinstance(level, int):
        raise ValueError(f"level must be an int or None, got {level!r}")
    if not c.levels:
        raise ValueError(f"codec {c.name!r} has no levels (pass level=None)")
    if level not in c.levels:
        raise ValueError(f"unknown level {level} for codec {c.name!r}; levels are "
                         f"{list(c.levels)} (default {c.default_level})")
    return level


def get_codec(name: str) -> Codec:
    """Registry lookup; ValueError listing the valid names (and the closest) otherwise."""
    if isinstance(name, str) and name in CODECS:
        return CODECS[name]
    close = difflib.get_close_matches(str(name), list(CODECS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown codec {name!r}; available codecs: {sorted(CODECS)}.{hint}")
