"""LMCache's own serdes as peer rows of bench.codec and bench.quality.

``lmcache-fp8`` (lmcache.v1.distributed.serde.fp8: cast to float8_e4m3fn, 1 byte per
element, no scale) and ``lmcache-asym_k16_v8`` (lmcache.v1.distributed.serde.asym_k16_v8:
K kept in its 16-bit dtype, V to FP8 with a per-tensor scale), computed by LMCache's
code on LMCache's MP layout: our K, V ``[L, T, H, D]`` become the ``[2, L, T, H*D]``
MemoryObj (fp8) or the (K, V) MemoryObj group (asym) its serdes take, and back.
``turboquant`` (LMCache's third) needs CUDA and is not offered. The rows exist only when
``lmcache`` imports (``available()``; the optional .venv-lmcache, docs/lmcache.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PEERS = ("lmcache-fp8", "lmcache-asym_k16_v8")


def available() -> list[str]:
    """The peer rows that can run here ([] without lmcache)."""
    try:
        import lmcache.v1.distributed.serde.asym_k16_v8  # noqa: F401
        import lmcache.v1.distributed.serde.fp8  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed / not importable: no peer rows
        return []
    return list(PEERS)


def is_peer(name: str) -> bool:
    return name in PEERS


@dataclass
class PeerBlob:
    """What a peer serde wrote: ``data`` (the bytes LMCache would store) and the KV's
    shape and dtype (LMCache keeps those in its own object metadata, not in the bytes)."""

    name: str
    data: torch.Tensor          # uint8 [n]
    shape: tuple                # (L, T, H, D)
    dtype: torch.dtype


def memory_obj(t: torch.Tensor):
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    raw = t.contiguous().view(-1)
    return TensorMemoryObj(raw_data=raw, metadata=MemoryObjMetadata(
        shape=t.shape, dtype=t.dtype, address=-1, phy_size=raw.numel() * t.element_size(),
        ref_count=1, shapes=[t.shape], dtypes=[t.dtype]), parent_allocator=None)


def _key():
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=b"\0" * 32, model_name="bench", kv_rank=0)


def encode_with_stats(k: torch.Tensor, v: torch.Tensor, name: str) -> tuple[PeerBlob, dict]:
    """Encode K, V ``[L, T, H, D]`` (bf16/fp16) with LMCache's serde ``name``.
    Returns (blob, stats with bytes, elements, dtype_bytes). Raises ValueError for an
    unknown name; LMCache's own errors pass through."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    L, T, H, D = k.shape
    k, v = k.detach().cpu(), v.detach().cpu()
    if name == "lmcache-fp8":
        from lmcache.v1.distributed.serde.fp8 import Fp8QuantizationSerializer

        x = torch.stack([k.reshape(L, T, H * D), v.reshape(L, T, H * D)])
        ser = Fp8QuantizationSerializer()
        n_est = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
        dst = memory_obj(torch.empty(n_est, dtype=torch.uint8))
        n = ser.serialize(memory_obj(x), dst, _key())
    elif name == "lmcache-asym_k16_v8":
        from lmcache.v1.distributed.serde.asym_k16_v8 import AsymK16V8MultiSerializer

        kk, vv = k.reshape(L, T, H * D), v.reshape(L, T, H * D)
        ser = AsymK16V8MultiSerializer()
        lay = MemoryLayoutDesc([kk.shape], [kk.dtype])
        n_est = ser.estimate_serialized_size((lay, MemoryLayoutDesc([vv.shape], [vv.dtype])))
        dst = memory_obj(torch.empty(n_est, dtype=torch.uint8))
        n = ser.serialize((memory_obj(kk), memory_obj(vv)), dst, _key())
    else:
        raise ValueError(f"unknown LMCache peer {name!r} (known: {list(PEERS)})")
    elements = 2 * L * T * H * D
    blob = PeerBlob(name, dst.tensor[:n].clone(), (L, T, H, D), k.dtype)
    return blob, {"bytes": int(n), "elements": elements,
                  "dtype_bytes": elements * k.element_size(), "estimate_bytes": int(n_est)}


def decode(blob: PeerBlob) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[L, T, H, D]`` in the original dtype from a ``PeerBlob``."""
    L, T, H, D = blob.shape
    if blob.name == "lmcache-fp8":
        from lmcache.v1.distributed.serde.fp8 import Fp8QuantizationDeserializer

        out = memory_obj(torch.empty(2, L, T, H * D, dtype=blob.dtype))
        Fp8QuantizationDeserializer().deserialize(memory_obj(blob.data), out, _key())
        x = out.tensor
        return x[0].reshape(L, T, H, D), x[1].reshape(L, T, H, D)
    from lmcache.v1.distributed.serde.asym_k16_v8 import AsymK16V8MultiDeserializer

    ko = memory_obj(torch.empty(L, T, H * D, dtype=blob.dtype))
    vo = memory_obj(torch.empty(L, T, H * D, dtype=blob.dtype))
    AsymK16V8MultiDeserializer().deserialize(memory_obj(blob.data), (ko, vo), _key())
    return ko.tensor.reshape(L, T, H, D), vo.tensor.reshape(L, T, H, D)


def peer_level(name: str) -> Optional[int]:
    """Peers have no levels."""
    return None
