"""The row coders of a grouped KVTC calibration (kvtc format 4, layout "grouped"): each layer
group's features [K_l, V_l, ...] transformed by the group's analysis matrix, quantized and
coded in the kept layout (codec.kvtc.kept); and their decode back to symbols.

Separate from codec.kvtc.layout (formats 1-3: per (K/V, layer) bases, tail spans), which
dispatches here when the calibration has ``group_layers``. Errors: ``CodecError``.
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import CodecError
from .calibration import KvtcCalibration, MAX_Q
from .kept import _KeptSymbols, _decode_kept, _kept_halves, _n_kept
from .rope import undo_rope


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
    """``_code_rows`` of a grouped calibration (kvtc format 4, layout "grouped"): per layer
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
    sym_a, sym_b, nba, nbb = _kept_halves([syms, None], keep, [offs, []], Tq)
    es = encode_symbols(sym_a, sym_b, [nba], [nbb], channels_per_stream=4)
    return ({"layout": KVTC_GROUPED_LAYOUT, "n_kept": _n_kept(keep), "offsets": offs,
             "entropy": es.header}, es, int(sym_a.size + sym_b.size))


def _decode_rows_grouped(hdr: dict, ent_arrays: dict, payload: Any, cal: KvtcCalibration,
                         lvl: int, keep: list, Tq: int) -> tuple[list, list]:
    """The symbols of Tq rows of a grouped calibration (layout "grouped"):
    ([_KeptSymbols over the groups], [offsets per group]). Raises CodecError."""
    NG = cal.num_groups
    o = hdr.get("offsets")
    if not isinstance(o, list) or len(o) != NG or any(
            isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_Q for x in o):
        raise CodecError(f"kvtc: bad offsets in header (want {NG} ints in [0, {MAX_Q}])")
    ent = hdr.get("entropy")
    if not isinstance(ent, dict):
        raise CodecError("kvtc: missing entropy-coder header")
    a, b = _decode_kept(hdr, ent, ent_arrays, payload, keep, [o, []],
                        NG * 2 * cal.group_layers * cal.C, lvl, Tq)
    return [_KeptSymbols(a, b, keep, 0)], [o]
