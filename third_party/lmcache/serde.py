"""LMCache MP-mode serdes ``cachegen`` and ``kvtc``: LMCache's Serializer/Deserializer
contract (lmcache.v1.distributed.serde.base, lmcache 0.5.6) over our codec.

What LMCache hands a serde (read from lmcache 0.5.6): one ``MemoryObj`` per chunk whose
layout (``MemoryLayoutDesc``) lists one (shape, dtype) per kernel group, each
- ``[2, L, T, H*D]`` (K and V planes; the MP server's layout for attention KV),
- ``[2, L, T, H, D]`` (the same with heads split), or
- ``[L, T, C]`` (one plane: MLA latent or fused K/V; ``cachegen`` only),
in bfloat16, float16 or float32. K and V are taken as views ``[L, T, H, D]`` of the
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
zero-padded to the slot and the slot is what L2 stores: the slot is sized from a bits-per-
element bound per level (``BITS_PER_ELEMENT``, measured on the default model's KV at
chunks of 256 and 1024 tokens, docs/lmcache.md) plus the frame's exact overhead. When a
chunk's bitstream does not fit (KV unlike the measured one), the serializer re-encodes
at the next smaller levels (``fallback``, counted in ``stats``) and fails the store
(LMCache keeps the chunk out of L2) only if none fits.

Errors: the factories raise ValueError for a bad serde config (LMCache refuses to start
with it); serialize/deserialize raise ValueError / codec.CodecError, which LMCache
catches and reports as a failed store / a miss. ``estimate_serialized_size`` never
raises (LMCache calls it outside its error handling).
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

import codec
from codec import kvtc as codec_kvtc

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.memory_management import MemoryObj

FRAME_MAGIC = b"KVLM"
FRAME_VERSION = 1
_HEAD = struct.Struct("<4sHHI")     # magic, version, number of containers, ident length
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
MAX_CONTAINERS = 4096
MAX_IDENT = 1 << 16
DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# Upper bounds of whole-container bits per KV element, per (codec, chunk tokens, level),
# for the default model (SmolLM2-135M, 30 layers x 3 KV heads x 64, bf16): max over every
# chunk of three 4K-token pydoc contexts of (container bytes * 8 / elements), times 1.05,
# rounded up to 0.01 (the measured spread, max / median, is <= 1.04). An object of T
# tokens uses the entry of the largest chunk size <= T (else the smallest). Measured by
# `python -m bench.lmcache --estimate` (docs/lmcache.md); a serde config's
# "bits_per_element" replaces the table for other models.
BITS_PER_ELEMENT = {
    "cachegen": {256: {0: 1.97, 1: 2.36, 2: 2.50, 3: 2.81, 4: 3.26, 5: 4.88},
                 1024: {0: 1.70, 1: 2.10, 2: 2.24, 3: 2.55, 4: 3.00, 5: 4.62}},
    "kvtc": {256: {0: 0.57, 1: 0.71, 2: 0.84, 3: 0.99, 4: 1.13, 5: 2.04},
             1024: {0: 0.36, 1: 0.49, 2: 0.62, 3: 0.76, 4: 0.90, 5: 1.80}},
}
# bytes a container may need beyond bits_per_element * elements (JSON header digits,
# alignment): a fixed allowance per container
CONTAINER_SLACK = 512


@dataclass(frozen=True)
class SerdeSettings:
    """A serde config, validated. ``level``: the codec's level (resolved: None -> the
    codec's default); ``chunk_tokens``: split each object's tokens into containers of
    this many (None: one container per kernel group); ``num_kv_heads``/``head_dim``:
    cachegen's view of a ``[2, L, T, H*D]`` plane (None: H = 1); ``calibration``: kvtc's
    calibration hash; ``bits_per_element``: the slot bound (None: ``BITS_PER_ELEMENT``);
    ``pad``: pad the frame to the slot; ``fallback``: re-encode at smaller levels when a
    bitstream does not fit its slot."""

    codec: str
    level: int
    chunk_tokens: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    calibration: Optional[str] = None
    bits_per_element: Optional[float] = None
    pad: bool = True
    fallback: bool = True

    def bound(self, tokens: int = 256) -> float:
        """Bits per element of the slot for an object (or sub-chunk) of ``tokens`` tokens."""
        if self.bits_per_element is not None:
            return self.bits_per_element
        table = BITS_PER_ELEMENT[self.codec]
        fit = [c for c in table if c <= tokens]
        return table[max(fit) if fit else min(table)][self.level]

    def identity(self) -> str:
        """16 hex digits naming everything that changes the bytes this serde writes or
        accepts (codec config hash incl. kvtc's calibration, chunking, heads, slot)."""
        cfg = self.codec_config(self.level)
        ch = codec.config_hash(self.codec, None if cfg is not None else self.level, cfg)
        blob = json.dumps({"frame": FRAME_VERSION, "codec": self.codec, "config": ch,
                           "chunk_tokens": self.chunk_tokens, "heads": self.num_kv_heads,
                           "head_dim": self.head_dim,
                           "bpe": self.bits_per_element if self.bits_per_element is not None
                           else BITS_PER_ELEMENT[self.codec],
                           "pad": self.pad}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def codec_config(self, level: int):
        """The ``config=`` for ``codec.encode_kv`` (kvtc: its calibration and level)."""
        if self.codec == "kvtc":
            return codec_kvtc.KvtcConfig(calibration=self.calibration, level=level)
        return None


def _installed_adapters_report_sizes() -> bool:
    """Whether the installed LMCache's L2 adapters can load an object shorter than its
    slot (newer LMCache: ``get_object_sizes``); 0.5.6: no."""
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

    return hasattr(L2AdapterInterface, "get_object_sizes")


def _opt_int(kw: dict, name: str, lo: int) -> Optional[int]:
    v = kw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"serde option {name!r} must be an integer >= {lo}, got {v!r}")
    return v


def parse_settings(name: str, kwargs: dict) -> SerdeSettings:
    """Validate an LMCache serde config (the ``"serde"`` dict less ``"type"``).

    Options: ``level`` (int, the codec's levels; default the codec's default),
    ``chunk_tokens`` (int >= 16, multiple of 16), ``num_kv_heads``, ``head_dim`` (cachegen),
    ``calibration`` (kvtc, required: a calibration hash, found by the codec's lookup),
    ``calibration_path`` (kvtc: an artifact file registered first; its hash must match
    ``calibration`` when both are given), ``bits_per_element`` (float > 0),
    ``pad`` ("auto" | true | false), ``fallback`` (bool), ``max_workers`` (int >= 1, read
    by the factory). Raises ValueError naming the bad option."""
    kw = dict(kwargs)
    known = {"level", "chunk_tokens", "num_kv_heads", "head_dim", "calibration",
             "calibration_path", "bits_per_element", "pad", "fallback", "max_workers"}
    bad = sorted(set(kw) - known)
    if bad:
        raise ValueError(f"unknown {name} serde option(s) {bad}; known: {sorted(known)}")
    if name == "cachegen" and ({"calibration", "calibration_path"} & set(kw)):
        raise ValueError("the cachegen serde takes no calibration (that is kvtc's)")
    if name == "kvtc" and ({"num_kv_heads", "head_dim"} & set(kw)):
        raise ValueError("the kvtc serde takes its heads from its calibration")
    lvl = kw.get("level")
    if lvl is not None and (isinstance(lvl, bool) or not isinstance(lvl, int)
                            or lvl not in codec.levels(name)):
        raise ValueError(f"{name} serde level must be one of {list(codec.levels(name))}, "
                         f"got {lvl!r}")
    level = codec.resolve_level(name, lvl)
    ct = _opt_int(kw, "chunk_tokens", 16)
    if ct is not None and ct % 16:
        raise ValueError(f"serde option 'chunk_tokens' must be a multiple of 16, got {ct}")
    bpe = kw.get("bits_per_element")
    if bpe is not None and (isinstance(bpe, bool) or not isinstance(bpe, (int, float))
                            or not 0 < bpe <= 64 or not math.isfinite(bpe)):
        raise ValueError(f"serde option 'bits_per_element' must be in (0, 64], got {bpe!r}")
    pad = kw.get("pad", "auto")
    if pad == "auto":
        pad = not _installed_adapters_report_sizes()
    elif not isinstance(pad, bool):
        raise ValueError(f"serde option 'pad' must be \"auto\", true or false, got {pad!r}")
    fallback = kw.get("fallback", True)
    if not isinstance(fallback, bool):
        raise ValueError(f"serde option 'fallback' must be true or false, got {fallback!r}")
    cal = None
    if name == "kvtc":
        path = kw.get("calibration_path")
        cal = kw.get("calibration")
        if path is not None:
            try:
                h = codec_kvtc.register_calibration(str(path))
            except (codec.CodecError, OSError, ValueError) as e:
                raise ValueError(f"kvtc serde: calibration_path {path!r}: {e}") from None
            if cal is not None and cal != h:
                raise ValueError(f"kvtc serde: {path} holds calibration {h}, not {cal}")
            cal = h
        if not isinstance(cal, str) or not cal:
            raise ValueError("the kvtc serde needs \"calibration\": the hash of its "
                             "calibration (python -m kv_extraction_hf.calibrate), reachable "
                             "by every reader, or \"calibration_path\"")
        try:
            codec_kvtc.get_calibration(cal)
        except codec.CodecError as e:
            raise ValueError(f"kvtc serde: {e}") from None
    return SerdeSettings(codec=name, level=level, chunk_tokens=ct,
                         num_kv_heads=_opt_int(kw, "num_kv_heads", 1),
                         head_dim=_opt_int(kw, "head_dim", 1), calibration=cal,
                         bits_per_element=None if bpe is None else float(bpe), pad=pad,
                         fallback=fallback)


# ---------------------------------------------------------------------------- layouts
def _group_tensors(obj: MemoryObj) -> list[torch.Tensor]:
    """The object's tensors, one per kernel group (views of its memory). Objects with
    only a ``.tensor`` (LMCache's own tests use such) are one group."""
    get = getattr(obj, "get_shapes", None)
    shapes = get() if callable(get) else None
    if shapes is not None and len(shapes) > 1:
        out = [obj.get_tensor(i) for i in range(len(shapes))]
    else:
        out = [obj.tensor]
    if any(t is None for t in out):
        raise ValueError("LMCache MemoryObj has no tensor (invalidated object)")
    return out


def _heads(s: SerdeSettings, L: int, C: int) -> tuple[int, int]:
    if s.codec == "kvtc":
        cal = codec_kvtc.get_calibration(s.calibration)
        if cal.num_layers != L or cal.num_heads * cal.head_dim != C:
            raise ValueError(
                f"kvtc calibration {s.calibration[:16]} is for {cal.num_layers} layers x "
                f"{cal.num_heads} heads x {cal.head_dim}, not a KV of {L} layers x {C} "
                f"channels")
        return cal.num_heads, cal.head_dim
    if s.num_kv_heads is not None or s.head_dim is not None:
        H = s.num_kv_heads or C // s.head_dim
        D = s.head_dim or C // s.num_kv_heads
        if H * D != C:
            raise ValueError(f"num_kv_heads {H} x head_dim {D} != the layout's {C} channels")
        return H, D
    return 1, C


def kv_views(t: torch.Tensor, s: SerdeSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[L, T, H, D]`` of one kernel group's tensor (no copy; see the
    module docstring for the layouts). Raises ValueError for another rank/dtype."""
    if t.dtype not in DTYPES:
        raise ValueError(f"{s.codec} serde: KV dtype {t.dtype} not supported "
                         f"(bfloat16, float16, float32)")
    if t.dim() == 5 and t.shape[0] == 2:
        return t[0], t[1]
    if t.dim() == 4 and t.shape[0] == 2:
        _, L, T, C = t.shape
        H, D = _heads(s, L, C)
        return t[0].view(L, T, H, D), t[1].view(L, T, H, D)
    if t.dim() == 3:
        if s.codec == "kvtc":
            raise ValueError("the kvtc serde needs K and V planes ([2, L, T, H*D]); a "
                             "single-plane (MLA) layout has no calibration")
        L, T, C = t.shape
        if C % 2:
            raise ValueError(f"single-plane layout needs an even channel count, got {C}")
        # the plane's channels split in two halves coded as "K" and "V" (views)
        return t[..., : C // 2].unsqueeze(2), t[..., C // 2:].unsqueeze(2)
    raise ValueError(f"{s.codec} serde: unsupported KV layout {tuple(t.shape)} (expected "
                     f"[2, L, T, H*D], [2, L, T, H, D] or [L, T, C])")


def _token_bounds(T: int, s: SerdeSettings) -> list[tuple[int, int]]:
    return [(0, T)] if s.chunk_tokens is None else codec.chunk_bounds(T, s.chunk_tokens)


def _tokens(shape) -> int:
    return int(shape[2]) if len(shape) >= 4 else int(shape[1])


def _layout_json(shapes, dtypes) -> list:
    return [[[int(d) for d in sh], str(dt).replace("torch.", "")]
            for sh, dt in zip(shapes, dtypes)]


def _key_digest(key: Optional[ObjectKey]) -> str:
    if key is None:
        return "0" * 32
    parts = [str(getattr(key, "model_name", "")), str(getattr(key, "kv_rank", "")),
             bytes(getattr(key, "chunk_hash", b"")).hex(),
             str(getattr(key, "object_group_id", "")), str(getattr(key, "cache_salt", ""))]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


def _ident(s: SerdeSettings, ident_hash: str, key, shapes, dtypes) -> bytes:
    return json.dumps({"serde": s.codec, "identity": ident_hash, "key": _key_digest(key),
                       "layout": _layout_json(shapes, dtypes)}, sort_keys=True,
                      separators=(",", ":")).encode()


def _n_containers(shapes, s: SerdeSettings) -> int:
    return sum(len(_token_bounds(_tokens(sh), s)) for sh in shapes)


def frame_overhead(s: SerdeSettings, ident_hash: str, shapes, dtypes) -> int:
    """Exact bytes of the frame before the containers (the key digest has fixed size)."""
    n = _n_containers(shapes, s)
    return _HEAD.size + len(_ident(s, ident_hash, None, shapes, dtypes)) + n * _U64.size \
        + _U32.size


def estimate_bytes(s: SerdeSettings, ident_hash: str, layout: MemoryLayoutDesc) -> int:
    """The slot for one object of ``layout`` (bytes): the frame overhead plus, per
    kernel group, bits_per_element * elements / 8 and ``CONTAINER_SLACK`` per container.
    Never raises: an unsupported layout gets its raw size (its serialize fails)."""
    try:
        shapes, dtypes = list(layout.shapes), list(layout.dtypes)
        raw = sum(math.prod(int(d) for d in sh) * dt.itemsize for sh, dt in zip(shapes, dtypes))
        if not shapes or any(dt not in DTYPES or len(sh) not in (3, 4, 5)
                             for sh, dt in zip(shapes, dtypes)):
            return max(1, raw)
        ct = s.chunk_tokens
        payload = sum(math.ceil(math.prod(int(d) for d in sh)
                                * s.bound(min(_tokens(sh), ct or _tokens(sh))) / 8)
                      for sh in shapes)
        return frame_overhead(s, ident_hash, shapes, dtypes) + payload \
            + CONTAINER_SLACK * _n_containers(shapes, s)
    except Exception:  # noqa: BLE001 - the contract: never raise here
        try:
            return max(1, sum(math.prod(int(d) for d in sh) * dt.itemsize
                              for sh, dt in zip(layout.shapes, layout.dtypes)))
        except Exception:  # noqa: BLE001
            return 1 << 20


# ---------------------------------------------------------------------------- the pair
class _Base:
    def __init__(self, settings: SerdeSettings):
        self.settings = settings
        self.ident_hash = settings.identity()


class CodecSerializer(_Base, Serializer):
    """LMCache ``Serializer``: KV MemoryObj -> our framed bitstream in ``dst``.

    ``stats``: counts of serialized objects, ``fallbacks`` (objects stored at a smaller
    level than configured because the configured one did not fit the slot) and
    ``bytes`` (frame bytes before padding)."""

    def __init__(self, settings: SerdeSettings):
        super().__init__(settings)
        self._lock = threading.Lock()
        self.stats = {"objects": 0, "fallbacks": 0, "bytes": 0, "slot_bytes": 0}

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """The slot in bytes (see ``estimate_bytes``); an upper bound of what
        ``serialize`` writes, by construction."""
        return estimate_bytes(self.settings, self.ident_hash, layout_desc)

    def encode_frame(self, src: MemoryObj, key: Optional[ObjectKey], budget: int,
                     level: int) -> bytes:
        """The frame for ``src`` at ``level`` (bytes; may exceed ``budget``)."""
        s = self.settings
        tensors = _group_tensors(src)
        shapes = [tuple(t.shape) for t in tensors]
        dtypes = [t.dtype for t in tensors]
        cfg = s.codec_config(level)
        lvl = None if cfg is not None else level
        blobs = []
        for t in tensors:
            k, v = kv_views(t, s)
            if s.chunk_tokens is None:
                blobs.append(codec.encode_kv(k, v, codec=s.codec, level=lvl, config=cfg,
                                             backend="cpu"))
            else:   # one context split as codec.encode_chunks splits it
                blobs.extend(codec.encode_chunks(k, v, codec=s.codec, level=lvl, config=cfg,
                                                 chunk_tokens=s.chunk_tokens, backend="cpu"))
        ident = _ident(s, self.ident_hash, key, shapes, dtypes)
        head = _HEAD.pack(FRAME_MAGIC, FRAME_VERSION, len(blobs), len(ident)) + ident + \
            b"".join(_U64.pack(len(x)) for x in blobs)
        return b"".join([head, _U32.pack(zlib.crc32(head)), *blobs])

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Encode ``src`` into ``dst`` (a uint8 buffer of at least the slot).
        Returns the bytes to store: the slot when padding, else the frame's length.
        Raises ValueError (layout, dtype, a frame that fits no level's slot) or CodecError."""
        s = self.settings
        out = getattr(dst, "tensor", None)
        if out is None or getattr(src, "tensor", None) is None:
            raise ValueError(f"{s.codec} serde: src and dst need tensors")
        out = out.view(-1).view(torch.uint8) if out.dtype != torch.uint8 else out.view(-1)
        tensors = _group_tensors(src)
        budget = estimate_bytes(s, self.ident_hash,
                                MemoryLayoutDesc(shapes=[t.shape for t in tensors],
                                                 dtypes=[t.dtype for t in tensors]))
        budget = min(budget, out.numel())
        levels = [s.level]
        if s.fallback:
            levels += [x for x in sorted(codec.levels(s.codec), reverse=True) if x < s.level]
        data = b""
        for i, lvl in enumerate(levels):
            data = self.encode_frame(src, key, budget, lvl)
            if len(data) <= budget:
                break
        else:
            raise ValueError(f"{s.codec} serde: the bitstream ({len(data)} bytes at level "
                             f"{levels[-1]}) does not fit the slot of {budget} bytes; set "
                             f"\"bits_per_element\" for this model (docs/lmcache.md)")
        n = len(data)
        out[:n].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        stored = n
        if s.pad:
            out[n:budget].zero_()
            stored = budget
        with self._lock:
            self.stats["objects"] += 1
            self.stats["fallbacks"] += int(i > 0)
            self.stats["bytes"] += n
            self.stats["slot_bytes"] += budget
        return stored


def parse_frame(buf: memoryview) -> tuple[bytes, list[memoryview]]:
    """(ident JSON bytes, container views) of a frame. Raises ValueError on a bad or
    corrupt frame (magic, version, lengths, CRC)."""
    if len(buf) < _HEAD.size + _U32.size:
        raise ValueError("object too short for a KVLM frame")
    magic, ver, n, ilen = _HEAD.unpack_from(buf, 0)
    if magic != FRAME_MAGIC:
        raise ValueError(f"not a KVLM frame (magic {bytes(magic)!r})")
    if ver != FRAME_VERSION:
        raise ValueError(f"KVLM frame version {ver} (this reader: {FRAME_VERSION})")
    if not 1 <= n <= MAX_CONTAINERS or ilen > MAX_IDENT:
        raise ValueError("KVLM frame header out of range")
    pos = _HEAD.size + ilen + n * _U64.size
    if pos + _U32.size > len(buf):
        raise ValueError("KVLM frame truncated")
    if zlib.crc32(buf[:pos]) != _U32.unpack_from(buf, pos)[0]:
        raise ValueError("KVLM frame CRC mismatch (corrupt object)")
    ident = bytes(buf[_HEAD.size:_HEAD.size + ilen])
    lens = [_U64.unpack_from(buf, _HEAD.size + ilen + i * _U64.size)[0] for i in range(n)]
    pos += _U32.size
    if pos + sum(lens) > len(buf):
        raise ValueError("KVLM frame's containers run past the object")
    views = []
    for ln in lens:
        views.append(buf[pos:pos + ln])
        pos += ln
    if pos < len(buf) and any(buf[pos:].tobytes().rstrip(b"\0")):
        raise ValueError("KVLM frame padding is not zero (corrupt object)")
    return ident, views


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
        tensors = _group_tensors(dst)
        shapes = [tuple(t.shape) for t in tensors]
        want = _ident(s, self.ident_hash, key, shapes, [t.dtype for t in tensors])
        if ident != want:
            raise ValueError(f"{s.codec} serde: stored object was written for another "
                             f"serde config, key or layout (ident mismatch)")
        if len(views) != _n_containers(shapes, s):
            raise ValueError("KVLM frame has the wrong number of containers")
        it = iter(views)
        for t in tensors:
            k, v = kv_views(t, s)
            for a, b in _token_bounds(k.shape[1], s):
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


# ---------------------------------------------------------------------------- factories
def make_pair(name: str, kwargs: dict) -> tuple[CodecSerializer, CodecDeserializer]:
    """The sync pair for a serde config (tests, bench). Raises ValueError."""
    s = parse_settings(name, kwargs)
    return CodecSerializer(s), CodecDeserializer(s)


def _factory(name: str):
    def create(kwargs: dict) -> SerdeProcessor:
        mw = _opt_int(kwargs, "max_workers", 1) or 1
        ser, de = make_pair(name, kwargs)
        return AsyncSerdeProcessor(ser, de, max_workers=mw)

    create.__name__ = f"create_{name}_serde"
    create.__qualname__ = create.__name__
    return create


FACTORIES = {"cachegen": _factory("cachegen"), "kvtc": _factory("kvtc")}
