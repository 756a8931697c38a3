"""LMCache MP-mode serdes ``cachegen`` and ``kvtc``: LMCache's Serializer/Deserializer
contract (lmcache.v1.distributed.serde.base, lmcache 0.5.6) over our codec.

What LMCache hands a serde (read from lmcache 0.5.6): one ``MemoryObj`` per chunk whose
layout (``MemoryLayoutDesc``) lists one (shape, dtype) per kernel group, each
- ``[2, L, T, H*D]`` (K and V planes; the MP server's layout for attention KV),
- ``[2, L, T, H, D]`` (the same with heads split), or
- ``[L, T, C]`` or ``[1, L, T, C]`` (one plane: MLA latent or fused K/V, C even;
  ``cachegen`` only),
in bfloat16, float16 or float32; an object may hold several groups (read group by group,
never through ``MemoryObj.tensor``). Any other group is stored verbatim (lossless, its
exact size added to the slot; logged once per layout). K and V are taken as views ``[L, T, H, D]`` of the
object's memory (no copy); the decoder writes straight into the destination object when
its view is contiguous (``codec.decode_kv_into``), else decodes then copies once.
H and D: kvtc from its calibration; cachegen from ``num_kv_heads``/``head_dim`` in the
serde config, else H = 1 (cachegen codes each (layer, channel) alike either way).

Bytes: a frame ``KVLM`` | u16 version | u16 containers | u32 ident length | ident JSON |
u64 length per container | u32 CRC32 of all of it, then the containers: our versioned,
CRC-checked codec bitstreams (docs/bitstream.md), one per kernel group and token chunk.
The ident names the serde identity (codec, level, config hash incl. kvtc's calibration),
a digest of the object key (model name, rank, chunk hash, group) and the layout: a
reader whose config, key or layout differs refuses the object (an exception, which
LMCache's AsyncSerdeProcessor turns into a failed deserialize = a miss), as does any
corruption (frame or container CRC, bounds).

Size: ``estimate_serialized_size`` is the slot LMCache allocates before serialising;
``serialize`` never writes more. LMCache 0.5.6's fs and RESP adapters load an object
only if its stored length equals that slot (measured: a shorter value reads as
"Incomplete read" / "size header mismatch", a miss), so by default (``pad: "auto"``:
pad unless the installed LMCache's L2 adapters report stored object sizes) the frame is
zero-padded to the slot and the slot is what L2 stores. The slot (slot.py): by
default with padding a fixed one, the object's KV bytes / ``slot_ratio`` (8 for cachegen,
20 for kvtc: ``DEFAULT_SLOT_RATIO``), each object coded at the finest level whose frame
fits it (coarser: ``fallback``; finer: ``fill``; counted in ``stats``); with
``slot_ratio`` false or ``bits_per_element`` given, a bits-per-element bound per level
(``BITS_PER_ELEMENT``, the max measured on the default model's KV at chunks of 256 and
1024 tokens, docs/lmcache.md) plus the frame's exact overhead, every object at ``level``
unless it does not fit. Below level 0 the ladder has floor steps and raw
(slot.py); with ``always_fit`` (cachegen's default) the slot always holds one of
them, so every object is stored; every fallback is counted in ``stats`` and logged. If no
allowed step fits (``always_fit`` off), serialize raises ValueError and writes nothing
(LMCache keeps the chunk out of L2: a miss; counted as ``refused``).

Errors: the factories raise ValueError for a bad serde config (LMCache refuses to start
with it); serialize/deserialize raise ValueError / codec.CodecError, which LMCache
catches and reports as a failed store / a miss. ``estimate_serialized_size`` never
raises (LMCache calls it outside its error handling).

Here: the factories LMCache calls (``FACTORIES``, by serde type) and the pair they build,
:class:`CodecSerializer` / :class:`CodecDeserializer` (encode a KV MemoryObj into a padded
frame in its slot at the finest step that fits, with the stats and a log line for every
kind of fallback; decode a frame back into the destination object after checking its
ident). The pieces: :mod:`.settings` (the config), :mod:`.frame` (bytes), :mod:`.layout`
(tensors <-> containers), :mod:`.slot` (the slot and the ladder of steps),
:mod:`.position` (sink tokens, kvtc's positions).
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
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.memory_management import MemoryObj
from third_party.lmcache.frame import is_raw, pack_frame, pack_raw, parse_frame, unpack_raw
from third_party.lmcache.layout import (frame_ident, group_tensors, kv_form, kv_views, plane_head,
                                        token_bounds)
from third_party.lmcache.position import estimate_offset, starts_context
from third_party.lmcache.settings import SerdeSettings, opt_int, parse_settings
from third_party.lmcache.slot import RAW, encode_group, estimate_bytes, is_level, ladder, level_step, pick_level

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
    the slot / a finer one fit too, :mod:`.slot`), ``levels`` (step coded at ->
    objects: a level, ``floor-4``/``-6``/``-8`` or ``raw``), ``floor`` and ``raw``
    (objects at a floor step / verbatim because nothing coded fit), ``verbatim_groups``
    (kernel groups stored verbatim because the serde cannot code their layout),
    ``encodes`` (encodes of whole objects, tries included), ``fill_misses`` (finer tries
    that did not fit), ``refused`` (objects no step fit: ValueError, not stored),
    ``encode_s`` (seconds in serialize); ``bytes`` (frame bytes before padding),
    ``kv_bytes`` (the objects' own bytes), ``slot_bytes``; ``sink_groups`` /
    ``no_sink_groups`` (kernel groups coded with / without exact sink tokens, once per
    object: :mod:`.position`), ``offsets`` (position coded at -> count:
    :mod:`.position`). Every kind of fallback is logged (WARNING) the first time per
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
        """The slot in bytes (see ``slot.estimate_bytes``); an upper bound of what
        ``serialize`` writes, by construction."""
        return estimate_bytes(self.settings, self.ident_hash, layout_desc)

    def plan(self, src) -> list[Optional[tuple]]:
        """Per kernel group of ``src`` (a MemoryObj, or its list of group tensors):
        (K view, V view, keeps exact sinks, position coded at), the level-independent part
        of an encode (computed once per object), or None for a group stored verbatim (a
        layout the serde cannot code: :func:`.layout.kv_form`)."""
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
            # the first); an MLA plane keeps them (position); kvtc codes it at its
            # estimated position (position)
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
        """The frame for ``src`` at ``level`` (a step of :func:`.slot.ladder`;
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
        Step: the finest that fits the slot (:mod:`.slot`: ``fallback``, ``fill``;
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


# ---------------------------------------------------------------------------- factories
def make_pair(name: str, kwargs: dict) -> tuple[CodecSerializer, CodecDeserializer]:
    """The sync pair for a serde config (tests, bench). Raises ValueError."""
    s = parse_settings(name, kwargs)
    return CodecSerializer(s), CodecDeserializer(s)


def describe(s: SerdeSettings) -> str:
    """One line on what a serde config stores (logged when LMCache creates the serde)."""
    slot = f"slot_ratio {s.slot_ratio:g}" if s.slot_ratio is not None else "max-bound slot"
    kv = "[2, L, T, H*D], [2, L, T, H, D] and one-plane [L, T, C] / [1, L, T, C] groups" \
        if s.codec == "cachegen" else "[2, L, T, H*D] and [2, L, T, H, D] groups of its " \
        "calibration's geometry"
    fit = "every object is stored (always_fit)" if s.always_fit else \
        "an object no step fits is refused, counted and logged (always_fit off)"
    return (f"{s.codec} serde: level {s.level}, {slot}; codes {kv}, stores any other group "
            f"verbatim; falls back below the level to floor steps, then raw; {fit}")


def _factory(name: str):
    def create(kwargs: dict) -> SerdeProcessor:
        mw = opt_int(kwargs, "max_workers", 1) or 1
        ser, de = make_pair(name, kwargs)
        # a config that may refuse objects says so where the user sees it (WARNING)
        (log.info if ser.settings.always_fit else log.warning)("%s", describe(ser.settings))
        return AsyncSerdeProcessor(ser, de, max_workers=mw)

    create.__name__ = f"create_{name}_serde"
    create.__qualname__ = create.__name__
    return create


FACTORIES = {"cachegen": _factory("cachegen"), "kvtc": _factory("kvtc")}
