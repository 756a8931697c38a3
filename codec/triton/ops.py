"""Triton GPU kernels of the CacheGen codec, bit-exact with the CPU backend.

Purpose: the GPU half of "written twice" (DEVELOPERS.md): quantization/dequantization
with the layer-wise bins (CacheGen, Liu et al., SIGCOMM 2024, section 5.2; arithmetic of
codec/quant/reference.py), per-(layer, channel) histograms (the statistics behind the 16-bit
CDFs of section 5.2), and the 32-bit-state / 16-bit-word rANS coder of
docs/bitstream.md sections 2-3 (J. Duda, "Asymmetric numeral systems", 2013), one SIMD
lane per independent stream. Every kernel produces exactly the bytes / symbols of the
CPU backend (codec/entropy/rans_cpu.py, codec/quant/reference.py, codec/entropy/models.py) for the same
input, so a KV encoded on a GPU decodes on a CPU and the reverse. See docs/gpu.md.

Design (docs/gpu.md has the long version):
- rANS, one lane per stream: a program owns BLOCK consecutive channel groups of one
  (kv, layer, token block); lane j walks its stream's symbols (channel-major, as in
  section 3) with per-lane gathers of symbols and cum rows and per-lane word pointers.
  With G = 1 adjacent lanes touch adjacent channels, so symbol loads/stores coalesce.
- Encoding is two-pass, so no output buffer can overflow: pass 1 runs the exact coder
  arithmetic without writing and returns each stream's word count; torch.cumsum gives
  exact offsets and the payload is allocated to the exact size; pass 2 re-runs the coder
  and writes each stream's words into its own slot from the slot's end backwards
  (rANS pushes words in reverse), and checks it ends exactly at the slot's start.
- Decoding reads each stream from the prefix sum of the stored lengths (validated on the
  host first: even, >= 4, <= 4 + 2 * symbols, summing to the payload size), never reads
  outside its own slot, and writes a per-stream error code (the codes of
  codec/entropy/rans_cpu.py: truncated, final state != L, leftover bytes); the wrapper turns any
  non-zero code into CodecError. Symbol lookup (`lookup=`): "search", a branch-free
  binary search over the model's cum row, ceil(log2(nbins)) gathers (<= 8 for 256
  bins), or "scan", the row held in registers and NB compare/selects per symbol;
  "auto" scans alphabets <= 32 symbols. One launch per alphabet-size class of layers.
- Models (the codebook clustering of codec/entropy/models.py) are built on the HOST from the
  GPU-computed histograms: that step is tiny (models x bins counts) and running the very
  same numpy code guarantees identical models, hence identical bytes.
- Quantization: scales (max |x|, log8 rounding) and `inv = M / s`, `step = s / M` are
  computed with the same torch expressions as codec/quant/reference.py on the tensor's device
  (they are 1/D of the data); the elementwise part runs in Triton. Rounding is
  round-half-to-even implemented with floor/compare (exact, no libdevice, so it also runs
  in the interpreter), and fp fusion is disabled so x * inv is rounded before rint.

Integer arithmetic: states are tl.uint32; `x // f`, `x % f` are unsigned 32-bit; the
decoder's `f * (x >> 16) + slot - c` is < 2^32 for valid tables. Offsets are int64.

Public API (mirrors the CPU functions):
  available() -> bool; resolve_backend(device, backend="auto") -> "cpu" | "triton"
  quantize_triton(x, scale, max_level) / dequantize_triton(sym, scale, max_level, out_dtype)
  histogram_triton(sym) -> int64 [L, C, 256]
  rans_encode_triton(sym_k, sym_v, cum, model_index, G, B) -> (payload uint8, lengths int64)
  rans_decode_triton(payload, lengths, cum, model_index, L, T, C, G, B) -> (sym_k, sym_v)
  compile_for_target(arch=90) -> {variant: PTX}: AOT compile check, no GPU needed
  encode_symbols_triton / decode_symbols_triton: codec.entropy's API on the GPU path.
Layout: the kernel sources, their compilation and the availability checks are in
codec/triton/kernels.py (import `available`, `resolve_backend`, `interpreting` and
`compile_for_target` from there); the Python wrappers that launch them are here.
Torch/numpy references: codec.quant.reference.quantize/dequantize, histogram_ref (torch
bincount), codec.entropy.rans_ref.encode_streams_ref / decode_streams_ref.

Run the tests (CPU, interpreter):
  TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/codec/test_codec_triton.py -q
Run the benchmark (GPU):  python -m bench.triton --device cuda
Whole GPU check (correctness + speed table):  bash scripts/gpu_check.sh
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .. import scratch
from ..errors import CodecError

__all__ = [
    "quantize_triton",
    "dequantize_triton",
    "histogram_triton",
    "histogram_ref",
    "rans_encode_triton",
    "rans_decode_triton",
    "encode_symbols_triton",
    "decode_symbols_triton",
    "TRITON_CODER",
]

# The coder's constants, error codes and stream layout: codec.entropy.rans_spec (specified once,
# shared with the numba backend codec.entropy.rans_cpu; docs/bitstream.md sections 2-4).
from ..entropy.rans_spec import (ERR_MESSAGES as _ERR_MESSAGES, PROB_SCALE,  # noqa: E402
                                 bad_stream_lengths, stream_layout)

# The kernels, their JIT / AOT compilation, the launch helpers, the import guard and the
# checks of where Triton can run (``available``, ``resolve_backend``) live in
# codec.triton.kernels (modules stay under 600 lines).
from .kernels import (RANS_BLOCK_GPU, RANS_BLOCK_INTERP, interpreting, kernel,  # noqa: E402
                      launch_opts, on_device, require_device, triton)


# ---------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------
def _scale_indexing(x_shape: torch.Size, s: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """Express `s` (broadcastable to x_shape, layer dim first) as a [L, S] table indexed
    by (n // DIV) % MOD over the flattened per-layer index n. Returns (table, S, DIV, MOD).
    Falls back to a materialised expand when the broadcast dims are not one run."""
    L = x_shape[0]
    rest = list(x_shape[1:])
    if s.dim() > len(x_shape):
        raise ValueError(f"scale has more dims ({s.dim()}) than x ({len(x_shape)})")
    s = s.reshape((1,) * (len(x_shape) - s.dim()) + tuple(s.shape))
    for d, (a, b) in enumerate(zip(s.shape, x_shape)):
        if a not in (1, b):
            raise ValueError(f"scale shape {tuple(s.shape)} does not broadcast to x {tuple(x_shape)}")
    s = s.expand((L,) + tuple(s.shape[1:]))
    full = [i for i, (a, b) in enumerate(zip(s.shape[1:], rest)) if a == b and b != 1]
    if not full:
        return s.reshape(L, -1)[:, :1].contiguous(), 1, 1, 1
    lo, hi = full[0], full[-1]
    if all(s.shape[1 + i] == rest[i] for i in range(lo, hi + 1)):
        mod = int(np.prod(rest[lo:hi + 1]))
        div = int(np.prod(rest[hi + 1:])) if hi + 1 < len(rest) else 1
        table = s.reshape(L, *s.shape[1:]).contiguous().reshape(L, -1)
        return table, mod, div, mod
    table = s.expand(x_shape).contiguous().reshape(L, -1)   # rare: non-contiguous broadcast
    n = table.shape[1]
    return table, n, 1, n


def quantize_triton(x: torch.Tensor, scale: torch.Tensor, max_level: torch.Tensor) -> torch.Tensor:
    """Triton twin of `codec.quant.reference.quantize`: the same uint8 symbols, bit for bit.

    Args:
      x: [L, ...] float16/bfloat16/float32, on CUDA (or CPU under TRITON_INTERPRET=1).
      scale: float32 (or any float), broadcastable to x with the layer dim first (e.g.
        [L, T, G, 1] for x [L, T, G, D], [L, 1, C] for per-channel key scales).
      max_level: float32 [L], M = bins // 2 - 1 per layer.
    Returns: uint8 [x.shape], symbols in [0, 2M].
    Raises: ValueError on shape/dtype/device mismatch.
    Arithmetic: inv = M / s (s > 0, else 0) computed by torch exactly as the reference;
      the kernel computes clamp(rint(float32(x) * inv), -M, M) + M with round half to even.
    """
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16/bfloat16/float32, got {x.dtype}")
    if x.dim() < 2 or x.shape[0] != max_level.shape[0]:
        raise ValueError(f"x [L, ...] with L = len(max_level) required, got {tuple(x.shape)} "
                         f"and {tuple(max_level.shape)}")
    scale = scale.to(device=x.device)
    dev = require_device(x, scale)
    L = x.shape[0]
    m = max_level.to(device=dev, dtype=torch.float32).contiguous()
    mb = m.reshape((-1,) + (1,) * (x.dim() - 1))              # [L, 1, ..., 1]
    s32 = scale.to(torch.float32)
    # the exact expression of codec.quant.reference.quantize (broadcasts like it)
    inv = torch.where(s32 > 0, mb / torch.where(s32 > 0, s32, torch.ones_like(s32)),
                      torch.zeros_like(s32))
    table, S, DIV, MOD = _scale_indexing(x.shape, inv)
    xf = x.contiguous().reshape(L, -1)
    N = xf.shape[1]
    if N >= 2**31 - 1024:
        raise ValueError(f"{N} elements per layer: at most 2^31 - 1024 supported")
    out = scratch.empty((L, N), dtype=torch.uint8, device=dev)
    if N:
        BLOCK = 1024
        opts = launch_opts(4)
        with on_device(dev):
            kernel("_quantize_kernel")[(triton.cdiv(N, BLOCK), L)](
                xf, table.to(torch.float32).contiguous(), m, out, N, S, DIV, MOD, BLOCK=BLOCK,
                **opts)
    return out.reshape(x.shape)


def dequantize_triton(sym: torch.Tensor, scale: torch.Tensor, max_level: torch.Tensor,
                      out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton twin of `codec.quant.reference.dequantize`: float32 (sym - M) * (scale / M), then
    cast (round to nearest even) to `out_dtype` (float32/float16/bfloat16).

    Args: sym uint8 [L, ...]; scale float broadcastable to sym (layer first); max_level
      float32 [L]. Returns: out_dtype [sym.shape]. Raises ValueError on bad input.
    """
    if sym.dtype != torch.uint8:
        raise ValueError(f"sym must be uint8, got {sym.dtype}")
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be float16/bfloat16/float32, got {out_dtype}")
    if sym.dim() < 2 or sym.shape[0] != max_level.shape[0]:
        raise ValueError("sym [L, ...] with L = len(max_level) required")
    scale = scale.to(device=sym.device)
    dev = require_device(sym, scale)
    L = sym.shape[0]
    m = max_level.to(device=dev, dtype=torch.float32).contiguous()
    step = scale.to(torch.float32) / m.reshape((-1,) + (1,) * (sym.dim() - 1))  # reference
    table, S, DIV, MOD = _scale_indexing(sym.shape, step)
    sf = sym.contiguous().reshape(L, -1)
    N = sf.shape[1]
    if N >= 2**31 - 1024:
        raise ValueError(f"{N} elements per layer: at most 2^31 - 1024 supported")
    out = scratch.empty((L, N), dtype=out_dtype, device=dev)
    if N:
        BLOCK = 1024
        opts = launch_opts(4)
        bf16 = out_dtype == torch.bfloat16
        with on_device(dev):
            kernel("_dequantize_kernel")[(triton.cdiv(N, BLOCK), L)](
                sf, table.contiguous(), m, out.view(torch.int16) if bf16 else out, N, S, DIV,
                MOD, OUT_BF16=bf16, BLOCK=BLOCK, **opts)
    return out.reshape(sym.shape)


# ---------------------------------------------------------------------------------------
# Histograms
# ---------------------------------------------------------------------------------------
def histogram_ref(sym: torch.Tensor) -> torch.Tensor:
    """Torch reference: per-(layer, channel) counts, int64 [L, C, 256] for uint8 [L, T, C]."""
    L, T, C = sym.shape
    idx = (torch.arange(L, device=sym.device)[:, None, None] * C
           + torch.arange(C, device=sym.device)[None, None, :]) * 256 + sym.to(torch.int64)
    return torch.bincount(idx.reshape(-1), minlength=L * C * 256).reshape(L, C, 256)


def histogram_triton(sym: torch.Tensor, nbins_max: int = 256) -> torch.Tensor:
    """Per-(layer, channel) symbol counts over tokens (twin of codec.entropy.models.histograms).

    Args: sym uint8 [L, T, C] (CUDA, or CPU under the interpreter); nbins_max: an upper
      bound on the symbols + 1 (smaller = smaller register histograms); symbols >= it
      raise ValueError.
    Returns: int64 [L, C, 256] on sym's device (zeros past nbins_max).
    """
    if sym.dtype != torch.uint8 or sym.dim() != 3:
        raise ValueError(f"sym must be uint8 [L, T, C], got {sym.dtype} {tuple(sym.shape)}")
    if not (1 <= nbins_max <= 256):
        raise ValueError("nbins_max must be in [1, 256]")
    dev = require_device(sym)
    L, T, C = sym.shape
    NB = 1 << max(0, (nbins_max - 1).bit_length())
    if nbins_max < 256 and sym.numel() and int(sym.max()) >= nbins_max:
        raise ValueError(f"symbol {int(sym.max())} >= nbins_max={nbins_max}")
    BC = max(1, 1024 // NB)                      # BC * NB = 1024 register bins
    BC = min(BC, 1 << max(0, (C - 1).bit_length()))
    BT = 64 if interpreting() else max(16, 4096 // BC)
    counts = torch.zeros((L, C, NB), dtype=torch.int32, device=dev)
    if sym.numel():
        with on_device(dev):
            kernel("_histogram_kernel")[(triton.cdiv(C, BC), L)](
                sym.contiguous(), counts, T, C, BT=BT, BC=BC, NB=NB, **launch_opts(4))
    out = torch.zeros((L, C, 256), dtype=torch.int64, device=dev)
    out[:, :, :NB] = counts
    return out


# ---------------------------------------------------------------------------------------
# rANS
# ---------------------------------------------------------------------------------------
def _layout(L: int, T: int, C: int, G: int, B: int) -> tuple[int, int, int]:
    return stream_layout(L, T, C, G, B)


def _symbol_counts(L, T, C, G, B, device) -> torch.Tensor:
    """int64 [n_streams]: symbols per stream (section 3 order)."""
    n_groups, n_blocks, _ = _layout(L, T, C, G, B)
    ch = torch.full((n_groups,), G, dtype=torch.int64, device=device)
    ch[-1] = C - G * (n_groups - 1)
    tk = torch.full((n_blocks,), B, dtype=torch.int64, device=device)
    tk[-1] = T - B * (n_blocks - 1)
    return torch.outer(ch, tk).reshape(-1).repeat(2 * L)


def _as_tensor(a, device, dtype=None) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        t = a
    else:
        arr = np.ascontiguousarray(a)
        if arr.dtype.kind == "u":            # torch's unsigned dtypes are thin on CUDA
            arr = arr.astype(np.int64)
        t = torch.from_numpy(arr)
    return t.to(device=device, dtype=dtype if dtype is not None else t.dtype).contiguous()


def _tables(cum, model_index, L: int, C: int, device, exc=ValueError):
    """cum -> int32 [n_models, 257], model_index -> int32 [2, L, C], validated
    (shapes, index range; rows: cum[0] = 0, non-decreasing, cum[256] = M)."""
    if isinstance(cum, np.ndarray) and cum.dtype.kind not in "ui":
        raise exc("model table must be an integer array")
    cum_t = _as_tensor(cum, device)
    if cum_t.dim() != 2 or cum_t.shape[1] != 257 or cum_t.shape[0] < 1:
        raise exc(f"model table must be [n_models, 257], got {tuple(cum_t.shape)}")
    if cum_t.dtype.is_floating_point or cum_t.dtype == torch.bool:
        raise exc("model table must be an integer array")
    c64 = cum_t.to(torch.int64)
    if bool((c64[:, 0] != 0).any()) or bool((c64[:, 256] != PROB_SCALE).any()) \
            or bool((c64[:, 1:] < c64[:, :-1]).any()):
        raise exc("model table rows must start at 0, be non-decreasing and end at 65536")
    mi = _as_tensor(model_index, device)
    if tuple(mi.shape) != (2, L, C):
        raise exc(f"model index must be [2, {L}, {C}], got {tuple(mi.shape)}")
    if mi.dtype.is_floating_point or mi.dtype == torch.bool:
        raise exc("model index must be an integer array")
    mi64 = mi.to(torch.int64)
    if mi64.numel() and (int(mi64.min()) < 0 or int(mi64.max()) >= cum_t.shape[0]):
        raise exc("model index out of range of the model table")
    return c64.to(torch.int32).contiguous(), mi64.to(torch.int32).contiguous()


def _grid(n_groups: int, n_blocks: int, L: int, block: int):
    return (triton.cdiv(n_groups, block), n_blocks, 2 * L)


def _rans_block(block: int | None) -> tuple[int, dict]:
    if block is None:
        block = RANS_BLOCK_INTERP if interpreting() else RANS_BLOCK_GPU
    if block < 1 or block & (block - 1):
        raise ValueError("block must be a power of two")
    return block, launch_opts(max(1, min(8, block // 32)) if not interpreting() else 1)


def rans_encode_triton(sym_k: torch.Tensor, sym_v: torch.Tensor, cum, model_index,
                       G: int, B: int, block: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode all streams of a chunk (docs/bitstream.md sections 2-3) on the GPU; twin of
    `codec.entropy.rans_cpu.encode_streams` (identical bytes).

    Args:
      sym_k, sym_v: uint8 [L, T, C] on CUDA (CPU under TRITON_INTERPRET=1).
      cum: [n_models, 257] integer cumulative frequencies (numpy or tensor), valid rows.
      model_index: integer [2, L, C], values < n_models.
      G, B: channels_per_stream, tokens_per_stream (>= 1).
      block: lanes (streams) per program (power of two; default per backend).
    Returns: (payload uint8 [total_bytes], lengths int64 [n_streams] in bytes), on the
      symbols' device.
    Raises: ValueError on bad shapes/tables or a symbol with zero frequency.
    Memory: exactly the payload (two-pass: count, exclusive prefix sum, write), so no
      stream can overflow its slot.
    """
    if not (isinstance(sym_k, torch.Tensor) and isinstance(sym_v, torch.Tensor)):
        raise ValueError("sym_k and sym_v must be torch tensors")
    if sym_k.dtype != torch.uint8 or sym_v.dtype != torch.uint8:
        raise ValueError("symbols must be uint8")
    if sym_k.dim() != 3 or sym_k.shape != sym_v.shape:
        raise ValueError(f"sym_k and sym_v must both be [L, T, C], got {tuple(sym_k.shape)} "
                         f"and {tuple(sym_v.shape)}")
    dev = require_device(sym_k, sym_v)
    L, T, C = sym_k.shape
    n_groups, n_blocks, n_streams = _layout(L, T, C, G, B)
    cum_t, mi = _tables(cum, model_index, L, C, dev)
    sk, sv = sym_k.contiguous(), sym_v.contiguous()
    block, opts = _rans_block(block)
    grid = _grid(n_groups, n_blocks, L, block)
    nwords = torch.zeros(n_streams, dtype=torch.int32, device=dev)
    err = torch.zeros(n_streams, dtype=torch.int32, device=dev)
    kern = kernel("_rans_encode_kernel")
    with on_device(dev):
        kern[grid](sk, sv, mi, cum_t, nwords, nwords, nwords, err, L, T, C, G, B,
                   n_groups, n_blocks, WRITE=False, BLOCK=block, **opts)
    if bool((err != 0).any()):
        i = int(torch.nonzero(err)[0, 0])
        raise ValueError(f"stream {i}: {_ERR_MESSAGES.get(int(err[i]), 'encode error')}")
    woff = torch.zeros(n_streams + 1, dtype=torch.int64, device=dev)
    torch.cumsum(nwords.to(torch.int64), 0, out=woff[1:])
    total = int(woff[-1])
    words = scratch.empty(total, dtype=torch.int16, device=dev)
    with on_device(dev):
        kern[grid](sk, sv, mi, cum_t, woff, words, nwords, err, L, T, C, G, B,
                   n_groups, n_blocks, WRITE=True, BLOCK=block, **opts)
    if bool((err != 0).any()):  # pragma: no cover - would be a kernel bug
        i = int(torch.nonzero(err)[0, 0])
        raise AssertionError(f"stream {i}: {_ERR_MESSAGES.get(int(err[i]), 'encode error')}")
    return words.view(torch.uint8), nwords.to(torch.int64) * 2


_SCAN_BROKEN = False


def _scan_failed(e: Exception) -> None:
    """The register-scan decoder did not compile here: warn once, use the search."""
    global _SCAN_BROKEN
    if not _SCAN_BROKEN:
        import warnings
        warnings.warn(f"Triton rANS decoder: lookup='scan' unavailable ({type(e).__name__}: "
                      f"{str(e)[:200]}); falling back to lookup='search'", RuntimeWarning)
    _SCAN_BROKEN = True


def _steps_per_kvl(cum_t: torch.Tensor, mi: torch.Tensor) -> list[int]:
    """For each (kv, layer): ceil(log2(max nbins of the models it uses)), nbins of a
    model = 1 + #{s >= 1: cum[s] < M} (rows are validated non-decreasing)."""
    nb = (cum_t[:, 1:] < PROB_SCALE).sum(dim=1) + 1                 # [n_models]
    per = nb[mi.reshape(mi.shape[0] * mi.shape[1], -1).long()].amax(dim=1)   # [2L]
    return [max(1, (max(2, int(v)) - 1).bit_length()) for v in per.cpu().tolist()]


def rans_decode_triton(payload, lengths, cum, model_index, L: int, T: int, C: int,
                       G: int, B: int, block: int | None = None, device=None,
                       lookup: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Decode all streams of a chunk on the GPU; twin of `codec.entropy.rans_cpu.decode_streams`.

    Args:
      payload: the concatenated streams: uint8 tensor, numpy array or bytes-like.
      lengths: integer [n_streams], bytes per stream (section-3 order).
      cum: [n_models, 257] valid rows (`codec.entropy.rans_cpu.validate_cum_table` for untrusted
        tables; rows are also checked here for monotonicity); model_index [2, L, C].
      L, T, C, G, B: chunk shape and stream layout.
      device: where to decode (default: payload's device if a tensor, else "cuda", or
        "cpu" under TRITON_INTERPRET=1).
      block: lanes (streams) per program (power of two; default per backend).
      lookup: symbol lookup strategy, "search" (binary search over the cum row in memory,
        any nbins), "scan" (row held in registers, compare/select over it; used for
        alphabets <= 64 symbols, "search" above) or "auto" (scan up to 32 symbols, the
        CacheGen schedules' 31 and 15). Same output; a speed choice for the GPU, not yet
        measured on one (docs/gpu.md).
    Returns: (sym_k, sym_v) uint8 [L, T, C] each, on that device.
    Raises: CodecError on any inconsistency (bad layout, lengths not adding up to the
      payload, odd / too short / too long streams, truncated or corrupt streams).
    """
    try:
        n_groups, n_blocks, n_streams = _layout(L, T, C, G, B)
    except ValueError as e:
        raise CodecError(str(e)) from None
    if device is None:
        device = payload.device if isinstance(payload, torch.Tensor) else (
            "cpu" if interpreting() else "cuda")
    device = torch.device(device)
    if isinstance(payload, torch.Tensor):
        buf = payload.reshape(-1)
        if buf.dtype != torch.uint8:
            raise CodecError("payload tensor must be uint8")
        buf = buf.to(device)
    else:
        arr = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) \
            else payload.reshape(-1).view(np.uint8)
        buf = torch.from_numpy(arr.copy()).to(device)
    dev = require_device(buf)
    cum_t, mi = _tables(cum, model_index, L, C, dev, exc=CodecError)
    lens = _as_tensor(lengths, dev)
    if tuple(lens.shape) != (n_streams,) or lens.dtype.is_floating_point or lens.dtype == torch.bool:
        raise CodecError(f"stream lengths must be an integer array of {n_streams} entries")
    lens = lens.to(torch.int64)
    counts = _symbol_counts(L, T, C, G, B, dev)
    badlen = bad_stream_lengths(lens, counts)
    if bool(badlen.any()):
        i = int(torch.nonzero(badlen)[0, 0])
        raise CodecError(f"stream {i}: invalid length {int(lens[i])} bytes for "
                         f"{int(counts[i])} symbols")
    if int(lens.sum()) != buf.numel():
        raise CodecError(f"stream lengths add up to {int(lens.sum())} bytes but the payload "
                         f"has {buf.numel()}")
    if buf.storage_offset() % 2:             # an odd-offset slice: int16 view needs alignment
        buf = buf.clone()
    words = buf.view(torch.int16)
    woff = torch.zeros(n_streams + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lens // 2, 0, out=woff[1:])
    out_k = scratch.empty((L, T, C), dtype=torch.uint8, device=dev)
    out_v = scratch.empty((L, T, C), dtype=torch.uint8, device=dev)
    err = torch.zeros(n_streams, dtype=torch.int32, device=dev)
    block, opts = _rans_block(block)
    if lookup not in ("auto", "search", "scan"):
        raise ValueError(f"lookup must be 'auto', 'search' or 'scan', got {lookup!r}")
    scan_max = {"auto": 5, "scan": 6, "search": 0}[lookup]
    steps = _steps_per_kvl(cum_t, mi)
    kern = kernel("_rans_decode_kernel")
    for st in sorted(set(steps)):               # one launch per alphabet size class
        kvls = torch.tensor([i for i, v in enumerate(steps) if v == st], dtype=torch.int32,
                            device=dev)
        grid = (triton.cdiv(n_groups, block), n_blocks, kvls.numel())
        args = (words, woff, mi, cum_t, out_k, out_v, err, kvls, L, T, C, G, B, n_groups,
                n_blocks)
        with on_device(dev):
            if st <= scan_max and not _SCAN_BROKEN:
                try:
                    kern[grid](*args, SEARCH_STEPS=st, BLOCK=block, SCAN=True, **opts)
                    continue
                except Exception as e:  # e.g. a Triton without tuples in kernels
                    if interpreting():  # tests must exercise the scan, not the fallback
                        raise
                    _scan_failed(e)     # compile errors happen before anything runs
            kern[grid](*args, SEARCH_STEPS=st, BLOCK=block, SCAN=False, **opts)
    if bool((err != 0).any()):
        i = int(torch.nonzero(err)[0, 0])
        raise CodecError(f"stream {i} of {n_streams}: "
                         f"{_ERR_MESSAGES.get(int(err[i]), 'decode error')}")
    return out_k, out_v


# ---------------------------------------------------------------------------------------
# codec.entropy's API on the GPU path (same header, arrays and payload bytes)
# ---------------------------------------------------------------------------------------
class _TritonCoder:
    """The Triton coder backend of ``codec.entropy`` (``entropy.CoderBackend``): uint8
    torch tensors [L, T, C] on CUDA (CPU under TRITON_INTERPRET=1); histograms and rANS
    in Triton, results the entropy stage needs on the host copied back."""

    name = "triton"

    @staticmethod
    def check_symbols(sym_k, sym_v):
        if not (isinstance(sym_k, torch.Tensor) and isinstance(sym_v, torch.Tensor)):
            raise ValueError("sym_k and sym_v must be torch tensors (use codec.entropy for numpy)")
        if sym_k.dtype != torch.uint8 or sym_v.dtype != torch.uint8:
            raise ValueError(f"symbols must be uint8, got {sym_k.dtype} and {sym_v.dtype}")
        if sym_k.dim() != 3 or sym_k.shape != sym_v.shape:
            raise ValueError(f"sym_k and sym_v must both be [L, T, C], got {tuple(sym_k.shape)} "
                             f"and {tuple(sym_v.shape)}")
        return sym_k, sym_v

    @staticmethod
    def histograms(sym):
        return histogram_triton(sym).cpu().numpy()

    @staticmethod
    def encode_streams(sym_k, sym_v, cum, model_index, G, B):
        payload, lengths = rans_encode_triton(sym_k, sym_v, cum, model_index, G, B)
        return payload.cpu().numpy(), lengths.cpu().numpy()

    @staticmethod
    def decode_streams(payload, lengths, cum, model_index, L, T, C, G, B, device=None,
                       lookup="auto"):
        if device is None and not isinstance(payload, torch.Tensor):
            device = "cpu" if interpreting() else "cuda"
        return rans_decode_triton(payload, np.asarray(lengths).astype(np.int64), cum,
                                  model_index, L, T, C, G, B, device=device, lookup=lookup)


TRITON_CODER = _TritonCoder()


def encode_symbols_triton(sym_k: torch.Tensor, sym_v: torch.Tensor, nbins_k: Sequence[int],
                          nbins_v: Sequence[int], channels_per_stream: int = 4,
                          tokens_per_stream: int | None = None):
    """GPU twin of `codec.entropy.encode_symbols`: returns an identical `EncodedSymbols`.

    Args: sym_k, sym_v uint8 torch tensors [L, T, C] on CUDA (CPU under the interpreter);
      the rest as `codec.entropy.encode_symbols`.
    Steps (codec.entropy.encode_symbols with ``backend=TRITON_CODER``): histograms
      (Triton) -> host: codec.entropy.models.build_models (the same numpy code as the CPU
      path, so the models are identical; it is tiny) -> rANS (Triton, two-pass) ->
      payload copied to the host as bytes.
    Raises: ValueError as `encode_symbols` does (and on an empty chunk).
    """
    from .. import entropy as ent

    sym_k, sym_v = TRITON_CODER.check_symbols(sym_k, sym_v)
    if min(sym_k.shape) < 1:
        raise ValueError(f"empty chunk: [L, T, C] = {tuple(sym_k.shape)}")
    return ent.encode_symbols(sym_k, sym_v, nbins_k, nbins_v, channels_per_stream,
                              tokens_per_stream, backend=TRITON_CODER)


def decode_symbols_triton(header: dict, arrays: dict, payload, L: int, T: int, C: int,
                          nbins_k: Sequence[int], nbins_v: Sequence[int], device=None,
                          max_symbols: int = 1 << 33, lookup: str = "auto"
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPU twin of `codec.entropy.decode_symbols`: same checks, same errors, symbols as
    uint8 torch tensors [L, T, C] on `device` (default cuda; cpu under the interpreter).

    codec.entropy.decode_symbols with ``backend=TRITON_CODER``: the header / model-table
    validation is codec.entropy's and codec.entropy.models's own code (run on the host: it
    is small); only the rANS decoding runs in Triton.
    Raises: CodecError on any inconsistency.
    """
    from .. import entropy as ent

    for name, v in (("L", L), ("T", T), ("C", C)):
        if type(v) not in (int, np.int64, np.int32) or v < 1:
            raise CodecError(f"{name} must be a positive integer, got {v!r}")
    return ent.decode_symbols(header, arrays, payload, int(L), int(T), int(C), nbins_k,
                              nbins_v, max_symbols=max_symbols, backend=TRITON_CODER,
                              device=device, lookup=lookup)
