"""How an LMCache object maps onto codec containers: its kernel groups' tensors, their K/V
views ``[L, T, H, D]`` (see :mod:`third_party.lmcache.serde` for the layouts) or why a
group is stored verbatim, the token chunks, the ident (serde identity, key digest,
layout) and the frame's exact overhead.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Optional

import torch

import codec
from codec import kvtc as codec_kvtc
from codec.api import MAX_DIM

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryObj
from third_party.lmcache.frame import RAW_HEAD, header_size
from third_party.lmcache.settings import SerdeSettings

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_LIMITS = tuple((name, MAX_DIM[name]) for name in "LTHD")
PLANE_HEAD = 64     # the head size a one-plane group is read with when none is configured


def group_tensors(obj: MemoryObj) -> list[torch.Tensor]:
    """The object's tensors, one per kernel group (views of its memory). The groups are
    looked at first: an object of several groups is read group by group
    (``get_tensor``), never through ``.tensor`` (which LMCache 0.5.6 refuses for it);
    objects with only a ``.tensor`` (LMCache's own tests use such) are one group.
    Raises ValueError for an invalidated object."""
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
        return cal.num_heads, C // cal.num_heads if C % cal.num_heads == 0 else C
    if s.num_kv_heads is not None or s.head_dim is not None:
        H = s.num_kv_heads or C // s.head_dim
        D = s.head_dim or C // s.num_kv_heads
        if H * D != C:
            raise ValueError(f"num_kv_heads {H} x head_dim {D} != the layout's {C} channels")
        return H, D
    return 1, C


def kv_form(shape, dtype, s: SerdeSettings) -> tuple[int, int, int, int]:
    """(L, T, H, D) of K and V for one kernel group of ``shape`` and ``dtype``: the KV
    layouts of the module docstring of :mod:`third_party.lmcache.serde`. Raises
    ValueError naming why the serde cannot code the group (it is then stored verbatim)."""
    dims = tuple(int(d) for d in shape)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} (the codecs take bfloat16, float16, float32)")
    if len(dims) == 5 and dims[0] == 2:
        L, T, H, D = dims[1:]
    elif len(dims) == 4 and dims[0] == 2:
        L, T, C = dims[1:]
        H, D = _heads(s, L, C)
    elif len(dims) == 3 or (len(dims) == 4 and dims[0] == 1):
        if s.codec == "kvtc":
            raise ValueError("one plane (MLA or fused K/V): kvtc needs K and V planes")
        L, T, C = dims[-3:]
        if C % 2:
            raise ValueError(f"one plane of an odd channel count ({C})")
        d = plane_head(s, C)
        H, D = (C // (2 * d), d) if d else (1, C // 2)
    else:
        raise ValueError("not [2, L, T, H*D], [2, L, T, H, D], [1, L, T, C] or [L, T, C]")
    for (name, lim), n in zip(_LIMITS, (L, T, H, D)):
        if not 1 <= n <= lim:
            raise ValueError(f"{name} = {n} outside the codec's [1, {lim}]")
    if s.codec == "kvtc":
        cal = codec_kvtc.get_calibration(s.calibration)
        if (cal.num_layers, cal.num_heads, cal.head_dim) != (L, H, D):
            raise ValueError(f"kvtc calibration {s.calibration[:16]} is for {cal.num_layers} "
                             f"layers x {cal.num_heads} heads x {cal.head_dim}, not {L} x "
                             f"{H} x {D}")
    return L, T, H, D


def plane_head(s: SerdeSettings, C: int):
    """The head size of a one-plane group of C channels read as fused K/V (each head's K
    then V, ``[.., H, 2 D]``: how fused formats pack them): ``head_dim``, else C / (2
    ``num_kv_heads``), else ``PLANE_HEAD``; None when C is not a multiple of 2 D (then
    the plane is read as two halves, one head each: an MLA latent)."""
    d = s.head_dim
    if d is None and s.num_kv_heads and C % (2 * s.num_kv_heads) == 0:
        d = C // (2 * s.num_kv_heads)
    d = d or PLANE_HEAD
    return d if C % (2 * d) == 0 else None


def codable(shape, dtype, s: SerdeSettings) -> bool:
    """Whether the serde codes a kernel group of this shape and dtype (else: verbatim)."""
    try:
        kv_form(shape, dtype, s)
    except (ValueError, codec.CodecError):
        return False
    return True


def kv_views(t: torch.Tensor, s: SerdeSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[L, T, H, D]`` of one kernel group's tensor (no copy): the planes
    of ``[2, L, T, ...]``; a single plane's (``[L, T, C]``, ``[1, L, T, C]``) heads'
    K and V halves (:func:`plane_head`), else its two channel halves. Raises ValueError
    for a group :func:`kv_form` refuses."""
    L, T, H, D = kv_form(t.shape, t.dtype, s)
    if t.dim() == 5:
        return t[0], t[1]
    if t.dim() == 4 and t.shape[0] == 2:
        return t[0].view(L, T, H, D), t[1].view(L, T, H, D)
    plane = t[0] if t.dim() == 4 else t
    if H == 1 and plane_head(s, 2 * D) is None:          # two halves
        return plane[..., :D].unsqueeze(2), plane[..., D:].unsqueeze(2)
    heads = plane.view(L, T, H, 2 * D)                   # fused: each head's K then V
    return heads[..., :D], heads[..., D:]


def token_bounds(T: int, s: SerdeSettings) -> list[tuple[int, int]]:
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


def frame_ident(s: SerdeSettings, ident_hash: str, key, shapes, dtypes) -> bytes:
    return json.dumps({"serde": s.codec, "identity": ident_hash, "key": _key_digest(key),
                       "layout": _layout_json(shapes, dtypes)}, sort_keys=True,
                      separators=(",", ":")).encode()


def group_bytes(shape, dtype) -> int:
    """Bytes of one kernel group (its verbatim size)."""
    return math.prod(int(d) for d in shape) * dtype.itemsize


def n_containers(shapes, s: SerdeSettings, dtypes=None, raw: bool = False) -> int:
    """Containers of a frame: per coded group one per token chunk, per verbatim group
    one (``raw``: every group verbatim; ``dtypes`` None: every group taken as coded)."""
    n = 0
    for i, sh in enumerate(shapes):
        coded = not raw and (dtypes is None or codable(sh, dtypes[i], s))
        n += len(token_bounds(_tokens(sh), s)) if coded else 1
    return n


def frame_overhead(s: SerdeSettings, ident_hash: str, shapes, dtypes, raw: bool = False) -> int:
    """Exact bytes of the frame before the containers (the key digest has fixed size)."""
    return header_size(len(frame_ident(s, ident_hash, None, shapes, dtypes)),
                       n_containers(shapes, s, dtypes, raw))


def raw_frame_bytes(s: SerdeSettings, ident_hash: str, shapes, dtypes) -> int:
    """Exact bytes of the frame storing every group verbatim (the ``raw`` step)."""
    return frame_overhead(s, ident_hash, shapes, dtypes, raw=True) + sum(
        RAW_HEAD + group_bytes(sh, dt) for sh, dt in zip(shapes, dtypes))
