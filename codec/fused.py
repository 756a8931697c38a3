"""Fused CPU decode of the quantized codecs: symbols -> model-dtype values, in one pass,
straight into the destination tensor (issue 14.2).

Purpose: the reference decode path (``codecs.CacheGenCodec.decode`` on the CPU) makes a
uint8 symbol tensor, an int64 copy for the range check, a float32 dequantized tensor, a
cast to the model dtype and a concatenation with the sink tokens: five full-size passes
besides the rANS decoding itself (measured breakdown: docs/codec.md, "Where decode time
goes"). Here every lossy decode is a table lookup: for each scale row r (a (layer, KV
head) of a chunk for cachegen's "chunk_head" scales, a (layer, token[, head]) otherwise)
the value of every symbol s is computed ONCE, by the reference torch arithmetic of
``codec.quantize.dequantize`` and the same cast (``to_dtype_clamped``), into a table
``deq[layer, r, s]`` of the model dtype's bit pattern; the numba rANS decoder
(``codec.rans_cpu.decode_streams_into``) then writes ``deq[layer, row(t, c), s]`` for each
decoded symbol directly into the destination's memory, both cores, no intermediate
tensor. Since the table entries are computed by the reference code, the result is
bit-identical to decode -> dequantize -> cast (tests/test_codec_fused.py).

CacheGen's decoder: Liu et al., SIGCOMM 2024, section 5.2 (quantization + arithmetic
coding), section 5.3 (decoding overlapped with streaming); table-driven dequantization
is the usual way to decode low-bit codes (e.g. the lookup-table dequantization of
SqueezeLLM, Kim et al., ICML 2024, section 4).

Run the tests: .venv/bin/python -m pytest tests/test_codec_fused.py -q
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import quantize as Q
from .errors import CodecError

__all__ = ["all_finite", "dequant_table", "bits_view", "decode_cachegen_cpu", "decode_fp8_cpu",
           "decode_kivi_cpu", "check_out"]


def bits_view(t: torch.Tensor) -> np.ndarray:
    """The bit pattern of a contiguous CPU float tensor as a numpy view sharing its memory:
    uint16 for bf16/fp16, uint32 for fp32 (numba has no bf16/fp16 type)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float32:
        return t.view(torch.int32).numpy().view(np.uint32)
    raise ValueError(f"unsupported dtype {t.dtype}")


_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def all_finite(t: torch.Tensor) -> bool:
    """``bool(torch.isfinite(t).all())`` for a bf16/fp16/fp32 tensor in one numba pass over
    its bits on both cores, without the full-size bool temporary (issue 14.6); other
    devices/dtypes fall back to torch."""
    if t.device.type != "cpu" or t.dtype not in _NAMES:
        return bool(torch.isfinite(t).all())
    from .rans_cpu import count_nonfinite

    return count_nonfinite(bits_view(t.contiguous()), _NAMES[t.dtype]) == 0


