"""CPU rANS coder (numba) for many independent streams, plus a pure-Python reference.

Purpose: the arithmetic-coding stage of CacheGen (Liu et al., SIGCOMM 2024, section 5.2:
"arithmetic coding with a probability model per (layer, channel)") realised as the
32-bit-state / 16-bit-word rANS coder of docs/bitstream.md section 2, over the stream
layout of section 3. rANS itself: J. Duda, "Asymmetric numeral systems" (2013); coding
several independent streams in lockstep (interleaving) follows F. Giesen's ryg_rans.

Measured on this 2-core AMD EPYC (Zen 4) VM under heavy load from other jobs, real KV
symbols (30 layers x 1024 tokens x 192 channels x K/V, 2.4 bits/symbol), per CPU-second
of one core: encode ~300 Msym, decode ~375 Msym; constriction's RangeCoder on the same
symbols with ONE model: ~190 / ~50 (see `python -m bench.coder rans --npz ...`).

`decode_streams_into` is the same decoder writing, for each symbol, an entry of a
caller-given table (the dequantized value in the model dtype's bits) straight into a
destination (codec/quant/fused.py); `gather_into`, `lut8_into`, `kivi_into`, the
table decoders of the baselines quant8, fp8 and KIVI, are codec/quant/tables.py's. `CPU_CODER` is this module as the
coder backend of codec/entropy/__init__.py; the constants and layout are codec/entropy/rans_spec.py's.

The numba kernels (`encode_streams`, `decode_streams`) run one work item (4 streams of
identical shape coded in lockstep, or 1 stream) at a time on every core (the encoder per
`prange` iteration; the decoder's workers take items from an atomic counter, so a thread
slowed by other work does not hold the others back; small chunks use a serial build) and must produce exactly the bytes of the pure-Python
reference (`rans_encode_ref`, `rans_decode_ref`, `encode_streams_ref`,
`decode_streams_ref`), which the Triton kernels (codec/triton/ops.py) also match.
The kernels themselves are in codec/entropy/rans_kernels.py and the reference in
codec/entropy/rans_ref.py.

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_entropy*.py -q
Run the benchmark: nice -n 5 .venv/bin/python -m bench.coder rans   (Msym/s encode/decode)

Shapes and dtypes used throughout:
  sym_k, sym_v     uint8  [L, T, C]   symbols, sym < nbins of the model used
  cum              uint32 [n_models, 257]  cumulative frequencies (cum[m][nbins..256] = M)
  model_index      uint16 [2, L, C]   row of `cum` used by (kv, layer, channel)
  G, B             channels_per_stream, tokens_per_stream (B >= 1, G >= 1)
Stream i = ((kv * L + layer) * n_groups + g) * n_blocks + b, n_groups = ceil(C / G),
n_blocks = ceil(T / B); inside a stream symbols are channel-major (for c in group: for t
in block). Stream lengths are in bytes (always even, >= 4).
"""
from __future__ import annotations

import sys

import numpy as np

from ..errors import CodecError
from ..scratch import np_empty
from .. import threads
from ..threads import run_kernel

__all__ = ["validate_cum_table", "encode_streams", "decode_streams", "decode_streams_into",
           "build_decode_tables", "max_symbols_of", "CPU_CODER"]

# The coder's constants, error codes and stream layout are specified once, in
# codec.entropy.rans_spec (docs/bitstream.md sections 2-4).
from .rans_spec import (ERR_MESSAGES, PROB_SCALE, bad_stream_lengths, stream_layout,  # noqa: E402
                        stream_symbol_counts)

if sys.byteorder != "little":  # pragma: no cover - the numba kernels write native u16
    raise ImportError("codec.entropy.rans_cpu assumes a little-endian host")

# The numba kernels live in codec.entropy.rans_kernels, the pure-Python reference in
# codec.entropy.rans_ref (modules stay under 600 lines).
from .rans_kernels import (LANES, compact_par, compact_ser, decode_par, decode_ser,  # noqa: E402
                           encode_par, encode_ser, lut_par, lut_ser)


