"""The baseline codecs (CacheGen paper section 7.1 plus KIVI and FP8): ``raw`` (the KV in
its dtype, lossless), ``fp8`` (float8 e4m3 cast, saturating at +-448) and ``kivi2`` /
``kivi4`` (KIVI, Liu et al., ICML 2024: keys per-channel in groups of 32 tokens, values
per-token in groups of 32 channels, the last 128 tokens kept exact). See codec/codecs.py.
"""
from __future__ import annotations

import numpy as np
import torch

from . import quantize as Q
from .errors import CodecError

from .base import (Codec, DTYPES, EncodedChunk, KIVI_GROUP, KIVI_RESIDUAL, from_bits,
                   need_array, need_int, pack_bits, to_bits, unpack_bits)


class RawCodec(Codec):
    """The KV in the model's dtype, bit-exact."""

    name = "raw"
    lossless = True

    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        return EncodedChunk({}, {"k": to_bits(k), "v": to_bits(v)})

    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None):
        if payload:
            raise CodecError("raw codec: unexpected payload")
        return (from_bits(arrays.get("k"), dtype_name, shape, "k"),
                from_bits(arrays.get("v"), dtype_name, shape, "v"))


class Fp8Codec(Codec):
    """float8 e4m3 cast (saturating at +-448), 1 byte per element."""

    name = "fp8"
    fused_cpu = True   # codec.fused.decode_fp8_cpu (issue 14.5)

    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        return EncodedChunk({}, {"k": Q.fp8_quantize(k).numpy(), "v": Q.fp8_quantize(v).numpy()})

    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None, fused=True, out=None):
        if payload:
            raise CodecError("fp8: unexpected payload")
        if fused or out is not None:
            from .fused import decode_fp8_cpu

            return decode_fp8_cpu(arrays, shape, dtype_name, out=out)
        out = []
        for name in ("k", "v"):
            a = need_array(arrays.get(name), np.uint8, shape, name)
            x = Q.fp8_dequantize(torch.from_numpy(np.array(a, copy=True)))
            if not bool(torch.isfinite(x).all()):
                raise CodecError(f"fp8 array {name!r} holds NaN codes")
            out.append(x.to(DTYPES[dtype_name]))
        return out[0], out[1]


class KiviCodec(Codec):
    """KIVI asymmetric ``bits``-bit quantization (see module docstring)."""

    def __init__(self, bits: int):
        self.bits = bits
        self.name = f"kivi{bits}"

    @staticmethod
    def _split(T: int, token_offset: int, total_tokens: int) -> int:
        """Tokens of this chunk that are quantized: those before the last KIVI_RESIDUAL
        tokens of the context, rounded down to a multiple of KIVI_GROUP."""
        nq = max(0, min(T, total_tokens - KIVI_RESIDUAL - token_offset))
        return nq - nq % KIVI_GROUP

    @staticmethod
    def _vgroup(D: int) -> int:
        return KIVI_GROUP if D % KIVI_GROUP == 0 else D

    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        L, T, H, D = k.shape
        nq = self._split(T, token_offset, total_tokens)
        arrays = {"k_full": to_bits(k[:, nq:]), "v_full": to_bits(v[:, nq:])}
        if nq:
            # keys per channel: groups of 32 tokens along dim 1 of [L, nq, H, D]
            qk, lok, stk = Q.kivi_quantize(k[:, :nq], self.bits, dim=1, group=KIVI_GROUP)
            # values per token: groups of g channels along D of [L, nq, H, D]
            qv, lov, stv = Q.kivi_quantize(v[:, :nq], self.bits, dim=3, group=self._vgroup(D))
            arrays.update(k_q=pack_bits(qk.numpy(), self.bits), k_lo=to_bits(lok),
                          k_step=to_bits(stk), v_q=pack_bits(qv.numpy(), self.bits),
                          v_lo=to_bits(lov), v_step=to_bits(stv))
        return EncodedChunk({"nq": nq}, arrays)

    fused_cpu = True   # codec.fused.decode_kivi_cpu (issue 14.5)

    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None, fused=True, out=None):
        if fused or out is not None:
            from .fused import decode_kivi_cpu

            if payload:
                raise CodecError("kivi: unexpected payload")
            return decode_kivi_cpu(self, header, arrays, shape, dtype_name, out=out)
        L, T, H, D = shape
        nq = need_int(header, "nq", 0, T)
        if nq % KIVI_GROUP:
            raise CodecError(f"kivi: quantized token count {nq} is not a multiple of "
                             f"{KIVI_GROUP}")
        dt = DTYPES[dtype_name]
        kf = from_bits(arrays.get("k_full"), dtype_name, (L, T - nq, H, D), "k_full")
        vf = from_bits(arrays.get("v_full"), dtype_name, (L, T - nq, H, D), "v_full")
        if not nq:
            return kf, vf
        n = L * nq * H * D
        nbytes = -(-n // (8 // self.bits))
        g = self._vgroup(D)
        out = []
        for name, dim, grp, gshape in (("k", 1, KIVI_GROUP, (L, nq // KIVI_GROUP, H, D)),
                                        ("v", 3, g, (L, nq, H, D // g))):
            qb = need_array(arrays.get(f"{name}_q"), np.uint8, (nbytes,), f"{name}_q")
            q = torch.from_numpy(unpack_bits(qb, self.bits, n).reshape(L, nq, H, D))
            lo = from_bits(arrays.get(f"{name}_lo"), dtype_name, gshape, f"{name}_lo")
            st = from_bits(arrays.get(f"{name}_step"), dtype_name, gshape, f"{name}_step")
            x = Q.kivi_dequantize(q, lo, st, dim=dim, group=grp)
            if not bool(torch.isfinite(x).all()):
                raise CodecError(f"kivi: non-finite values in {name}")
            out.append(x.to(dt))
        return torch.cat([out[0], kf], 1), torch.cat([out[1], vf], 1)
