"""The steps an LMCache object can be coded at, coarsest first: ``raw`` (every kernel group
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

The slot guarantee (``always_fit``, :mod:`.serde_slot`) uses :func:`worst_floor_bytes`:
the size of ``floor-4`` on maximum-entropy input (every value -1, 0 or +1 times the
step, equally often, the most a 3-symbol entropy coder can need), plus ``FLOOR_SLACK``.
"""
from __future__ import annotations

import math
import threading

import torch

import codec

from third_party.lmcache.serde_layout import kv_views
from third_party.lmcache.serde_settings import SerdeSettings

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
