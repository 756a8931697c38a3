"""The slot of an LMCache object and the step it is coded at in it: the fallback to coarser
levels (and below level 0, the floor steps and raw) and the fill to finer ones ("constant
bitrate" for LMCache's fixed slots).

LMCache 0.5.6's fs and RESP adapters store every object at the size
``estimate_serialized_size`` returns (docs/lmcache.md, "The size estimate"), so the slot is
paid whether the frame fills it or not. Two ways to size it (:mod:`.settings`):
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

Below level 0 the ladder goes on (:mod:`.slot`): the floor steps, then ``raw``.
With ``always_fit`` (cachegen's default) the slot is at least the smaller of the raw frame
and the floor's worst case, so one step fits every object of the layout whatever its
values; for the default model's 256-token objects that bound (~1.6 bits per element) is
below the 8x slot (2 bits), which is unchanged. Kernel groups the serde cannot code
(:func:`.layout.kv_form`) are stored verbatim and add their exact size to the slot.

The ladder. The steps an LMCache object can be coded at, coarsest first: ``raw`` (every kernel group
verbatim), the floor steps ``floor-4``, ``floor-6``, ``floor-8`` (cachegen with that many
uniform bins for K and V on every layer and no exact sink tokens; ``floor-4`` with one
scale per (layer, token), the others one step per (layer, KV head)), then the serde
codec's levels 0-5.

Why the floor: the fixed slot (``slot_ratio`` 8: 2 bits per bf16 element) holds the
default level of real KV, but not every object LMCache hands a serde: incompressible
(Gaussian) KV codes at 2.9 bits per element at cachegen level 0, and a 1-token object's
container is larger than its KV. The floor steps code Gaussian KV of 256 tokens at 1.7
(8 bins) and 1.2 (6) bits per element (measured here on 2 layers x 3 heads x 64); the
floor steps are coarse (the errors in docs/lmcache.md) and are only taken when nothing
finer fits, counted in the serializer's stats and logged.

The slot guarantee (``always_fit``, :mod:`.slot`) uses :func:`worst_floor_bytes`:
the size of ``floor-4`` on maximum-entropy input (every value -1, 0 or +1 times the
step, equally often, the most a 3-symbol entropy coder can need), plus ``FLOOR_SLACK``.
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Sequence

import torch

import codec

from third_party.lmcache.frame import RAW_HEAD
from third_party.lmcache.layout import (
    codable,
    frame_overhead,
    group_bytes,
    kv_views,
    raw_frame_bytes,
    token_bounds,
)
from third_party.lmcache.settings import CONTAINER_SLACK, SerdeSettings

RAW = "raw"
FLOOR_BINS = {"floor-4": 4, "floor-6": 6, "floor-8": 8}
GUARANTEED = "floor-4"
FLOOR_SLACK = 1.03          # x the measured worst case, plus 64 bytes per container
_cache: dict = {}
_lock = threading.Lock()


def ladder(s: SerdeSettings) -> list:
    """Every step of this serde, coarsest first: raw, the floor steps, the codec's levels."""
    return [RAW, *FLOOR_BINS, *sorted(codec.levels(s.codec))]


def is_level(step) -> bool:
    """Whether ``step`` is one of the codec's levels (not a floor step, not raw)."""
    return isinstance(step, int) and not isinstance(step, bool)


def encode_group(k: torch.Tensor, v: torch.Tensor, keep: bool, off: int, s: SerdeSettings,
                 step) -> list[bytes]:
    """The codec containers of one coded kernel group (K, V [L, T, H, D]) at ``step`` (a
    level or a floor step; ``raw`` is the caller's): one per token chunk. ``keep``:
    exact sink tokens (levels only); ``off``: the position coded at.
    Raises ValueError (non-finite KV, bad shape) or CodecError."""
    if is_level(step):
        if not keep:
            cfg, lvl = s.codec_config(step, no_sinks_layers=k.shape[0]), None
        else:
            cfg = s.codec_config(step)
            lvl = None if cfg is not None else step
        name = s.codec
    else:
        b = FLOOR_BINS[step]
        # floor-4 takes one scale per (layer, token): no outlier side lists, so its size
        # has a bound whatever the values (the guarantee); the others one step per
        # (layer, KV head), finer for normal KV
        group = "token" if step == GUARANTEED else "chunk_head"
        cfg, lvl, name = codec.CodecConfig.uniform(k.shape[0], b, b, scale_group=group,
                                                   sink_tokens=0), None, "cachegen"
        off = 0
    if s.chunk_tokens is None:
        return [codec.encode_kv(k, v, codec=name, level=lvl, config=cfg, backend="cpu",
                                token_offset=off)]
    return list(codec.encode_chunks(k, v, codec=name, level=lvl, config=cfg,
                                    chunk_tokens=s.chunk_tokens, backend="cpu",
                                    token_offset=off))


def worst_floor_bytes(s: SerdeSettings, shape, dtype) -> int:
    """An upper bound of the containers' bytes of one coded kernel group of ``shape`` and
    ``dtype`` at ``floor-4``, whatever its values (see the module docstring); cached per
    (serde identity, shape, dtype). Raises ValueError for a group the serde cannot code."""
    key = (s, tuple(int(d) for d in shape), dtype)
    with _lock:
        if key in _cache:
            return _cache[key]
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 3, tuple(key[1]), generator=g) - 1).to(dtype)
    k, v = kv_views(x, s)
    blobs = encode_group(k.contiguous(), v.contiguous(), False, 0, s, GUARANTEED)
    n = sum(math.ceil(len(b) * FLOOR_SLACK) + 64 for b in blobs)
    with _lock:
        _cache[key] = n
    return n


FILL_SLACK = 0.98


def level_step(s: SerdeSettings, tokens: int, lo: int, hi: int) -> float:
    """Predicted size of a frame at level ``hi`` over its size at level ``lo`` for an
    object (or sub-chunk) of ``tokens`` tokens: the ratio of the measured table's entries
    (:data:`.settings.BITS_PER_ELEMENT`, the default model's; for another model
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
    codec's levels, or :func:`.slot.ladder`); ``fallback``:
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
