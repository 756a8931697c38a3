"""The rANS coder's specification, defined once: constants, error codes, stream layout.

Purpose: docs/bitstream.md sections 2-4 in code. Both coder backends - numba on the CPU
(``codec.entropy.rans_cpu``) and Triton on the GPU (``codec.triton.ops``) - and the entropy
stage that composes them (``codec.entropy``) import these names; nothing here depends on
numpy's or torch's flavour of arrays except the two layout helpers (numpy).

The coder: a 32-bit-state rANS with 16-bit renormalisation words (J. Duda, "Asymmetric
numeral systems", 2013; the interleaved-stream organisation of F. Giesen's ryg_rans),
coding CacheGen's symbols with one probability model per (layer, channel) (Liu et al.,
SIGCOMM 2024, section 5.2).

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_entropy.py -q
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "CODER_NAME", "PROB_BITS", "PROB_SCALE", "RANS_L", "WORD_BITS", "WORD_MASK",
    "STATE_BYTES", "MAX_ALPHABET", "ERR_OK", "ERR_SHORT", "ERR_STATE", "ERR_TRUNCATED",
    "ERR_FINAL", "ERR_LEFTOVER", "ERR_SYMBOL", "ERR_INTERNAL", "ERR_MESSAGES",
    "HEADER_FIELDS", "ARRAY_NAMES", "stream_layout", "stream_symbol_counts",
    "bad_stream_lengths",
]

CODER_NAME = "rans32x16"          # header["coder"] (docs/bitstream.md section 4.3)

# section 2: models and state
PROB_BITS = 16                    # every model's frequencies sum to 2^PROB_BITS
PROB_SCALE = 1 << PROB_BITS       # M
RANS_L = 1 << 16                  # lower bound of the normalised state interval [L, 2^32)
WORD_BITS = 16                    # renormalisation moves one 16-bit word
WORD_MASK = (1 << WORD_BITS) - 1
STATE_BYTES = 4                   # the final state, flushed first (2 words, little-endian)
MAX_ALPHABET = 256                # symbols are uint8; cum rows have MAX_ALPHABET + 1 entries

# per-stream error codes of the decoders (and ERR_SYMBOL of the encoders); 0 = ok
ERR_OK = 0
ERR_SHORT = 1       # stream shorter than the 4-byte initial state
ERR_STATE = 2       # initial state x < L
ERR_TRUNCATED = 3   # a renormalisation read went past the end of the stream
ERR_FINAL = 4       # final state != L
ERR_LEFTOVER = 5    # bytes left over after the last symbol
ERR_SYMBOL = 6      # (encode) symbol with zero frequency in its model
ERR_INTERNAL = 7    # (Triton encode) pass 2 did not fill its slot exactly: a kernel bug
ERR_MESSAGES = {
    ERR_SHORT: "stream shorter than its 4-byte initial state",
    ERR_STATE: "initial rANS state below L",
    ERR_TRUNCATED: "stream truncated (renormalisation read past its end)",
    ERR_FINAL: "final rANS state is not L (corrupt stream)",
    ERR_LEFTOVER: "bytes left over after the last symbol (corrupt stream)",
    ERR_SYMBOL: "symbol outside its model's alphabet (zero frequency)",
    ERR_INTERNAL: "internal error: encoder pass 2 did not fill its slot exactly",
}

# section 4.3: the entropy part of a chunk header, and its arrays
HEADER_FIELDS = ("coder", "channels_per_stream", "tokens_per_stream", "n_streams",
                 "model_groups")
ARRAY_NAMES = ("ent_codebook", "ent_model_index", "ent_stream_lengths",
               "ent_tables", "ent_freqs")   # the version-3 / version-2 codebooks (read only)


def stream_layout(L: int, T: int, C: int, G: int, B: int) -> tuple[int, int, int]:
    """Section 3: (n_groups, n_blocks, n_streams) for a chunk of K and V [L, T, C] coded
    with G channels and B tokens per stream: n_groups = ceil(C / G), n_blocks =
    ceil(T / B), n_streams = 2 * L * n_groups * n_blocks; stream i = ((kv * L + layer) *
    n_groups + g) * n_blocks + b, symbols channel-major inside (for c in group: for t in
    block). Raises ValueError if a dimension or G/B is not an integer >= 1."""
    for name, v in (("L", L), ("T", T), ("C", C), ("channels_per_stream", G),
                    ("tokens_per_stream", B)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    n_groups = -(-C // G)
    n_blocks = -(-T // B)
    return n_groups, n_blocks, 2 * L * n_groups * n_blocks


def stream_symbol_counts(L: int, T: int, C: int, G: int, B: int) -> np.ndarray:
    """int64 [n_streams]: number of symbols in each stream (section 3 order)."""
    n_groups, n_blocks, _ = stream_layout(L, T, C, G, B)
    ch = np.full(n_groups, G, dtype=np.int64)
    ch[-1] = C - G * (n_groups - 1)
    tk = np.full(n_blocks, B, dtype=np.int64)
    tk[-1] = T - B * (n_blocks - 1)
    return np.tile(np.outer(ch, tk).reshape(-1), 2 * L)


def bad_stream_lengths(lengths, counts):
    """Boolean mask of stream lengths (bytes) that no valid stream can have: odd, shorter
    than the state, or longer than the state plus one word per symbol. Works on numpy
    arrays and torch tensors alike."""
    return (lengths < STATE_BYTES) | (lengths % 2 != 0) | \
        (lengths > STATE_BYTES + (WORD_BITS // 8) * counts)