def dequant_table(eff: torch.Tensor, m: torch.Tensor, nsym: int, dtype: torch.dtype
                  ) -> np.ndarray:
    """Values of every symbol for every scale row, in ``dtype``'s bit pattern.

    Args: eff float32 [L, Ts, NH, 1] effective scales (``decode_scales``); m float32 [L]
      (M per layer); nsym: symbols per row (> the largest symbol to decode); dtype: the
      model dtype.
    Returns: numpy [L, Ts * NH, nsym] (uint16 for bf16/fp16, uint32 for fp32) with
      entry [l, r, s] = to_dtype_clamped((float32(s) - M_l) * (eff[l, r] / M_l), dtype):
      exactly the elementwise arithmetic of ``codec.quantize.dequantize`` followed by the
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
    from .codecs import DTYPES, from_bits, need_array

    L, T, H, D = shape
    C = H * D
    Tq = T - ns
    dt = DTYPES[dtype_name]
    if out is None:
        k_out, v_out = torch.empty(shape, dtype=dt), torch.empty(shape, dtype=dt)
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
            from .entropy import decode_symbols_into

            ent = header.get("entropy")
            if not isinstance(ent, dict):
                raise CodecError("missing entropy-coder header")
            ent_arrays = {n: a for n, a in arrays.items() if n.startswith("ent_")}
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
        from .entropy import decode_symbols_into

        ent = header.get("entropy")
        if not isinstance(ent, dict):
            raise CodecError("missing entropy-coder header")
        ent_arrays = {n: a for n, a in arrays.items() if n.startswith("ent_")}
        nk = [b - 1 for b in cfg.key_bins]
        nv = [b - 1 for b in cfg.value_bins]
        try:
            decode_symbols_into(ent, ent_arrays, payload, L, Tq, C, nk, nv, ok_k, ov_k,
                                tabs[0], tabs[1], t_stride, hd, ns)
        except CodecError:
            raise
        except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
            raise CodecError(f"entropy decoding failed: {e}") from None
    else:
        from .rans_cpu import dequant_direct_into, gather_into

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
    # exact outliers (issue 12.3): scattered after the fused dequantization
    for tag, o in (("k", k_out), ("v", v_out)):
        if header.get(f"n_out_{tag}") is None and f"out_{tag}_idx" not in arrays \
                and f"out_{tag}_val" not in arrays:
            continue
        part = o[:, ns:] if ns else o
        x = codec_obj.apply_outliers(part, header, arrays, dtype_name, tag)
        if x.data_ptr() != part.data_ptr() or not part.is_contiguous():
            part.copy_(x)
    return k_out, v_out


# ------------------------------------------------------------------ baselines (issue 14.5)
def _dest(shape: tuple, dt: torch.dtype, out) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return torch.empty(shape, dtype=dt), torch.empty(shape, dtype=dt)
    return check_out(out, shape, dt)


def decode_fp8_cpu(arrays: dict, shape: tuple, dtype_name: str, out=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 (e4m3) decode by a 256-entry table in the model dtype, one pass per tensor,
    both cores; bit-identical to ``fp8_dequantize(...).to(dtype)``.
    Raises CodecError on NaN codes (0x7F / 0xFF) or bad arrays; ValueError on a bad out."""
    from .codecs import DTYPES, need_array
    from .rans_cpu import lut8_into

    dt = DTYPES[dtype_name]
    ko, vo = _dest(shape, dt, out)
    vals = Q.fp8_dequantize(torch.arange(256, dtype=torch.uint8))         # float32 [256]
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
    group a table of its 2^bits values (``Q.kivi_dequantize`` itself on the codes 0..2^bits-1,
    cast to the dtype: bit-identical), then one numba pass unpacking the codes and looking
    them up; the full-precision tokens are copied behind. Raises CodecError as the
    reference decoder; ValueError on a bad out."""
    from .codecs import DTYPES, KIVI_GROUP, from_bits, need_array, need_int
    from .rans_cpu import kivi_into

    L, T, H, D = shape
    bits = codec_obj.bits
    nq = need_int(header, "nq", 0, T)
    if nq % KIVI_GROUP:
        raise CodecError(f"kivi: quantized token count {nq} is not a multiple of {KIVI_GROUP}")
    dt = DTYPES[dtype_name]
    ko, vo = _dest(shape, dt, out)
    NQ = 1 << bits
    n = L * nq * H * D
    nbytes = -(-n // (8 // bits))
    g = codec_obj._vgroup(D)
    for name, o in (("k", ko), ("v", vo)):
        full = from_bits(arrays.get(f"{name}_full"), dtype_name, (L, T - nq, H, D),
                         f"{name}_full")
        if not all_finite(full):
            raise CodecError(f"kivi: non-finite full-precision values in {name}")
        o[:, nq:] = full
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
        tab = Q.kivi_dequantize(qsyn, lo, st, dim=dim, group=NQ)
        if not all_finite(tab):
            raise CodecError(f"kivi: non-finite values in {name}")
        tab = tab.to(dt).contiguous()
        kivi_into(qb, bits, bits_view(tab).reshape(-1), strides, bits_view(o), nq)
    return ko, vo
