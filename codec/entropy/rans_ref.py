"""Pure-Python reference of the CPU rANS coder (docs/bitstream.md sections 2-3).

Purpose: the coder's specification, literally: one stream (`rans_encode_ref`,
`rans_decode_ref`) and all streams of a chunk in section-3 order (`encode_streams_ref`,
`decode_streams_ref`); the numba kernels (codec.entropy.rans_cpu) and the Triton kernels
(codec.triton.ops) must produce exactly these bytes. Slow: tests and small shapes only.
Re-exported by codec.entropy.rans_cpu (moved out of it unchanged, to keep each module under 600 lines).

Shapes and dtypes: sym_k, sym_v uint8 [L, T, C]; cum uint32 [n_models, 257]; model_index
[2, L, C]; G, B channels / tokens per stream (codec/entropy/rans_cpu.py's module docstring).
Errors: CodecError with a one-line message (codec.entropy.rans_spec.ERR_MESSAGES).

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_entropy.py -q
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import CodecError
from .rans_spec import (ERR_FINAL, ERR_LEFTOVER, ERR_MESSAGES, ERR_SHORT, ERR_STATE, ERR_TRUNCATED,
                        RANS_L, WORD_MASK as _MASK16, stream_layout)

# ---------------------------------------------------------------------------------------
# Pure-Python reference (the spec, literally). Slow: for tests and small shapes only.
# ---------------------------------------------------------------------------------------
def rans_encode_ref(symbols: Sequence[int], cum_rows: Sequence[Sequence[int]]) -> bytes:
    """Encode one stream (docs/bitstream.md section 2), literally as specified.

    Args:
      symbols: ints s_0..s_{n-1}.
      cum_rows: for each symbol i, the cumulative-frequency row (len >= s_i + 2) of its
        model, i.e. cum_rows[i][s] = cum[m_i][s].
    Returns: the stream bytes (4 + 2 * renorm_words).
    Raises: ValueError if a symbol has zero frequency.
    """
    stack: list[int] = []
    x = RANS_L
    for i in range(len(symbols) - 1, -1, -1):
        s = int(symbols[i])
        row = cum_rows[i]
        c = int(row[s])
        f = int(row[s + 1]) - c
        if f <= 0:
            raise ValueError(f"symbol {s} at position {i} has zero frequency in its model")
        x_max = f << 16  # ((L >> PROB_BITS) << 16) * f
        if x >= x_max:
            stack.append(x & _MASK16)
            x >>= 16
        x = ((x // f) << 16) + (x % f) + c
    stack.append(x >> 16)
    stack.append(x & _MASK16)
    out = bytearray()
    for w in reversed(stack):
        out += int(w).to_bytes(2, "little")
    return bytes(out)


def rans_decode_ref(stream: bytes, cum_rows: Sequence[Sequence[int]]) -> list[int]:
    """Decode one stream (docs/bitstream.md section 2), literally as specified.

    Args: stream bytes; cum_rows as for `rans_encode_ref` (one row per symbol to decode;
      rows must be valid models: cum[0] = 0, cum[nbins] = 65536, padded with 65536).
    Returns: the n decoded symbols.
    Raises: CodecError (truncated stream, x < L at start, final x != L, leftover bytes).
    """
    n_bytes = len(stream)
    if n_bytes < 4:
        raise CodecError(ERR_MESSAGES[ERR_SHORT])
    x = int.from_bytes(stream[0:4], "little")
    pos = 4
    if x < RANS_L:
        raise CodecError(ERR_MESSAGES[ERR_STATE])
    out = []
    for row in cum_rows:
        slot = x & _MASK16
        s = 0
        while int(row[s + 1]) <= slot:
            s += 1
        c = int(row[s])
        f = int(row[s + 1]) - c
        x = f * (x >> 16) + slot - c
        if x < RANS_L:
            if pos + 2 > n_bytes:
                raise CodecError(ERR_MESSAGES[ERR_TRUNCATED])
            x = (x << 16) | int.from_bytes(stream[pos : pos + 2], "little")
            pos += 2
        out.append(s)
    if x != RANS_L:
        raise CodecError(ERR_MESSAGES[ERR_FINAL])
    if pos != n_bytes:
        raise CodecError(ERR_MESSAGES[ERR_LEFTOVER])
    return out


def _iter_stream_positions(L: int, T: int, C: int, G: int, B: int):
    """Yield (kv, layer, [(t, c), ...]) per stream in section-3 order (reference only)."""
    n_groups, n_blocks, _ = stream_layout(L, T, C, G, B)
    for kv in range(2):
        for layer in range(L):
            for g in range(n_groups):
                for b in range(n_blocks):
                    pos = [
                        (t, c)
                        for c in range(g * G, min((g + 1) * G, C))
                        for t in range(b * B, min((b + 1) * B, T))
                    ]
                    yield kv, layer, pos


def encode_streams_ref(sym_k, sym_v, cum, model_index, G: int, B: int) -> tuple[bytes, np.ndarray]:
    """Reference for `encode_streams`: returns (payload bytes, lengths int64 [n_streams])."""
    sym = (np.asarray(sym_k), np.asarray(sym_v))
    L, T, C = sym[0].shape
    cum = np.asarray(cum)
    mi = np.asarray(model_index)
    parts, lengths = [], []
    for kv, layer, pos in _iter_stream_positions(L, T, C, G, B):
        syms = [int(sym[kv][layer, t, c]) for t, c in pos]
        rows = [cum[int(mi[kv, layer, c])].tolist() for t, c in pos]
        st = rans_encode_ref(syms, rows)
        parts.append(st)
        lengths.append(len(st))
    return b"".join(parts), np.asarray(lengths, dtype=np.int64)


def decode_streams_ref(payload: bytes, lengths, cum, model_index, L, T, C, G, B):
    """Reference for `decode_streams`: returns (sym_k, sym_v) uint8 [L, T, C]."""
    out = np.zeros((2, L, T, C), dtype=np.uint8)
    cum = np.asarray(cum)
    mi = np.asarray(model_index)
    off = 0
    lengths = [int(v) for v in lengths]
    for i, (kv, layer, pos) in enumerate(_iter_stream_positions(L, T, C, G, B)):
        st = payload[off : off + lengths[i]]
        off += lengths[i]
        rows = [cum[int(mi[kv, layer, c])].tolist() for t, c in pos]
        syms = rans_decode_ref(st, rows)
        for (t, c), s in zip(pos, syms):
            out[kv, layer, t, c] = s
    if off != len(payload):
        raise CodecError("stream lengths do not add up to the payload size")
    return out[0], out[1]
