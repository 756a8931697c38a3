"""KVTC calibrations as bytes: an entry's calibration travels with it through
the KV store, which keeps the artifact under cal/<hash>; a reader that lacks it fetches it
once (``calibration_from_bytes``: verified, registered, kept in the cache folder).

Separate from codec.kvtc.registry (finding a calibration in this process) because it is
the KV store's transport of the artifact file. Errors: ``CodecError``.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import CodecError
from . import registry
from .calibration import KvtcCalibration, _HASH_RE, default_calibration_dir, load_calibration
from .registry import get_calibration, register_calibration


def has_calibration(h: str) -> bool:
    """True when calibration ``h`` is registered in this process or its artifact is in the
    cache folder (``default_calibration_dir()/<h>.safetensors``; verified when loaded)."""
    if not isinstance(h, str) or not _HASH_RE.match(h):
        return False
    with registry._LOCK:
        if h in registry._CALIBRATIONS:
            return True
    return (default_calibration_dir() / f"{h}.safetensors").is_file()


def calibration_bytes(h: str) -> bytes:
    """The artifact file bytes (safetensors + JSON metadata, as ``KvtcCalibration.save``
    writes them) of calibration ``h`` (registered or in the cache folder). Raises
    CodecError when it is not available."""
    import tempfile

    cal = get_calibration(h)
    with tempfile.TemporaryDirectory(prefix="cgh-cal-") as d:
        return cal.save(Path(d) / f"{h}.safetensors").read_bytes()


def calibration_from_bytes(data: bytes, expected_hash: str, cache: bool = True
                           ) -> KvtcCalibration:
    """Read an artifact received as bytes (e.g. from the KV store), verify it
    (``load_calibration``: format, shapes, finiteness, content hash = recorded hash; no
    pickle) and that its hash is ``expected_hash``, register it and (cache=True) keep it
    in the cache folder so later processes find it. Raises CodecError."""
    import tempfile

    if not isinstance(expected_hash, str) or not _HASH_RE.match(expected_hash):
        raise CodecError(f"invalid KVTC calibration hash {expected_hash!r}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"calibration data must be bytes, got {type(data).__name__}")
    with tempfile.TemporaryDirectory(prefix="cgh-cal-") as d:
        p = Path(d) / f"{expected_hash}.safetensors"
        p.write_bytes(bytes(data))
        cal = load_calibration(p)
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
