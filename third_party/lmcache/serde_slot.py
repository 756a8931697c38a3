"""Which level an object is coded at, given its slot: the fallback to coarser levels and
the fill to finer ones ("constant bitrate" for LMCache's fixed slots).

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
"""
from __future__ import annotations

from typing import Callable, Sequence

from third_party.lmcache.serde_settings import SerdeSettings

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

    ``encode(level)`` -> the frame (bytes); ``levels``: the codec's levels; ``fallback``:
    try coarser levels when ``start``'s frame does not fit; ``fill``: try finer ones when
    it fits and ``len(frame) * step(level, finer) * FILL_SLACK <= budget``.
    Returns (frame, level coded at, ``{"encodes": n, "fill_misses": m}``).
    Raises ValueError when no allowed level fits (the frame at the coarsest tried is
    larger than the slot): the caller must not write it.
    """
    order = sorted(levels)
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
