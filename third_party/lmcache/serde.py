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
zero-padded to the slot and the slot is what L2 stores. The slot (serde_slot.py): by
default with padding a fixed one, the object's KV bytes / ``slot_ratio`` (8 for cachegen,
20 for kvtc: ``DEFAULT_SLOT_RATIO``), each object coded at the finest level whose frame
fits it (coarser: ``fallback``; finer: ``fill``; counted in ``stats``); with
``slot_ratio`` false or ``bits_per_element`` given, a bits-per-element bound per level
(``BITS_PER_ELEMENT``, the max measured on the default model's KV at chunks of 256 and
1024 tokens, docs/lmcache.md) plus the frame's exact overhead, every object at ``level``
unless it does not fit. Below level 0 the ladder has floor steps and raw
(serde_steps.py); with ``always_fit`` (cachegen's default) the slot always holds one of
them, so every object is stored; every fallback is counted in ``stats`` and logged. If no
allowed step fits (``always_fit`` off), serialize raises ValueError and writes nothing
(LMCache keeps the chunk out of L2: a miss; counted as ``refused``).

Errors: the factories raise ValueError for a bad serde config (LMCache refuses to start
with it); serialize/deserialize raise ValueError / codec.CodecError, which LMCache
catches and reports as a failed store / a miss. ``estimate_serialized_size`` never
raises (LMCache calls it outside its error handling).
"""
from __future__ import annotations

# the pieces live in serde_frame (bytes), serde_settings / serde_options (the config),
# serde_layout (tensors <-> containers, the slot) and serde_pair (Serializer and
# Deserializer); their public names stay importable from here
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import SerdeProcessor
from third_party.lmcache.serde_frame import FRAME_MAGIC, FRAME_VERSION, MAX_CONTAINERS, MAX_IDENT, parse_frame
from third_party.lmcache.serde_layout import DTYPES, frame_overhead, kv_views
from third_party.lmcache.serde_options import opt_int, parse_settings
from third_party.lmcache.serde_pair import CodecDeserializer, CodecSerializer, log, serializer_stats
from third_party.lmcache.serde_slot import estimate_bytes
from third_party.lmcache.serde_settings import (BITS_PER_ELEMENT, CONTAINER_SLACK, DEFAULT_SLOT_RATIO,
                                                SerdeSettings)

__all__ = [
    "BITS_PER_ELEMENT", "CONTAINER_SLACK", "DEFAULT_SLOT_RATIO", "DTYPES", "FACTORIES", "FRAME_MAGIC", "FRAME_VERSION",
    "MAX_CONTAINERS", "MAX_IDENT", "CodecDeserializer", "CodecSerializer", "SerdeSettings",
    "describe", "estimate_bytes", "frame_overhead", "kv_views", "make_pair", "parse_frame",
    "parse_settings", "serializer_stats",
]


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
