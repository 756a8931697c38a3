"""Our LMCache serdes as rows of bench.quality: a window's KV stored the way
LMCache's MP mode stores it, object by object, through our ``cachegen`` / ``kvtc``
serializer, and loaded back through the deserializer, so the quality rows measure the KV
LMCache hands back and the bytes its fs / RESP adapters write (the padded slots).

Row names (``--codecs "lmcache-cachegen-256;lmcache-cachegen-256-max;..."``):
``lmcache-<codec>-<tokens>[-max | -r<ratio>][-heads5 | -fused]``
- ``<codec>``: ``cachegen`` or ``kvtc`` (kvtc: the calibration bench.quality prepares);
- ``<tokens>``: tokens per LMCache object (LMCache's chunk size; 256 is its default); the
  window's context is split into objects of that many tokens (a shorter last one is its
  own object), each a ``[2, L, T, H*D]`` MemoryObj as the MP server hands a serde;
- no suffix: the serde's defaults (with LMCache 0.5.6: the fixed slot, ``slot_ratio``
  "auto", fill and fallback); ``-max``: the max-bound slot (``slot_ratio`` false, the
  ``BITS_PER_ELEMENT`` table, the default level everywhere: the default before the fixed
  slot); ``-r<ratio>``: the fixed slot at that ``slot_ratio``;
- layout (default ``[2, L, T, H*D]``): ``-heads5``: ``[2, L, T, H, D]``; ``-fused``: one
  plane ``[1, L, T, H*2D]``, each head's K then V (fused K/V, cachegen only).
Bytes (``stats["bytes"]``): the slots, what LMCache 0.5.6 writes; ``frame_bytes``: our
frames before padding. An object no level fits is refused by the serde (a miss in
LMCache): the row raises and bench.quality skips it, reason recorded. Needs lmcache (the
optional .venv-lmcache).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

_NAME = re.compile(r"^lmcache-(cachegen|kvtc)-([1-9][0-9]*)(-max|-r[0-9]+(?:\.[0-9]+)?)?"
                   r"(-heads5|-fused)?$")


def is_row(name: str) -> bool:
    """Whether ``name`` is one of this module's row names (see the module docstring)."""
    return _NAME.match(name) is not None


def needs_kvtc(name: str) -> bool:
    """Whether the row needs bench.quality's kvtc calibration."""
    m = _NAME.match(name)
    return m is not None and m.group(1) == "kvtc"


def can_run(name: str) -> bool:
    """Whether the row can run here (a valid name, lmcache importable)."""
    if not is_row(name):
        return False
    try:
        import lmcache.v1.distributed.serde.base  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed / not importable
        return False
    return True


def serde_options(name: str, configs: Optional[dict] = None) -> tuple[str, int, dict]:
    """(codec, tokens per object, serde options) of a row name. ``configs``: bench.quality's
    codec configs (``configs["kvtc"].calibration``). Raises ValueError for a bad name or a
    kvtc row without a calibration."""
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"not an lmcache serde row name: {name!r} (lmcache-<codec>-<tokens>"
                         f"[-max|-r<ratio>])")
    codec_name, tokens, mode = m.group(1), int(m.group(2)), m.group(3) or ""
    kw: dict = {}
    if mode == "-max":
        kw["slot_ratio"] = False
    elif mode.startswith("-r"):
        kw["slot_ratio"] = float(mode[2:])
    if codec_name == "kvtc":
        cfg = (configs or {}).get("kvtc")
        cal = getattr(cfg, "calibration", None)
        if not isinstance(cal, str):
            raise ValueError(f"{name}: no kvtc calibration (bench.quality prepares it)")
        kw["calibration"] = cal
    return codec_name, tokens, kw


@dataclass
class SerdeBlob:
    """What LMCache's L2 holds for one window: one slot (uint8) per object, the objects'
    token bounds, and what the deserializer needs (its pair, the shape and dtype)."""

    name: str
    slots: list          # uint8 tensors, one per object
    layout: str          # "", "-heads5" or "-fused" (the module docstring)
    bounds: list         # (first, end) token of each object
    deserializer: object
    shape: tuple         # (L, T, H, D)
    dtype: torch.dtype


