"""Entropy coding of quantized KV symbols: probability models + rANS, as one API.

Purpose: turn the integer symbols of one chunk (K and V, each [L, T, C] uint8) into
independent rANS streams (docs/bitstream.md sections 1-3) plus the compact model table
(section 4), and back. Implements CacheGen's arithmetic coding with a probability model
per (layer, channel) (Liu et al., SIGCOMM 2024, section 5.2) with a per-chunk codebook of
models (codec/entropy/models.py) and a rANS coder backend (``CoderBackend``: the numba
``codec.entropy.rans_cpu.CPU_CODER`` by default, or ``codec.triton.ops.TRITON_CODER``), whose
constants and stream layout are codec/entropy/rans_spec.py's. ``decode_symbols_into`` fuses the
decoding with a table dequantization into a destination (codec/quant/fused.py).

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_entropy*.py -q
Run the benchmark: .venv/bin/python -m bench.coder entropy   (prints Msym/s and overheads)

Stats: `entropy_bits` is the cross-entropy of the symbols under the coded (codebook,
16-bit) models - what an ideal coder would need with the models we transmit; the rANS
payload + length table is within ~0.5% of entropy_bits/8 at 1K tokens x 4 channels per
stream; `ideal_bits` is the sum of per-(kv, layer, channel) empirical entropies, a lower
bound no per-channel static model can beat (it ignores the cost of sending the models).

Header fields written (all ints unless noted; see docs/bitstream.md section 4.3):
  coder ("rans32x16"), channels_per_stream (G), tokens_per_stream (B), n_streams,
  model_groups ([[nbins, K, table_k, index_k], ...]).
Arrays: ent_codebook (uint8, range- and Rice-coded table codes; ent_tables in format
  version 3, ent_freqs in version 2, both still read), ent_model_index (uint8, Rice-coded
  indices, absent if every K == 1), ent_stream_lengths (uint16 if every stream < 65536 bytes else uint32).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from . import codebook as cb
from . import models as prob
from . import rans_cpu
from ..errors import CodecError
from .rans_spec import ARRAY_NAMES, CODER_NAME, HEADER_FIELDS, stream_layout

__all__ = ["EncodedSymbols", "CoderBackend", "encode_symbols", "decode_symbols",
           "decode_symbols_into", "entropy_part", "decoding_errors", "CodecError", "CODER_NAME"]


class CoderBackend(Protocol):
    """What the entropy stage needs from a coder backend. Implemented by
    ``codec.entropy.rans_cpu.CPU_CODER`` (numba, numpy arrays) and
    ``codec.triton.ops.TRITON_CODER`` (Triton, torch tensors on a GPU); both code the
    rANS streams of ``codec.entropy.rans_spec`` and produce identical bytes.

    check_symbols(sym_k, sym_v) -> (sym_k, sym_v): the backend's uint8 [L, T, C] arrays;
      ValueError on a wrong type/dtype/rank or differing shapes.
    histograms(sym) -> numpy int64 [L, C, 256]: per-(layer, channel) symbol counts.
    encode_streams(sym_k, sym_v, cum, model_index, G, B) -> (payload numpy uint8,
      lengths numpy int64 [n_streams]) on the host.
    decode_streams(payload, lengths, cum, model_index, L, T, C, G, B, **kw) -> (sym_k,
      sym_v) uint8 [L, T, C] in the backend's array type; CodecError on corrupt streams.
    """

    name: str

    def check_symbols(self, sym_k, sym_v): ...

    def histograms(self, sym) -> np.ndarray: ...

    def encode_streams(self, sym_k, sym_v, cum, model_index, G: int, B: int): ...

    def decode_streams(self, payload, lengths, cum, model_index, L: int, T: int, C: int,
                       G: int, B: int, **kw): ...


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
    backend: CoderBackend | None = None,
) -> EncodedSymbols:
    """Entropy-code the K and V symbols of one chunk.

    Args:
      sym_k, sym_v: uint8 arrays [L, T, C] (same shape), sym_k[l] < nbins_k[l] etc.
      nbins_k, nbins_v: bins per layer (len L), each in [2, 256].
      channels_per_stream: G, channels per rANS stream (default 4: ~6 bytes of per-stream
        overhead amortised over 4*T symbols; smaller G = more parallel streams for a GPU).
      tokens_per_stream: B, tokens per stream (None = all T tokens of the chunk).
      backend: the coder backend (default ``rans_cpu.CPU_CODER``: numpy arrays; pass
        ``triton_kernels.TRITON_CODER`` for torch tensors on a GPU). The models are built
        on the host by the same code either way, so the bytes are identical.
    Returns: EncodedSymbols (see its docstring).
    Raises: ValueError on bad arguments (shape/dtype mismatch, symbol >= nbins, nbins out
      of range, G or B < 1).
    """
    backend = rans_cpu.CPU_CODER if backend is None else backend
    sym_k, sym_v = backend.check_symbols(sym_k, sym_v)
    L, T, C = (int(d) for d in sym_k.shape)
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
            arrays={"ent_codebook": np.zeros(0, np.uint8), "ent_stream_lengths": np.zeros(0, np.uint16)},
            payload=b"",
        )

    hist_k = backend.histograms(sym_k)  # [L, C, 256], host
    hist_v = backend.histograms(sym_v)
    for name, hist, nbs in (("K", hist_k, nbk), ("V", hist_v, nbv)):
        for layer in range(L):
            if hist[layer, :, nbs[layer]:].any():
                mx = int(np.flatnonzero(hist[layer].sum(axis=0))[-1])
                raise ValueError(f"{name} layer {layer}: symbol {mx} >= nbins={nbs[layer]}")
    ms = prob.build_models(hist_k, hist_v, nbk, nbv)
    payload, lengths = backend.encode_streams(sym_k, sym_v, ms.cum, ms.model_index, G, B)
    len_dtype = np.uint16 if int(lengths.max()) < 65536 else np.uint32
    m_hdr, m_arrays = cb.serialize_models(ms)
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


def _parse_streams(header, arrays, payload, L, T, C, nbins_k, nbins_v, max_symbols,
                   allow_tensor=False):
    """Validate an entropy header/arrays/payload for a chunk [L, T, C] (T >= 0).
    Returns None for T == 0 (no streams), else (cum, model_index, lengths, G, B)."""
    for name, v, lo in (("L", L, 1), ("T", T, 0), ("C", C, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise CodecError(f"{name} must be an integer >= {lo}, got {v!r}")
    L, T, C = int(L), int(T), int(C)
    if 2 * L * T * C > max_symbols:
        raise CodecError(f"chunk of 2*{L}*{T}*{C} symbols exceeds max_symbols={max_symbols}")
    if not isinstance(header, dict) or not isinstance(arrays, dict):
        raise CodecError("entropy header must be a dict and arrays a dict")
    if not isinstance(payload, (bytes, bytearray, memoryview)) and not (
            allow_tensor and type(payload).__name__ == "Tensor"):
        raise CodecError("payload must be bytes")
    if header.get("coder") != CODER_NAME:
        raise CodecError(f"unknown entropy coder {header.get('coder')!r} (expected {CODER_NAME!r})")
    if T == 0:
        expect_h = {"coder": CODER_NAME, "tokens_per_stream": 1, "n_streams": 0, "model_groups": []}
        if (any(header.get(k) != v for k, v in expect_h.items()) or set(header) != set(expect_h) | {"channels_per_stream"}
                or set(arrays) not in ({"ent_codebook", "ent_stream_lengths"},   # version 4
                                       {"ent_tables", "ent_stream_lengths"},
                                       {"ent_freqs", "ent_stream_lengths"})   # version 3 / 2
                or any(not isinstance(a, np.ndarray) or a.size != 0 for a in arrays.values()) or len(payload) != 0):
            raise CodecError("a chunk with T=0 tokens must have no streams, no models and an empty payload")
        _hdr_int(header, "channels_per_stream", 1, C)
        return None
    G = _hdr_int(header, "channels_per_stream", 1, C)
    B = _hdr_int(header, "tokens_per_stream", 1, T)
    n_groups, n_blocks, n_streams = stream_layout(L, T, C, G, B)
    if _hdr_int(header, "n_streams", 1, 1 << 40) != n_streams:
        raise CodecError(f"header n_streams={header.get('n_streams')} but the layout has {n_streams}")
    extra = set(header) - set(HEADER_FIELDS)
    if extra:
        raise CodecError(f"unknown entropy header fields {sorted(extra)}")
    extra = set(arrays) - set(ARRAY_NAMES)
    if extra:
        raise CodecError(f"unknown entropy arrays {sorted(extra)}")
    cum, model_index = cb.deserialize_models(header, arrays, nbins_k, nbins_v, L, C)
    lengths = arrays.get("ent_stream_lengths")
    if (not isinstance(lengths, np.ndarray) or lengths.dtype not in (np.uint16, np.uint32)
            or lengths.shape != (n_streams,)):
        raise CodecError(f"ent_stream_lengths must be uint16/uint32 [{n_streams}]")
    return cum, model_index, lengths, G, B


def decode_symbols(header: dict, arrays: dict, payload: bytes, L: int, T: int, C: int,
                   nbins_k: Sequence[int], nbins_v: Sequence[int], max_symbols: int = 1 << 32,
                   backend: CoderBackend | None = None, **backend_kw
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Decode what `encode_symbols` produced.

    Args: header/arrays/payload as produced (e.g. after a bitstream round trip); L, T, C
      the chunk shape; nbins_k/nbins_v the bins per layer (from the caller's config);
      backend: the coder backend (default ``rans_cpu.CPU_CODER``), ``backend_kw`` passed
      to its ``decode_streams`` (e.g. ``device`` for Triton). The header and model
      tables are validated here, on the host, for every backend.
    Returns: (sym_k, sym_v), uint8 [L, T, C] each (numpy for the CPU backend).
    Raises: CodecError on any inconsistency (bad header fields, wrong array shapes/dtypes,
      model table not matching nbins, truncated/corrupt streams, leftover bytes).
    """
    backend = rans_cpu.CPU_CODER if backend is None else backend
    parsed = _parse_streams(header, arrays, payload, L, T, C, nbins_k, nbins_v, max_symbols,
                            allow_tensor=backend is not rans_cpu.CPU_CODER)
    if parsed is None:
        return np.zeros((int(L), 0, int(C)), np.uint8), np.zeros((int(L), 0, int(C)), np.uint8)
    cum, model_index, lengths, G, B = parsed
    return backend.decode_streams(payload, lengths, cum, model_index, int(L), int(T), int(C),
                                  G, B, **backend_kw)


