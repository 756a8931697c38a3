"""Auxiliary artifacts of the codecs: content-addressed blobs a codec's chunks name by hash
and its decoder needs (e.g. a kvtc calibration), as bytes. The KV store (streaming/)
keeps them beside an entry and serves them to a reader that lacks one, through these
three functions, without knowing which codec made them.

A codec that has such artifacts exposes an ``artifacts`` object with ``has(h) -> bool``,
``to_bytes(h) -> bytes`` and ``from_bytes(data, h)`` (verify, make available to the
decoder; CodecError otherwise). Not runnable.
"""
from __future__ import annotations

from .errors import CodecError


def _providers() -> list:
    """The ``artifacts`` objects of the registered codecs (``codec.CODECS``)."""
    import codec

    return [a for c in codec.CODECS.values() if (a := getattr(c, "artifacts", None)) is not None]


def has_artifact(h: str) -> bool:
    """True when a codec has artifact ``h`` available (in this process or its cache
    folder)."""
    return any(p.has(h) for p in _providers())


def artifact_bytes(h: str) -> bytes:
    """The bytes of artifact ``h`` from the codec that has it. Raises CodecError when no
    codec has it."""
    for p in _providers():
        if p.has(h):
            return p.to_bytes(h)
    raise CodecError(f"artifact {str(h)[:16]} is not available to any codec")


def load_artifact(data: bytes, h: str) -> None:
    """Give artifact bytes received for hash ``h`` (e.g. from the KV store) to the codec
    whose artifact they are: verified by it and made available to its decoder. Raises
    CodecError when no codec accepts them (the first refusal's reason)."""
    errors = []
    for p in _providers():
        try:
            p.from_bytes(data, h)
            return
        except CodecError as e:
            errors.append(f"{getattr(p, 'kind', type(p).__name__)}: {e}")
    raise CodecError("; ".join(errors) or f"no codec takes artifact {str(h)[:16]}")
