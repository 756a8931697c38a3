"""The baseline codecs (CacheGen paper section 7.1 plus KIVI and FP8): ``raw`` (the KV in
its dtype, lossless), ``fp8`` (float8 e4m3 cast, saturating at +-448) and ``kivi2`` /
``kivi4`` (KIVI, Liu et al., ICML 2024: keys per-channel in groups of 32 tokens, values
per-token in groups of 32 channels, the last 128 tokens kept exact; a chunk's tokens before
those 128 that do not fill a group of 32 form one short last key group with its own
lo/step, so chunking never leaves a token unquantized). See codec/codecs/__init__.py.
"""
from __future__ import annotations

import numpy as np
import torch

from ..quant import lowbit
from ..errors import CodecError

from ..base import (Codec, DTYPES, EncodedChunk, KIVI_GROUP, KIVI_RESIDUAL, from_bits,
                   need_array, need_int, pack_bits, to_bits, unpack_bits)


class RawCodec(Codec):
    """The KV in the model's dtype, bit-exact."""

    name = "raw"
    lossless = True
    fused_cpu = True   # codec.quant.fused.decode_raw_cpu: copy + finite check in one pass

    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        return EncodedChunk({}, {"k": to_bits(k), "v": to_bits(v)})

    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None, fused=True, out=None):
        if payload:
            raise CodecError("raw codec: unexpected payload")
        if fused or out is not None:
            from ..quant.fused import decode_raw_cpu

            return decode_raw_cpu(arrays, shape, dtype_name, out=out)
        return (from_bits(arrays.get("k"), dtype_name, shape, "k"),
                from_bits(arrays.get("v"), dtype_name, shape, "v"))