# ---------------------------------------------------------------------------------------
# Layout helpers and validation
# ---------------------------------------------------------------------------------------
def validate_cum_table(cum: np.ndarray, nbins: np.ndarray | None = None) -> None:
    """Check a model table: uint32 [n_models, 257] with cum[:,0]=0, non-decreasing,
    cum[:,256]=M, and, when `nbins` (int [n_models]) is given, strictly increasing on
    [0, nbins] with cum[nbins:] == M. Raises CodecError otherwise."""
    if not isinstance(cum, np.ndarray) or cum.ndim != 2 or cum.shape[1] != 257 or cum.shape[0] < 1:
        raise CodecError(f"model table must be [n_models, 257], got {getattr(cum, 'shape', None)}")
    c = cum.astype(np.int64)
    if np.any(c[:, 0] != 0) or np.any(c[:, 256] != PROB_SCALE):
        raise CodecError("model table rows must start at 0 and end at 65536")
    d = np.diff(c, axis=1)
    if np.any(d < 0):
        raise CodecError("model table rows must be non-decreasing")
    if nbins is not None:
        nb = np.asarray(nbins, dtype=np.int64)
        if nb.shape != (c.shape[0],) or np.any(nb < 2) or np.any(nb > 256):
            raise CodecError("model nbins must be in [2, 256], one per model")
        j = np.arange(256)[None, :]
        inside = j < nb[:, None]
        if np.any(d[inside] < 1):
            raise CodecError("every symbol < nbins must have frequency >= 1")
        if np.any(d[~inside] != 0):
            raise CodecError("model table rows must be padded with 65536 past nbins")


# ---------------------------------------------------------------------------------------
# Python wrappers
# ---------------------------------------------------------------------------------------
LUT_PARALLEL_MODELS = 512  # models per chunk from which the decode tables use both cores


def _work_items(L: int, T: int, C: int, G: int, B: int) -> np.ndarray:
    """int64 [n_items, 2]: (first stream, lanes). Lanes are the streams of LANES
    consecutive FULL channel groups of one (kv, layer, token block) - stream ids
    i0, i0 + n_blocks, ...; everything else is a single-lane item."""
    n_groups, n_blocks, _ = stream_layout(L, T, C, G, B)
    n_full = C // G
    n_quads = n_full // LANES
    base = np.arange(2 * L, dtype=np.int64)[:, None] * (n_groups * n_blocks) + np.arange(n_blocks, dtype=np.int64)[None, :]
    base = base.reshape(-1)  # stream id of group 0 for each (kv, layer, block)
    quad_g = np.arange(n_quads, dtype=np.int64) * LANES
    single_g = np.arange(n_quads * LANES, n_groups, dtype=np.int64)
    quads = (base[:, None] + quad_g[None, :] * n_blocks).reshape(-1)
    singles = (base[:, None] + single_g[None, :] * n_blocks).reshape(-1)
    items = np_empty((quads.size + singles.size, 2), dtype=np.int64)
    items[: quads.size, 0] = quads
    items[: quads.size, 1] = LANES
    items[quads.size :, 0] = singles
    items[quads.size :, 1] = 1
    return items[np.argsort(items[:, 0], kind="stable")]


