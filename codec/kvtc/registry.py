"""The registry of KVTC calibrations: where a DECODE finds the calibration its chunk names
(registered in this process by hash, then ``default_calibration_dir()/<hash>.safetensors``),
and ``_resolve_calibration``, how an ENCODE's given calibration (object, path or hash; no
"latest of this shape") is found and registered.

Separate from codec.kvtc.calibration (the artifact itself: fields, load/save, checks)
because it holds the process-wide state (``_CALIBRATIONS`` under ``_LOCK``).
Errors: ``CodecError`` (unreadable artifact, unknown hash), ValueError (an encode given
no or a mismatching calibration).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import CodecError
from .calibration import KvtcCalibration, _HASH_RE, default_calibration_dir, load_calibration

# content-addressed registry of loaded calibrations, keyed by hash: where a DECODE finds
# the calibration its chunk names (then the cache folder, ``get_calibration``). An encode
# never picks one from here: it is given its calibration (``KvtcConfig.calibration``).
_CALIBRATIONS: dict[str, KvtcCalibration] = {}
_LOCK = threading.Lock()


def register_calibration(cal: Union[KvtcCalibration, str, os.PathLike]) -> str:
    """Make a calibration (object or artifact path) available, by its hash, to the decode
    of the chunks that name it (``get_calibration``); returns its hash. It does not make
    it an encoder's default (an encode names its calibration:
    ``KvtcConfig(calibration=...)``). Raises CodecError for an unreadable artifact."""
    if not isinstance(cal, KvtcCalibration):
        cal = load_calibration(cal)
    if not cal.hash:
        cal.hash = cal.content_hash()
    with _LOCK:
        _CALIBRATIONS.pop(cal.hash, None)
        _CALIBRATIONS[cal.hash] = cal
    return cal.hash


def registered_calibrations() -> list[str]:
    """Hashes of the registered calibrations (registration order; informational only)."""
    with _LOCK:
        return list(_CALIBRATIONS)


def get_calibration(h: str, search_dir: Optional[Union[str, os.PathLike]] = None
                    ) -> KvtcCalibration:
    """The calibration with hash ``h``: a registered one, else
    ``<search_dir or default_calibration_dir()>/<h>.safetensors`` (then registered).
    Raises CodecError naming the hash when it cannot be found or does not verify."""
    if not isinstance(h, str) or not _HASH_RE.match(h):
        raise CodecError(f"invalid KVTC calibration hash {h!r}")
    with _LOCK:
        cal = _CALIBRATIONS.get(h)
    if cal is not None:
        return cal
    folder = Path(search_dir) if search_dir is not None else default_calibration_dir()
    p = folder / f"{h}.safetensors"
    if not p.is_file():
        raise CodecError(
            f"KVTC calibration {h} is not available (this data or config names it): "
            f"register it with codec.kvtc.register_calibration(PATH) or place it at {p} "
            f"(the cache folder is $CACHEGEN_CACHE/kvtc, default ~/.cache/cachegen-harness/kvtc; "
            f"make one with: python -m kv_extraction_hf.calibrate)")
    cal = load_calibration(p)
    if cal.hash != h:
        raise CodecError(f"{p} holds calibration {cal.hash}, not {h}")
    register_calibration(cal)
    return cal


def _resolve_calibration(c: Any, L: int, H: int, D: int) -> KvtcCalibration:
    """The calibration an encode was given (``KvtcConfig.calibration``: the object, an
    artifact path, or the hash of a registered / cache-folder one). ValueError when none
    is given: there is no implicit "latest of this shape" choice."""
    if c is None:
        raise ValueError(
            f"kvtc encode needs its calibration: pass config=codec.kvtc.KvtcConfig("
            f"calibration=CAL) with CAL a KvtcCalibration, an artifact path or its hash "
            f"(the documented default for a model: "
            f"kv_extraction_hf.calibrate.default_calibration(bundle); the KV here has "
            f"L={L}, H={H}, D={D})")
    if isinstance(c, KvtcCalibration):
        if not c.hash:
            c.hash = c.content_hash()
        register_calibration(c)
        cal = c
    elif isinstance(c, str) and _HASH_RE.match(c):
        try:
            cal = get_calibration(c)
        except CodecError as e:
            raise ValueError(str(e)) from None
    elif isinstance(c, (str, os.PathLike)):
        try:
            cal = get_calibration(register_calibration(c))
        except CodecError as e:
            raise ValueError(str(e)) from None
    else:
        raise ValueError(f"calibration must be a KvtcCalibration, a path or a hash, "
                         f"got {type(c).__name__}")
    if (cal.num_layers, cal.num_heads, cal.head_dim) != (L, H, D):
        raise ValueError(f"calibration {cal.hash[:16]} is for L={cal.num_layers}, "
                         f"H={cal.num_heads}, D={cal.head_dim}; the KV has L={L}, H={H}, D={D}")
    return cal
