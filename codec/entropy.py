"""Entropy coding of quantized KV symbols: probability models + rANS, as one API.

Purpose: turn the integer symbols of one chunk (K and V, each [L, T, C] uint8) into
independent rANS streams (docs/bitstream.md sections 1-3) plus the compact model table
(section 4), and back. Implements CacheGen's arithmetic coding with a probability model
per (layer, channel) (Liu et al., SIGCOMM 2024, section 5.2) with a per-chunk codebook of
models (codec/probability.py) and the rANS coder of codec/rans_cpu.py.

Run the tests: .venv/bin/python -m pytest tests/test_codec_entropy*.py -q
Run the benchmark: .venv/bin/python -m codec.entropy   (prints Msym/s and overheads)

Stats: `entropy_bits` is the cross-entropy of the symbols under the coded (codebook,
16-bit) models - what an ideal coder would need with the models we transmit; the rANS
payload + length table is within ~0.5% of entropy_bits/8 at 1K tokens x 4 channels per
stream; `ideal_bits` is the sum of per-(kv, layer, channel) empirical entropies, a lower
bound no per-channel static model can beat (it ignores the cost of sending the models).

Header fields written (all ints unless noted; see docs/bitstream.md section 4.3):
  coder ("rans32x16"), channels_per_stream (G), tokens_per_stream (B), n_streams,
  model_groups ([[nbins, K], ...]).
Arrays: ent_freqs (uint16), ent_model_index (uint8 [2, L, C], absent if every K == 1),
  ent_stream_lengths (uint16 if every stream < 65536 bytes else uint32).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import probability as prob
from . import rans_cpu
from .errors import CodecError

__all__ = ["EncodedSymbols", "encode_symbols", "decode_symbols", "CodecError", "CODER_NAME"]

CODER_NAME = "rans32x16"


@dataclass
class EncodedSymbols:
    """Entropy-coded symbols of one chunk, ready for `codec.bitstream.pack`.

    Fields:
      header: small JSON-able dict (layout params: channels_per_stream, tokens_per_stream,
        n_streams, n_models, model encoding version ...). The caller may store it as a
        sub-dict of its own container header; `decode_symbols` needs it back unchanged.
      arrays: dict name -> np.ndarray (all names start with "ent_"): serialised model
        codebook, model index per (kv, layer, channel), stream lengths (uint16 when every
        stream is < 65536 bytes, else uint32). Pass them to `bitstream.pack` unchanged.
      payload: the concatenated rANS streams (bytes).
    Stats (not serialised):
      entropy_bits: cross-entropy of the symbols under the CODED (quantized) models, bits.
      ideal_bits: sum over (kv, layer, channel) of the empirical entropy of its symbols, bits.
      model_bytes: bytes of the serialised model codebook + model index arrays.
      length_table_bytes: bytes of the stream-length array.
      payload_bytes: len(payload).
    """

    header: dict
    arrays: dict
    payload: bytes
    entropy_bits: float = 0.0
    ideal_bits: float = 0.0
    model_bytes: int = 0
    length_table_bytes: int = 0
    payload_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """payload + length table + model bytes (excludes the container's own overhead)."""
        return self.payload_bytes + self.length_table_bytes + self.model_bytes


def encode_symbols(
    sym_k: np.ndarray,
    sym_v: np.ndarray,
    nbins_k: Sequence[int],
    nbins_v: Sequence[int],
    channels_per_stream: int = 4,
    tokens_per_stream: int | None = None,
) -> EncodedSymbols:
    """Entropy-code the K and V symbols of one chunk.

    Args:
      sym_k, sym_v: uint8 arrays [L, T, C] (same shape), sym_k[l] < nbins_k[l] etc.
      nbins_k, nbins_v: bins per layer (len L), each in [2, 256].
      channels_per_stream: G, channels per rANS stream (default 4: ~6 bytes of per-stream
        overhead amortised over 4*T symbols; smaller G = more parallel streams for a GPU).
      tokens_per_stream: B, tokens per stream (None = all T tokens of the chunk).
    Returns: EncodedSymbols (see its docstring).
    Raises: ValueError on bad arguments (shape/dtype mismatch, symbol >= nbins, nbins out
      of range, G or B < 1).
    """
    sym_k = np.asarray(sym_k)
    sym_v = np.asarray(sym_v)
    if sym_k.dtype != np.uint8 or sym_v.dtype != np.uint8:
        raise ValueError(f"symbols must be uint8, got {sym_k.dtype} and {sym_v.dtype}")
    if sym_k.ndim != 3 or sym_k.shape != sym_v.shape:
        raise ValueError(f"sym_k and sym_v must both be [L, T, C], got {sym_k.shape} and {sym_v.shape}")
    L, T, C = sym_k.shape
    if L < 1 or C < 1:
        raise ValueError(f"L and C must be >= 1: [L, T, C] = {sym_k.shape}")
    nbk = _int_list(nbins_k, "nbins_k")
    nbv = _int_list(nbins_v, "nbins_v")
    if len(nbk) != L or len(nbv) != L:
        raise ValueError(f"nbins_k/nbins_v must have L={L} entries, got {len(nbk)} and {len(nbv)}")
    if any(not 2 <= v <= 256 for v in nbk + nbv):
        raise ValueError("nbins must be in [2, 256]")
    G = _pos_int(channels_per_stream, "channels_per_stream")
    B = max(T, 1) if tokens_per_stream is None else _pos_int(tokens_per_stream, "tokens_per_stream")
    G, B = min(G, C), min(B, max(T, 1))
    if T == 0:  # no tokens (e.g. every token of the chunk kept exact): no streams at all
        return EncodedSymbols(
            header={"coder": CODER_NAME, "channels_per_stream": G, "tokens_per_stream": 1,
                    "n_streams": 0, "model_groups": []},
            arrays={"ent_freqs": np.zeros(0, np.uint16), "ent_stream_lengths": np.zeros(0, np.uint16)},
            payload=b"",
        )

    hist_k = prob.histograms(sym_k)  # [L, C, 256]
    hist_v = prob.histograms(sym_v)
    for name, hist, nbs in (("K", hist_k, nbk), ("V", hist_v, nbv)):
        for layer in range(L):
            if hist[layer, :, nbs[layer]:].any():
                mx = int(np.flatnonzero(hist[layer].sum(axis=0))[-1])
                raise ValueError(f"{name} layer {layer}: symbol {mx} >= nbins={nbs[layer]}")
    ms = prob.build_models(hist_k, hist_v, nbk, nbv)
    payload, lengths = rans_cpu.encode_streams(sym_k, sym_v, ms.cum, ms.model_index, G, B)
    len_dtype = np.uint16 if int(lengths.max()) < 65536 else np.uint32
    m_hdr, m_arrays = prob.serialize_models(ms)
    header = {
        "coder": CODER_NAME,
        "channels_per_stream": int(G),
        "tokens_per_stream": int(B),
        "n_streams": int(lengths.size),
        **m_hdr,
    }
    arrays = dict(m_arrays)
    arrays["ent_stream_lengths"] = lengths.astype(len_dtype)
    model_bytes = sum(int(a.nbytes) for a in m_arrays.values())
    return EncodedSymbols(
        header=header,
        arrays=arrays,
        payload=payload.tobytes(),
        entropy_bits=float(ms.coded_bits),
        ideal_bits=float(ms.ideal_bits),
        model_bytes=model_bytes,
        length_table_bytes=int(arrays["ent_stream_lengths"].nbytes),
        payload_bytes=int(payload.size),
    )


def decode_symbols(
    header: dict,
    arrays: dict,
    payload: bytes,
    L: int,
    T: int,
    C: int,
    nbins_k: Sequence[int],
    nbins_v: Sequence[int],
    max_symbols: int = 1 << 32,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode what `encode_symbols` produced.

    Args: header/arrays/payload as produced (e.g. after a bitstream round trip); L, T, C
      the chunk shape; nbins_k/nbins_v the bins per layer (from the caller's config).
    Returns: (sym_k, sym_v), uint8 [L, T, C] each.
    Raises: CodecError on any inconsistency (bad header fields, wrong array shapes/dtypes,
      model table not matching nbins, truncated/corrupt streams, leftover bytes).
    """
    for name, v, lo in (("L", L, 1), ("T", T, 0), ("C", C, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise CodecError(f"{name} must be an integer >= {lo}, got {v!r}")
    L, T, C = int(L), int(T), int(C)
    if 2 * L * T * C > max_symbols:
        raise CodecError(f"chunk of 2*{L}*{T}*{C} symbols exceeds max_symbols={max_symbols}")
    if not isinstance(header, dict) or not isinstance(arrays, dict):
        raise CodecError("entropy header must be a dict and arrays a dict")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError("payload must be bytes")
    if header.get("coder") != CODER_NAME:
        raise CodecError(f"unknown entropy coder {header.get('coder')!r} (expected {CODER_NAME!r})")
    if T == 0:
        expect_h = {"coder": CODER_NAME, "tokens_per_stream": 1, "n_streams": 0, "model_groups": []}
        if (any(header.get(k) != v for k, v in expect_h.items()) or set(header) != set(expect_h) | {"channels_per_stream"}
                or set(arrays) != {"ent_freqs", "ent_stream_lengths"}
                or any(not isinstance(a, np.ndarray) or a.size != 0 for a in arrays.values()) or len(payload) != 0):
            raise CodecError("a chunk with T=0 tokens must have no streams, no models and an empty payload")
        _hdr_int(header, "channels_per_stream", 1, C)
        return np.zeros((L, 0, C), np.uint8), np.zeros((L, 0, C), np.uint8)
    G = _hdr_int(header, "channels_per_stream", 1, C)
    B = _hdr_int(header, "tokens_per_stream", 1, T)
    n_groups, n_blocks, n_streams = rans_cpu.stream_layout(L, T, C, G, B)
    if _hdr_int(header, "n_streams", 1, 1 << 40) != n_streams:
        raise CodecError(f"header n_streams={header.get('n_streams')} but the layout has {n_streams}")
    known = {"coder", "channels_per_stream", "tokens_per_stream", "n_streams", "model_groups"}
    extra = set(header) - known
    if extra:
        raise CodecError(f"unknown entropy header fields {sorted(extra)}")
    extra = set(arrays) - {"ent_freqs", "ent_model_index", "ent_stream_lengths"}
    if extra:
        raise CodecError(f"unknown entropy arrays {sorted(extra)}")
    cum, model_index = prob.deserialize_models(header, arrays, nbins_k, nbins_v, L, C)
    lengths = arrays.get("ent_stream_lengths")
    if (not isinstance(lengths, np.ndarray) or lengths.dtype not in (np.uint16, np.uint32)
            or lengths.shape != (n_streams,)):
        raise CodecError(f"ent_stream_lengths must be uint16/uint32 [{n_streams}]")
    return rans_cpu.decode_streams(payload, lengths, cum, model_index, L, T, C, G, B)


def _int_list(v, name: str) -> list[int]:
    try:
        out = [int(x) for x in v]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of ints") from None
    if any(int(x) != x for x in v):
        raise ValueError(f"{name} must be a sequence of ints")
    return out


def _pos_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return int(v)


def _hdr_int(header: dict, key: str, lo: int, hi: int) -> int:
    v = header.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise CodecError(f"entropy header field {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _bench(argv=None) -> None:
    """python -m codec.entropy [--npz FILE] : sizes and Msym/s of encode/decode_symbols.

    FILE (optional) holds sym_k, sym_v (uint8 [L, T, C]) and nbins_k, nbins_v (int [L]);
    default: a synthetic chunk (30 layers x 1024 tokens x 192 channels, Laplace symbols
    with per-channel widths and offsets, LMCache's 32/16-bin schedule as 31/15 symbols).
    """
    import argparse
    import time

    ap = argparse.ArgumentParser(description=_bench.__doc__)
    ap.add_argument("--npz", default=None)
    ap.add_argument("--channels-per-stream", type=int, default=4)
    ap.add_argument("--tokens-per-stream", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    if a.npz:
        d = np.load(a.npz)
        sk, sv = d["sym_k"], d["sym_v"]
        nbk, nbv = [int(x) for x in d["nbins_k"]], [int(x) for x in d["nbins_v"]]
    else:
        rng = np.random.default_rng(0)
        L, T, C = 30, 1024, 192
        nbk = [31] * 10 + [15] * 20
        nbv = [31] * 2 + [15] * 28
        syms = []
        for nbs in (nbk, nbv):
            s = np.empty((L, T, C), np.uint8)
            for layer, nb in enumerate(nbs):
                width = rng.lognormal(0.0, 0.5, C) * nb / 12
                centre = nb // 2 + rng.integers(-2, 3, C)
                s[layer] = np.clip(np.round(rng.laplace(0.0, width, (T, C)) + centre), 0, nb - 1)
            syms.append(s)
        sk, sv = syms
    L, T, C = sk.shape
    n = 2 * sk.size
    encode_symbols(sk[:, :2], sv[:, :2], nbk, nbv)  # compile / warm up
    te, td = [], []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        enc = encode_symbols(sk, sv, nbk, nbv, a.channels_per_stream, a.tokens_per_stream)
        t1 = time.perf_counter()
        dk, dv = decode_symbols(enc.header, enc.arrays, enc.payload, L, T, C, nbk, nbv)
        t2 = time.perf_counter()
        te.append(t1 - t0)
        td.append(t2 - t1)
    assert np.array_equal(dk, sk) and np.array_equal(dv, sv)
    tot = enc.total_bytes
    print(f"chunk [L={L}, T={T}, C={C}] x K/V = {n} symbols; groups (nbins, K) = {enc.header['model_groups']}")
    print(f"ideal (per-channel empirical entropy): {enc.ideal_bits / n:.4f} bits/sym = {enc.ideal_bits / 8:.0f} B")
    print(f"coded-model cross-entropy: {enc.entropy_bits / 8:.0f} B ({100 * (enc.entropy_bits / enc.ideal_bits - 1):+.2f}% vs ideal)")
    print(f"payload {enc.payload_bytes} B + length table {enc.length_table_bytes} B "
          f"({100 * ((enc.payload_bytes + enc.length_table_bytes) * 8 / enc.entropy_bits - 1):+.2f}% vs cross-entropy)")
    print(f"models {enc.model_bytes} B = {100 * enc.model_bytes / tot:.2f}% of {tot} B; "
          f"total {100 * (tot * 8 / enc.ideal_bits - 1):+.2f}% vs ideal")
    print(f"encode_symbols {n / np.median(te) / 1e6:.1f} Msym/s, decode_symbols {n / np.median(td) / 1e6:.1f} Msym/s "
          f"(median of {a.reps}; both include model building / table validation)")


if __name__ == "__main__":
    _bench()
