"""The Serializer/Deserializer pair LMCache calls (lmcache.v1.distributed.serde.base):
encode a KV MemoryObj into a padded frame in its slot, at the finest step of the ladder
that fits (:mod:`.serde_steps`), with the stats and a log line for every kind of
fallback; decode a frame back into the destination object after checking its ident.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Optional

import torch

import codec
from codec import kvtc as codec_kvtc

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.base import Deserializer, Serializer
from lmcache.v1.memory_management import MemoryObj
from third_party.lmcache.serde_frame import is_raw, pack_frame, pack_raw, parse_frame, unpack_raw
from third_party.lmcache.serde_layout import (frame_ident, group_tensors, kv_form, kv_views, plane_head,
                                              token_bounds)
from third_party.lmcache.serde_settings import SerdeSettings
from third_party.lmcache.serde_slot import estimate_bytes, level_step, pick_level
from third_party.lmcache.serde_steps import RAW, encode_group, is_level, ladder
from third_party.lmcache.serde_rope import estimate_offset
from third_party.lmcache.serde_sinks import starts_context


log = logging.getLogger("third_party.lmcache.serde")
_LIVE: "weakref.WeakSet[CodecSerializer]" = weakref.WeakSet()


def serializer_stats() -> list[dict]:
    """A copy of the ``stats`` of every live serializer of this process (one per LMCache
    adapter using our serde), each with its ``codec`` and ``level``: the counters a user
    reads to see fallbacks, floor and raw objects and refusals."""
    out = []
    for ser in list(_LIVE):
        with ser._lock:
            st = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ser.stats.items()}
        out.append({"codec": ser.settings.codec, "level": ser.settings.level, **st})
    return out


def _layout_text(tensors) -> str:
    return ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors)


def _group_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class _Base:
    def __init__(self, settings: SerdeSettings):
        self.settings = settings
        self.ident_hash = settings.identity()


class CodecSerializer(_Base, Serializer):
    """LMCache ``Serializer``: KV MemoryObj -> our framed bitstream in ``dst``.

    ``stats``: counts of serialized objects; ``coarser`` (= ``fallbacks``) and ``finer``
    (objects stored at a coarser / finer step than the configured level: it did not fit
    the slot / a finer one fit too, :mod:`.serde_slot`), ``levels`` (step coded at ->
    objects: a level, ``floor-4``/``-6``/``-8`` or ``raw``), ``floor`` and ``raw``
    (objects at a floor step / verbatim because nothing coded fit), ``verbatim_groups``
    (kernel groups stored verbatim because the serde cannot code their layout),
    ``encodes`` (encodes of whole objects, tries included), ``fill_misses`` (finer tries
    that did not fit), ``refused`` (objects no step fit: ValueError, not stored),
    ``encode_s`` (seconds in serialize); ``bytes`` (frame bytes before padding),
    ``kv_bytes`` (the objects' own bytes), ``slot_bytes``; ``sink_groups`` /
    ``no_sink_groups`` (kernel groups coded with / without exact sink tokens, once per
    object: :mod:`.serde_sinks`), ``offsets`` (position coded at -> count:
    :mod:`.serde_rope`). Every kind of fallback is logged (WARNING) the first time per
    layout and step; :func:`serializer_stats` reads the counters of every serializer."""

    def __init__(self, settings: SerdeSettings):
        super().__init__(settings)
        self._lock = threading.Lock()
        self._logged: set = set()
        self.stats = {"objects": 0, "fallbacks": 0, "coarser": 0, "finer": 0, "levels": {},
                      "floor": 0, "raw": 0, "verbatim_groups": 0,
                      "encodes": 0, "fill_misses": 0, "refused": 0, "encode_s": 0.0,
                      "bytes": 0, "kv_bytes": 0, "slot_bytes": 0,
                      "sink_groups": 0, "no_sink_groups": 0, "offsets": {}}
        self._ladder = ladder(settings)
        _LIVE.add(self)

    def _note_sinks(self, kept: bool, offset: int) -> None:
        with self._lock:
            self.stats["sink_groups" if kept else "no_sink_groups"] += 1
            self.stats["offsets"][offset] = self.stats["offsets"].get(offset, 0) + 1

    def _log_once(self, what, msg: str, *args) -> None:
        with self._lock:
            first = what not in self._logged
            self._logged.add(what)
        (log.warning if first else log.debug)(msg, *args)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """The slot in bytes (see ``serde_slot.estimate_bytes``); an upper bound of what
        ``serialize`` writes, by construction."""
        return estimate_bytes(self.settings, self.ident_hash, layout_desc)

    def plan(self, src) -> list[Optional[tuple]]:
        """Per kernel group of ``src`` (a MemoryObj, or its list of group tensors):
        (K view, V view, keeps exact sinks, position coded at), the level-independent part
        of an encode (computed once per object), or None for a group stored verbatim (a
        layout the serde cannot code: :func:`.serde_layout.kv_form`)."""
        s = self.settings
        out = []
        tensors = src if isinstance(src, list) else group_tensors(src)
        for t in tensors:
            try:
                kv_form(t.shape, t.dtype, s)
            except (ValueError, codec.CodecError) as e:
                self._log_once(("verbatim", tuple(t.shape), t.dtype),
                               "%s serde: kernel group %s stored verbatim, uncompressed: %s",
                               s.codec, _layout_text([t]), e)
                out.append(None)
                continue
            k, v = kv_views(t, s)
            off = 0
            # not a context's start: no exact sink tokens (our store path's chunks after
            # the first); an MLA plane keeps them (serde_sinks); kvtc codes it at its
            # estimated position (serde_rope)
            planes = t.dim() == 5 or (t.dim() == 4 and t.shape[0] == 2) or \
                plane_head(s, int(t.shape[-1])) is not None      # fused K/V: real K and V
            keep = not (s.sinks == "auto" and planes and not starts_context(v))
            if not keep and s.codec == "kvtc" and s.position_step:
                off = estimate_offset(k, codec_kvtc.get_calibration(s.calibration),
                                      s.position_step, s.max_tokens)
            out.append((k, v, keep, off))
        return out

    def encode_frame(self, src: MemoryObj, key: Optional[ObjectKey], budget: int,
                     level, plan: Optional[list] = None) -> bytes:
        """The frame for ``src`` at ``level`` (a step of :func:`.serde_steps.ladder`;
        bytes, may exceed ``budget``). ``plan``: :meth:`plan` of ``src`` (None: computed
        and counted in ``stats``)."""
        s = self.settings
        tensors = group_tensors(src)
        if plan is None:
            plan = self.plan(tensors)
            for p in plan:
                if p is not None:
                    self._note_sinks(p[2], p[3])
        blobs = []
        for t, p in zip(tensors, plan):
            if p is None or level == RAW:
                blobs.append(pack_raw(_group_bytes(t)))
            else:
                blobs.extend(encode_group(*p, s, level))
        return pack_frame(frame_ident(s, self.ident_hash, key, [tuple(t.shape) for t in tensors],
                                      [t.dtype for t in tensors]), blobs)

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Encode ``src`` into ``dst`` (a uint8 buffer of at least the slot).
        Step: the finest that fits the slot (:mod:`.serde_slot`: ``fallback``, ``fill``;
        below level 0 the floor steps, then raw). Returns the bytes to store: the slot
        when padding, else the frame's length. Raises ValueError (a frame that fits the
        slot at no allowed step: nothing is written) or CodecError."""
        s = self.settings
        out = getattr(dst, "tensor", None)
        if out is None:
            raise ValueError(f"{s.codec} serde: dst needs a tensor")
        out = out.view(-1).view(torch.uint8) if out.dtype != torch.uint8 else out.view(-1)
        tensors = group_tensors(src)
        budget = estimate_bytes(s, self.ident_hash,
                                MemoryLayoutDesc(shapes=[t.shape for t in tensors],
                                                 dtypes=[t.dtype for t in tensors]))
        budget = min(budget, out.numel())
        t0 = time.perf_counter()
        plan = self.plan(tensors)
        coded = [p for p in plan if p is not None]
        for p in coded:
            self._note_sinks(p[2], p[3])
        steps = self._ladder if coded else [RAW]
        start = s.level if coded else RAW
        tokens = min([int(p[0].shape[1]) for p in coded] or [1])
        tokens = min(tokens, s.chunk_tokens or tokens)
        try:
            data, lvl, info = pick_level(
                lambda x: self.encode_frame(src, key, budget, x, plan), start, steps, budget,
                s.fallback, s.fill, lambda lo, hi: level_step(s, tokens, lo, hi))
        except ValueError as e:
            with self._lock:
                self.stats["refused"] += 1
            hint = "a smaller \"slot_ratio\"" if s.slot_ratio is not None else \
                "\"bits_per_element\" for this model"
            msg = f"{s.codec} serde: {e}; not stored"
            if "does not fit" in str(e):
                msg += f" (set {hint} or \"always_fit\", docs/lmcache.md)"
            log.warning("%s (layout %s)", msg, _layout_text(tensors))
            raise ValueError(msg) from None
        n = len(data)
        out[:n].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        stored = n
        if s.pad:
            out[n:budget].zero_()
            stored = budget
        self._count(tensors, plan, lvl, info, n, budget, time.perf_counter() - t0)
        return stored

    def _count(self, tensors, plan, lvl, info, n: int, budget: int, secs: float) -> None:
        s = self.settings
        order = self._ladder
        below = any(p is not None for p in plan) and order.index(lvl) < order.index(s.level)
        if below:
            self._log_once(("step", tuple(tuple(t.shape) for t in tensors), lvl),
                           "%s serde: object %s did not fit its slot of %d bytes at level %s: "
                           "stored at %s (counted in stats; logged once per layout and step)",
                           s.codec, _layout_text(tensors), budget, s.level,
                           f"level {lvl}" if is_level(lvl) else lvl)
        with self._lock:
            st = self.stats
            st["objects"] += 1
            st["fallbacks"] += int(below)
            st["coarser"] += int(below)
            st["finer"] += int(is_level(lvl) and lvl > s.level)
            st["floor"] += int(not is_level(lvl) and lvl != RAW)
            st["raw"] += int(lvl == RAW and any(p is not None for p in plan))
            st["verbatim_groups"] += sum(p is None for p in plan)
            st["levels"][lvl] = st["levels"].get(lvl, 0) + 1
            st["encodes"] += info["encodes"]
            st["fill_misses"] += info["fill_misses"]
            st["encode_s"] += secs
            st["bytes"] += n
            st["kv_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
            st["slot_bytes"] += budget


class CodecDeserializer(_Base, Deserializer):
    """LMCache ``Deserializer``: our framed bitstream -> the destination KV MemoryObj."""

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Decode ``src`` (uint8 buffer) into ``dst`` (the layout it was stored from; any
        number of kernel groups). Raises ValueError / CodecError on a frame for another
        serde config, key or layout, or on corruption; ``dst`` may then be partly written
        (LMCache treats it as a miss)."""
        s = self.settings
        if getattr(src, "tensor", None) is None:
            raise ValueError(f"{s.codec} serde: src needs a tensor")
        raw = src.tensor.view(-1)
        if raw.dtype != torch.uint8:
            raw = raw.view(torch.uint8)
        buf = memoryview(raw.numpy())
        ident, views = parse_frame(buf)
        tensors = group_tensors(dst)
        shapes = [tuple(t.shape) for t in tensors]
        want = frame_ident(s, self.ident_hash, key, shapes, [t.dtype for t in tensors])
        if ident != want:
            raise ValueError(f"{s.codec} serde: stored object was written for another "
                             f"serde config, key or layout (ident mismatch)")
        it = iter(views)
        for t in tensors:
            first = next(it, None)
            if first is None:
                raise ValueError("KVLM frame has too few containers")
            if is_raw(first):
                _fill_verbatim(t, unpack_raw(first, t.numel() * t.element_size()))
                continue
            k, v = kv_views(t, s)
            for j, (a, b) in enumerate(token_bounds(k.shape[1], s)):
                data = first if j == 0 else next(it, None)
                if data is None:
                    raise ValueError("KVLM frame has too few containers")
                _decode_into(data, k[:, a:b], v[:, a:b])
        if next(it, None) is not None:
            raise ValueError("KVLM frame has too many containers")


def _fill_verbatim(t: torch.Tensor, body: memoryview) -> None:
    src = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    if t.is_contiguous():
        t.view(-1).view(torch.uint8).copy_(src)
    else:
        t.copy_(src.view(t.dtype).view(t.shape))


def _decode_into(data, kd: torch.Tensor, vd: torch.Tensor) -> None:
    if kd.is_contiguous() and vd.is_contiguous():
        codec.decode_kv_into(data, kd, vd)
        return
    k2, v2 = codec.decode_kv(data, "cpu", backend="cpu")
    if k2.shape != kd.shape or k2.dtype != kd.dtype:
        raise ValueError(f"decoded KV {tuple(k2.shape)} {k2.dtype} does "
                         f"not fit the destination {tuple(kd.shape)}")
    kd.copy_(k2)
    vd.copy_(v2)
