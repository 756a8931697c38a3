"""The codec's single decoding error type.

Purpose: every malformed, truncated, corrupted or inconsistent input handed to any
decoding function of the codec (`codec.bitstream.unpack`, `codec.entropy.decode_symbols`,
`codec.decode_kv`, ...) raises `CodecError` - never another exception type, never a
hang, never an allocation larger than the input justifies. See docs/bitstream.md.

Run: nothing to run; imported by the other codec modules.
"""
from __future__ import annotations

__all__ = ["CodecError"]


class CodecError(ValueError):
    """Bad input to a decoder (truncated/corrupt bitstream, inconsistent header, ...).

    Subclass of ValueError so callers that catch ValueError for "bad input" also catch it.
    The message says what was wrong and where (e.g. "container truncated: need 12 bytes
    for the fixed header, got 7").
    """
