"""CacheGen (Liu et al., SIGCOMM 2024, section 5.2): layer-wise symmetric quantization and
per-(layer, channel) rANS coding, as codecs ``cachegen`` (this project's quantizer,
variant "harness"), ``cachegen-ref`` (the LMCache reference schedules) and ``quant8``
(256 bins, no entropy coding). The caller-side choice of the fused numba quantizer or
the reference one (``codec.quant.reference``) is made here.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from .. import level_table
from ..quant import outliers
from ..quant import reference as Q
from ..config import CodecConfig
from ..errors import CodecError

from ..base import Codec, DTYPES, EncodedChunk, from_bits, need_array, need_int, to_bits


def _row_scales(x: torch.Tensor, dim) -> torch.Tensor:
    """``codec.quant.reference.row_scales(x, dim)``: a contiguous CPU bf16/fp32 x [L, T, G, D]
    reduced over (3,) or (1, 3) takes the fused numba pass ``codec.quant.fused.row_absmax_fast``
    (bit-identical, no float32 copy), anything else the torch reference."""
    if x.dim() == 4 and x.device.type == "cpu":
        from ..quant.fused import row_absmax_fast

        fast = row_absmax_fast(x, (dim,) if isinstance(dim, int) else tuple(dim))
        if fast is not None:
            return fast
    return Q.row_scales(x, dim=dim)


def _quantize(x: torch.Tensor, scale: torch.Tensor, max_level: torch.Tensor) -> torch.Tensor:
    """``codec.quant.reference.quantize(x, scale, max_level)`` (uint8 symbols, shape of x): a CPU
    x [L, T, G, D] with a 4-d scale takes the fused numba pass ``codec.quant.fused.quantize_fast``
    (same symbols, one pass) where it applies, else the torch reference."""
    if x.dim() == 4 and x.device.type == "cpu" and isinstance(scale, torch.Tensor) \
            and scale.dim() == 4 and x.shape[0] == max_level.shape[0]:
        from ..quant.fused import quantize_fast

        fast = quantize_fast(x, scale, max_level.to(torch.float32).reshape(-1, 1, 1, 1))
        if fast is not None:
            return fast
    return Q.quantize(x, scale, max_level)


def _outlier_thresholds(x: torch.Tensor, dims: tuple) -> torch.Tensor:
    """``codec.quant.outliers.outlier_thresholds(x, dims)``: a CPU bf16/fp32 x [L, T, G, D]
    with dims (1, 3) takes its sample medians from the fused numba selection
    ``codec.quant.fused.sample_median_abs_fast`` (the same values, no sample copy), anything
    else the torch reference."""
    med = None
    if x.dim() == 4 and x.device.type == "cpu" and tuple(sorted(d % 4 for d in dims)) == (1, 3):
        from ..quant.fused import sample_median_abs_fast

        med = sample_median_abs_fast(x, outliers.sample_step(x, (1, 3)))
    return outliers.outlier_thresholds(x, dims, med=med)


def _outlier_channels(x: torch.Tensor, x_orig: torch.Tensor):
    """``codec.quant.outliers.outlier_channels(x, x_orig)`` with the channel maxima of a
    CPU bf16/fp32 x from the fused numba pass ``codec.quant.fused.channel_absmax_fast``
    (bit-identical, no full-size abs copy) where it applies."""
    c = None
    if x.dim() == 4 and x.device.type == "cpu" and x.shape[1]:
        from ..quant.fused import channel_absmax_fast

        c = channel_absmax_fast(x)
    return outliers.outlier_channels(x, x_orig, c=c)


def _side_index(hdr: dict, arrays: dict, tag: str, prefix: str, other: str, what: str,
                limit: int) -> Optional[tuple[int, np.ndarray]]:
    """The count and index array of a side list of ``tag`` (outliers: prefix "out", channels:
    "chx"; docs/bitstream.md 4.4): None when the header has no ``n_<prefix>_<tag>`` (and no
    such arrays), else (n in [1, limit], ``<prefix>_<tag>_idx`` uint32/uint64 [n]).
    Raises CodecError on an inconsistent list."""
    if hdr.get(f"n_{prefix}_{tag}") is None:
        if f"{prefix}_{tag}_idx" in arrays or f"{prefix}_{tag}_{other}" in arrays:
            raise CodecError(f"{what} arrays of {tag} without n_{prefix}_{tag}")
        return None
    n = need_int(hdr, f"n_{prefix}_{tag}", 1, limit)
    idx = arrays.get(f"{prefix}_{tag}_idx")
    if not isinstance(idx, np.ndarray) or idx.dtype not in (np.uint32, np.uint64) \
            or idx.shape != (n,):
        raise CodecError(f"{what} index array of {tag} must be uint32/uint64 [{n}]")
    return n, idx


class CacheGenCodec(Codec):
    """CacheGen: layer-wise symmetric quantization + per-(layer, channel) rANS coding.

    ``variant`` "harness" (codec ``cachegen``) or "reference" (``cachegen-ref``) chooses
    the preset used when no explicit ``config`` is given. With ``entropy=False`` the
    symbols are stored as bytes (this is ``quant8``: 256 bins, reference quantizer).
    """

    def __init__(self, name: str, variant: str, entropy: bool = True):
        self.name = name
        self.variant = variant
        self.entropy = entropy
        # levels: cachegen 0 (smallest) .. 5 (near lossless), default 1 (HARNESS_LEVELS);
        # cachegen-ref: 0 = LMCache's default schedule, 1-3 = the CacheGen artifact's
        # levels, default 0; quant8: one fixed config (256 bins), no levels.
        # (codec.level_table holds each scale and default; a codec of another name takes
        # its variant's)
        scale = "quant8" if not entropy else "cachegen" if variant == "harness" else "cachegen-ref"
        self.levels = level_table.levels(scale)
        self.default_level = level_table.default_level(scale)
        # the Triton kernels implement quantization + rANS; quant8 (no entropy coding)
        # stays on the CPU like the other baselines
        self.supports_triton = entropy

    # ---- config ------------------------------------------------------------------
    def resolve_config(self, num_layers: int, level: Optional[int],
                       config: Optional[CodecConfig]) -> CodecConfig:
        if config is not None:
            if not isinstance(config, CodecConfig):
                raise ValueError(f"config must be a CodecConfig, got {type(config).__name__}")
            if config.num_layers != num_layers:
                raise ValueError(f"config is for {config.num_layers} layers but the KV has "
                                 f"{num_layers}")
            if level is not None and config.level is not None and level != config.level:
                raise ValueError(f"level={level} contradicts config.level={config.level}")
            return config
        if not self.entropy:   # quant8: 256 bins everywhere, LMCache's quantizer
            return CodecConfig.uniform(num_layers, 256, 256, scale_group="token",
                                       scale_format="dtype", variant="reference")
        return CodecConfig.for_model(num_layers, level, variant=self.variant)

    # ---- quantization (shared by encoder, decoder and the benchmark) ---------------
    @staticmethod
    def _layout(shape: tuple, cfg: CodecConfig, is_key: bool):
        """How scales cover x [L, T, H, D]: (view shape of x, dims reduced by max |x|,
        stored scale array shape, broadcastable effective-scale shape).

        token: one scale per (layer, token) over H*D channels (LMCache);
        head: per (layer, token, KV head) over D; chunk_head: per (layer, KV head) over
        the chunk's tokens and D (a uniform step per head). (Per-channel key scales and
        anchor/delta groups were measured and dropped: docs/codec.md section 4.)"""
        L, T, H, D = shape
        if cfg.scale_group == "head":
            return (L, T, H, D), (3,), (L, T, H), (L, T, H, 1)
        if cfg.scale_group == "chunk_head":
            return (L, T, H, D), (1, 3), (L, H), (L, 1, H, 1)
        return (L, T, 1, H * D), (3,), (L, T, 1), (L, T, 1, 1)

    def quantize_tensor(self, x: torch.Tensor, cfg: CodecConfig, is_key: bool,
                        backend: str = "cpu"):
        """x [L, T, H, D] (tokens to quantize) -> (symbols uint8 [L, T, H*D], header dict,
        arrays dict, effective float32 scales broadcastable to the ``_layout`` view).

        Scales are computed by torch on x's device (exact: max |x| and a searchsorted);
        ``backend="triton"`` quantizes with ``codec.triton.ops.quantize_triton`` (the
        same symbols bit for bit) and returns symbols and scales on x's device."""
        L, T, H, D = x.shape
        bins = cfg.key_bins if is_key else cfg.value_bins
        m = Q.max_levels(bins)
        view, dims, sshape, eshape = self._layout(tuple(x.shape), cfg, is_key)
        xg = x.reshape(view)
        tag = "k" if is_key else "v"
        hdr: dict[str, Any] = {}
        arrays: dict[str, np.ndarray] = {}
        s = _row_scales(xg, dims) if xg.numel() else torch.zeros(eshape, device=x.device)
        if cfg.scale_group == "chunk_head" and xg.numel():
            # outliers (|x| > OUTLIER_RATIO * median |x| of the group) are stored exactly in
            # a sparse side list and set to 0 before the scale is taken (one outlier must not set its group's step;
            # docs/bitstream.md section 4.4); normal KV stops at the group maxima
            thr = _outlier_thresholds(xg, dims)
            x_orig = xg
            if bool((s > thr).any()):
                mask = xg.to(torch.float32).abs() > thr
                flat = torch.nonzero(mask.reshape(-1)).reshape(-1)
                idx = flat.cpu().numpy()
                n_all = xg.numel()
                arrays[f"out_{tag}_idx"] = idx.astype(np.uint32 if n_all <= 1 << 32
                                                      else np.uint64)
                arrays[f"out_{tag}_val"] = to_bits(xg.reshape(-1)[flat])
                hdr[f"n_out_{tag}"] = int(idx.size)
                xg = torch.where(mask, torch.zeros_like(xg), xg)
                s = _row_scales(xg, dims)
            # outlier channels (docs/bitstream.md section 4.4b): after the side
            # list took its values out, a channel far above the rest of its (layer, KV
            # head) is divided by 2^e (e stored) before the scale is taken, so that it no
            # longer sets the step of the others
            ch = _outlier_channels(xg, x_orig)
            if ch is not None:
                cidx, cexp = ch
                arrays[f"chx_{tag}_idx"] = cidx.astype(np.uint32 if L * H * D <= 1 << 32
                                                       else np.uint64)
                arrays[f"chx_{tag}_exp"] = cexp
                hdr[f"n_chx_{tag}"] = int(cidx.size)
                xg = Q.scale_channels(xg.clone(), cidx, cexp, -1)
                s = _row_scales(xg, dims)
        s = Q.flush_tiny_scales(s)      # M / s must not overflow float32
        enc = Q.encode_log8(s) if cfg.scale_format == "log8" and s.numel() else None
        if enc is not None:
            codes, e0, eff = enc
            hdr[f"scale_{tag}"] = "log8"
            hdr[f"e0_{tag}"] = e0
            arrays[f"scale_{tag}"] = codes.reshape(sshape).cpu().numpy()
        else:
            st = s.to(x.dtype)                                # exact: max of dtype values
            eff = st.to(torch.float32)
            hdr[f"scale_{tag}"] = "dtype"
            arrays[f"scale_{tag}"] = to_bits(st.reshape(sshape))
        if backend == "triton" and xg.numel():
            from ..triton import ops as tk

            sym = tk.quantize_triton(xg, eff, m).reshape(L, T, H * D)
        else:
            sym = _quantize(xg, eff, m.to(xg.device)).reshape(L, T, H * D)   # [L, T, C]
        return sym, hdr, arrays, eff

    def dequantize_tensor(self, sym: torch.Tensor, hdr: dict, arrays: dict, cfg: CodecConfig,
                          shape: tuple, dtype_name: str, is_key: bool, backend: str = "cpu",
                          out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inverse of ``quantize_tensor``; sym [L, T, C] -> ``out_dtype`` [L, T, H, D] on
        sym's device (float32 arithmetic, then rounded to ``out_dtype``). ``backend=
        "triton"``: ``codec.triton.ops.dequantize_triton`` (bit-identical)."""
        L, T, H, D = shape
        tag = "k" if is_key else "v"
        view, _, _, eshape = self._layout(shape, cfg, is_key)
        eff, m = self.decode_scales(hdr, arrays, cfg, shape, dtype_name, is_key)
        if backend == "triton" and sym.numel():
            from ..triton import ops as tk

            x = tk.dequantize_triton(sym.reshape(view), eff.reshape(eshape).to(sym.device),
                                     m, out_dtype=out_dtype).reshape(L, T, H, D)
        else:
            x = Q.to_dtype_clamped(Q.dequantize(sym.reshape(view),
                                                eff.reshape(eshape).to(sym.device), m),
                                   out_dtype).reshape(L, T, H, D)
        x = self.apply_channels(x, hdr, arrays, tag)
        return self.apply_outliers(x, hdr, arrays, dtype_name, tag)

    @staticmethod
    def apply_channels(x: torch.Tensor, hdr: dict, arrays: dict, tag: str) -> torch.Tensor:
        """Undo the encoder's outlier-channel pre-scaling of ``tag`` ("k" | "v") on the
        dequantized ``x`` [L, Tq, H, D] (before ``apply_outliers``; in place, x may be a
        view; docs/bitstream.md section 4.4b): channel ``idx`` (flat into [L, H, D],
        strictly increasing) times ``2^exp`` (exp 1..CHANNEL_MAX_EXP), clamped to the
        dtype's finite range. No list (``n_chx_<tag>`` absent) = nothing to do.
        Raises CodecError on an inconsistent list."""
        L, _, H, D = x.shape
        side = _side_index(hdr, arrays, tag, "chx", "exp", "outlier-channel", L * H * D)
        if side is None:
            return x
        n, idx = side
        ex = need_array(arrays.get(f"chx_{tag}_exp"), np.uint8, (n,), f"chx_{tag}_exp")
        idx64 = idx.astype(np.int64)
        if int(idx.max()) >= L * H * D or (n > 1 and bool(np.any(np.diff(idx64) <= 0))):
            raise CodecError(f"outlier-channel indices of {tag} are out of range or not "
                             f"increasing")
        if int(ex.min()) < 1 or int(ex.max()) > outliers.CHANNEL_MAX_EXP:
            raise CodecError(f"outlier-channel exponents of {tag} must lie in "
                             f"1..{outliers.CHANNEL_MAX_EXP}")
        if x.shape[1]:
            Q.scale_channels(x, idx64, ex, +1)
        return x

    def decode_scales(self, hdr: dict, arrays: dict, cfg: CodecConfig, shape: tuple,
                      dtype_name: str, is_key: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated effective float32 scales of K (``is_key``) or V of x [L, T, H, D],
        shaped as ``_layout``'s ``eshape``, and M per layer (float32 [L]); shared by
        ``dequantize_tensor`` and the fused decoder (``codec.quant.fused``).
        Raises CodecError on a bad scale array or format."""
        tag = "k" if is_key else "v"
        bins = cfg.key_bins if is_key else cfg.value_bins
        m = Q.max_levels(bins)
        view, _, sshape, eshape = self._layout(shape, cfg, is_key)
        fmt = hdr.get(f"scale_{tag}")
        if fmt == "log8":
            e0 = need_int(hdr, f"e0_{tag}", *Q.LOG8_E0_RANGE)
            codes = need_array(arrays.get(f"scale_{tag}"), np.uint8, sshape, f"scale_{tag}")
            eff = Q.decode_log8(torch.from_numpy(np.array(codes, copy=True)), e0)
            if not bool(torch.isfinite(eff).all()):
                raise CodecError(f"log8 scales of {tag} overflow float32")
        elif fmt == "dtype":
            eff = from_bits(arrays.get(f"scale_{tag}"), dtype_name, sshape,
                            f"scale_{tag}").to(torch.float32)
            if not bool(torch.isfinite(eff).all()) or bool((eff < 0).any()):
                raise CodecError(f"scales of {tag} are negative or not finite")
        else:
            raise CodecError(f"unknown scale format {fmt!r} for {tag}")
        return eff.reshape(eshape), m

    @staticmethod
    def apply_outliers(x: torch.Tensor, hdr: dict, arrays: dict, dtype_name: str,
                       tag: str) -> torch.Tensor:
        """Scatter the exact outlier values of ``tag`` ("k" | "v") into the dequantized
        ``x`` [L, Tq, H, D] (in place; docs/bitstream.md section 4.4): ``x.view(-1)[idx] =
        val`` with ``idx`` strictly increasing flat C-order indices into x and ``val`` in
        the model dtype. No side list (``n_out_<tag>`` absent) = no outliers.
        Raises CodecError on an inconsistent list."""
        side = _side_index(hdr, arrays, tag, "out", "val", "outlier", x.numel())
        if side is None:
            return x
        n, idx = side
        val = from_bits(arrays.get(f"out_{tag}_val"), dtype_name, (n,), f"out_{tag}_val")
        idx64 = idx.astype(np.int64)
        if int(idx.max()) >= x.numel() or (n > 1 and bool(np.any(np.diff(idx64) <= 0))):
            raise CodecError(f"outlier indices of {tag} are out of range or not increasing")
        if not bool(torch.isfinite(val).all()):
            raise CodecError(f"outlier values of {tag} are not finite")
        x = x.contiguous()
        x.view(-1)[torch.from_numpy(idx64).to(x.device)] = val.to(x.device, x.dtype)
        return x

    def n_sink(self, cfg: CodecConfig, T: int, token_offset: int) -> int:
        return max(0, min(T, cfg.sink_tokens - token_offset))

    # ---- encode / decode -----------------------------------------------------------
    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        L, T, H, D = k.shape
        cfg = self.resolve_config(L, level, config)
        ns = self.n_sink(cfg, T, token_offset)
        cfg_d = cfg.to_dict()
        cfg_d.pop("chunk_tokens", None)   # the split size lives in the container header
        header: dict[str, Any] = {"config": cfg_d, "n_sink": ns}
        arrays: dict[str, np.ndarray] = {}
        if ns:
            arrays["sink_k"] = to_bits(k[:, :ns])
            arrays["sink_v"] = to_bits(v[:, :ns])
        triton = backend == "triton" and self.supports_triton
        syms = []
        scale_bytes = 0
        # the tokens after the sinks as one contiguous block: the fused CPU passes take
        # only contiguous input (on the strided view the quantizer fell back to torch:
        # 17-19 ms per 1024-token tensor of the default model against 10-11 with the copy)
        for x, is_key in ((k[:, ns:].contiguous(), True), (v[:, ns:].contiguous(), False)):
            sym, h, a, _ = self.quantize_tensor(x, cfg, is_key,
                                                backend="triton" if triton else "cpu")
            header.update(h)
            arrays.update(a)
            scale_bytes += sum(int(arr.nbytes) for arr in a.values())
            # Triton path: symbols stay on the device for the Triton rANS encoder, except
            # a chunk of only sink tokens (T = 0 symbols), which the CPU coder handles
            syms.append(sym if triton and sym.shape[1] else sym.cpu().numpy())
        stats: dict[str, Any] = {"scale_bytes": scale_bytes,
                                 "symbols": int(syms[0].size + syms[1].size)
                                 if isinstance(syms[0], np.ndarray)
                                 else int(syms[0].numel() + syms[1].numel()),
                                 "sink_bytes": int(sum(arrays[n].nbytes for n in arrays
                                                       if n.startswith("sink_")))}
        payload = b""
        if self.entropy:
            from ..entropy import encode_symbols

            nk = [b - 1 for b in cfg.key_bins]       # 2M + 1 = bins - 1 symbols per layer
            nv = [b - 1 for b in cfg.value_bins]
            if isinstance(syms[0], torch.Tensor):
                from ..triton.ops import encode_symbols_triton

                es = encode_symbols_triton(syms[0], syms[1], nk, nv,
                                           channels_per_stream=cfg.channels_per_stream,
                                           tokens_per_stream=cfg.tokens_per_stream)
            else:
                es = encode_symbols(syms[0], syms[1], nk, nv,
                                    channels_per_stream=cfg.channels_per_stream,
                                    tokens_per_stream=cfg.tokens_per_stream)
            header["entropy"] = es.header
            arrays.update(es.arrays)
            payload = es.payload
            stats.update(entropy_bits=es.entropy_bits, ideal_bits=es.ideal_bits,
                         model_bytes=es.model_bytes,
                         length_table_bytes=es.length_table_bytes,
                         payload_bytes=es.payload_bytes)
        else:
            arrays["sym_k"], arrays["sym_v"] = syms
            stats.update(payload_bytes=int(syms[0].nbytes + syms[1].nbytes))
        # outlier-channel exponents are a version-5 feature (docs/bitstream.md 4.1)
        ver = 5 if any(n.startswith("chx_") for n in arrays) else 4
        return EncodedChunk(header, arrays, payload, stats, format_version=ver)

    # the CPU decode is fused (codec.quant.fused): symbols -> model dtype straight into the
    # destination, finite by construction (tables, sinks and outliers are checked)
    fused_cpu = True

    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None, fused=True, out=None):
        """``fused`` (default): on the CPU, decode with ``codec.quant.fused`` (bit-identical to
        the reference path kept below, which ``fused=False`` selects); ``out``: optional
        (k_out, v_out) destination tensors for the fused path (``codec.decode_kv_into``)."""
        L, T, H, D = shape
        try:
            cfg = CodecConfig.from_dict(header.get("config"))
        except ValueError as e:
            raise CodecError(f"bad codec config in header: {e}") from None
        if cfg.num_layers != L:
            raise CodecError(f"header config has {cfg.num_layers} layers, KV has {L}")
        if not self.entropy and (cfg.key_bins != [256] * L or cfg.value_bins != [256] * L):
            raise CodecError("quant8 needs 256 bins on every layer")
        ns = need_int(header, "n_sink", 0, T)
        Tq = T - ns
        C = H * D
        dt = DTYPES[dtype_name]
        triton = backend == "triton" and self.supports_triton
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if (fused or out is not None) and not triton and dev.type == "cpu":
            from ..quant.fused import decode_cachegen_cpu   # decodes straight into the destination

            return decode_cachegen_cpu(self, cfg, header, arrays, payload, shape, dtype_name,
                                       ns, out=out)
        if self.entropy:
            from ..entropy import decode_symbols, decoding_errors, entropy_part

            nk = [b - 1 for b in cfg.key_bins]
            nv = [b - 1 for b in cfg.value_bins]
            ent, ent_arrays = entropy_part(header, arrays)
            with decoding_errors():
                if triton and Tq:   # symbols decoded on (and left on) the device
                    from ..triton.ops import decode_symbols_triton

                    sk, sv = decode_symbols_triton(ent, ent_arrays, payload, L, Tq, C, nk,
                                                   nv, device=dev, max_symbols=1 << 32)
                else:
                    sk, sv = decode_symbols(ent, ent_arrays, payload, L, Tq, C, nk, nv)
        else:
            if payload:
                raise CodecError("quant8: unexpected payload")
            sk = need_array(arrays.get("sym_k"), np.uint8, (L, Tq, C), "sym_k")
            sv = need_array(arrays.get("sym_v"), np.uint8, (L, Tq, C), "sym_v")
        out = []
        for sym, is_key, tag in ((sk, True, "k"), (sv, False, "v")):
            if isinstance(sym, torch.Tensor):
                if sym.dtype != torch.uint8:
                    raise CodecError(f"decoded {tag} symbols have dtype {sym.dtype}")
            else:
                sym = torch.from_numpy(np.array(sym, dtype=np.uint8, copy=True))
            if triton:
                sym = sym.to(dev)
            if sym.shape != (L, Tq, C):
                raise CodecError(f"decoded {tag} symbols have shape {tuple(sym.shape)}")
            bins = cfg.key_bins if is_key else cfg.value_bins
            if Tq and C:
                lim = torch.tensor([2 * (b // 2 - 1) for b in bins],
                                   device=sym.device).reshape(L, 1, 1)
                if bool((sym.to(torch.int64) > lim).any()):
                    raise CodecError(f"{tag} symbols exceed 2M")
            x = self.dequantize_tensor(sym, header, arrays, cfg, (L, Tq, H, D), dtype_name,
                                       is_key, backend="triton" if triton else "cpu",
                                       out_dtype=dt)
            if ns:
                sink = from_bits(arrays.get(f"sink_{tag}"), dtype_name, (L, ns, H, D),
                                 f"sink_{tag}")
                x = torch.cat([sink.to(x.device), x], 1)
            out.append(x)
        return out[0], out[1]
