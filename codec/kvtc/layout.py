"""KVTC bitstream layouts: which coefficient columns are coded and how (format 1 "padded"
decode only, format 2 "kept", format 3 tail-tier spans, format 4 "grouped"), the tier
checks, the token spans of a chunk, and the row coders ``code_rows`` /
``decode_rows`` between K/V rows and entropy-coded symbols (the kept layout's pieces are
codec/kvtc/kept.py's). A grouped calibration (kvtc format 4, layout "grouped") codes
each layer group's features [K_l, V_l, ...] transformed by the group's analysis matrix in
the same kept layout (``_code_rows_grouped`` / ``_decode_rows_grouped``).
docs/bitstream.md 4.5 describes the formats. Errors: ``CodecError`` on a bad header.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from ..base import need_int
from ..errors import CodecError

from .rope import undo_rope
from .calibration import KvtcCalibration, MAX_Q
from .kept import KeptSymbols, decode_kept, kept_halves, n_kept


def exact_counts(T: int, token_offset: int, total_tokens: int, sink: int, recent: int
                  ) -> tuple[int, int]:
    """(tokens at the start of this chunk that are attention sinks, tokens at its end that
    are among the last ``recent`` of the context)."""
    ns = max(0, min(T, sink - token_offset))
    first_recent = max(total_tokens - recent, token_offset + ns)
    nr = max(0, min(T - ns, token_offset + T - first_recent))
    return ns, nr


# Column layouts of the coded symbols (docs/bitstream.md 4.5). Format 1 ("padded", header
# field ``layout`` absent): K and V each [L, Tq, n], n = the level's largest kept width,
# columns past a layer's own count always the offset symbol. Format 2 (``layout`` =
# "kept"): only each (K/V, layer)'s kept columns, in one [Tq, S] concatenation split into
# two equal halves (the entropy stage's K and V arrays, [1, Tq, ceil(S/2)] each).
KVTC_FORMAT_VERSION = 2
KVTC_TIERED_FORMAT = 3           # a tiered level's chunks: format 2 plus tail spans
KVTC_LAYOUT = "kept"
_PADDED = None


MAX_TIERS = 8                    # spans per chunk at most (header validation)


def check_tiers(tiers: Any) -> tuple:
    """``tiers`` as a tuple of (tokens, level) int pairs, tokens >= 1, at most
    ``MAX_TIERS``. Raises ValueError otherwise (the levels are checked against the
    calibration by the encoder)."""
    try:
        out = tuple((r, b) for r, b in tiers)
    except (TypeError, ValueError):
        raise ValueError(f"tiers must be a sequence of (tokens, level) pairs, got "
                         f"{tiers!r}") from None
    if len(out) > MAX_TIERS or any(
            isinstance(x, bool) or not isinstance(x, int) for p in out for x in p) or \
            any(r < 1 for r, _ in out):
        raise ValueError(f"tiers must be at most {MAX_TIERS} (tokens >= 1, level) int "
                         f"pairs, got {tiers!r}")
    return out


def tail_spans(lo: int, hi: int, total: int, tiers: tuple) -> list:
    """[(first absolute token, count, level)] ascending: the rows of the coded range
    [lo, hi) that fall in each tier (the last R1 tokens of ``total`` at B1, the R2 before
    them at B2, ...). Contiguous, and the last one ends at ``hi`` when any exists."""
    spans, end = [], total
    for r, b in tiers:
        s, e = max(end - r, lo), min(end, hi)
        if e > s:
            spans.append((s, e - s, b))
        end -= r
        if end <= lo:
            break
    return spans[::-1]


SPAN_ARRAY_RE = re.compile(r"^ent_t\d+_")


def span_array(i: int, name: str) -> str:
    """Container name of tail span i's entropy array ``name`` (ent_X -> ent_t<i>_X)."""
    return f"ent_t{i}_{name[4:]}"


