"""Fused CPU decode of the quantized codecs: symbols -> model-dtype values, in one pass,
straight into the destination tensor.

Purpose: the reference decode path (``codecs.CacheGenCodec.decode`` on the CPU) makes a
uint8 symbol tensor, an int64 copy for the range check, a float32 dequantized tensor, a
cast to the model dtype and a concatenation with the sink tokens: five full-size passes
besides the rANS decoding itself (measured breakdown: docs/codec.md, "Where decode time
goes"). Here every lossy decode is a table lookup: for each scale row r (a (layer, KV
head) of a chunk for cachegen's "chunk_head" scales, a (layer, token[, head]) otherwise)
the value of every symbol s is computed ONCE, by the reference torch arithmetic of
``codec.quant.reference.dequantize`` and the same cast (``to_dtype_clamped``), into a table
``deq[layer, r, s]`` of the model dtype's bit pattern; the numba rANS decoder
(``codec.entropy.rans_cpu.decode_streams_into``) then writes ``deq[layer, row(t, c), s]`` for each
decoded symbol directly into the destination's memory, both cores, no intermediate
tensor. Since the table entries are computed by the reference code, the result is
bit-identical to decode -> dequantize -> cast (tests/codec/test_codec_fused.py).

CacheGen's decoder: Liu et al., SIGCOMM 2024, section 5.2 (quantization + arithmetic
coding), section 5.3 (decoding overlapped with streaming); table-driven dequantization
is the usual way to decode low-bit codes (e.g. the lookup-table dequantization of
SqueezeLLM, Kim et al., ICML 2024, section 4).

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_fused.py -q
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import lowbit
from . import reference as Q
from .. import scratch
from ..base import DTYPES, KIVI_GROUP, from_bits, need_array, need_int
from ..errors import CodecError
from .. import threads
from ..threads import run_kernel

__all__ = ["all_finite", "dequant_table", "bits_view", "decode_cachegen_cpu", "decode_fp8_cpu",
           "decode_raw_cpu",
           "decode_kivi_cpu", "check_out", "row_absmax_fast", "quantize_fast",
           "channel_absmax_fast", "sample_median_abs_fast"]


def bits_view(t: torch.Tensor) -> np.ndarray:
    """The bit pattern of a (contiguous or strided) CPU float tensor as a numpy view sharing its memory:
    uint16 for bf16/fp16, uint32 for fp32 (numba has no bf16/fp16 type)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float32:
        return t.view(torch.int32).numpy().view(np.uint32)
    raise ValueError(f"unsupported dtype {t.dtype}")


_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def all_finite(t: torch.Tensor) -> bool:
    """``bool(torch.isfinite(t).all())`` for a bf16/fp16/fp32 tensor in one numba pass over
    its bits on both cores, without the full-size bool temporary; other
    devices/dtypes fall back to torch."""
    if t.device.type != "cpu" or t.dtype not in _NAMES:
        return bool(torch.isfinite(t).all())
    from .tables import count_nonfinite

    return count_nonfinite(bits_view(t.contiguous()), _NAMES[t.dtype]) == 0


def dequant_table(eff: torch.Tensor, m: torch.Tensor, nsym: int, dtype: torch.dtype
                  ) -> np.ndarray:
    """Values of every symbol for every scale row, in ``dtype``'s bit pattern.

    Args: eff float32 [L, Ts, NH, 1] effective scales (``decode_scales``); m float32 [L]
      (M per layer); nsym: symbols per row (> the largest symbol to decode); dtype: the
      model dtype.
    Returns: numpy [L, Ts * NH, nsym] (uint16 for bf16/fp16, uint32 for fp32) with
      entry [l, r, s] = to_dtype_clamped((float32(s) - M_l) * (eff[l, r] / M_l), dtype):
      exactly the elementwise arithmetic of ``codec.quant.reference.dequantize`` followed by the
      codecs' cast, so a lookup is bit-identical to the reference.
    """
    L, Ts, NH = eff.shape[0], eff.shape[1], eff.shape[2]
    sym = torch.arange(nsym, dtype=torch.uint8).expand(L, Ts, NH, nsym)
    x = Q.dequantize(sym, eff.to(torch.float32), m)                 # [L, Ts, NH, nsym]
    tab = Q.to_dtype_clamped(x, dtype).reshape(L, Ts * NH, nsym).contiguous()
    if not bool(torch.isfinite(tab).all()):   # e.g. M = 0 (bins < 4): 0 * (s / 0)
        raise CodecError("the scales and bins give non-finite dequantized values")
    return bits_view(tab)


