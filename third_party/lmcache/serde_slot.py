"""The slot of an LMCache object and the step it is coded at in it: the fallback to coarser
levels (and below level 0, the floor steps and raw) and the fill to finer ones ("constant
bitrate" for LMCache's fixed slots).

LMCache 0.5.6's fs and RESP adapters store every object at the size
``estimate_serialized_size`` returns (docs/lmcache.md, "The size estimate"), so the slot is
paid whether the frame fills it or not. Two ways to size it (:mod:`.serde_settings`):
- ``bits_per_element`` bound (the measured max per level x 1.05): every object fits the
  configured level; the slot is mostly padding (the max is a context's first object, with
  exact sink tokens);
- ``slot_ratio`` (fixed slot, the default when padding): slot = KV bytes / ratio, near the
  default level's mean frame. An object whose frame does not fit is coded at the next
  coarser level that fits (``fallback``); one whose frame fits with room is coded at the
  finest level that still fits (``fill``): better KV for the same written bytes.

Encode cost is bounded: the finer level is tried only when the frame at the current level
times the predicted size step to the next one, times ``FILL_SLACK``, fits the slot (the
step: the ratio of the two levels' entries in the measured bits-per-element table,
``level_step``; the slack lets a try through when the prediction is up to 2% too big).
Measured on the default model's 4K pydoc contexts at 256 tokens, the real step of every
object is within 0.2% below to 15% above the table's (cachegen 1 -> 2: 1.065-1.073 vs
1.067; kvtc 4 -> 5: 1.70-1.95 vs 1.71), so the prediction rarely blocks a level that fits
and a try rarely misses (a slack of 0.9 instead: cachegen at ``slot_ratio`` 8 tried
level 2 for every object and missed each time, 2.0 encodes per object instead of 1.27).
An object whose next finer level is predicted past the slot costs one encode; each finer
try that misses costs one more (counted: ``fill_misses``). The levels are assumed to grow
in size (ours do).

Below level 0 the ladder goes on (:mod:`.serde_steps`): the floor steps, then ``raw``.
With ``always_fit`` (cachegen's default) the slot is at least the smaller of the raw frame
and the floor's worst case, so one step fits every object of the layout whatever its
values; for the default model's 256-token objects that bound (~1.6 bits per element) is
below the 8x slot (2 bits), which is unchanged. Kernel groups the serde cannot code
(:func:`.serde_layout.kv_form`) are stored verbatim and add their exact size to the slot.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from third_party.lmcache.serde_layout import (
    codable,
    frame_overhead,
    group_bytes,
    raw_frame_bytes,
    token_bounds,
)
from third_party.lmcache.serde_frame import RAW_HEAD
from third_party.lmcache.serde_settings import CONTAINER_SLACK, SerdeSettings
from third_party.lmcache.serde_steps import worst_floor_bytes

FILL_SLACK = 0.98


def level_step(s: SerdeSettings, tokens: int, lo: int, hi: int) -> float:
    """Predicted size of a frame at level ``hi`` over its size at level ``lo`` for an
    object (or sub-chunk) of ``tokens`` tokens: the ratio of the measured table's entries
    (:data:`.serde_settings.BITS_PER_ELEMENT`, the default model's; for another model
    an estimate, never a bound). A ratio, > 0."""
    table = s.table()
    fit = [c for c in table if c <= tokens]
    row = table[max(fit) if fit else min(table)]
    return row[hi] / row[lo]


def pick_level(encode: Callable[[int], bytes], start: int, levels: Sequence[int],
               budget: int, fallback: bool, fill: bool,
               step: Callable[[int, int], float]) -> tuple[bytes, int, dict]:
    """Code at the finest level whose frame fits ``budget`` bytes, starting at ``start``.

    ``encode(level)`` -> the frame (bytes); ``levels``: the steps, coarsest first (the
    codec's levels, or :func:`.serde_steps.ladder`); ``fallback``:
    try coarser levels when ``start``'s frame does not fit; ``fill``: try finer ones when
    it fits and ``len(frame) * step(level, finer) * FILL_SLACK <= budget``.
    Returns (frame, level coded at, ``{"encodes": n, "fill_misses": m}``).
    Raises ValueError when no allowed level fits (the frame at the coarsest tried is
    larger than the slot): the caller must not write it.
    """
    order = list(levels)
    i = order.index(start)
    data = encode(start)
    info = {"encodes": 1, "fill_misses": 0}
    if len(data) > budget:
        tried = start
        for lvl in reversed(order[:i] if fallback else []):
            data = encode(lvl)
            info["encodes"] += 1
            tried = lvl
            if len(data) <= budget:
                return data, lvl, info
        raise ValueError(f"the bitstream ({len(data)} bytes at level {tried}) does not fit "
                         f"the slot of {budget} bytes")
    level = start
    while fill and i + 1 < len(order):
        nxt = order[i + 1]
        if len(data) * step(level, nxt) * FILL_SLACK > budget:
            break
        more = encode(nxt)
        info["encodes"] += 1
        if len(more) > budget:
            info["fill_misses"] += 1
            break
        data, level, i = more, nxt, i + 1
    return data, level, info


def _tokens(shape) -> int:
    return int(shape[2]) if len(shape) >= 4 else int(shape[1])


def estimate_bytes(s: SerdeSettings, ident_hash: str, layout) -> int:
    """The slot for one object of ``layout`` (an LMCache ``MemoryLayoutDesc``; bytes).
    Coded kernel groups: fixed-slot mode (``slot_ratio``): floor(their KV bytes /
    slot_ratio), the frame included; else the frame overhead plus bits_per_element *
    elements / 8 and ``CONTAINER_SLACK`` per container. Verbatim groups add their exact
    size. ``always_fit``: at least min(raw frame, floor's worst case) (module docstring).
    An object with no coded group: the raw frame. Never raises (LMCache calls it outside
    its error handling): on an unexpected error, the raw size (its serialize may fail)."""
    try:
        shapes, dtypes = list(layout.shapes), list(layout.dtypes)
        if not shapes or len(shapes) != len(dtypes):
            raise ValueError("empty layout")
        coded = [codable(sh, dt, s) for sh, dt in zip(shapes, dtypes)]
        raw_frame = raw_frame_bytes(s, ident_hash, shapes, dtypes)
        if not any(coded):
            return raw_frame
        kv_raw = sum(group_bytes(sh, dt) for sh, dt, c in zip(shapes, dtypes, coded) if c)
        verbatim = sum(RAW_HEAD + group_bytes(sh, dt) for sh, dt, c in zip(shapes, dtypes, coded)
                       if not c)
        head = frame_overhead(s, ident_hash, shapes, dtypes)
        if s.slot_ratio is not None:
            slot = max(1, math.floor(kv_raw / s.slot_ratio)) + verbatim
        else:
            ct = s.chunk_tokens
            payload = sum(math.ceil(math.prod(int(d) for d in sh)
                                    * s.bound(min(_tokens(sh), ct or _tokens(sh))) / 8)
                          + CONTAINER_SLACK * len(token_bounds(_tokens(sh), s))
                          for sh, c in zip(shapes, coded) if c)
            slot = head + payload + verbatim
        if s.always_fit:
            floor = head + verbatim + sum(worst_floor_bytes(s, sh, dt)
                                          for sh, dt, c in zip(shapes, dtypes, coded) if c)
            slot = max(slot, min(raw_frame, floor))
        return slot
    except Exception:  # noqa: BLE001 - the contract: never raise here
        try:
            return max(1, sum(math.prod(int(d) for d in sh) * dt.itemsize
                              for sh, dt in zip(layout.shapes, layout.dtypes)))
        except Exception:  # noqa: BLE001
            return 1 << 20