def _check_common(cum: np.ndarray, model_index: np.ndarray, L: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    cum = np.ascontiguousarray(cum, dtype=np.uint32)
    if cum.ndim != 2 or cum.shape[1] != 257 or cum.shape[0] < 1:
        raise CodecError(f"model table must be uint32 [n_models, 257], got {cum.shape}")
    mi = np.ascontiguousarray(model_index)
    if mi.shape != (2, L, C):
        raise CodecError(f"model index must be [2, {L}, {C}], got {mi.shape}")
    if mi.dtype.kind not in "ui":
        raise CodecError("model index must be an integer array")
    if mi.size and (int(mi.min()) < 0 or int(mi.max()) >= cum.shape[0]):
        raise CodecError("model index out of range of the model table")
    return cum, mi.astype(np.uint16, copy=False)


def encode_streams(
    sym_k: np.ndarray, sym_v: np.ndarray, cum: np.ndarray, model_index: np.ndarray, G: int, B: int,
    parallel: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Encode all streams of a chunk (docs/bitstream.md sections 2-3) with numba.

    Args:
      sym_k, sym_v: uint8 [L, T, C]; every symbol must have frequency >= 1 in its model.
      cum: uint32 [n_models, 257] (valid rows; see `validate_cum_table`).
      model_index: integer [2, L, C], values < n_models.
      G, B: channels_per_stream, tokens_per_stream (>= 1).
      parallel: force the parallel (True) or serial (False) kernel; None = by size.
    Returns: (payload uint8 [total_bytes], lengths int64 [n_streams] in bytes).
    Raises: ValueError on bad shapes or a zero-frequency symbol.
    Memory: one uint16 scratch of (total symbols + 2 * n_streams) words - the worst case
      (at most one renormalisation word per symbol plus the 2-word final state), so no
      stream can overflow its region - then a compaction pass into the output.
    """
    sym_k = np.ascontiguousarray(sym_k)
    sym_v = np.ascontiguousarray(sym_v)
    if sym_k.dtype != np.uint8 or sym_v.dtype != np.uint8:
        raise ValueError("symbols must be uint8")
    if sym_k.ndim != 3 or sym_k.shape != sym_v.shape:
        raise ValueError(f"sym_k and sym_v must both be [L, T, C], got {sym_k.shape} and {sym_v.shape}")
    L, T, C = sym_k.shape
    _, _, n_streams = stream_layout(L, T, C, G, B)
    try:
        cum, mi = _check_common(cum, model_index, L, C)
    except CodecError as e:
        raise ValueError(str(e)) from None
    cum64 = cum.astype(np.int64)
    freq = np.ascontiguousarray(cum64[:, 1:] - cum64[:, :-1])
    if np.any(freq < 0):
        raise ValueError("model table rows must be non-decreasing")
    counts = stream_symbol_counts(L, T, C, G, B)
    scr_off = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(counts + 2, out=scr_off[1:])
    scratch = np_empty(int(scr_off[-1]), dtype=np.uint16)
    nwords = np.zeros(n_streams, dtype=np.int64)
    err = np.zeros(n_streams, dtype=np.int64)
    items = _work_items(L, T, C, G, B)
    par = (2 * L * T * C >= threads.PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    # run_kernel: thread-safe parallel/serial dispatch (codec.threads)
    run_kernel(encode_par, encode_ser, par, sym_k, sym_v, freq, np.ascontiguousarray(cum64[:, :256]), mi, G, B, items, scratch, scr_off, nwords, err)
    if np.any(err):
        i = int(np.flatnonzero(err)[0])
        raise ValueError(f"stream {i}: {ERR_MESSAGES.get(int(err[i]), 'encode error')}")
    out_off = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(nwords, out=out_off[1:])
    out = np_empty(int(out_off[-1]), dtype=np.uint16)
    run_kernel(compact_par, compact_ser, par, scratch, scr_off, nwords, out_off, out)
    return out.view(np.uint8), nwords * 2




def build_decode_tables(cum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-model decode tables from a valid uint32 [n_models, 257] `cum`:
    packed int64 [n_models, 256] = freq | (cum << 16), and lut uint8 [n_models, 256]:
    lut[m][j] = the symbol s with cum[s] <= 256*j < cum[s+1] (first candidate for slots
    in [256*j, 256*j + 256); the decoder scans forward from it)."""
    c = np.ascontiguousarray(cum, dtype=np.int64)
    freq = c[:, 1:] - c[:, :-1]
    packed = freq | (c[:, :256] << 16)
    lut = np_empty((c.shape[0], 256), dtype=np.uint8)
    run_kernel(lut_par, lut_ser, c.shape[0] >= LUT_PARALLEL_MODELS, c, lut)
    return packed, lut


def decode_streams(
    payload, lengths, cum: np.ndarray, model_index: np.ndarray, L: int, T: int, C: int, G: int, B: int,
    parallel: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode all streams of a chunk with numba.

    Args:
      payload: bytes-like, the concatenated streams.
      lengths: integer [n_streams], bytes per stream (section-3 order).
      cum: uint32 [n_models, 257], VALID rows (call `validate_cum_table` first on
        untrusted tables); model_index [2, L, C]; L, T, C, G, B as in `encode_streams`.
      parallel: force the parallel (True) or serial (False) kernel; None = by size.
    Returns: (sym_k, sym_v), uint8 [L, T, C] each.
    Raises: CodecError on any inconsistency (lengths not adding up to the payload, odd or
      too-short or too-long streams, truncated/corrupt streams).
    """
    out_k = np_empty((L, T, C), dtype=np.uint8) if _dims_ok(L, T, C) else None
    out_v = np_empty((L, T, C), dtype=np.uint8) if out_k is not None else None
    ident = np.ascontiguousarray(np.broadcast_to(np.arange(256, dtype=np.uint8), (max(int(L), 1) if out_k is not None else 1, 1, 256)))
    decode_streams_into(payload, lengths, cum, model_index, L, T, C, G, B, out_k, out_v,
                        ident, ident, 0, C, 0, parallel=parallel)
    return out_k, out_v


def _dims_ok(L, T, C) -> bool:
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in (L, T, C))


def max_symbols_of(cum: np.ndarray) -> np.ndarray:
    """int64 [n_models]: the largest symbol a valid model row can decode to (the last s
    with cum[s + 1] > cum[s])."""
    c = np.asarray(cum, dtype=np.int64)
    pos = np.diff(c, axis=1) > 0                                  # [n_models, 256]
    return 255 - np.argmax(pos[:, ::-1], axis=1)


def decode_streams_into(
    payload, lengths, cum: np.ndarray, model_index: np.ndarray, L: int, T: int, C: int, G: int, B: int,
    out_k: np.ndarray, out_v: np.ndarray, deq_k: np.ndarray, deq_v: np.ndarray,
    t_stride: int, hd: int, t_off: int = 0, parallel: bool | None = None,
) -> None:
    """Fused rANS decode + table dequantization of all streams of a chunk (numba, one
    pass, both cores): symbol s of (kv, layer, t, c) is written as
    ``out[layer, t_off + t, c] = deq[layer, t * t_stride + c // hd, s]``.

    Used by the cachegen decoder with ``deq`` = the dequantized values of every symbol for
    each scale row, already rounded to the model dtype and given as its bit pattern
    (uint16 for bf16/fp16, uint32 for fp32; computed by the reference torch arithmetic, so
    the result is bit-identical to decode -> dequantize -> cast), and ``out`` = a view of
    the destination tensor [L, T_out, C] (C = H * D). No full-size intermediate is made.

    Args:
      payload, lengths, cum, model_index, L, T, C, G, B: as `decode_streams`.
      out_k, out_v: C-contiguous writable arrays [L, T_out, C] of one dtype,
        T_out >= t_off + T (tokens [t_off, t_off + T) are written, the rest untouched).
      deq_k, deq_v: C-contiguous arrays [L, R, NS] of out's dtype; R > (T - 1) * t_stride
        + (C - 1) // hd; NS > the largest symbol any model used by that kv can decode.
      t_stride: table rows per token (0 = one row set for the whole chunk).
      hd: channels per scale row (head_dim for per-head scales, C for one row).
      t_off: first destination token.
    Raises: CodecError on corrupt input (as `decode_streams`, and a model whose alphabet
      exceeds the table); ValueError on inconsistent destination/table arguments.
    """
    try:
        n_groups, n_blocks, n_streams = stream_layout(L, T, C, G, B)
    except ValueError as e:
        raise CodecError(str(e)) from None
    L, T, C = int(L), int(T), int(C)
    cum, mi = _check_common(cum, model_index, L, C)
    for name, o in (("out_k", out_k), ("out_v", out_v)):
        if (not isinstance(o, np.ndarray) or o.ndim != 3 or o.shape[0] != L or o.shape[2] != C
                or not o.flags.c_contiguous or not o.flags.writeable):
            raise ValueError(f"{name} must be a writable C-contiguous array [{L}, T_out, {C}]")
    if out_k.dtype != out_v.dtype or out_k.shape != out_v.shape:
        raise ValueError("out_k and out_v must have one dtype and shape")
    t_stride, hd, t_off = int(t_stride), int(hd), int(t_off)
    if t_stride < 0 or hd < 1 or t_off < 0 or t_off + T > out_k.shape[1]:
        raise ValueError(f"bad t_stride={t_stride} / hd={hd} / t_off={t_off} for {out_k.shape[1]} tokens")
    msym = max_symbols_of(cum)
    for kv, (name, d) in enumerate((("deq_k", deq_k), ("deq_v", deq_v))):
        if (not isinstance(d, np.ndarray) or d.ndim != 3 or d.shape[0] != L or d.dtype != out_k.dtype
                or not d.flags.c_contiguous):
            raise ValueError(f"{name} must be a C-contiguous array [{L}, R, NS] of {out_k.dtype}")
        if d.shape[1] <= (T - 1) * t_stride + (C - 1) // hd:
            raise ValueError(f"{name} has {d.shape[1]} rows, the layout needs {(T - 1) * t_stride + (C - 1) // hd + 1}")
        if int(msym[mi[kv]].max()) >= d.shape[2]:
            raise CodecError(f"a model decodes symbol {int(msym[mi[kv]].max())} but {name} has {d.shape[2]}")
    lengths = np.asarray(lengths)
    if lengths.shape != (n_streams,) or lengths.dtype.kind not in "ui":
        raise CodecError(f"stream lengths must be an integer array of {n_streams} entries")
    lens = lengths.astype(np.int64)
    counts = stream_symbol_counts(L, T, C, G, B)
    badmask = bad_stream_lengths(lens, counts)
    if np.any(badmask):
        bad = int(np.flatnonzero(badmask)[0])
        raise CodecError(f"stream {bad}: invalid length {int(lens[bad])} bytes for {int(counts[bad])} symbols")
    try:
        buf = np.frombuffer(payload, dtype=np.uint8)
    except (TypeError, ValueError):
        raise CodecError("payload must be a bytes-like object") from None
    if int(lens.sum()) != buf.size:
        raise CodecError(f"stream lengths add up to {int(lens.sum())} bytes but the payload has {buf.size}")
    # zero padding so that unchecked reads stay inside the buffer: a stream starting at
    # word w reads indices < w + 2 + n_symbols <= len + max(n_symbols) + 2
    pad = int(counts.max()) + 4
    words = np.zeros(buf.size // 2 + pad, dtype=np.uint16)
    if buf.size:
        words[: buf.size // 2] = buf.view(np.uint16)
    w_off = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(lens // 2, out=w_off[1:])
    packed, lut = build_decode_tables(cum)
    err = np.zeros(n_streams, dtype=np.int64)
    items = _work_items(L, T, C, G, B)
    par = (2 * L * T * C >= threads.PARALLEL_MIN_SYMBOLS) if parallel is None else parallel
    # run_kernel: thread-safe parallel/serial dispatch (codec.threads)
    counter = np.zeros(1, dtype=np.int64)   # next work item (dynamic scheduling, `_decode_impl`)
    workers = threads.num_workers() if par else 1
    # the native C kernel (codec.entropy.rans_native: default with AVX2) when built; the numba kernel
    # otherwise (imported here so that `python -m codec.entropy.rans_native` runs it fresh)
    from . import rans_native

    if not rans_native.decode_into(words, w_off, packed, cum, lut, mi, items, L, T, C, G, B, out_k,
                                   out_v, deq_k, deq_v, t_stride, hd, t_off, err, workers):
        run_kernel(decode_par, decode_ser, par, words, w_off, packed, cum.astype(np.int64), lut, mi, G, B, T,
                   items, out_k, out_v, deq_k, deq_v, t_stride, hd, t_off, err, counter, workers)
    if np.any(err):
        i = int(np.flatnonzero(err)[0])
        raise CodecError(f"stream {i} of {n_streams}: {ERR_MESSAGES.get(int(err[i]), 'decode error')}")


class _CpuCoder:
    """The numba coder backend of ``codec.entropy`` (``entropy.CoderBackend``): numpy
    uint8 arrays in, host arrays out."""

    name = "cpu"

    @staticmethod
    def check_symbols(sym_k, sym_v):
        sym_k = np.asarray(sym_k)
        sym_v = np.asarray(sym_v)
        if sym_k.dtype != np.uint8 or sym_v.dtype != np.uint8:
            raise ValueError(f"symbols must be uint8, got {sym_k.dtype} and {sym_v.dtype}")
        if sym_k.ndim != 3 or sym_k.shape != sym_v.shape:
            raise ValueError(f"sym_k and sym_v must both be [L, T, C], got {sym_k.shape} and {sym_v.shape}")
        return sym_k, sym_v

    @staticmethod
    def histograms(sym):
        from .models import histograms

        return histograms(sym)

    @staticmethod
    def encode_streams(sym_k, sym_v, cum, model_index, G, B):
        return encode_streams(sym_k, sym_v, cum, model_index, G, B)

    @staticmethod
    def decode_streams(payload, lengths, cum, model_index, L, T, C, G, B, **kw):
        return decode_streams(payload, lengths, cum, model_index, L, T, C, G, B, **kw)


CPU_CODER = _CpuCoder()
