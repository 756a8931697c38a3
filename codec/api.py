"""Public encode/decode API of the codec: KV tensors <-> self-describing bitstreams.

CacheGen's encoder/decoder (Liu et al., SIGCOMM 2024, section 5) and the baselines, each
chunk an independently decodable container (``codec.bitstream``: magic, version, JSON
header, arrays, payload, CRC32; docs/bitstream.md), so a streamer can send chunk k while
the receiver decodes chunk k-1 (paper section 5.3).

    import codec
    data = codec.encode_kv(k, v, codec="cachegen", level=2)   # k, v [L, T, H, D]
    k2, v2 = codec.decode_kv(data, device="cpu")               # same dtype and shape
    chunks = codec.encode_chunks(k, v, chunk_tokens=1024)      # list[bytes]
    codec.peek_header(chunks[0])                               # codec, level, shapes, sizes

Backends: ``backend="auto"`` (default) runs the cachegen codecs' quantization and rANS
coding in Triton when the tensors (encode) or the target ``device`` (decode) are on CUDA,
and on the CPU otherwise; ``"cpu"`` / ``"triton"`` force one (docs/gpu.md). Both produce
the same bytes and the same decoded values, so a KV encoded on a GPU decodes on a CPU and
the reverse.

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_api*.py -q
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

import hashlib
import json

from . import bitstream
from .base import DTYPE_BYTES, DTYPE_NAMES, DTYPES
from .registry import CODECS, get_codec, resolve_level
from .config import MIN_BLOCK_TOKENS, DEFAULT_CHUNK_TOKENS, CodecConfig
from .errors import CodecError

__all__ = ["encode_kv", "encode_blob", "encode_chunks", "decode_kv", "decode_kv_into", "decode_chunk",
           "decode_chunks", "peek_header", "encode_with_stats", "CODEC_VERSION",
           "DEFAULT_CHUNK_TOKENS", "chunk_bounds", "config_hash", "default_level",
           "levels", "resolve_level"]

# Version of the bytes the codecs produce: bumped whenever the same KV and config would
# encode to different bytes (quantizer, coder, layout or container change). Part of
# ``config_hash`` so that a store never serves bytes made by another codec version.
# 1: format version 1. 2: cachegen outlier side list (docs/bitstream.md 4.4), KIVI in
# float64, container format version 2, chunk_tokens in the container header. 3: cachegen
# model tables and model index Rice-coded (docs/bitstream.md 4.3), container
# format version 3, 8 channels per rANS stream by default. 4: model
# tables coded over their nonzero range, codebook size by description length over a finer
# ladder, container format version 4. 5: container format version 6 (an
# xxh3-64 checksum in place of the CRC32; the content bytes of every chunk are those of
# codec version 4).
CODEC_VERSION = 5

CONTAINER_KIND = "kvcodec"   # header["kind"]: what the container holds
MAX_DIM = {"L": 1 << 12, "T": 1 << 24, "H": 1 << 12, "D": 1 << 13}
MAX_ELEMENTS = 1 << 33       # per K or V tensor: refuse to allocate more when decoding
BACKENDS = ("auto", "cpu", "triton")


# ------------------------------------------------------------------------ validation
def check_kv(k: Any, v: Any) -> tuple[int, int, int, int]:
    """ValueError unless k and v are finite fp16/bf16/fp32 tensors of one shape
    [L, T, H, D] with every dimension >= 1."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 [layers, tokens, kv_heads, head_dim], "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name} has dtype {t.dtype}; supported: {sorted(DTYPES)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v dtypes differ: {k.dtype} vs {v.dtype}")
    if min(k.shape) < 1:
        raise ValueError(f"every dimension must be >= 1, got shape {tuple(k.shape)}")
    for key, n in zip("LTHD", k.shape):
        if n > MAX_DIM[key]:
            raise ValueError(f"dimension {key}={n} exceeds the limit {MAX_DIM[key]}")
    from .quant.fused import all_finite   # one numba pass over the bits

    for name, t in (("k", k), ("v", v)):
        if not all_finite(t):
            raise ValueError(f"{name} contains NaN or inf")
    return tuple(k.shape)  # type: ignore[return-value]


def check_level(codec_obj, level: Optional[int], config: Optional[CodecConfig] = None
                 ) -> Optional[int]:
    """The level to encode with: ``resolve_level`` (None -> the codec's default) when no
    config is given; with a config, None stays None (the config's own level counts)."""
    if config is not None and level is None:
        return None
    return resolve_level(codec_obj.name, level)


def as_device(device: Any) -> torch.device:
    """``torch.device(device)``, checked to be usable HERE, before any work.
    Raises ValueError (one line) on a malformed device, a CUDA device with a CPU-only
    torch or without that GPU, a device type this torch cannot allocate on, or "meta"."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"bad device {device!r} ({first}); use e.g. 'cpu' or 'cuda:0'") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError(f"device {device!r} holds no data; use 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but this torch has no usable CUDA "
                             f"(CPU-only build or no GPU); use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} requested but only "
                             f"{torch.cuda.device_count()} CUDA device(s) are visible")
        return dev
    try:  # other device types (xpu, mps, ...): usable iff torch can allocate there
        torch.empty(0, device=dev)
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        raise ValueError(f"device {device!r} is not usable with this torch: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return dev


# ------------------------------------------------------------------ levels, chunks, ids
def default_level(codec: str) -> Optional[int]:
    """What ``level=None`` means for ``codec`` (cachegen: 1, cachegen-ref: 0, codecs
    without levels: None). ValueError on an unknown codec."""
    return get_codec(codec).default_level


def levels(codec: str) -> tuple:
    """The valid levels of ``codec`` (() for codecs without levels; docs/codec.md
    "Levels" gives each codec's scale). ValueError on an unknown codec."""
    return tuple(get_codec(codec).levels)


def chunk_bounds(num_tokens: int, chunk_tokens: Optional[int] = None
                 ) -> list[tuple[int, int]]:
    """The chunk boundaries of a context: half-open token ranges ``[(0, c), (c, 2c), ...,
    (k*c, num_tokens)]``, the last one possibly shorter (paper section 5.3: chunks are
    independently decodable units of ``chunk_tokens`` tokens).

    ``chunk_tokens``: None = ``DEFAULT_CHUNK_TOKENS`` (1024); otherwise a positive multiple
    of ``MIN_BLOCK_TOKENS`` (16, the GPU vLLM KV block; use a multiple of 128 for vLLM
    CPU). ``encode_chunks`` splits with exactly this function.
    Raises ValueError on num_tokens < 1 or a bad chunk_tokens."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
    if chunk_tokens is None:
        chunk_tokens = DEFAULT_CHUNK_TOKENS
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) \
            or chunk_tokens < 1 or chunk_tokens % MIN_BLOCK_TOKENS:
        raise ValueError(f"chunk_tokens must be a positive multiple of {MIN_BLOCK_TOKENS}, "
                         f"got {chunk_tokens!r}")
    return [(a, min(num_tokens, a + chunk_tokens)) for a in range(0, num_tokens, chunk_tokens)]


# depths over which a preset is hashed when the caller does not give num_layers
_HASH_DEPTHS = (1, 2, 4, 8, 12, 16, 24, 28, 30, 32, 36, 40, 48, 60, 64, 80, 96, 128)


def _config_identity(c, level: Optional[int], config: Optional[CodecConfig],
                     num_layers: Optional[int]) -> Any:
    """The JSON-able part of ``config_hash`` that depends on the codec's config."""
    if config is not None:
        if not hasattr(c, "resolve_config"):
            raise ValueError(f"codec {c.name!r} takes no config")
        n = getattr(config, "num_layers", None)
        if num_layers is not None and n is not None and num_layers != n:
            raise ValueError(f"config is for {n} layers, not {num_layers}")
        depth = n if n is not None else (num_layers or 1)
        # validates level/config, and fills in what the codec derives from them
        return [_stored_config(c.resolve_config(depth, level, config))]
    if not hasattr(c, "resolve_config"):
        return None
    depths = _HASH_DEPTHS if num_layers is None else (num_layers,)
    return [_stored_config(c.resolve_config(n, level, None)) for n in depths]


def _stored_config(cfg: Any) -> Any:
    """The config as recorded in a chunk's header: everything but ``chunk_tokens`` (the
    split size, recorded in the container header; it does not change a chunk's bytes).
    Any codec's config object works: ``to_dict()``, else a dataclass, else ``repr``."""
    import dataclasses

    if hasattr(cfg, "to_dict"):
        d = cfg.to_dict()
    elif dataclasses.is_dataclass(cfg):
        d = dataclasses.asdict(cfg)
    else:
        return repr(cfg)
    d = dict(d)
    d.pop("chunk_tokens", None)
    return json.loads(json.dumps(d, sort_keys=True, default=repr))


def config_hash(codec: str, level: Optional[int] = None,
                config: Optional[CodecConfig] = None, *,
                num_layers: Optional[int] = None) -> str:
    """Identity of everything that changes the encoded bytes, for store keys (one level scale per codec,
    12.1): a 16-hex-digit prefix of the SHA-256 of the codec name, the resolved level
    (``resolve_level``: None and the default level give the same hash), the full resolved
    config (bins schedule per layer, scale group and format, sink tokens, stream layout,
    variant; not ``chunk_tokens``, which only decides the split that the token range of
    a chunk already identifies), ``CODEC_VERSION`` and the container format version.

    ``num_layers``: the model's depth when known (hash of the exact schedule for it);
    without it the presets are hashed at a fixed set of depths, so any change of a
    schedule table still changes the hash. ``config``: an explicit CodecConfig (cachegen
    codecs), hashed instead of the preset.
    Raises ValueError on an unknown codec, a bad level, or a config that contradicts
    ``level``/``num_layers``."""
    c = get_codec(codec)
    if num_layers is not None and (isinstance(num_layers, bool)
                                   or not isinstance(num_layers, int) or num_layers < 1):
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    lvl = check_level(c, level, config)
    if config is not None and lvl is None:
        lvl = config.level
    ident = {"codec": c.name, "level": lvl, "codec_version": CODEC_VERSION,
             "format_version": bitstream.FORMAT_VERSION,
             "config": _config_identity(c, level, config, num_layers)}
    # codecs with inputs beyond the config (kvtc: its calibration) add them with an
    # ``identity(level, config, num_layers) -> JSON-able`` method
    extra = getattr(c, "identity", None)
    if callable(extra):
        ident["codec_identity"] = extra(level=lvl, config=config, num_layers=num_layers)
    blob = json.dumps(ident, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def backend_for(device: torch.device, backend: Any) -> str:
    """"cpu" or "triton" for tensors on ``device`` (``codec.triton.ops.resolve_backend``).
    ValueError on an unknown name (listing the options) or on "triton" where Triton
    cannot run. "auto" on a non-CUDA device is "cpu" without importing Triton."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available backends: {list(BACKENDS)}")
    if backend == "cpu" or (backend == "auto" and device.type != "cuda"):
        return "cpu"
    from .triton.kernels import resolve_backend

    return resolve_backend(device, backend)


# -------------------------------------------------------------------------- encoding
def encode_one(k: torch.Tensor, v: torch.Tensor, codec: str, level: Optional[int],
                config: Optional[CodecConfig], token_offset: int, total_tokens: int,
                chunk_index: int, num_chunks: int, backend: str = "cpu",
                chunk_tokens: Optional[int] = None) -> tuple[bytes, dict]:
    """``backend``: already resolved ("cpu" | "triton"). Codecs without Triton kernels
    (raw, fp8, quant8, kivi) always run on CPU copies; the cachegen codecs with "triton"
    keep K/V on their device."""
    c = get_codec(codec)
    L, T, H, D = k.shape
    if backend == "triton" and c.supports_triton:
        k, v = k.detach(), v.detach()
    else:
        backend = "cpu"
        k, v = k.detach().to("cpu"), v.detach().to("cpu")
    enc = c.encode(k, v, level=level, config=config, token_offset=token_offset,
                   total_tokens=total_tokens, backend=backend)
    lvl = level
    if "config" in enc.header:
        lvl = enc.header["config"].get("level")
    dtype_name = DTYPE_NAMES[k.dtype]
    header = {"kind": CONTAINER_KIND, "codec": c.name, "level": lvl, "L": L, "T": T,
              "H": H, "D": D, "dtype": dtype_name, "token_offset": token_offset,
              "total_tokens": total_tokens, "chunk_index": chunk_index,
              "num_chunks": num_chunks, "codec_header": enc.header,
              "chunk_tokens": T if chunk_tokens is None else chunk_tokens,
              "codec_version": CODEC_VERSION}
    bf16 = [n for n, a in enc.arrays.items()
            if dtype_name == "bfloat16" and a.dtype == np.uint16 and not n.startswith("ent_")]
    # every chunk is written in the newest container version (6: xxh3-64 trailer), which
    # allows the version-5 features; ``enc.format_version`` (4 or 5) is the oldest
    # version whose reader could read its content (``bitstream.reseal`` rewrites it so)
    data = bitstream.pack(header, enc.arrays, enc.payload, bf16=bf16,
                          version=bitstream.FORMAT_VERSION)
    stats = dict(enc.stats)
    stats.update(bytes=len(data), elements=2 * L * T * H * D,
                 dtype_bytes=2 * L * T * H * D * DTYPE_BYTES[dtype_name])
    return data, stats


def _check_offset(token_offset: Any) -> int:
    if isinstance(token_offset, bool) or not isinstance(token_offset, int) \
            or not 0 <= token_offset < 2 ** 31:
        raise ValueError(f"token_offset must be an int in [0, 2**31), got {token_offset!r}")
    return token_offset


def encode_with_stats(k: torch.Tensor, v: torch.Tensor, codec: str = "cachegen",
                      level: Optional[int] = None, config: Optional[CodecConfig] = None,
                      backend: str = "auto", token_offset: int = 0) -> tuple[bytes, dict]:
    """``encode_kv`` plus a stats dict (bytes, elements, dtype_bytes, and for cachegen:
    entropy_bits, ideal_bits, model_bytes, length_table_bytes, payload_bytes, scale_bytes,
    sink_bytes, symbols) for benchmarks."""
    codec_obj = get_codec(codec)
    level = check_level(codec_obj, level, config)
    _, T, _, _ = check_kv(k, v)
    off = _check_offset(token_offset)
    b = backend_for(k.device, backend)
    return encode_one(k, v, codec, level, config, off, off + T, 0, 1, backend=b)


def encode_kv(k: torch.Tensor, v: torch.Tensor, codec: str = "cachegen",
              level: Optional[int] = None, config: Optional[CodecConfig] = None,
              backend: str = "auto", token_offset: int = 0) -> bytes:
    """Encode a whole KV cache as ONE container.

    Args:
      k, v: [L, T, H, D] (layers, tokens, KV heads, head_dim), float16/bfloat16/float32,
        finite, any device.
      codec: a name in ``codec.CODECS`` (raw, fp8, quant8, kivi2, kivi4, cachegen,
        cachegen-ref, kvtc).
      level: the codec's level (None = its default, ``resolve_level``: cachegen 1 of
        0-5, cachegen-ref 0 of 0-3, kvtc 4 of 0-5); must be None for codecs without levels.
      config: explicit CodecConfig for cachegen codecs (overrides the level preset), or a
        ``codec.kvtc.KvtcConfig`` for kvtc (its calibration, sinks, tiers).
      backend: "auto" (default: Triton when k is on CUDA and Triton is usable, else CPU),
        "cpu" (copies to the host) or "triton" (the Triton kernels of
        ``codec.triton.ops``, on k's device). Same bytes either way. Only cachegen
        and cachegen-ref have Triton kernels; other codecs always encode on a CPU copy.
      token_offset: the position of the first token in its context (int >= 0, default 0):
        the tokens are coded as positions ``token_offset .. token_offset + T - 1`` of a
        context of ``token_offset + T`` tokens (sink tokens only below ``sink_tokens``;
        kvtc's pre-RoPE transform undoes RoPE at these positions); recorded in the header,
        so the decode needs nothing else.
    Returns: bytes (self-describing: ``decode_kv`` needs nothing else).
    Raises: ValueError on bad input (rank, shapes, dtype, NaN/inf, unknown
      codec/level/backend, backend="triton" where Triton cannot run). Values up to the
      dtype's max are accepted by every codec; fp8 saturates at +-448.
    Thread safety: every encode/decode function may be called from several threads at
      once (``codec.threads``); results are identical to serial calls.
    """
    return encode_with_stats(k, v, codec, level, config, backend=backend,
                             token_offset=token_offset)[0]


def encode_blob(kv: torch.Tensor, codec: str = "cachegen", level: Optional[int] = None,
                config: Optional[CodecConfig] = None, backend: str = "auto") -> bytes:
    """``encode_kv`` for LMCache's layout: ``kv`` [L, 2, T, H, D] (index 0 = K, 1 = V)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv blob must be a tensor [L, 2, T, H, D], got {shape}")
    return encode_kv(kv[:, 0], kv[:, 1], codec=codec, level=level, config=config,
                     backend=backend)


def encode_chunks(k: torch.Tensor, v: torch.Tensor, codec: str = "cachegen",
                  level: Optional[int] = None, config: Optional[CodecConfig] = None,
                  chunk_tokens: Optional[int] = None, backend: str = "auto",
                  token_offset: int = 0) -> list[bytes]:
    """Split the tokens into chunks of ``chunk_tokens`` (the last may be shorter) and encode
    each as an independently decodable container (own header, models, CRC32).

    ``chunk_tokens``: None = ``config.chunk_tokens`` if a config is given, else
    ``DEFAULT_CHUNK_TOKENS`` (1024); must be a positive multiple of 16 (GPU vLLM's KV
    block; use a multiple of 128 for vLLM CPU); boundaries from ``chunk_bounds``. Each
    chunk's header records ``T`` (its real length), ``chunk_tokens`` (the split size),
    ``token_offset``, ``total_tokens``, ``chunk_index`` and ``num_chunks``;
    ``decode_chunks`` concatenates them back to the full KV.
    ``backend``, ``token_offset`` (the first token's position; chunk offsets and
    ``total_tokens`` are shifted by it): as ``encode_kv``.
    Raises ValueError on bad input.
    """
    codec_obj = get_codec(codec)
    level = check_level(codec_obj, level, config)
    _, T, _, _ = check_kv(k, v)
    bk = backend_for(k.device, backend)
    if chunk_tokens is None and config is not None:
        chunk_tokens = config.chunk_tokens
    off = _check_offset(token_offset)
    bounds = chunk_bounds(T, chunk_tokens)
    ct = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    return [encode_one(k[:, a:b], v[:, a:b], codec, level, config, off + a, off + T, i,
                        len(bounds), backend=bk, chunk_tokens=ct)[0]
            for i, (a, b) in enumerate(bounds)]


# -------------------------------------------------------------------------- decoding
def unpack_kind(data: Any, kind: str, what: str) -> tuple[dict, dict, bytes]:
    """``bitstream.unpack`` of ``data`` whose header ``kind`` must be ``kind`` (``what``
    names it in the error); CodecError on anything else (also shared by codec.window)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    try:   # no copy: the arrays and the payload are read-only views of ``data``
        c = bitstream.unpack_container(data, copy=False)
        header, arrays, payload = c.header, c.arrays, c.payload
    except CodecError:
        raise
    except Exception as e:  # the container must only raise CodecError; be defensive
        raise CodecError(f"cannot parse container: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict) or header.get("kind") != kind:
        raise CodecError(f"not a {what} container (header kind mismatch)")
    return header, arrays, payload


def _read(data: Any) -> tuple[dict, dict, bytes, Any]:
    """unpack + validate the common header; returns (header, arrays, payload, codec)."""
    header, arrays, payload = unpack_kind(data, CONTAINER_KIND, "KV codec")
    name = header.get("codec")
    if not isinstance(name, str) or name not in CODECS:
        raise CodecError(f"unknown codec {name!r} in header; known: {sorted(CODECS)}")
    dims = {}
    for key in "LTHD":
        v = header.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DIM[key]:
            raise CodecError(f"header field {key!r} invalid: {v!r}")
        dims[key] = v
    if dims["L"] * dims["T"] * dims["H"] * dims["D"] > MAX_ELEMENTS:
        raise CodecError("header declares a KV larger than the decoder's limit")
    if not isinstance(header.get("dtype"), str) or header["dtype"] not in DTYPES:
        raise CodecError(f"header dtype {header.get('dtype')!r} not in {sorted(DTYPES)}")
    for key, lo in (("token_offset", 0), ("total_tokens", 1), ("chunk_index", 0),
                    ("num_chunks", 1)):
        v = header.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_DIM["T"]:
            raise CodecError(f"header field {key!r} invalid: {v!r}")
    if header["token_offset"] + dims["T"] > header["total_tokens"] or \
            header["chunk_index"] >= header["num_chunks"]:
        raise CodecError("header token/chunk positions are inconsistent")
    if "level" not in header:
        raise CodecError("header lacks the level field")
    lvl = header["level"]
    if lvl is not None and (isinstance(lvl, bool) or not isinstance(lvl, int)
                            or not CODECS[name].uses_level):
        raise CodecError(f"header level invalid for codec {name!r}: {lvl!r}")
    if not isinstance(header.get("codec_header"), dict):
        raise CodecError("header lacks the codec_header dict")
    if not isinstance(arrays, dict):
        raise CodecError("container arrays are not a dict")
    return header, arrays, payload, CODECS[name]


def decode_kv_into(data: bytes, k_out: torch.Tensor, v_out: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode one container on the CPU straight into caller-provided tensors.

    k_out, v_out: contiguous CPU tensors [L, T, H, D] of the container's dtype (see
    ``peek_header``). cachegen / cachegen-ref / quant8 decode into them with no
    intermediate full-size tensor (``codec.quant.fused``); kvtc writes its inverse transform
    into them (no copy); the other codecs decode, then copy.
    Returns: (k_out, v_out). Raises: CodecError on a corrupt container; ValueError when
    the destination does not match the header's shape/dtype."""
    return decode_kv(data, "cpu", backend="cpu", out=(k_out, v_out))


def decode_kv(data: bytes, device: Any = "cpu", backend: str = "auto", out=None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode one container (``encode_kv`` output or one chunk of ``encode_chunks``).

    ``backend``: "auto" (default: Triton when ``device`` is CUDA and Triton is usable,
    else CPU), "cpu" (decode on the host, then copy to ``device``) or "triton" (rANS
    decoding and dequantization by ``codec.triton.ops`` on ``device``). The decoded
    values are identical either way. Only cachegen / cachegen-ref use Triton.
    On the CPU, cachegen / cachegen-ref / quant8 / fp8 / KIVI decode with the fused
    decoders of ``codec.quant.fused`` (symbols -> model dtype in one pass, both cores, no
    intermediate tensor; bit-identical to the reference path). ``out``: optional
    (k_out, v_out) contiguous CPU tensors of the header's shape and dtype to decode into
    (``decode_kv_into``).
    Returns: (k, v), each [L, T, H, D] in the ORIGINAL dtype, on ``device``.
    Raises: CodecError on any malformed, truncated or corrupted input (nothing else);
      ValueError on a bad ``device`` or ``backend`` argument.
    """
    dev = as_device(device)
    b = backend_for(dev, backend)
    header, arrays, payload, c = _read(data)
    shape = (header["L"], header["T"], header["H"], header["D"])
    outp = _check_out(out, shape, header["dtype"])   # ValueError on a bad destination
    try:
        if b == "triton" and c.supports_triton:
            k, v = c.decode(header["codec_header"], arrays, payload, shape,
                            header["dtype"], backend="triton", device=dev)
        elif getattr(c, "fused_cpu", False):   # codec.quant.fused: into ``out`` if given
            k, v = c.decode(header["codec_header"], arrays, payload, shape, header["dtype"],
                            out=outp)
        elif outp is not None and getattr(c, "decodes_into", False):   # kvtc: no copy after
            k, v = c.decode(header["codec_header"], arrays, payload, shape, header["dtype"], out=outp)
        else:
            k, v = c.decode(header["codec_header"], arrays, payload, shape, header["dtype"])
    except CodecError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, RuntimeError,
            AttributeError) as e:
        raise CodecError(f"{c.name}: corrupt bitstream ({type(e).__name__}: {e})") from None
    if k.shape != shape or v.shape != shape:
        raise CodecError(f"{c.name}: decoded shape {tuple(k.shape)} != header {shape}")
    if k.dtype != DTYPES[header["dtype"]] or v.dtype != k.dtype:
        raise CodecError(f"{c.name}: decoded dtype {k.dtype} != header {header['dtype']}")
    # encoders refuse NaN/inf, so a decoded NaN/inf can only come from corrupt bytes (the
    # fused CPU decoders check their tables, sinks and outliers instead: finite by
    # construction, no extra pass over the output)
    fused = b != "triton" and getattr(c, "fused_cpu", False)
    from .quant.fused import all_finite

    if not fused and not (all_finite(k) and all_finite(v)):
        raise CodecError(f"{c.name}: decoded KV contains NaN/inf (corrupt bitstream)")
    if outp is not None and not fused:
        ko, vo = outp
        if k is not ko:
            ko.copy_(k)
        if v is not vo:
            vo.copy_(v)
        return ko, vo
    return k.to(dev), v.to(dev)


def _check_out(out, shape: tuple, dtype_name: str):
    """None, or the validated (k_out, v_out) pair (ValueError if it does not match)."""
    if out is None:
        return None
    from .quant.fused import check_out

    return check_out(out, shape, DTYPES[dtype_name])


def decode_chunk(data: bytes, device: Any = "cpu", backend: str = "auto"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode one chunk of ``encode_chunks`` (same as ``decode_kv``); its position in the
    context is ``peek_header(data)["token_offset"]``."""
    return decode_kv(data, device, backend=backend)


CHUNK_FIELDS = ("codec", "L", "H", "D", "dtype", "total_tokens", "num_chunks")  # shared by one call's chunks


def join_chunks(chunks: Sequence[bytes], peek: Callable[[bytes], dict],
                decode: Callable[[bytes], tuple[torch.Tensor, torch.Tensor]],
                same: Sequence[str] = CHUNK_FIELDS) -> tuple[torch.Tensor, torch.Tensor]:
    """One encode call's chunks checked against chunk 0 and their places (``peek``: a header
    with token_offset, chunk_index, T and the ``same`` fields), decoded (``decode``) and
    joined along tokens: (k, v) [L, T, H, D]. Raises CodecError if chunks are missing,
    out of order or from different KVs."""
    if not chunks:
        raise CodecError("no chunks")
    ks, vs, first, pos = [], [], None, 0
    for i, data in enumerate(chunks):
        h = peek(data)
        if first is None:
            first, pos = h, h["token_offset"]   # an encode_chunks(token_offset=...) call's start
        if h["token_offset"] != pos or h["chunk_index"] != i:
            raise CodecError(f"chunk {i} starts at token {h['token_offset']}, expected {pos}")
        for key in same:
            if h[key] != first[key]:
                raise CodecError(f"chunk {i} has {key}={h[key]!r}, chunk 0 has {first[key]!r}")
        k, v = decode(data)
        ks.append(k)
        vs.append(v)
        pos += h["T"]
    if pos != first["total_tokens"] or len(chunks) != first["num_chunks"]:
        raise CodecError(f"chunks cover {pos} of {first['total_tokens']} tokens")
    return torch.cat(ks, 1), torch.cat(vs, 1)


def decode_chunks(chunks: Sequence[bytes], device: Any = "cpu", backend: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode all chunks of one ``encode_chunks`` call and concatenate along tokens
    (``backend`` as ``decode_kv``); returns (k, v) [L, T, H, D] of the call's T tokens.
    Raises CodecError if chunks are missing, out of order or from different KVs;
    ValueError on a bad ``device`` or ``backend``."""
    backend_for(as_device(device), backend)   # argument errors before any decoding
    return join_chunks(chunks, peek_header, lambda data: decode_kv(data, device, backend=backend))


def peek_header(data: bytes) -> dict:
    """The container's validated header fields without dequantizing anything.

    Returns a dict with: codec, level, L, T (tokens in this container: the real chunk
    length), H, D, dtype, token_offset, total_tokens, chunk_index, num_chunks,
    chunk_tokens (the split size of ``encode_chunks``; T for ``encode_kv``; None in
    format-1 containers), codec_version (1 for format-1 containers), bytes (len(data)),
    payload_bytes, array_bytes, elements (2*L*T*H*D), dtype_bytes (the KV's size in its
    own dtype), ratio_vs_dtype, bits_per_element, config (dict or None).
    Raises CodecError on bad input.
    """
    header, arrays, payload, c = _read(data)
    L, T, H, D = header["L"], header["T"], header["H"], header["D"]
    elements = 2 * L * T * H * D
    dtype_bytes = elements * DTYPE_BYTES[header["dtype"]]
    out = {key: header[key] for key in ("codec", "level", "L", "T", "H", "D", "dtype",
                                        "token_offset", "total_tokens", "chunk_index",
                                        "num_chunks")}
    ct = header.get("chunk_tokens")          # absent in format-1 containers
    out["chunk_tokens"] = ct if isinstance(ct, int) and not isinstance(ct, bool) else None
    cv = header.get("codec_version")
    out["codec_version"] = cv if isinstance(cv, int) and not isinstance(cv, bool) else 1
    cfg = header["codec_header"].get("config")
    out.update(bytes=len(data), payload_bytes=len(payload),
               array_bytes=int(sum(getattr(a, "nbytes", 0) for a in arrays.values())),
               elements=elements, dtype_bytes=dtype_bytes,
               ratio_vs_dtype=dtype_bytes / len(data),
               bits_per_element=8 * len(data) / elements,
               config=cfg if isinstance(cfg, dict) else None)
    return out
