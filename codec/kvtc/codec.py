"""The ``kvtc`` codec: ``KvtcCodec`` (encode one chunk of K, V [L, T, H, D] fp16/bf16/fp32
to header + arrays + payload, decode back), on top of the calibration, layout, RoPE and
worker modules of ``codec.kvtc``; its per-call options ``KvtcConfig`` are
codec/kvtc/options.py's.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from .. import level_table
from .. import scratch as _scratch
from ..base import DTYPES, EncodedChunk, from_bits, need_int, to_bits
from ..errors import CodecError

from .rope import _rope_bf16_kernel, _rope_kernel, _rope_tables, apply_rope
from .calibration import DEFAULT_LEVEL, DEFAULT_LEVEL_SINKS, KvtcCalibration, level_tiers
from .options import KvtcConfig
from .registry import _resolve_calibration, get_calibration
from .workers import _bf16_gemm, _rows, _split_over_workers
from .layout import (KVTC_FORMAT_VERSION, KVTC_TIERED_FORMAT, _KeptSymbols, _SPAN_ARRAY_RE,
                     _code_rows, _decode_rows, _exact_counts, _parse_spans, _span_array,
                     _tail_spans, check_tiers)


class KvtcCodec:
    """The ``kvtc`` codec behind ``codec.api`` (see the module docstring).

    Header ("codec_header") fields: config {level, calibration (sha256 hex),
    sink_tokens, recent_tokens}, n_sink, n_recent, layout ("kept"; absent in the older
    padded layout) and n_kept (kept columns of all (K/V, layer); the padded layout has
    n_components, coded columns per layer, instead), offset_k / offset_v (per layer: the
    symbol of coefficient 0, = max |q|), token_offset (the chunk's first position, for
    RoPE), entropy (``codec.entropy`` header); format 3 adds tiers (the tail spans: start,
    count, level, their own layout/n_kept/offset_k/offset_v/entropy, payload_bytes).
    Arrays: sink_k/v, recent_k/v (exact tokens, the KV dtype's bits), ent_* (entropy
    coder; span i's as ent_t<i>_*). docs/bitstream.md section 4.5.
    Decode raises CodecError on any inconsistent field, a missing or different
    calibration, or corrupt streams."""

    name = "kvtc"
    lossless = False
    uses_level = True
    supports_triton = False
    decodes_into = True      # decode(out=(k, v)) writes into the caller's tensors (no copy)

    @property
    def levels(self) -> tuple:
        return level_table.levels("kvtc")     # = sorted(DEFAULT_LEVEL_TARGETS) (tested)

    @property
    def default_level(self) -> int:
        return DEFAULT_LEVEL

    def resolve_config(self, num_layers: int, level: Optional[int], config: Any
                       ) -> KvtcConfig:
        """The effective KvtcConfig (level filled in when given)."""
        if config is None:
            config = KvtcConfig()
        if not isinstance(config, KvtcConfig):
            raise ValueError(f"kvtc config must be a codec.kvtc.KvtcConfig, got "
                             f"{type(config).__name__}")
        if level is not None and config.level is not None and level != config.level:
            raise ValueError(f"level={level} contradicts config.level={config.level}")
        if level is not None:
            config = KvtcConfig(config.calibration, level, config.recent_tokens,
                                config.sink_tokens, config.chunk_tokens, config.tiers)
        if config.tiers is not None:
            check_tiers(config.tiers)
        return config

    # ---- encode ----------------------------------------------------------------------
    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        L, T, H, D = k.shape
        cfg = self.resolve_config(L, level, config)
        cal = _resolve_calibration(cfg.calibration, L, H, D)
        lvl = cal.default_level if cfg.level is None else cfg.level
        if lvl not in cal.levels:
            raise ValueError(f"unknown kvtc level {lvl!r}; calibration {cal.hash[:16]} has "
                             f"levels {list(cal.levels)}")
        sink = DEFAULT_LEVEL_SINKS.get(lvl, cal.sink_tokens) if cfg.sink_tokens is None \
            else cfg.sink_tokens
        recent = cal.recent_tokens if cfg.recent_tokens is None else cfg.recent_tokens
        for nm, x in (("sink_tokens", sink), ("recent_tokens", recent)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"{nm} must be an int >= 0, got {x!r}")
        tiers = check_tiers(level_tiers(lvl) if cfg.tiers is None else cfg.tiers)
        for _, b in tiers:
            if b not in cal.levels:
                raise ValueError(f"tier level {b!r} is not a level of calibration "
                                 f"{cal.hash[:16]} ({list(cal.levels)})")
        ns, nr = _exact_counts(T, token_offset, total_tokens, sink, recent)
        Tq = T - ns - nr
        spans = _tail_spans(token_offset + ns, token_offset + T - nr, total_tokens, tiers)
        Tb = Tq - sum(c for _, c, _ in spans)          # rows at the base level
        conf: dict[str, Any] = {"level": lvl, "calibration": cal.hash,
                                "sink_tokens": sink, "recent_tokens": recent}
        if tiers:              # absent for an untiered level: format-2 bytes unchanged
            conf["tiers"] = [[r, b] for r, b in tiers]
        header: dict[str, Any] = {"config": conf, "n_sink": ns, "n_recent": nr,
                                  "token_offset": token_offset}
        arrays: dict[str, np.ndarray] = {}
        if ns:
            arrays["sink_k"], arrays["sink_v"] = to_bits(k[:, :ns]), to_bits(v[:, :ns])
        if nr:
            arrays["recent_k"] = to_bits(k[:, T - nr:])
            arrays["recent_v"] = to_bits(v[:, T - nr:])
        # the base rows [ns, ns + Tb) at ``lvl`` (the format-2 fields), then each tail span
        fields, es, nsym = _code_rows(k[:, ns:ns + Tb], v[:, ns:ns + Tb], cal, lvl,
                                      token_offset + ns)
        header.update(fields)
        arrays.update(es.arrays)
        payload, parts = [es.payload], [es]
        if spans:
            tl = []
            for i, (start, count, b) in enumerate(spans):
                r0 = start - token_offset
                f2, e2, n2 = _code_rows(k[:, r0:r0 + count], v[:, r0:r0 + count], cal, b,
                                        start)
                tl.append({"start": start, "count": count, "level": b, **f2,
                           "payload_bytes": len(e2.payload)})
                arrays.update({_span_array(i, nm): a for nm, a in e2.arrays.items()})
                payload.append(e2.payload)
                parts.append(e2)
                nsym += n2
            header["tiers"] = tl
        stats = {"symbols": nsym, "components": cal.torch_params(lvl)["n"],
                 "sink_bytes": int(sum(a.nbytes for nm, a in arrays.items()
                                       if nm.startswith(("sink_", "recent_")))),
                 "entropy_bits": sum(e.entropy_bits for e in parts),
                 "ideal_bits": sum(e.ideal_bits for e in parts),
                 "model_bytes": sum(e.model_bytes for e in parts),
                 "length_table_bytes": sum(e.length_table_bytes for e in parts),
                 "payload_bytes": sum(e.payload_bytes for e in parts), "scale_bytes": 0,
                 "tail_tokens": Tq - Tb}
        return EncodedChunk(header, arrays, b"".join(payload), stats)

    # ---- decode ----------------------------------------------------------------------
    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None, out=None):
        """(k, v) [L, T, H, D] in ``dtype_name``; ``out``: contiguous CPU tensors of that
        shape and dtype to write into (every position is written) instead of new ones."""

        L, T, H, D = shape
        cfgd = header.get("config")
        if not isinstance(cfgd, dict):
            raise CodecError("kvtc: header lacks the config dict")
        h = cfgd.get("calibration")
        cal = get_calibration(h)
        if (cal.num_layers, cal.num_heads, cal.head_dim) != (L, H, D):
            raise CodecError(f"kvtc: calibration {h[:16]} is for L={cal.num_layers}, "
                             f"H={cal.num_heads}, D={cal.head_dim}, the data has "
                             f"L={L}, H={H}, D={D}")
        lvl = cfgd.get("level")
        if isinstance(lvl, bool) or lvl not in cal.levels:
            raise CodecError(f"kvtc: level {lvl!r} not in calibration levels {list(cal.levels)}")
        ns = need_int(header, "n_sink", 0, T)
        nr = need_int(header, "n_recent", 0, T - ns)
        Tq = T - ns - nr
        off0 = need_int(header, "token_offset", 0, 1 << 24)
        # format 3: tail spans (absolute rows [start, start + count) at their own level),
        # contiguous and ending where the coded rows end; the base rows come first
        spans = _parse_spans(header.get("tiers"), cal, off0 + ns, Tq, len(payload))
        Tb = Tq - sum(s["count"] for s in spans)
        span_bytes = sum(s["payload_bytes"] for s in spans)
        base_arrays = {nm: a for nm, a in arrays.items()
                       if nm.startswith("ent_") and not _SPAN_ARRAY_RE.match(nm)}
        pay = memoryview(payload) if not isinstance(payload, memoryview) else payload
        pos = len(pay) - span_bytes
        # (without spans the payload is passed as it came: no copy)
        jobs = [(lvl, off0 + ns, Tb, ns, header, base_arrays,
                 payload if not spans else bytes(pay[:pos]))]
        for i, s in enumerate(spans):
            pre = f"ent_t{i}_"
            sa = {"ent_" + nm[len(pre):]: a for nm, a in arrays.items() if nm.startswith(pre)}
            jobs.append((s["level"], s["start"], s["count"], s["start"] - off0, s, sa,
                         bytes(pay[pos:pos + s["payload_bytes"]])))
            pos += s["payload_bytes"]
        dt = DTYPES[dtype_name]
        res = list(out) if out is not None else \
            [_scratch.empty((L, T, H, D), dtype=dt) for _ in range(2)]   # model dtype
        with torch.inference_mode():
            for kv, tag in enumerate(("k", "v")):
                if ns:
                    res[kv][:, :ns] = from_bits(arrays.get(f"sink_{tag}"), dtype_name,
                                                (L, ns, H, D), f"sink_{tag}")
                if nr:
                    res[kv][:, T - nr:] = from_bits(arrays.get(f"recent_{tag}"), dtype_name,
                                                    (L, nr, H, D), f"recent_{tag}")
            for lv, start, count, row, hdr, ent_arrays, pl in jobs:
                P = cal.torch_params(lv)
                srcs, offs = _decode_rows(hdr, ent_arrays, pl, cal, lv, P, L, count)
                if not count:
                    continue
                if cal.group_layers:
                    self._inverse_grouped(
                        srcs[0], offs[0], P, cal, (L, count, H, D),
                        start if cal.key_space == "pre_rope" else None,
                        res[0][:, row:row + count], res[1][:, row:row + count])
                    continue
                for kv in (0, 1):
                    self._inverse(
                        srcs[kv], offs[kv], P, kv, (L, count, H, D),
                        start if kv == 0 and cal.key_space == "pre_rope" else None,
                        cal.rope_theta, out=res[kv][:, row:row + count])
        return res[0], res[1]

    def identity(self, level=None, config=None, num_layers=None) -> dict:
        """Part of ``codec.config_hash`` (store keys): the kvtc bitstream format version
        (``KVTC_FORMAT_VERSION`` = 2 for a level without tail tiers, so that store entries
        of untiered levels written before format 3 stay valid; ``KVTC_TIERED_FORMAT`` = 3
        with the level's tiers ``[[tokens, level], ...]`` for a tiered one) and the level's
        own sink count (``DEFAULT_LEVEL_SINKS``, when it has one), so that a store entry of
        an older format or an older level table is never served.
        ``level``: None = the default level; ``config``: a KvtcConfig whose ``tiers``
        overrides the table. It sees no calibration: a grouped calibration's chunks (format
        4) get the same 2 or 3; the calibration hash, which the store's entry identity
        holds and every chunk header names, tells them apart."""
        lvl = DEFAULT_LEVEL if level is None else level
        if config is not None and getattr(config, "level", None) is not None:
            lvl = config.level
        t = getattr(config, "tiers", None)
        tiers = check_tiers(level_tiers(lvl) if t is None else t)
        sinks = {} if lvl not in DEFAULT_LEVEL_SINKS else {
            "sink_tokens": int(DEFAULT_LEVEL_SINKS[lvl])}
        if not tiers:
            return {"kvtc_format": KVTC_FORMAT_VERSION, **sinks}
        return {"kvtc_format": KVTC_TIERED_FORMAT, "tiers": [[r, b] for r, b in tiers],
                **sinks}

    @staticmethod
    def _inverse(sym, offs: list, P: dict, kv: int, shape: tuple,
                 rope_from: Optional[int], theta: float,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """KV [L, Tq, H, D] from the symbols (uint8 [L, Tq, n] in the padded layout, or a
        ``_KeptSymbols`` of the kept layout), written into ``out`` (any float dtype, e.g. a
        view of the model-dtype result; None = a new float32 tensor, returned either way).

        Per layer l (at its kept width n_l, dropped components are never multiplied):
        x = sym[:, :n_l] @ B_s[:n_l] + (mean - off * colsum(B_s)), one float32 ``addmm``
        with the step-scaled inverse basis B_s (x = (sym - off) * step @ B^T + mean).
        With centroid offsets (``P["shrink"]``) the coefficients are centred first and
        each non-zero one moved toward 0 by its component's offset:
        x = (q - shrink sign(q)) @ B_s^T + mean. Keys coded before RoPE
        (``rope_from`` = the first token's position; None = no RoPE) are rotated in place
        in that float32 layer (``_rope_rows_py``, a numba kernel: rotate-half RoPE,
        RoFormer eq. 34, [x1 cos - x2 sin, x2 cos + x1 sin] per head; torch ops without
        numba), then the layer is cast into ``out``. No full-size float32 intermediate: each
        worker casts one layer's kept symbol columns at a time into its own buffers.

        Threads: with one worker (``_decode_workers()``: max of torch's and numba's
        thread counts) the layers run in the calling thread; with more, the layers are
        split over ``_decode_pool()`` (Python threads, each running torch ops on one
        thread; torch releases the GIL), so the cores work on whole layers instead of
        synchronising many small parallel regions (a per-layer loop with 2 OpenMP
        threads collapsed ~8x on a busy machine; docs/codec.md section 8.4). Each layer's
        arithmetic is the same ops in the same order either way, so the bytes do not
        depend on the thread count. float32 rounding only: ``_inverse_ref`` (the
        textbook path) agrees within float32 rounding (tests/codec/test_kvtc_decode_fast.py).
        bf16 products: with a bf16 ``out``, no centroid offsets and a CPU with bf16 dot
        products (``_bf16_gemm``), the product is a bf16 ``addmm`` (float32 accumulation)
        of the exact integer coefficients q - off with the step-scaled basis and the mean
        rounded to bf16 (values written straight into ``out``; keys rotated by
        ``_rope_bf16_py`` on the bf16 bits: widened exactly, RoPE in float32, rounded
        once); error within eps_bf16 (|x| + |q| @ |B_s| + |mean|) of the float32 result
        (twice the pair's bound after RoPE; tests/codec/test_kvtc_decode_fast.py), 2-4x faster
        than the float32 product (docs/codec.md 8.4b).
        """
        L, Tq, H, D = shape
        C = H * D
        rope = rope_from is not None
        if out is None:
            out = _scratch.empty((L, Tq, H, D), dtype=torch.float32)
        if L == 0 or Tq == 0:
            return out
        basis = P["basis_ts"][kv]                                         # [L, n, C]
        keep = P["keep"][kv]
        n = basis.shape[1]
        if isinstance(sym, _KeptSymbols):
            pieces = sym.pieces
        else:
            symt = torch.from_numpy(np.ascontiguousarray(sym, np.uint8))  # [L, Tq, n]

            def pieces(layer):
                return [(0, keep[layer], symt[layer, :, :keep[layer]])]
        offt = torch.tensor(offs, dtype=torch.float32)
        shrink = P.get("shrink")
        if shrink is not None:
            shrink = shrink[kv]                                          # [L, 1, n]
            bias = P["mean"][kv, :, 0]                                   # [L, C]
        else:
            bias = P["mean"][kv, :, 0] - offt[:, None] * P["colsum"][kv]   # [L, C]
        h = D // 2
        kern = _rope_kernel() if rope else None
        # bf16 destination, integer coefficients (no centroid offsets) and a CPU with bf16
        # dot products: the product runs in bf16 with float32 accumulation (2-4x faster
        # than float32 here; the basis and mean are rounded to bf16 once, docs/codec.md 8.4b)
        bf16 = out.dtype == torch.bfloat16 and shrink is None and _bf16_gemm()
        if bf16:
            if "basis_ts_bf16" not in P:     # cached beside the float32 tensors
                P["basis_ts_bf16"] = P["basis_ts"].to(torch.bfloat16)
                P["mean_bf16"] = P["mean"][:, :, 0].to(torch.bfloat16)
            basis_h = P["basis_ts_bf16"][kv]                              # [L, n, C]
            mean_h = P["mean_bf16"][kv]                                   # [L, C]
        kern16 = _rope_bf16_kernel() if (bf16 and rope and kern is not None) else None
        if rope:
            cos_full, sin_signed, cos_np, sin_np = _rope_tables(rope_from, Tq, D, theta)

        def layers(idx) -> None:
            with torch.inference_mode():    # a worker thread does not inherit the mode
                _layers(idx)

        def _layers(idx) -> None:
            x = _scratch.empty((Tq, C), dtype=torch.float32)
            # the coefficient operands are flat buffers whose first Tq * nl elements are
            # viewed as a CONTIGUOUS [Tq, nl] matrix (never a column slice of [Tq, n]: on
            # AMX oneDNN's bf16 GEMM reads a row up to its stride, codec/scratch.py)
            qb = _scratch.empty((Tq * n,), dtype=torch.bfloat16 if bf16 else torch.float32)
            xh = _scratch.empty((Tq, C), dtype=torch.bfloat16) if bf16 else None
            q16 = _scratch.empty((Tq * n,), dtype=torch.int16) if bf16 else None
            for layer in idx:
                nl = keep[layer]
                if bf16:
                    # straight into the destination unless RoPE follows (then via float32)
                    dst = out[layer].view(Tq, C) if not rope and out[layer].is_contiguous() \
                        else xh
                    if nl:
                        q, qi = _rows(qb, Tq, nl), _rows(q16, Tq, nl)
                        for lo, hi, src in pieces(layer):
                            qi[:, lo:hi].copy_(src)
                        qi -= offs[layer]        # integer q = symbol - M (int16 ops are
                        q.copy_(qi)              # ~2x faster than bf16 ones); exact in bf16
                        torch.addmm(mean_h[layer], q, basis_h[layer, :nl], out=dst)
                    else:
                        dst.copy_(mean_h[layer].expand(Tq, C))
                    if not rope:
                        if dst is xh:
                            out[layer].copy_(xh.view(Tq, H, D))
                        continue
                    if kern16 is not None and out[layer].is_contiguous():
                        kern16(xh.view(torch.int16).numpy().view(np.uint16).reshape(Tq, H, D),
                               out[layer].view(torch.int16).numpy().view(np.uint16),
                               cos_np, sin_np)
                        continue
                    x.copy_(xh)
                elif nl:
                    q = _rows(qb, Tq, nl)
                    for lo, hi, src in pieces(layer):    # symbols of the kept columns
                        q[:, lo:hi].copy_(src)
                    if shrink is not None:
                        q -= offt[layer]
                        q.addcmul_(torch.sign(q), shrink[layer, :, :nl], value=-1.0)
                    torch.addmm(bias[layer], q, basis[layer, :nl], out=x)
                else:
                    x.copy_(bias[layer].expand(Tq, C))
                xv = x.view(Tq, H, D)
                if rope and kern is not None:
                    kern(x.numpy().reshape(Tq, H, D), cos_np, sin_np)   # in place
                elif rope:   # no numba: the same arithmetic with torch ops
                    xv = xv * cos_full + xv.roll(h, dims=-1) * sin_signed
                out[layer].copy_(xv)

        _split_over_workers(layers, L)
        return out

    @staticmethod
    def _inverse_grouped(sym: "_KeptSymbols", offs: list, P: dict, cal: KvtcCalibration,
                         shape: tuple, rope_from: Optional[int], out_k: torch.Tensor,
                         out_v: torch.Tensor) -> None:
        """K and V [L, Tq, H, D] of a grouped calibration from the symbols of its layer
        groups, written into ``out_k`` / ``out_v`` (views of the model-dtype result).

        Per group g: x = (sym - off) @ B_s[:n_g] + mean, one ``addmm`` [Tq, n_g] x [n_g,
        Cg] (bf16 with float32 accumulation for a bf16 destination on a CPU with bf16 dot
        products, ``_bf16_gemm``; float32 otherwise), then each layer's V slice is copied
        out and its K slice rotated by RoPE from ``rope_from`` (None = no RoPE; the same
        numba kernels as ``_inverse``). Groups are split over ``_decode_pool()`` as
        ``_inverse`` splits layers; each group's arithmetic is the same whatever the thread
        count, so the result does not depend on it."""
        L, Tq, H, D = shape
        C = H * D
        if L == 0 or Tq == 0:
            return
        NG, G = cal.num_groups, cal.group_layers
        keep = P["keep"][0]
        basis = P["basis_ts"]                                              # [NG, n, Cg]
        n, Cg = basis.shape[1], basis.shape[2]
        rope = rope_from is not None
        bf16 = out_k.dtype == torch.bfloat16 and out_v.dtype == torch.bfloat16 and \
            _bf16_gemm()
        if bf16:
            if "basis_ts_bf16" not in P:
                P["basis_ts_bf16"] = P["basis_ts"].to(torch.bfloat16)
                P["mean_bf16"] = P["mean"][:, 0].to(torch.bfloat16)
            basis_h, mean_h = P["basis_ts_bf16"], P["mean_bf16"]
        else:
            offt = torch.tensor(offs, dtype=torch.float32)
            bias = P["mean"][:, 0] - offt[:, None] * P["colsum"]              # [NG, Cg]
        kern = _rope_kernel() if rope else None
        kern16 = _rope_bf16_kernel() if (bf16 and rope and kern is not None) else None
        if rope:
            cos_full, sin_signed, cos_np, sin_np = _rope_tables(rope_from, Tq, D,
                                                                cal.rope_theta)
        h = D // 2

        def groups(idx) -> None:
            with torch.inference_mode():
                _groups(idx)

        def _groups(idx) -> None:
            xb = _scratch.empty((Tq, Cg), dtype=torch.bfloat16 if bf16 else torch.float32)
            # flat operands viewed as contiguous [Tq, nl] (as in ``_inverse``)
            qb = _scratch.empty((Tq * n,), dtype=torch.bfloat16 if bf16 else torch.float32)
            q16 = _scratch.empty((Tq * n,), dtype=torch.int16) if bf16 else None
            kb = _scratch.empty((Tq, C), dtype=xb.dtype) if rope else None
            kf = _scratch.empty((Tq, C), dtype=torch.float32) if rope else None
            for g in idx:
                nl = keep[g]
                if nl:
                    if bf16:
                        q, qi = _rows(qb, Tq, nl), _rows(q16, Tq, nl)
                        for lo, hi, src in sym.pieces(g):
                            qi[:, lo:hi].copy_(src)
                        qi -= offs[g]              # exact integers, exact in bf16
                        q.copy_(qi)
                        torch.addmm(mean_h[g], q, basis_h[g, :nl], out=xb)
                    else:
                        q = _rows(qb, Tq, nl)
                        for lo, hi, src in sym.pieces(g):
                            q[:, lo:hi].copy_(src)
                        torch.addmm(bias[g], q, basis[g, :nl], out=xb)
                else:
                    xb.copy_((mean_h[g] if bf16 else P["mean"][g, 0]).expand(Tq, Cg))
                for j, layer in enumerate(cal.group_layer_ids(g)):
                    ks = xb[:, 2 * j * C:(2 * j + 1) * C]
                    out_v[layer].view(Tq, C).copy_(xb[:, (2 * j + 1) * C:(2 * j + 2) * C])
                    ok = out_k[layer]
                    if not rope:
                        ok.view(Tq, C).copy_(ks)
                        continue
                    if kern16 is not None and ok.is_contiguous():
                        kb.copy_(ks)
                        kern16(kb.view(torch.int16).numpy().view(np.uint16).reshape(Tq, H, D),
                               ok.view(torch.int16).numpy().view(np.uint16), cos_np, sin_np)
                        continue
                    kf.copy_(ks)
                    if kern is not None:
                        kern(kf.numpy().reshape(Tq, H, D), cos_np, sin_np)
                        ok.copy_(kf.view(Tq, H, D))
                    else:
                        xv = kf.view(Tq, H, D)
                        ok.copy_(xv * cos_full + xv.roll(h, dims=-1) * sin_signed)

        _split_over_workers(groups, NG)

    @staticmethod
    def _inverse_ref(sym: np.ndarray, offs: list, P: dict, kv: int, shape: tuple,
                     rope_from: Optional[int], theta: float) -> torch.Tensor:
        """Reference (textbook, slow) inverse of ``_inverse``, float32 [L, Tq, H, D]:
        coefficients c = (sym - off) (centroid: c - shrink sign(c)), x = (c * step) @ B^T
        + mean with the unscaled kept basis, then ``apply_rope`` from ``rope_from``. For
        tests and the decode benchmark only."""
        L, Tq, H, D = shape
        c = torch.from_numpy(np.ascontiguousarray(sym, np.uint8)).to(torch.float32)
        c = c - torch.tensor(offs, dtype=torch.float32)[:, None, None]
        if P.get("shrink") is not None:
            c = c - torch.sign(c) * P["shrink"][kv]
        x = torch.bmm(c * P["step"][kv], P["basis_t"][kv]) + P["mean"][kv]
        x = x.reshape(L, Tq, H, D)
        if rope_from is not None:
            x = apply_rope(x, torch.arange(rope_from, rope_from + Tq), theta)
        return x
