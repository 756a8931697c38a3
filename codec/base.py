"""The codecs' shared vocabulary, below every codec: the dtypes a KV may have (``DTYPES``,
``DTYPE_NAMES``, ``DTYPE_BYTES``), ``EncodedChunk`` (what a codec's encode returns), the
bit helpers (``to_bits`` / ``from_bits``, 2/4-bit ``pack_bits`` / ``unpack_bits``), the
header/array validators (``need_array``, ``need_int``: CodecError on bad input), KIVI's
constants and the ``Codec`` base class every codec derives from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from . import scratch
from .config import CodecConfig
from .errors import CodecError


DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

KIVI_GROUP = 32       # KIVI's group size (tokens for keys, channels for values)
KIVI_RESIDUAL = 128   # KIVI keeps the most recent 128 tokens in full precision


@dataclass
class EncodedChunk:
    """What a codec's ``encode`` returns (before the container): ``header`` (JSON-able,
    codec-specific), ``arrays`` (name -> numpy array), ``payload`` (bytes), ``stats``
    (not serialised: entropy_bits, ideal_bits, model_bytes, length_table_bytes,
    payload_bytes, scale_bytes, symbols); ``format_version``: the oldest container format
    version whose reader can read the chunk's content (4; 5 when it uses a version-5
    feature: a KIVI short last group or cachegen outlier-channel exponents,
    docs/bitstream.md section 4.1). Every chunk is written as version 6 (the same content
    with an xxh3-64 trailer); ``bitstream.reseal(data, format_version)`` gives the bytes
    that version's writer made."""

    header: dict
    arrays: dict
    payload: bytes = b""
    stats: dict = field(default_factory=dict)
    format_version: int = 4


# ------------------------------------------------------------------------ bit helpers
def to_bits(t: torch.Tensor) -> np.ndarray:
    """A float tensor's bit pattern as a numpy array: uint16 for fp16/bf16, uint32 fp32."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float32:
        return t.view(torch.int32).numpy().view(np.uint32)
    raise ValueError(f"unsupported dtype {t.dtype}")


def from_bits(a: Any, dtype_name: str, shape: tuple, what: str) -> torch.Tensor:
    """Inverse of ``to_bits`` with validation (CodecError on a wrong dtype/shape)."""
    want = np.uint32 if DTYPE_BYTES[dtype_name] == 4 else np.uint16
    arr = need_array(a, want, shape, what)
    t = torch.from_numpy(np.array(arr, copy=True))
    t = t.view(torch.int32 if want == np.uint32 else torch.int16)
    return t.view(DTYPES[dtype_name])


def need_array(a: Any, dtype, shape: Optional[tuple], what: str) -> np.ndarray:
    """Check that ``a`` is a numpy array of ``dtype`` and ``shape``; CodecError otherwise."""
    if not isinstance(a, np.ndarray):
        raise CodecError(f"missing or invalid array {what!r}")
    if a.dtype != np.dtype(dtype):
        raise CodecError(f"array {what!r} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise CodecError(f"array {what!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def need_int(h: dict, key: str, lo: int, hi: int) -> int:
    v = h.get(key) if isinstance(h, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise CodecError(f"header field {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 values < 2^bits (bits in {2, 4}) little-endian into bytes."""
    per = 8 // bits
    flat = q.reshape(-1).astype(np.uint8)
    pad = (-flat.size) % per
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)])
    g = flat.reshape(-1, per)
    out = np.zeros(g.shape[0], np.uint8)
    for i in range(per):
        out |= (g[:, i] << (i * bits)).astype(np.uint8)
    return out


def unpack_bits(b: np.ndarray, bits: int, n: int) -> np.ndarray:
    per = 8 // bits
    mask = (1 << bits) - 1
    out = scratch.np_empty((b.size, per), np.uint8)
    for i in range(per):
        out[:, i] = (b >> (i * bits)) & mask
    return out.reshape(-1)[:n]


# ----------------------------------------------------------------------------- codecs
class Codec:
    """Base class. ``encode(k, v, ...)`` -> EncodedChunk; ``decode(header, arrays,
    payload, shape, dtype_name)`` -> (k, v) float tensors [L, T, H, D] of that dtype on CPU.
    ``shape`` = (L, T, H, D) is already validated by the API; decoders raise CodecError
    on anything inconsistent.

    ``backend`` ("cpu" | "triton", already resolved by ``codec.api`` with
    ``codec.triton.ops.resolve_backend``): only codecs with ``supports_triton`` get
    "triton"; they then take K/V on the device (encode) and return K/V on ``device``
    (decode), with the same bytes / values as the CPU backend. The others always get CPU
    tensors and "cpu"."""

    name = "base"
    lossless = False
    supports_triton = False
    # ``levels``: the codec's quality levels (one documented scale per codec, docs/codec.md
    # "Levels"); () = the codec has no levels and takes level=None only.
    # ``default_level``: what level=None means (``resolve_level``).
    levels: tuple = ()
    default_level: Optional[int] = None

    @property
    def uses_level(self) -> bool:
        return bool(self.levels)

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, level: Optional[int],
               config: Optional[CodecConfig], token_offset: int,
               total_tokens: int, backend: str = "cpu") -> EncodedChunk:
        raise NotImplementedError

    def decode(self, header: dict, arrays: dict, payload: bytes, shape: tuple,
               dtype_name: str, *, backend: str = "cpu", device: Any = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<codec {self.name}>"