def decode_symbols_into(header: dict, arrays: dict, payload: bytes, L: int, T: int, C: int,
                        nbins_k: Sequence[int], nbins_v: Sequence[int], out_k: np.ndarray,
                        out_v: np.ndarray, deq_k: np.ndarray, deq_v: np.ndarray, t_stride: int,
                        hd: int, t_off: int = 0, max_symbols: int = 1 << 32) -> None:
    """Fused decode + dequantization of what `encode_symbols` produced, straight into a
    destination: symbol s of (kv, layer, t, c) becomes
    ``out[layer, t_off + t, c] = deq[layer, t * t_stride + c // hd, s]`` in one numba pass
    over the streams, both cores (`codec.entropy.rans_cpu.decode_streams_into`).

    Args: header .. nbins_v as `decode_symbols`; out_k/out_v writable C-contiguous arrays
      [L, T_out, C] (e.g. the uint16 view of a bf16 destination [L, T_out, H, D]);
      deq_k/deq_v [L, R, NS] tables of out's dtype (values of each symbol per scale row);
      t_stride, hd, t_off as in `codec.entropy.rans_cpu.decode_streams_into`.
    Raises: CodecError on any inconsistency of the bitstream (as `decode_symbols`);
      ValueError on inconsistent destination/table arguments.
    """
    parsed = _parse_streams(header, arrays, payload, L, T, C, nbins_k, nbins_v, max_symbols)
    if parsed is None:
        return
    cum, model_index, lengths, G, B = parsed
    rans_cpu.decode_streams_into(payload, lengths, cum, model_index, int(L), int(T), int(C), G, B,
                                 out_k, out_v, deq_k, deq_v, t_stride, hd, t_off)


def entropy_part(header: dict, arrays: dict) -> tuple[dict, dict]:
    """A codec chunk's entropy-coder part: (its header's ``entropy`` dict, its ``ent_*``
    arrays). Raises CodecError when the header has none."""
    ent = header.get("entropy")
    if not isinstance(ent, dict):
        raise CodecError("missing entropy-coder header")
    return ent, {n: a for n, a in arrays.items() if n.startswith("ent_")}


@contextlib.contextmanager
def decoding_errors():
    """Inside: any ValueError/IndexError/KeyError/TypeError/OverflowError of a decode becomes
    CodecError("entropy decoding failed: ..."); a CodecError passes unchanged."""
    try:
        yield
    except CodecError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
        raise CodecError(f"entropy decoding failed: {e}") from None


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