def object_key(i: int):
    """The ObjectKey of the window's i-th object (what its slot was written for)."""
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(1 + i), model_name="bench", kv_rank=0)


def encode_with_stats(k: torch.Tensor, v: torch.Tensor, name: str,
                      configs: Optional[dict] = None) -> tuple[SerdeBlob, dict]:
    """Store K, V ``[L, T, H, D]`` as LMCache objects through our serde (row ``name``).
    Returns (blob, stats: ``bytes`` (slots: written), ``frame_bytes``, ``elements``,
    ``dtype_bytes``, ``estimate_bytes``, ``levels`` (level -> objects), ``coarser``,
    ``finer``, ``encodes``, ``encode_s``). Raises ValueError (bad name, an object no level
    fits) or the codec's errors."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    from bench.lmcache.peers import memory_obj
    from third_party.lmcache import serde as S

    codec_name, n, kw = serde_options(name, configs)
    L, T, H, D = k.shape
    if codec_name == "cachegen":
        kw["num_kv_heads"] = H
    ser, de = S.make_pair(codec_name, kw)
    k, v = k.detach().cpu(), v.detach().cpu()
    slots, bounds = [], []
    layout = _NAME.match(name).group(4) or ""
    for i, a in enumerate(range(0, T, n)):
        b = min(T, a + n)
        x = to_layout(k[:, a:b], v[:, a:b], layout)
        slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
        dst = memory_obj(torch.zeros(slot, dtype=torch.uint8))
        stored = ser.serialize(memory_obj(x), dst, object_key(i))
        slots.append(dst.tensor[:stored].clone())
        bounds.append((a, b))
    st = ser.stats
    elements = 2 * L * T * H * D
    blob = SerdeBlob(name, slots, layout, bounds, de, (L, T, H, D), k.dtype)
    return blob, {"bytes": sum(int(s.numel()) for s in slots), "frame_bytes": st["bytes"],
                  "estimate_bytes": st["slot_bytes"], "elements": elements,
                  "dtype_bytes": elements * k.element_size(), "levels": dict(st["levels"]),
                  "coarser": st["coarser"], "finer": st["finer"], "encodes": st["encodes"],
                  "encode_s": st["encode_s"]}


def decode(blob: SerdeBlob) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[L, T, H, D]`` in the original dtype, each object through the deserializer."""
    from bench.lmcache.peers import memory_obj

    L, T, H, D = blob.shape
    k = torch.empty(L, T, H, D, dtype=blob.dtype)
    v = torch.empty(L, T, H, D, dtype=blob.dtype)
    for i, (slot, (a, b)) in enumerate(zip(blob.slots, blob.bounds)):
        shape = to_layout(k[:1, :1], v[:1, :1], blob.layout).shape
        shape = (shape[0], L, b - a, *shape[3:]) if len(shape) == 5 else \
            (shape[0], L, b - a, shape[3])
        out = memory_obj(torch.zeros(shape, dtype=blob.dtype))
        blob.deserializer.deserialize(memory_obj(slot), out, object_key(i))
        k[:, a:b], v[:, a:b] = from_layout(out.tensor, blob.layout, H, D)
    return k, v


def to_layout(k: torch.Tensor, v: torch.Tensor, layout: str) -> torch.Tensor:
    """K, V ``[L, T, H, D]`` as the object LMCache hands a serde in ``layout`` (module
    docstring): ``[2, L, T, H*D]``, ``[2, L, T, H, D]`` or ``[1, L, T, H*2D]``."""
    L, T, H, D = k.shape
    if layout == "-heads5":
        return torch.stack([k, v]).contiguous()
    if layout == "-fused":
        return torch.cat([k, v], -1).reshape(1, L, T, H * 2 * D).contiguous()
    return torch.stack([k.reshape(L, T, H * D), v.reshape(L, T, H * D)])


def from_layout(x: torch.Tensor, layout: str, H: int, D: int):
    """The inverse of :func:`to_layout`: K, V ``[L, T, H, D]``."""
    if layout == "-heads5":
        return x[0], x[1]
    L, T = x.shape[1], x.shape[2]
    if layout == "-fused":
        y = x[0].reshape(L, T, H, 2 * D)
        return y[..., :D], y[..., D:]
    return x[0].reshape(L, T, H, D), x[1].reshape(L, T, H, D)
