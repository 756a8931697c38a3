"""How an LMCache object maps onto codec containers: its kernel groups' tensors, their K/V
views ``[L, T, H, D]`` (see :mod:`third_party.lmcache.serde` for the layouts), the token
chunks, the ident (serde identity, key digest, layout) and the slot size estimate.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Optional

import torch

import codec
from codec import kvtc as codec_kvtc

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryObj
from third_party.lmcache.serde_frame import header_size
from third_party.lmcache.serde_settings import CONTAINER_SLACK, SerdeSettings

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def group_tensors(obj: MemoryObj) -> list[torch.Tensor]:
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


def n_containers(shapes, s: SerdeSettings) -> int:
    return sum(len(token_bounds(_tokens(sh), s)) for sh in shapes)


def frame_overhead(s: SerdeSettings, ident_hash: str, shapes, dtypes) -> int:
    """Exact bytes of the frame before the containers (the key digest has fixed size)."""
    return header_size(len(frame_ident(s, ident_hash, None, shapes, dtypes)), n_containers(shapes, s))


def estimate_bytes(s: SerdeSettings, ident_hash: str, layout: MemoryLayoutDesc) -> int:
    """The slot for one object of ``layout`` (bytes). Fixed-slot mode (``slot_ratio``):
    floor(KV bytes / slot_ratio), the frame included (:mod:`.serde_slot`). Else the frame
    overhead plus, per kernel group, bits_per_element * elements / 8 and
    ``CONTAINER_SLACK`` per container. Never raises: an unsupported layout gets its raw
    size (its serialize fails)."""
    try:
        shapes, dtypes = list(layout.shapes), list(layout.dtypes)
        raw = sum(math.prod(int(d) for d in sh) * dt.itemsize for sh, dt in zip(shapes, dtypes))
        if not shapes or any(dt not in DTYPES or len(sh) not in (3, 4, 5)
                             for sh, dt in zip(shapes, dtypes)):
            return max(1, raw)
        if s.slot_ratio is not None:
            return max(1, math.floor(raw / s.slot_ratio))
        ct = s.chunk_tokens
        payload = sum(math.ceil(math.prod(int(d) for d in sh)
                                * s.bound(min(_tokens(sh), ct or _tokens(sh))) / 8)
                      for sh in shapes)
        return frame_overhead(s, ident_hash, shapes, dtypes) + payload \
            + CONTAINER_SLACK * n_containers(shapes, s)
    except Exception:  # noqa: BLE001 - the contract: never raise here
        try:
            return max(1, sum(math.prod(int(d) for d in sh) * dt.itemsize
                              for sh, dt in zip(layout.shapes, layout.dtypes)))
        except Exception:  # noqa: BLE001
            return 1 << 20