def check_out(out, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a caller-provided destination: a pair (k_out, v_out) of contiguous CPU
    tensors of ``shape`` [L, T, H, D] and ``dtype``. Raises ValueError otherwise."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError("out must be a pair (k_out, v_out) of tensors")
    for name, t in zip(("k_out", "v_out"), out):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"{name} must be a {dtype} tensor of shape {tuple(shape)}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    if out[0].data_ptr() == out[1].data_ptr():
        raise ValueError("k_out and v_out must not share memory")
    return out[0], out[1]


def _row_layout(eff: torch.Tensor, Tq: int, C: int) -> tuple[int, int]:
    """(t_stride, hd) of a scale tensor [L, Ts, NH, 1] for a chunk of Tq tokens and C
    channels: rows per token (0 when one row set covers the chunk) and channels per row."""
    Ts, NH = int(eff.shape[1]), int(eff.shape[2])
    if C % NH:
        raise CodecError(f"{NH} scale rows per token do not divide {C} channels")
    t_stride = NH if (Ts == Tq and Ts > 1) else 0
    if Ts not in (1, Tq):
        raise CodecError(f"scales cover {Ts} tokens, the chunk has {Tq}")
    return t_stride, C // NH


def decode_cachegen_cpu(codec_obj, cfg, header: dict, arrays: dict, payload: bytes,
                        shape: tuple, dtype_name: str, ns: int,
                        out: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused CPU decode of one cachegen / cachegen-ref / quant8 chunk.

    Args: codec_obj: the ``codecs.CacheGenCodec``; cfg: its validated CodecConfig;
      header/arrays/payload: the codec's part of the container; shape (L, T, H, D);
      dtype_name: "bfloat16" | "float16" | "float32"; ns: validated sink-token count;
      out: optional (k_out, v_out) contiguous CPU tensors [L, T, H, D] of the dtype to
      decode into (``check_out``); default: new tensors.
    Returns: (k, v) [L, T, H, D] of the dtype (``out`` itself when given).
    Raises: CodecError on any inconsistency of the bitstream; ValueError on a bad ``out``.
    """

    L, T, H, D = shape
    C = H * D
    Tq = T - ns
    dt = DTYPES[dtype_name]
    if out is None:
        k_out, v_out = scratch.empty(shape, dtype=dt), scratch.empty(shape, dtype=dt)
    else:
        k_out, v_out = check_out(out, shape, dt)
    if ns:
        for tag, o in (("k", k_out), ("v", v_out)):
            sink = from_bits(arrays.get(f"sink_{tag}"), dtype_name, (L, ns, H, D),
                             f"sink_{tag}")
            if not bool(torch.isfinite(sink).all()):
                raise CodecError(f"sink tokens of {tag} are not finite (corrupt bitstream)")
            o[:, :ns] = sink
    if not Tq:
        if codec_obj.entropy:   # the entropy part must still be the empty one
            from ..entropy import decode_symbols_into, entropy_part

            ent, ent_arrays = entropy_part(header, arrays)
            decode_symbols_into(ent, ent_arrays, payload, L, 0, C, [2] * L, [2] * L,
                                None, None, None, None, 0, 1)
        return k_out, v_out
    qshape = (L, Tq, H, D)
    tabs, lay = [], None
    nsyms, steps = [], []
    # quant8 (scales per (layer, token), 255 symbols): a table would be as large as the
    # output, so bf16/fp32 dequantize directly in the kernel (same float32 arithmetic)
    direct = not codec_obj.entropy and dtype_name in ("bfloat16", "float32")
    for is_key in (True, False):
        bins = cfg.key_bins if is_key else cfg.value_bins
        eff, m = codec_obj.decode_scales(header, arrays, cfg, qshape, dtype_name, is_key)
        nsym = max(bins) - 1                        # symbols 0..2M: bins - 1 per layer
        lay_kv = _row_layout(eff, Tq, C)
        if lay is not None and lay != lay_kv:
            raise CodecError("K and V scales have different layouts")
        lay = lay_kv
        if direct:
            if not bool(torch.isfinite(eff).all()) or bool((m <= 0).any()):
                raise CodecError("quant8 scales must be finite with M > 0")
            tabs.append(None)
            steps.append((eff, m))
        else:
            tabs.append(dequant_table(eff, m, nsym, dt))
        nsyms.append(nsym)
    t_stride, hd = lay
    ok_k = bits_view(k_out).reshape(L, T, C)
    ov_k = bits_view(v_out).reshape(L, T, C)
    if codec_obj.entropy:
        from ..entropy import decode_symbols_into, decoding_errors, entropy_part

        ent, ent_arrays = entropy_part(header, arrays)
        nk = [b - 1 for b in cfg.key_bins]
        nv = [b - 1 for b in cfg.value_bins]
        with decoding_errors():
            decode_symbols_into(ent, ent_arrays, payload, L, Tq, C, nk, nv, ok_k, ov_k,
                                tabs[0], tabs[1], t_stride, hd, ns)
    else:
        from .tables import dequant_direct_into, gather_into

        if payload:
            raise CodecError("quant8: unexpected payload")
        for i, (tag, o, tab, nsym) in enumerate((("k", ok_k, tabs[0], nsyms[0]),
                                                 ("v", ov_k, tabs[1], nsyms[1]))):
            sym = need_array(arrays.get(f"sym_{tag}"), np.uint8, (L, Tq, C), f"sym_{tag}")
            if sym.size and int(sym.max()) >= nsym:
                raise CodecError(f"{tag} symbols exceed 2M")
            if tab is None:   # direct float32 arithmetic + cast in the kernel (bf16/fp32)
                eff, m = steps[i]
                step = (eff.to(torch.float32) / m.reshape(-1, 1, 1, 1)).reshape(L, -1)
                dequant_direct_into(sym, m.numpy(), step.contiguous().numpy(), t_stride, hd,
                                    ns, float(torch.finfo(dt).max), dtype_name, o)
            else:
                gather_into(sym, o, tab, t_stride, hd, ns)
    # outlier channels: the pre-scaling undone before the exact outliers are
    # scattered, as the reference decoder (codecs.CacheGenCodec.dequantize_tensor) does
    for tag, o in (("k", k_out), ("v", v_out)):
        codec_obj.apply_channels(o[:, ns:], header, arrays, tag)
    # exact outliers: scattered after the fused dequantization
    for tag, o in (("k", k_out), ("v", v_out)):
        if header.get(f"n_out_{tag}") is None and f"out_{tag}_idx" not in arrays \
                and f"out_{tag}_val" not in arrays:
            continue
        part = o[:, ns:] if ns else o
        x = codec_obj.apply_outliers(part, header, arrays, dtype_name, tag)
        if x.data_ptr() != part.data_ptr() or not part.is_contiguous():
            part.copy_(x)
    return k_out, v_out


# ------------------------------------------------------------------ baselines
def _dest(shape: tuple, dt: torch.dtype, out) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return scratch.empty(shape, dtype=dt), scratch.empty(shape, dtype=dt)
    return check_out(out, shape, dt)


def decode_raw_cpu(arrays: dict, shape: tuple, dtype_name: str, out=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """raw decode: the stored bit patterns copied into the destination with the finite
    check in the same pass, both cores (``tables.copy_finite_into``): one read of the
    container and one write, against a copy plus a separate check before.

    Args: arrays: "k", "v" (uint16 for bf16/fp16, uint32 for fp32, ``shape`` [L, T, H, D],
      e.g. read-only views of the container); out: optional destination pair.
    Returns: (k, v) of the dtype (``out`` when given).
    Raises: CodecError on a missing or mis-shaped array or an inf/NaN value; ValueError on
      a bad out."""
    from .tables import copy_finite_into

    dt = DTYPES[dtype_name]
    want = np.uint32 if dt == torch.float32 else np.uint16
    srcs = [need_array(arrays.get(n), want, shape, n) for n in ("k", "v")]
    ko, vo = _dest(shape, dt, out)
    for name, a, o in (("k", srcs[0], ko), ("v", srcs[1], vo)):
        if copy_finite_into(np.ascontiguousarray(a), bits_view(o), dtype_name):
            raise CodecError(f"raw array {name!r} holds NaN/inf (corrupt bitstream)")
    return ko, vo


def decode_fp8_cpu(arrays: dict, shape: tuple, dtype_name: str, out=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 (e4m3) decode by a 256-entry table in the model dtype, one pass per tensor,
    both cores; bit-identical to ``fp8_dequantize(...).to(dtype)``.
    Raises CodecError on NaN codes (0x7F / 0xFF) or bad arrays; ValueError on a bad out."""
    from .tables import lut8_into

    dt = DTYPES[dtype_name]
    ko, vo = _dest(shape, dt, out)
    vals = lowbit.fp8_dequantize(torch.arange(256, dtype=torch.uint8))         # float32 [256]
    flag = (~torch.isfinite(vals)).to(torch.uint8).numpy()
    tab = bits_view(vals.to(dt).contiguous())
    for name, o in (("k", ko), ("v", vo)):
        a = need_array(arrays.get(name), np.uint8, shape, name)
        if lut8_into(a, tab, flag, bits_view(o)):
            raise CodecError(f"fp8 array {name!r} holds NaN codes")
    return ko, vo


def decode_kivi_cpu(codec_obj, header: dict, arrays: dict, shape: tuple, dtype_name: str,
                    out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI decode (``codecs.KiviCodec``) into one destination, both cores: per quantization
    group a table of its 2^bits values (``lowbit.kivi_dequantize`` itself on the codes 0..2^bits-1,
    cast to the dtype: bit-identical), then one numba pass unpacking the codes and looking
    them up; the full-precision tokens are copied behind. Raises CodecError as the
    reference decoder; ValueError on a bad out."""
    from .tables import kivi_into

    L, T, H, D = shape
    bits = codec_obj.bits
    nq = need_int(header, "nq", 0, T)
    if nq % KIVI_GROUP:
        raise CodecError(f"kivi: quantized token count {nq} is not a multiple of {KIVI_GROUP}")
    dt = DTYPES[dtype_name]
    nt = codec_obj._tail(header, T, nq)
    ko, vo = _dest(shape, dt, out)
    tails = codec_obj.decode_tail(arrays, shape, nt, dtype_name) if nt else (None, None)
    NQ = 1 << bits
    n = L * nq * H * D
    nbytes = -(-n // (8 // bits))
    g = codec_obj._vgroup(D)
    for name, o, tail in (("k", ko, tails[0]), ("v", vo, tails[1])):
        full = from_bits(arrays.get(f"{name}_full"), dtype_name, (L, T - nq - nt, H, D),
                         f"{name}_full")
        if not all_finite(full):
            raise CodecError(f"kivi: non-finite full-precision values in {name}")
        o[:, nq + nt:] = full
        if nt:
            o[:, nq:nq + nt] = tail
        if not nq:
            continue
        if name == "k":   # per channel, groups of 32 tokens: lo/step [L, nq/32, H, D]
            gshape, dim = (L, nq // KIVI_GROUP, H, D), 1
            qsyn = torch.arange(NQ, dtype=torch.uint8).reshape(1, 1, NQ, 1, 1).expand(
                L, nq // KIVI_GROUP, NQ, H, D).reshape(L, nq // KIVI_GROUP * NQ, H, D)
            ng = nq // KIVI_GROUP
            strides = (ng * NQ * H * D, NQ * H * D, KIVI_GROUP, D, 1, 1, H * D)
        else:             # per token, groups of g channels: lo/step [L, nq, H, D/g]
            gshape, dim = (L, nq, H, D // g), 3
            qsyn = torch.arange(NQ, dtype=torch.uint8).reshape(1, 1, 1, 1, NQ).expand(
                L, nq, H, D // g, NQ).reshape(L, nq, H, D // g * NQ)
            strides = (nq * H * (D // g) * NQ, H * (D // g) * NQ, 1, (D // g) * NQ, NQ, g, 1)
        qb = need_array(arrays.get(f"{name}_q"), np.uint8, (nbytes,), f"{name}_q")
        lo = from_bits(arrays.get(f"{name}_lo"), dtype_name, gshape, f"{name}_lo")
        st = from_bits(arrays.get(f"{name}_step"), dtype_name, gshape, f"{name}_step")
        tab = lowbit.kivi_dequantize(qsyn, lo, st, dim=dim, group=NQ)
        if not all_finite(tab):
            raise CodecError(f"kivi: non-finite values in {name}")
        tab = tab.to(dt).contiguous()
        kivi_into(qb, bits, bits_view(tab).reshape(-1), strides, bits_view(o), nq)
    return ko, vo


# ============================================================================ encode side
# Fused CPU quantization: ``codec.quant.reference.row_scales`` and
# ``codec.quant.reference.quantize`` in torch make a float32 copy of x, an abs copy, and five
# full-size float32 temporaries (x * inv, round, max, min, + M) before the uint8 cast:
# ~2/3 of a cachegen encode (profile in docs/codec.md, section 5b). The kernels below read
# the KV's bit pattern (bf16 or fp32) once per pass and compute exactly the same float32
# arithmetic per element (IEEE multiply, round half to even, clamp, + M), so the symbols
# and scales are bit-identical (tests/codec/test_codec_fused.py::test_fused_quantize_*).

def _absmax_impl(bits, shift, mode, out):
    """max |x| of a 4-D bit-pattern array ``bits`` [L, T, G, D] (uint16 bf16 with
    ``shift`` 16, or uint32 fp32 with ``shift`` 0), as float32 bits in ``out`` (uint32):
    mode 0: per (l, t, g) over D (``out`` [L, T, G]); mode 1: per (l, g) over T and D
    (``out`` [L, 1, G]). |x| of a finite float is its bits without the sign bit, ordered
    like the values, so the max is taken on integers (exact)."""
    L, T, G, D = bits.shape
    mag = np.uint32(0x7FFFFFFF)
    if mode == 0:
        for r in prange(L * T):
            layer = r // T
            t = r - layer * T
            for g in range(G):
                best = np.uint32(0)
                for d in range(D):
                    b = (np.uint32(bits[layer, t, g, d]) << np.uint32(shift)) & mag
                    if b > best:
                        best = b
                out[layer, t, g] = best
    else:
        for r in prange(L * G):
            layer = r // G
            g = r - layer * G
            best = np.uint32(0)
            for t in range(T):
                for d in range(D):
                    b = (np.uint32(bits[layer, t, g, d]) << np.uint32(shift)) & mag
                    if b > best:
                        best = b
            out[layer, 0, g] = best


def _quant_impl(bits, shift, inv, m, out, nchunks):
    """uint8 symbols ``out`` [L, T, G, D] = uint8(clamp(rint(x32 * inv), -M, M) + M) with
    x32 the float32 value of ``bits`` (as ``_absmax_impl``), ``inv`` float32 [L, Te, G]
    (Te = T or 1: per-token or per-chunk scales), ``m`` float32 [L]. Parallel over
    ``nchunks`` blocks of (layer, token) rows, one float32 scratch row per block. Returns
    the number of non-finite inputs (the symbols are then meaningless)."""
    L, T, G, D = bits.shape
    te = inv.shape[1]
    rows = L * T
    per = (rows + nchunks - 1) // nchunks
    expo = np.uint32(0x7F800000)
    bad = 0
    for c in prange(nchunks):
        nb = 0
        buf = np.empty(D, dtype=np.uint32)
        fb = buf.view(np.float32)
        lo = c * per
        hi = min(lo + per, rows)
        for r in range(lo, hi):
            layer = r // T
            t = r - layer * T
            ti = t if te > 1 else 0
            mm = m[layer]
            for g in range(G):
                iv = inv[layer, ti, g]
                for d in range(D):
                    b = np.uint32(bits[layer, t, g, d]) << np.uint32(shift)
                    nb += np.int64((b & expo) == expo)
                    buf[d] = b
                for d in range(D):
                    q = np.rint(fb[d] * iv)
                    if q > mm:
                        q = mm
                    elif q < -mm:
                        q = -mm
                    out[layer, t, g, d] = np.uint8(q + mm)
        bad += nb
    return bad


def _chanmax_impl(bits, shift, out):
    """max over tokens of |x| per (layer, head, channel) of a bit-pattern array ``bits``
    [L, T, G, D] (as ``_absmax_impl``), float32 bits in ``out`` uint32 [L, G, D]."""
    L, T, G, D = bits.shape
    mag = np.uint32(0x7FFFFFFF)
    for r in prange(L * G):
        layer = r // G
        g = r - layer * G
        for d in range(D):
            out[layer, g, d] = 0
        for t in range(T):
            for d in range(D):
                b = (np.uint32(bits[layer, t, g, d]) << np.uint32(shift)) & mag
                if b > out[layer, g, d]:
                    out[layer, g, d] = b


def _sample_median_impl(bits, shift, step, out):
    """Lower median of |x| per (layer, head) over the tokens 0, step, 2 * step, ... and
    every channel (``bits`` as ``_absmax_impl``): the element of rank (n - 1) // 2 of the
    n sampled magnitudes, as float32 bits in ``out`` uint32 [L, G]. Magnitudes of finite
    floats order like their bits without the sign, so the selection is exact."""
    L, T, G, D = bits.shape
    nt = (T + step - 1) // step
    n = nt * D
    mag = np.uint32(0x7FFFFFFF)
    for r in prange(L * G):
        layer = r // G
        g = r - layer * G
        buf = np.empty(n, dtype=np.uint32)
        j = 0
        for t in range(0, T, step):
            for d in range(D):
                buf[j] = (np.uint32(bits[layer, t, g, d]) << np.uint32(shift)) & mag
                j += 1
        out[layer, g] = np.partition(buf, (n - 1) // 2)[(n - 1) // 2]


if threads.HAVE_NUMBA:
    from numba import prange  # noqa: F811 - the kernels above use prange inside numba
    _absmax_par, _absmax_ser = threads.dual_build(_absmax_impl)
    _quant_par, _quant_ser = threads.dual_build(_quant_impl)
    _chanmax_par, _chanmax_ser = threads.dual_build(_chanmax_impl)
    _median_par, _median_ser = threads.dual_build(_sample_median_impl)
else:  # pragma: no cover
    prange = range


def _fast_bits(x: torch.Tensor):
    """(4-D bit view, shift) of a CPU bf16/fp32 tensor with unit stride in its last dim
    (e.g. the KV after its sink tokens are sliced off), or None (other dtypes,
    devices, layouts or no numba: the caller keeps the torch path)."""
    if not threads.HAVE_NUMBA or x.device.type != "cpu" or x.dim() != 4 or (x.numel() and x.stride(3) != 1):
        return None
    if x.dtype == torch.bfloat16:
        return bits_view(x), 16
    if x.dtype == torch.float32:
        return bits_view(x), 0
    return None


def row_absmax_fast(x: torch.Tensor, dims: tuple) -> Optional[torch.Tensor]:
    """``x.to(float32).abs().amax(dim=dims, keepdim=True)`` for a CPU bf16/fp32
    ``x`` [L, T, G, D] with ``dims`` (3,) or (1, 3), bit-identical, in one pass on both
    cores; None when not applicable (other dtype/layout/dims, or a non-finite maximum:
    the caller then uses the torch reduction, which also propagates NaN)."""
    fb = _fast_bits(x)
    if fb is None or x.numel() == 0:
        return None
    dims = tuple(sorted(d % 4 for d in dims))
    if dims not in ((3,), (1, 3)):
        return None
    bits, shift = fb
    L, T, G, D = x.shape
    mode = 0 if dims == (3,) else 1
    out = np.zeros((L, T if mode == 0 else 1, G), dtype=np.uint32)
    run_kernel(_absmax_par, _absmax_ser, x.numel() >= threads.PARALLEL_MIN_SYMBOLS, bits, shift, mode, out)
    if bool((out >= np.uint32(0x7F800000)).any()):
        return None
    return torch.from_numpy(out.view(np.float32)).unsqueeze(-1)


def quantize_fast(x: torch.Tensor, scale: torch.Tensor, m: torch.Tensor) -> Optional[torch.Tensor]:
    """``codec.quant.reference.quantize(x, scale, M)`` for a CPU bf16/fp32 ``x``
    [L, T, G, D] with float32 ``scale`` [L, T, G, 1] or [L, 1, G, 1] and ``m`` the
    broadcast M [L, 1, 1, 1]: the same float32 arithmetic per element (``inv = M / s`` by
    torch, then x32 * inv, round half to even, clamp, + M), bit-identical uint8 symbols,
    one pass on both cores. None when not applicable (the caller keeps the torch path);
    also None when x holds a non-finite value (counted in the same pass: the torch path's
    cast of NaN is implementation-defined, so it is kept for such input)."""
    fb = _fast_bits(x)
    if fb is None or x.numel() == 0 or scale.dim() != 4 or scale.shape[3] != 1:
        return None
    L, T, G, D = x.shape
    if scale.shape[0] != L or scale.shape[2] != G or scale.shape[1] not in (1, T):
        return None
    bits, shift = fb
    s = scale.to(torch.float32)
    mm = m.to(torch.float32).reshape(L, 1, 1, 1)
    # exactly the torch expression of codec.quant.reference.quantize (one float32 division)
    inv = torch.where(s > 0, mm / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    inv_np = np.ascontiguousarray(inv.reshape(L, s.shape[1], G).numpy())
    out = scratch.np_empty((L, T, G, D), dtype=np.uint8)
    par = x.numel() >= threads.PARALLEL_MIN_SYMBOLS
    nchunks = max(1, min(L * T, 8 * threads.num_workers())) if par else 1
    bad = run_kernel(_quant_par, _quant_ser, par, bits, shift, inv_np,
                     np.ascontiguousarray(m.to(torch.float32).reshape(L).numpy()), out, nchunks)
    return None if bad else torch.from_numpy(out)


def channel_absmax_fast(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``x.abs().amax(dim=1).to(float32)`` for a CPU bf16/fp32 ``x`` [L, T, G, D]
    (T >= 1): float32 [L, G, D], bit-identical, one pass without the full-size abs
    copy; None when not applicable (other dtype/layout, or a non-finite maximum)."""
    fb = _fast_bits(x)
    if fb is None or x.numel() == 0:
        return None
    bits, shift = fb
    L, T, G, D = x.shape
    out = np.empty((L, G, D), dtype=np.uint32)
    run_kernel(_chanmax_par, _chanmax_ser, x.numel() >= threads.PARALLEL_MIN_SYMBOLS, bits, shift, out)
    if bool((out >= np.uint32(0x7F800000)).any()):
        return None
    return torch.from_numpy(out.view(np.float32))


def sample_median_abs_fast(x: torch.Tensor, step: int) -> Optional[torch.Tensor]:
    """Per (layer, head) lower median of |x| over tokens 0, step, 2 * step, ... and all
    channels of a CPU bf16/fp32 ``x`` [L, T, G, D]: float32 [L, G], equal to torch's
    ``median`` of that sample (the element of rank (n - 1) // 2) converted to float32;
    None when not applicable (other dtype/layout, empty, or a non-finite median)."""
    fb = _fast_bits(x)
    if fb is None or x.numel() == 0 or step < 1:
        return None
    bits, shift = fb
    L, T, G, D = x.shape
    out = np.empty((L, G), dtype=np.uint32)
    run_kernel(_median_par, _median_ser, x.numel() >= threads.PARALLEL_MIN_SYMBOLS, bits, shift,
               int(step), out)
    if bool((out >= np.uint32(0x7F800000)).any()):
        return None
    return torch.from_numpy(out.view(np.float32))
