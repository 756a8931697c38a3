"""The ``kvtc`` codec: ``KvtcCodec`` (encode one chunk of K, V [L, T, H, D] fp16/bf16/fp32
to header + arrays + payload, decode back), in named steps: encode = ``_plan`` (calibration,
level, exact tokens, tail spans) then ``_write`` (the container; rows coded by
codec/kvtc/layout.py); decode = ``_read`` (header checks, the payload split into jobs)
then the inverse transform of each job (codec/kvtc/inverse.py). Its per-call options
``KvtcConfig`` are codec/kvtc/options.py's.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from .. import level_table
from .. import scratch
from ..base import DTYPES, EncodedChunk, from_bits, need_int, to_bits
from ..errors import CodecError

from . import calibration, layout
from .calibration import DEFAULT_LEVEL, level_tiers
from .inverse import inverse_groups, inverse_layers
from .options import KvtcConfig
from .registry import CalibrationArtifacts, get_calibration, resolve_calibration
from .layout import (SPAN_ARRAY_RE, check_tiers, code_rows, decode_rows, exact_counts,
                     parse_spans, span_array, tail_spans)


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
    artifacts = CalibrationArtifacts()   # its calibrations as bytes, for codec.artifacts

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

    # ---- encode: plan, then write -----------------------------------------------------
    def encode(self, k, v, *, level, config, token_offset, total_tokens, backend="cpu"):
        """EncodedChunk of K, V [L, T, H, D] (fp16/bf16/fp32) at absolute positions
        [token_offset, token_offset + T) of a context of ``total_tokens``: ``_plan`` (the
        calibration, level, exact tokens and tail spans), then ``_write`` (sinks / recent
        tokens as bits, the base rows and each tail span coded by ``layout.code_rows``).
        Raises ValueError on bad options or a calibration that does not fit the KV."""
        plan = self._plan(k.shape, level, config, token_offset, total_tokens)
        return self._write(k, v, plan, token_offset)

    def _plan(self, shape: tuple, level, config, token_offset: int, total_tokens: int
              ) -> dict:
        """What an encode codes: {cal, level, sink, recent, tiers, ns, nr (exact tokens at
        the chunk's start / end), Tb (rows at the base level), spans [(start, count,
        level)] (the tail rows, absolute positions)}. Raises ValueError."""
        L, T, H, D = shape
        cfg = self.resolve_config(L, level, config)
        cal = resolve_calibration(cfg.calibration, L, H, D)
        lvl = cal.default_level if cfg.level is None else cfg.level
        if lvl not in cal.levels:
            raise ValueError(f"unknown kvtc level {lvl!r}; calibration {cal.hash[:16]} has "
                             f"levels {list(cal.levels)}")
        sink = calibration.DEFAULT_LEVEL_SINKS.get(lvl, cal.sink_tokens) \
            if cfg.sink_tokens is None else cfg.sink_tokens
        recent = cal.recent_tokens if cfg.recent_tokens is None else cfg.recent_tokens
        for nm, x in (("sink_tokens", sink), ("recent_tokens", recent)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"{nm} must be an int >= 0, got {x!r}")
        tiers = check_tiers(level_tiers(lvl) if cfg.tiers is None else cfg.tiers)
        for _, b in tiers:
            if b not in cal.levels:
                raise ValueError(f"tier level {b!r} is not a level of calibration "
                                 f"{cal.hash[:16]} ({list(cal.levels)})")
        ns, nr = exact_counts(T, token_offset, total_tokens, sink, recent)
        spans = tail_spans(token_offset + ns, token_offset + T - nr, total_tokens, tiers)
        return {"cal": cal, "level": lvl, "sink": sink, "recent": recent, "tiers": tiers,
                "ns": ns, "nr": nr, "Tb": T - ns - nr - sum(c for _, c, _ in spans),
                "spans": spans}

    @staticmethod
    def _write(k, v, plan: dict, token_offset: int) -> EncodedChunk:
        """The chunk of ``plan`` (``_plan``): header, arrays, payload (base rows, then each
        tail span's bytes) and the stats ``codec.api`` reports."""
        T = k.shape[1]
        cal, lvl, ns, nr, Tb = plan["cal"], plan["level"], plan["ns"], plan["nr"], plan["Tb"]
        conf: dict[str, Any] = {"level": lvl, "calibration": cal.hash,
                                "sink_tokens": plan["sink"], "recent_tokens": plan["recent"]}
        if plan["tiers"]:      # absent for an untiered level: format-2 bytes unchanged
            conf["tiers"] = [[r, b] for r, b in plan["tiers"]]
        header: dict[str, Any] = {"config": conf, "n_sink": ns, "n_recent": nr,
                                  "token_offset": token_offset}
        arrays: dict[str, np.ndarray] = {}
        if ns:
            arrays["sink_k"], arrays["sink_v"] = to_bits(k[:, :ns]), to_bits(v[:, :ns])
        if nr:
            arrays["recent_k"] = to_bits(k[:, T - nr:])
            arrays["recent_v"] = to_bits(v[:, T - nr:])
        # the base rows [ns, ns + Tb) at ``lvl`` (the format-2 fields), then each tail span
        fields, es, nsym = code_rows(k[:, ns:ns + Tb], v[:, ns:ns + Tb], cal, lvl,
                                     token_offset + ns)
        header.update(fields)
        arrays.update(es.arrays)
        payload, parts = [es.payload], [es]
        if plan["spans"]:
            tl = []
            for i, (start, count, b) in enumerate(plan["spans"]):
                r0 = start - token_offset
                f2, e2, n2 = code_rows(k[:, r0:r0 + count], v[:, r0:r0 + count], cal, b,
                                       start)
                tl.append({"start": start, "count": count, "level": b, **f2,
                           "payload_bytes": len(e2.payload)})
                arrays.update({span_array(i, nm): a for nm, a in e2.arrays.items()})
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
                 "tail_tokens": T - ns - nr - Tb}
        return EncodedChunk(header, arrays, b"".join(payload), stats)

    # ---- decode: read the header, then inverse-transform each job -----------------------
    def decode(self, header, arrays, payload, shape, dtype_name, *, backend="cpu",
               device=None, out=None):
        """(k, v) [L, T, H, D] in ``dtype_name``; ``out``: contiguous CPU tensors of that
        shape and dtype to write into (every position is written) instead of new ones.
        ``_read`` checks the header and splits the payload into jobs (the base rows and
        each tail span); the exact tokens are copied in, then each job's symbols are
        decoded (``layout.decode_rows``) and inverse-transformed in place
        (``codec.kvtc.inverse``). Raises CodecError."""
        L, T, H, D = shape
        cal, ns, nr, jobs = self._read(header, arrays, payload, shape)
        res = list(out) if out is not None else \
            [scratch.empty((L, T, H, D), dtype=DTYPES[dtype_name]) for _ in range(2)]
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
                srcs, offs = decode_rows(hdr, ent_arrays, pl, cal, lv, P, L, count)
                if not count:
                    continue
                if cal.group_layers:
                    inverse_groups(
                        srcs[0], offs[0], P, cal, (L, count, H, D),
                        start if cal.key_space == "pre_rope" else None,
                        res[0][:, row:row + count], res[1][:, row:row + count])
                    continue
                for kv in (0, 1):
                    inverse_layers(
                        srcs[kv], offs[kv], P, kv, (L, count, H, D),
                        start if kv == 0 and cal.key_space == "pre_rope" else None,
                        cal.rope_theta, out=res[kv][:, row:row + count])
        return res[0], res[1]

    @staticmethod
    def _read(header: dict, arrays: dict, payload, shape: tuple) -> tuple:
        """(calibration, n_sink, n_recent, jobs) of a chunk: each job (level, first
        position, rows, first row in the chunk, its header fields, its ent_* arrays, its
        payload bytes), the base rows first, then each tail span (format 3). Raises
        CodecError on any inconsistent field or a missing / different calibration."""
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
        spans = parse_spans(header.get("tiers"), cal, off0 + ns, Tq, len(payload))
        Tb = Tq - sum(s["count"] for s in spans)
        span_bytes = sum(s["payload_bytes"] for s in spans)
        base_arrays = {nm: a for nm, a in arrays.items()
                       if nm.startswith("ent_") and not SPAN_ARRAY_RE.match(nm)}
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
        return cal, ns, nr, jobs

    def identity(self, level=None, config=None, num_layers=None) -> dict:
        """Part of ``codec.config_hash`` (store keys): the kvtc bitstream format version
        (``layout.KVTC_FORMAT_VERSION`` = 2 for a level without tail tiers, so that store entries
        of untiered levels written before format 3 stay valid; ``layout.KVTC_TIERED_FORMAT`` = 3
        with the level's tiers ``[[tokens, level], ...]`` for a tiered one) and the level's
        own sink count (``calibration.DEFAULT_LEVEL_SINKS``, when it has one), so that a store entry of
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
        sinks = {} if lvl not in calibration.DEFAULT_LEVEL_SINKS else {
            "sink_tokens": int(calibration.DEFAULT_LEVEL_SINKS[lvl])}
        if not tiers:
            return {"kvtc_format": layout.KVTC_FORMAT_VERSION, **sinks}
        return {"kvtc_format": layout.KVTC_TIERED_FORMAT, "tiers": [[r, b] for r, b in tiers],
                **sinks}
