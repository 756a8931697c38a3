"""The Serializer/Deserializer pair LMCache calls (lmcache.v1.distributed.serde.base):
encode a KV MemoryObj into a padded frame in its slot, with the level fallback and the
stats; decode a frame back into the destination object after checking its ident.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import torch

import codec
from codec import kvtc as codec_kvtc

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.base import Deserializer, Serializer
from lmcache.v1.memory_management import MemoryObj
from third_party.lmcache.serde_frame import pack_frame, parse_frame
from third_party.lmcache.serde_layout import (
    estimate_bytes,
    frame_ident,
    group_tensors,
    kv_views,
    n_containers,
    token_bounds,
)
from third_party.lmcache.serde_settings import SerdeSettings
from third_party.lmcache.serde_slot import level_step, pick_level
from third_party.lmcache.serde_rope import estimate_offset
from third_party.lmcache.serde_sinks import starts_context


class _Base:
    def __init__(self, settings: SerdeSettings):
        self.settings = settings
        self.ident_hash = settings.identity()


class CodecSerializer(_Base, Serializer):
    """LMCache ``Serializer``: KV MemoryObj -> our framed bitstream in ``dst``.

    ``stats``: counts of serialized objects; ``coarser`` (= ``fallbacks``) and ``finer``
    (objects stored at a coarser / finer level than configured: the configured one did
    not fit the slot / a finer one fit too, :mod:`.serde_slot`), ``levels`` (level coded
    at -> objects), ``encodes`` (codec encodes of whole objects, tries included),
    ``fill_misses`` (finer tries that did not fit), ``refused`` (objects no level fit:
    ValueError, not stored), ``encode_s`` (seconds in serialize); ``bytes`` (frame bytes
    before padding), ``slot_bytes``; ``sink_groups`` / ``no_sink_groups`` (kernel groups
    coded with / without exact sink tokens, once per object: :mod:`.serde_sinks`),
    ``offsets`` (position coded at -> count: :mod:`.serde_rope`)."""

    def __init__(self, settings: SerdeSettings):
        super().__init__(settings)
        self._lock = threading.Lock()
        self.stats = {"objects": 0, "fallbacks": 0, "coarser": 0, "finer": 0, "levels": {},
                      "encodes": 0, "fill_misses": 0, "refused": 0, "encode_s": 0.0,
                      "bytes": 0, "slot_bytes": 0,
                      "sink_groups": 0, "no_sink_groups": 0, "offsets": {}}

    def _note_sinks(self, kept: bool, offset: int) -> None:
        with self._lock:
            self.stats["sink_groups" if kept else "no_sink_groups"] += 1
            self.stats["offsets"][offset] = self.stats["offsets"].get(offset, 0) + 1

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """The slot in bytes (see ``estimate_bytes``); an upper bound of what
        ``serialize`` writes, by construction."""
        return estimate_bytes(self.settings, self.ident_hash, layout_desc)

    def plan(self, src: MemoryObj) -> list[tuple]:
        """Per kernel group: (K view, V view, keeps exact sinks, position coded at), the
        level-independent part of an encode (computed once per object)."""
        s = self.settings
        out = []
        for t in group_tensors(src):
            k, v = kv_views(t, s)
            off = 0
            # not a context's start: no exact sink tokens (our store path's chunks after
            # the first); single-plane layouts keep them (serde_sinks); kvtc codes it at
            # its estimated position (serde_rope)
            keep = not (s.sinks == "auto" and t.dim() != 3 and not starts_context(v))
            if not keep and s.codec == "kvtc" and s.position_step:
                off = estimate_offset(k, codec_kvtc.get_calibration(s.calibration),
                                      s.position_step, s.max_tokens)
            out.append((k, v, keep, off))
        return out

    def encode_frame(self, src: MemoryObj, key: Optional[ObjectKey], budget: int,
                     level: int, plan: Optional[list] = None) -> bytes:
        """The frame for ``src`` at ``level`` (bytes; may exceed ``budget``). ``plan``:
        :meth:`plan` of ``src`` (None: computed and counted in ``stats``)."""
        s = self.settings
        tensors = group_tensors(src)
        shapes = [tuple(t.shape) for t in tensors]
        dtypes = [t.dtype for t in tensors]
        if plan is None:
            plan = self.plan(src)
            for _, _, keep, off in plan:
                self._note_sinks(keep, off)
        blobs = []
        for k, v, keep, off in plan:
            if not keep:
                cfg, lvl = s.codec_config(level, no_sinks_layers=k.shape[0]), None
            else:
                cfg = s.codec_config(level)
                lvl = None if cfg is not None else level
            if s.chunk_tokens is None:
                blobs.append(codec.encode_kv(k, v, codec=s.codec, level=lvl, config=cfg,
                                             backend="cpu", token_offset=off))
            else:   # one context split as codec.encode_chunks splits it
                blobs.extend(codec.encode_chunks(k, v, codec=s.codec, level=lvl, config=cfg,
                                                 chunk_tokens=s.chunk_tokens, backend="cpu",
                                                 token_offset=off))
        return pack_frame(frame_ident(s, self.ident_hash, key, shapes, dtypes), blobs)

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Encode ``src`` into ``dst`` (a uint8 buffer of at least the slot).
        Level: the finest that fits the slot (:mod:`.serde_slot`: ``fallback``, ``fill``).
        Returns the bytes to store: the slot when padding, else the frame's length.
        Raises ValueError (layout, dtype, a frame that fits the slot at no allowed level:
        nothing is written) or CodecError."""
        s = self.settings
        out = getattr(dst, "tensor", None)
        if out is None or getattr(src, "tensor", None) is None:
            raise ValueError(f"{s.codec} serde: src and dst need tensors")
        out = out.view(-1).view(torch.uint8) if out.dtype != torch.uint8 else out.view(-1)
        tensors = group_tensors(src)
        budget = estimate_bytes(s, self.ident_hash,
                                MemoryLayoutDesc(shapes=[t.shape for t in tensors],
                                                 dtypes=[t.dtype for t in tensors]))
        budget = min(budget, out.numel())
        t0 = time.perf_counter()
        plan = self.plan(src)
        for _, _, keep, off in plan:
            self._note_sinks(keep, off)
        tokens = min(int(k.shape[1]) for k, _, _, _ in plan)
        tokens = min(tokens, s.chunk_tokens or tokens)
        try:
            data, lvl, info = pick_level(
                lambda x: self.encode_frame(src, key, budget, x, plan), s.level,
                codec.levels(s.codec), budget, s.fallback, s.fill,
                lambda lo, hi: level_step(s, tokens, lo, hi))
        except ValueError as e:
            with self._lock:
                self.stats["refused"] += 1
            hint = "a smaller \"slot_ratio\"" if s.slot_ratio is not None else \
                "\"bits_per_element\" for this model"
            raise ValueError(f"{s.codec} serde: {e}; not stored (set {hint}, "
                             f"docs/lmcache.md)") from None
        n = len(data)
        out[:n].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        stored = n
        if s.pad:
            out[n:budget].zero_()
            stored = budget
        with self._lock:
            st = self.stats
            st["objects"] += 1
            st["fallbacks"] += int(lvl < s.level)
            st["coarser"] += int(lvl < s.level)
            st["finer"] += int(lvl > s.level)
            st["levels"][lvl] = st["levels"].get(lvl, 0) + 1
            st["encodes"] += info["encodes"]
            st["fill_misses"] += info["fill_misses"]
            st["encode_s"] += time.perf_counter() - t0
            self.stats["bytes"] += n
            self.stats["slot_bytes"] += budget
        return stored