class Fp8Codec(Codec):
    """float8 e4m3 cast (saturating at +-448), 1 byte per element."""

    name = "fp8"
    fused_cpu = True   # codec.quant.fused.decode_fp8_cpu

    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        return EncodedChunk({}, {"k": lowbit.fp8_quantize(k).numpy(), "v": lowbit.fp8_quantize(v).numpy()})

    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None, fused=True, out=None):
        if payload:
            raise CodecError("fp8: unexpected payload")
        if fused or out is not None:
            from ..quant.fused import decode_fp8_cpu

            return decode_fp8_cpu(arrays, shape, dtype_name, out=out)
        out = []
        for name in ("k", "v"):
            a = need_array(arrays.get(name), np.uint8, shape, name)
            x = lowbit.fp8_dequantize(torch.from_numpy(np.array(a, copy=True)))
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
    def _split(T: int, token_offset: int, total_tokens: int) -> tuple[int, int]:
        """``(nq, nt)``: of this chunk's tokens before the last KIVI_RESIDUAL tokens of the
        context, ``nq`` (a multiple of KIVI_GROUP) form whole key groups and the
        remaining ``nt`` (0..KIVI_GROUP-1) one short last key group with its own lo/step
        (every token before the residual is quantized whatever the
        chunking; docs/bitstream.md section 4.6)."""
        n = max(0, min(T, total_tokens - KIVI_RESIDUAL - token_offset))
        return n - n % KIVI_GROUP, n % KIVI_GROUP

    def _tail(self, header: dict, T: int, nq: int) -> int:
        """Tokens of the short last key group (header ``nt``, absent = 0), validated."""
        if "nt" not in header:
            return 0
        return need_int(header, "nt", 1, min(KIVI_GROUP - 1, T - nq))

    def decode_tail(self, arrays: dict, shape: tuple, nt: int, dtype_name: str):
        """The short last group's K and V (``kt_*``/``vt_*`` arrays), each [L, nt, H, D] in
        the dtype (keys: one lo/step per (layer, head, channel) over the nt tokens; values
        per token as the full groups). Shared by the fused and reference decoders.
        Raises CodecError on bad arrays or non-finite values."""
        L, _, H, D = shape
        return self._decode_span(arrays, ("kt", "vt"), (L, nt, H, D), nt, dtype_name)

    def _decode_span(self, arrays: dict, names: tuple[str, str], span: tuple, key_group: int,
                     dtype_name: str):
        """Dequantize one span of quantized tokens: K and V [L, n, H, D] (span) from the
        arrays ``<name>_q/_lo/_step`` of names (K's, V's); keys per channel in groups of
        ``key_group`` tokens, values per token in groups of _vgroup(D) channels. Raises
        CodecError on bad arrays or non-finite values."""
        L, nt, H, D = span
        n = L * nt * H * D
        nbytes = -(-n // (8 // self.bits))
        g = self._vgroup(D)
        out = []
        for name, dim, grp, gshape in ((names[0], 1, key_group, (L, nt // key_group, H, D)),
                                        (names[1], 3, g, (L, nt, H, D // g))):
            qb = need_array(arrays.get(f"{name}_q"), np.uint8, (nbytes,), f"{name}_q")
            q = torch.from_numpy(unpack_bits(qb, self.bits, n).reshape(L, nt, H, D))
            lo = from_bits(arrays.get(f"{name}_lo"), dtype_name, gshape, f"{name}_lo")
            st = from_bits(arrays.get(f"{name}_step"), dtype_name, gshape, f"{name}_step")
            x = lowbit.kivi_dequantize(q, lo, st, dim=dim, group=grp)
            if not bool(torch.isfinite(x).all()):
                raise CodecError(f"kivi: non-finite values in {name}")
            out.append(x.to(DTYPES[dtype_name]))
        return out[0], out[1]

    @staticmethod
    def _vgroup(D: int) -> int:
        return KIVI_GROUP if D % KIVI_GROUP == 0 else D

    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        L, T, H, D = k.shape
        nq, nt = self._split(T, token_offset, total_tokens)
        arrays = {"k_full": to_bits(k[:, nq + nt:]), "v_full": to_bits(v[:, nq + nt:])}
        if nq:
            # keys per channel: groups of 32 tokens along dim 1 of [L, nq, H, D]
            qk, lok, stk = lowbit.kivi_quantize(k[:, :nq], self.bits, dim=1, group=KIVI_GROUP)
            # values per token: groups of g channels along D of [L, nq, H, D]
            qv, lov, stv = lowbit.kivi_quantize(v[:, :nq], self.bits, dim=3, group=self._vgroup(D))
            arrays.update(k_q=pack_bits(qk.numpy(), self.bits), k_lo=to_bits(lok),
                          k_step=to_bits(stk), v_q=pack_bits(qv.numpy(), self.bits),
                          v_lo=to_bits(lov), v_step=to_bits(stv))
        header = {"nq": nq}
        if not nt:
            return EncodedChunk(header, arrays)
        # the short last key group (nt < 32 tokens) with its own lo/step: format 5
        qk, lok, stk = lowbit.kivi_quantize(k[:, nq:nq + nt], self.bits, dim=1, group=nt)
        qv, lov, stv = lowbit.kivi_quantize(v[:, nq:nq + nt], self.bits, dim=3,
                                       group=self._vgroup(D))
        arrays.update(kt_q=pack_bits(qk.numpy(), self.bits), kt_lo=to_bits(lok),
                      kt_step=to_bits(stk), vt_q=pack_bits(qv.numpy(), self.bits),
                      vt_lo=to_bits(lov), vt_step=to_bits(stv))
        header["nt"] = nt
        return EncodedChunk(header, arrays, format_version=5)

    fused_cpu = True   # codec.quant.fused.decode_kivi_cpu

    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None, fused=True, out=None):
        if fused or out is not None:
            from ..quant.fused import decode_kivi_cpu

            if payload:
                raise CodecError("kivi: unexpected payload")
            return decode_kivi_cpu(self, header, arrays, shape, dtype_name, out=out)
        L, T, H, D = shape
        nq = need_int(header, "nq", 0, T)
        if nq % KIVI_GROUP:
            raise CodecError(f"kivi: quantized token count {nq} is not a multiple of "
                             f"{KIVI_GROUP}")
        nt = self._tail(header, T, nq)
        kf = from_bits(arrays.get("k_full"), dtype_name, (L, T - nq - nt, H, D), "k_full")
        vf = from_bits(arrays.get("v_full"), dtype_name, (L, T - nq - nt, H, D), "v_full")
        if nt:
            kt, vt = self.decode_tail(arrays, shape, nt, dtype_name)
            kf, vf = torch.cat([kt, kf], 1), torch.cat([vt, vf], 1)
        if not nq:
            return kf, vf
        kq, vq = self._decode_span(arrays, ("k", "v"), (L, nq, H, D), KIVI_GROUP, dtype_name)
        return torch.cat([kq, kf], 1), torch.cat([vq, vf], 1)
