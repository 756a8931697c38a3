"""The registry of KVTC calibrations: where a DECODE finds the calibration its chunk names
(registered in this process by hash, then ``default_calibration_dir()/<hash>.safetensors``),
and ``resolve_calibration``, how an ENCODE's given calibration (object, path or hash; no
"latest of this shape") is found and registered; and the artifact as bytes for the KV
store (an entry's calibration travels with it under cal/<hash>; a reader that lacks it
fetches it once: ``calibration_from_bytes`` verifies, registers and caches it).

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
from .calibration import KvtcCalibration, HASH_RE, default_calibration_dir, load_calibration

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
    if not isinstance(h, str) or not HASH_RE.match(h):
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


def resolve_calibration(c: Any, L: int, H: int, D: int) -> KvtcCalibration:
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
        register_calibration(c)
        cal = c
    elif isinstance(c, str) and HASH_RE.match(c):
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

def has_calibration(h: str) -> bool:
    """True when calibration ``h`` is registered in this process or its artifact is in the
    cache folder (``default_calibration_dir()/<h>.safetensors``; verified when loaded)."""
    if not isinstance(h, str) or not HASH_RE.match(h):
        return False
    with _LOCK:
        if h in _CALIBRATIONS:
            return True
    return (default_calibration_dir() / f"{h}.safetensors").is_file()


def calibration_bytes(h: str) -> bytes:
    """The artifact bytes (``KvtcCalibration.to_bytes``: safetensors + JSON metadata, the
    bytes ``save`` writes) of calibration ``h`` (registered or in the cache folder).
    Raises CodecError when it is not available."""
    return get_calibration(h).to_bytes()


def calibration_from_bytes(data: bytes, expected_hash: str, cache: bool = True
                           ) -> KvtcCalibration:
    """Read an artifact received as bytes (e.g. from the KV store), verify it
    (``KvtcCalibration.from_bytes``: format, shapes, finiteness, content hash = recorded
    hash; no pickle) and that its hash is ``expected_hash``, register it and (cache=True)
    keep it in the cache folder so later processes find it. Raises CodecError."""
    if not isinstance(expected_hash, str) or not HASH_RE.match(expected_hash):
        raise CodecError(f"invalid KVTC calibration hash {expected_hash!r}")
    cal = KvtcCalibration.from_bytes(data, f"calibration {expected_hash[:16]}")
    if cal.hash != expected_hash:
        raise CodecError(f"received calibration has hash {cal.hash[:16]}..., expected "
                         f"{expected_hash[:16]}...")
    register_calibration(cal)
    if cache:
        try:
            folder = default_calibration_dir()
            folder.mkdir(parents=True, exist_ok=True)
            if not (folder / f"{cal.hash}.safetensors").is_file():
                cal.save(folder)
        except OSError:
            pass  # registered in this process; the next process fetches it again
    return cal


class CalibrationArtifacts:
    """The kvtc codec's auxiliary artifacts (``codec.artifacts``): its calibrations, by
    content hash, as the bytes the KV store keeps under cal/<hash>. The store uses this
    through ``codec.artifacts`` and never imports codec.kvtc."""

    kind = "kvtc-calibration"

    def has(self, h: str) -> bool:
        """``has_calibration(h)``."""
        return has_calibration(h)

    def to_bytes(self, h: str) -> bytes:
        """``calibration_bytes(h)``. Raises CodecError."""
        return calibration_bytes(h)

    def from_bytes(self, data: bytes, h: str) -> None:
        """``calibration_from_bytes(data, h)`` (verified, registered, cached). Raises
        CodecError."""
        calibration_from_bytes(data, h)