class CodecDeserializer(_Base, Deserializer):
    """LMCache ``Deserializer``: our framed bitstream -> the destination KV MemoryObj."""

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Decode ``src`` (uint8 buffer) into ``dst`` (the KV layout it was stored from).
        Raises ValueError / CodecError on a frame for another serde config, key or layout,
        or on corruption; ``dst`` may then be partly written (LMCache treats it as a miss)."""
        s = self.settings
        if getattr(src, "tensor", None) is None or getattr(dst, "tensor", None) is None:
            raise ValueError(f"{s.codec} serde: src and dst need tensors")
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
        if len(views) != n_containers(shapes, s):
            raise ValueError("KVLM frame has the wrong number of containers")
        it = iter(views)
        for t in tensors:
            k, v = kv_views(t, s)
            for a, b in token_bounds(k.shape[1], s):
                data = next(it)
                kd, vd = k[:, a:b], v[:, a:b]
                if kd.is_contiguous() and vd.is_contiguous():
                    codec.decode_kv_into(data, kd, vd)
                else:
                    k2, v2 = codec.decode_kv(data, "cpu", backend="cpu")
                    if k2.shape != kd.shape or k2.dtype != kd.dtype:
                        raise ValueError(f"decoded KV {tuple(k2.shape)} {k2.dtype} does "
                                         f"not fit the destination {tuple(kd.shape)}")
                    kd.copy_(k2)
                    vd.copy_(v2)