def parse_spans(raw: Any, cal: KvtcCalibration, first: int, Tq: int, paylen: int
                 ) -> list:
    """Validated ``tiers`` header list of a format-3 chunk (None/absent = no spans).
    Each span: start, count >= 1, level (a calibration level), payload_bytes; contiguous,
    ending at first + Tq (the end of the coded rows), payload_bytes summing to at most
    ``paylen``. Raises CodecError otherwise."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_TIERS:
        raise CodecError(f"kvtc: header tiers must be a list of 1..{MAX_TIERS} spans")
    spans, used = [], 0
    for i, s in enumerate(raw):
        if not isinstance(s, dict):
            raise CodecError(f"kvtc: tail span {i} is not a dict")
        vals = {}
        for key, lo_, hi_ in (("start", first, first + Tq), ("count", 1, Tq),
                              ("payload_bytes", 0, paylen)):
            x = s.get(key)
            if isinstance(x, bool) or not isinstance(x, int) or not lo_ <= x <= hi_:
                raise CodecError(f"kvtc: tail span {i} field {key!r} must be an int in "
                                 f"[{lo_}, {hi_}], got {x!r}")
            vals[key] = x
        lv = s.get("level")
        if isinstance(lv, bool) or lv not in cal.levels:
            raise CodecError(f"kvtc: tail span {i} level {lv!r} not in calibration levels "
                             f"{list(cal.levels)}")
        if spans and vals["start"] != spans[-1]["start"] + spans[-1]["count"]:
            raise CodecError(f"kvtc: tail span {i} does not follow span {i - 1}")
        used += vals["payload_bytes"]
        spans.append({**s, **vals, "level": lv})
    if spans[-1]["start"] + spans[-1]["count"] != first + Tq or used > paylen:
        raise CodecError("kvtc: tail spans do not end at the last coded row or exceed "
                         "the payload")
    return spans


def code_rows(k: torch.Tensor, v: torch.Tensor, cal: KvtcCalibration, lvl: int,
               pos0: int) -> tuple[dict, Any, int]:
    """Transform-code the rows k, v [L, Tr, H, D] (absolute positions pos0, pos0 + 1, ...:
    keys of a pre-RoPE calibration are rotated back there) at ``lvl``, kept layout
    (format 2). Returns (the header fields layout, n_kept, offset_k, offset_v, entropy;
    the ``codec.entropy.EncodedSymbols``; the number of coded symbols)."""
    from ..entropy import encode_symbols

    L, Tq, H, D = k.shape
    P = cal.torch_params(lvl)
    keep = P["keep"]
    if cal.group_layers:
        return _code_rows_grouped(k, v, cal, P, pos0)
    syms, offs = [], []
    for kv, x in enumerate((k, v)):
        x = x.to(torch.float32)
        if kv == 0 and cal.key_space == "pre_rope" and Tq:
            x = undo_rope(x, torch.arange(pos0, pos0 + Tq), cal.rope_theta)
        xc = x.reshape(L, Tq, H * D) - P["mean"][kv]
        coef = torch.bmm(xc, P["basis"][kv]) / P["step"][kv]         # [L, Tq, n]
        if cal.rounding == 0.5:
            q = torch.round(coef)
        else:          # dead zone: sign(u) floor(|u| + rounding)
            q = torch.floor(coef.abs() + cal.rounding).copysign_(coef)
        q = q.clamp_(-MAX_Q, MAX_Q).to(torch.int16)
        off = q.abs().amax(dim=(1, 2)) if Tq else torch.zeros(L, dtype=torch.int16)
        syms.append((q + off[:, None, None]).to(torch.uint8).numpy())
        offs.append([int(o) for o in off])
    # layout "kept" (format 2): only each (K/V, layer)'s own kept columns are coded,
    # concatenated (K layers 0..L-1, then V) into [Tq, S] and split in two halves
    sym_a, sym_b, nba, nbb = kept_halves(syms, keep, offs, Tq)
    es = encode_symbols(sym_a, sym_b, [nba], [nbb], channels_per_stream=4)
    return ({"layout": KVTC_LAYOUT, "n_kept": n_kept(keep), "offset_k": offs[0],
             "offset_v": offs[1], "entropy": es.header}, es, int(sym_a.size + sym_b.size))


def decode_rows(hdr: dict, ent_arrays: dict, payload: Any, cal: KvtcCalibration,
                 lvl: int, P: dict, L: int, Tq: int) -> tuple[list, list]:
    """The symbols of Tq rows coded at ``lvl`` (header fields ``hdr``: layout, n_kept or
    n_components, offset_k/v, entropy): ([K, V] as ``KeptSymbols`` or uint8 [L, Tq, n],
    [offset_k, offset_v]). Raises CodecError on any inconsistency."""
    from ..entropy import decode_symbols

    keep = P["keep"]
    layout = hdr.get("layout", _PADDED)
    if (layout == KVTC_GROUPED_LAYOUT) != bool(cal.group_layers):
        raise CodecError(f"kvtc: column layout {layout!r} does not match calibration "
                         f"{cal.hash[:16]} (group_layers {cal.group_layers})")
    if cal.group_layers:
        return _decode_rows_grouped(hdr, ent_arrays, payload, cal, lvl, keep, Tq)
    offs = []
    for tag in ("k", "v"):
        o = hdr.get(f"offset_{tag}")
        if not isinstance(o, list) or len(o) != L or any(
                isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_Q
                for x in o):
            raise CodecError(f"kvtc: bad offset_{tag} in header")
        offs.append(o)
    ent = hdr.get("entropy")
    if not isinstance(ent, dict):
        raise CodecError("kvtc: missing entropy-coder header")
    if layout == KVTC_LAYOUT:            # format 2: each layer's kept columns only
        a, b = decode_kept(hdr, ent, ent_arrays, payload, keep, offs, 2 * L * cal.C, lvl, Tq)
        return [KeptSymbols(a, b, keep, kv) for kv in (0, 1)], offs
    if layout == _PADDED and "start" not in hdr:   # format 1: the max kept width
        n = need_int(hdr, "n_components", 1, cal.C)
        if n != P["n"]:
            raise CodecError(f"kvtc: header has {n} components, level {lvl} of the "
                             f"calibration codes {P['n']}")
        nbk = [max(2, 2 * o + 1) for o in offs[0]]
        nbv = [max(2, 2 * o + 1) for o in offs[1]]
        srcs = list(decode_symbols(ent, ent_arrays, payload, L, Tq, n, nbk, nbv))
        for sym, tag in zip(srcs, "kv"):
            if sym.shape != (L, Tq, n):
                raise CodecError(f"kvtc: decoded {tag} symbols have shape {sym.shape}")
        return srcs, offs
    raise CodecError(f"kvtc: unknown column layout {layout!r} (this decoder reads "
                     f"{KVTC_LAYOUT!r} and, outside tail spans, the older padded layout, "
                     f"field absent)")

KVTC_GROUPED_FORMAT = 4          # chunks of a grouped calibration (layout "grouped")
KVTC_GROUPED_LAYOUT = "grouped"


def _group_features(k: torch.Tensor, v: torch.Tensor, cal: KvtcCalibration, pos0: int
                    ) -> torch.Tensor:
    """float32 [NG, Tr, Cg]: each layer group's features [K_l, V_l, ...] of rows k, v [L,
    Tr, H, D] (keys rotated back by RoPE at positions pos0, ... for a pre-RoPE
    calibration), zero-padded past a short last group."""
    L, Tr, H, D = k.shape
    C, G = H * D, cal.group_layers
    kf = k.to(torch.float32)
    if cal.key_space == "pre_rope" and Tr:
        kf = undo_rope(kf, torch.arange(pos0, pos0 + Tr), cal.rope_theta)
    X = torch.zeros((cal.num_groups, Tr, 2 * G * C), dtype=torch.float32)
    for g in range(cal.num_groups):
        for j, layer in enumerate(cal.group_layer_ids(g)):
            X[g, :, 2 * j * C:(2 * j + 1) * C] = kf[layer].reshape(Tr, C)
            X[g, :, (2 * j + 1) * C:(2 * j + 2) * C] = v[layer].reshape(Tr, C)
    return X


def _code_rows_grouped(k: torch.Tensor, v: torch.Tensor, cal: KvtcCalibration, P: dict,
                       pos0: int) -> tuple[dict, Any, int]:
    """``code_rows`` of a grouped calibration (kvtc format 4, layout "grouped"): per layer
    group, coefficients (x - mean) @ analysis / step rounded, |q| <= MAX_Q, symbol = q +
    the group's offset (max |q|); the kept columns of all groups concatenated [Tr, S] and
    split into two halves for ``codec.entropy.encode_symbols``. Header fields: layout,
    n_kept (S), offsets (per group), entropy."""
    from ..entropy import encode_symbols

    Tq = k.shape[1]
    keep = P["keep"]
    X = _group_features(k, v, cal, pos0)
    coef = torch.bmm(X - P["mean"], P["basis"]) / P["step"]                 # [NG, Tq, n]
    q = torch.round(coef) if cal.rounding == 0.5 else \
        torch.floor(coef.abs() + cal.rounding).copysign_(coef)
    q = q.clamp_(-MAX_Q, MAX_Q).to(torch.int16)
    # a group's offset covers its kept columns only (dropped ones are never coded)
    mask = torch.arange(q.shape[-1])[None, :] < torch.tensor(keep[0])[:, None]   # [NG, n]
    off = (q.abs() * mask[:, None, :]).amax(dim=(1, 2)) if Tq else \
        torch.zeros(len(keep[0]), dtype=torch.int16)
    syms = (q + off[:, None, None]).to(torch.uint8).numpy()
    offs = [int(o) for o in off]
    sym_a, sym_b, nba, nbb = kept_halves([syms, None], keep, [offs, []], Tq)
    es = encode_symbols(sym_a, sym_b, [nba], [nbb], channels_per_stream=4)
    return ({"layout": KVTC_GROUPED_LAYOUT, "n_kept": n_kept(keep), "offsets": offs,
             "entropy": es.header}, es, int(sym_a.size + sym_b.size))


def _decode_rows_grouped(hdr: dict, ent_arrays: dict, payload: Any, cal: KvtcCalibration,
                         lvl: int, keep: list, Tq: int) -> tuple[list, list]:
    """The symbols of Tq rows of a grouped calibration (layout "grouped"):
    ([KeptSymbols over the groups], [offsets per group]). Raises CodecError."""
    NG = cal.num_groups
    o = hdr.get("offsets")
    if not isinstance(o, list) or len(o) != NG or any(
            isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_Q for x in o):
        raise CodecError(f"kvtc: bad offsets in header (want {NG} ints in [0, {MAX_Q}])")
    ent = hdr.get("entropy")
    if not isinstance(ent, dict):
        raise CodecError("kvtc: missing entropy-coder header")
    a, b = decode_kept(hdr, ent, ent_arrays, payload, keep, [o, []],
                        NG * 2 * cal.group_layers * cal.C, lvl, Tq)
    return [KeptSymbols(a, b, keep, 0)], [o]
