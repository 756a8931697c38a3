"""Exact anchor tokens: the first ``sink`` tokens (attention sinks) and the last ``recent``
tokens of a context stored exactly, the rest coded by any registered codec.

Why: attention sinks (Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", ICLR 2024) carry outliers a quantizer handles badly, and the most recent tokens
get most of the next token's attention; KVTC (Staniszewski and Lancucki, 2025, section 3)
keeps 4 sink + 128 recent tokens uncompressed. A KL measured with such a tail says little
about the codec alone, so every encode here reports its exact-token count.

Separate from ``codec.api`` because, like ``codec.window``, it is a layout ABOVE the
codecs: the tokens between the anchors are one ordinary codec container (``codec.api``,
unchanged bytes), wrapped with the anchors' exact bits in a small container of its own.
With ``sink = recent = 0`` (the default) nothing here is used: callers get the ordinary
container, the same bytes as before. The codec still knows no model.

Layout. For a context of ``total`` tokens (positions ``0 .. total - 1``) the exact tokens
are positions ``[0, s_end)`` and ``[r_start, total)`` with ``s_end = min(sink, total)``
and ``r_start = max(total - recent, s_end)``; the coded ones ``[s_end, r_start)``. A
context of at most ``sink + recent`` tokens is stored exactly whole. A chunk covering
``[a, b)`` holds its share of each: head (exact), middle (coded), tail (exact), each
contiguous, so the sinks travel in the first chunk and the recent tokens in the last
chunk(s).

Container: a ``codec.bitstream`` container whose JSON header has ``kind`` "kvanchor",
``anchor_version`` 1, the codec and level, the chunk's shape (L, T, H, D, dtype), its
token range (token_offset, total_tokens, chunk_index, num_chunks, chunk_tokens), the
option (``sink``, ``recent``), ``n_head`` / ``n_tail`` (exact tokens of this chunk) and
``middle_bytes``; arrays ``head_k``, ``head_v``, ``tail_k``, ``tail_v`` (the dtype's bit
patterns, ``[L, n, H, D]``); the payload is the middle's ordinary codec container (empty
when the chunk has no coded token). Sizes (``bytes``, ratios) count the whole container,
exact bits included. Any header that disagrees with its arrays or its middle container
raises CodecError; ``codec.decode_kv`` refuses an anchored container (kind mismatch), so
a reader never takes one for a plain entry.

    from codec import anchors
    data, stats = anchors.encode_with_stats(k, v, "cachegen", sink=4, recent=128)
    k2, v2 = anchors.decode(data)                          # k, v [L, T, H, D]
    chunks = anchors.encode_chunks(k, v, "kvtc", config=cfg, sink=4, recent=128)
    k2, v2 = anchors.decode_chunks(chunks)
    anchors.config_hash("cachegen", sink=4, recent=128)    # != codec.config_hash("cachegen")

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_anchors.py -q
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Optional, Sequence

import torch

from . import bitstream
from .api import (CHUNK_FIELDS, DEFAULT_CHUNK_TOKENS, MAX_DIM, MAX_ELEMENTS, as_device, backend_for, check_kv,
                  check_level, chunk_bounds, decode_kv, encode_one, join_chunks, peek_header, unpack_kind)
from .api import config_hash as plain_config_hash
from .base import DTYPE_BYTES, DTYPE_NAMES, DTYPES, from_bits, to_bits
from .errors import CodecError
from .registry import CODECS, get_codec

__all__ = ["ANCHOR_KIND", "ANCHOR_VERSION", "check_anchors", "anchor_spans", "config_hash", "encode",
           "encode_with_stats", "encode_chunks", "decode", "decode_chunks", "peek_anchor_header",
           "is_anchored", "exact_tokens", "parse_anchors"]

ANCHOR_KIND = "kvanchor"     # header["kind"] of an anchored container
ANCHOR_VERSION = 1


def check_anchors(sink: Any, recent: Any) -> tuple[int, int]:
    """``(sink, recent)`` validated: ints in ``[0, 2**24]`` (not bool). ValueError (one
    line) otherwise."""
    for name, x in (("sink", sink), ("recent", recent)):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_DIM["T"]:
            raise ValueError(f"anchor {name} must be an int in [0, {MAX_DIM['T']}], got {x!r}")
    return sink, recent


def parse_anchors(spec: str) -> tuple[int, int]:
    """``"SINK,RECENT"`` (e.g. ``"4,128"``) -> ``(sink, recent)``; ``"off"`` / ``"0,0"`` ->
    ``(0, 0)``. ValueError (one line) on anything else."""
    s = str(spec).strip().lower()
    if s in ("off", "none", ""):
        return 0, 0
    parts = s.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"anchors must be 'SINK,RECENT' (non-negative ints) or 'off', got {spec!r}")
    return check_anchors(int(parts[0]), int(parts[1]))


def anchor_spans(a: int, b: int, total: int, sink: int, recent: int) -> tuple[int, int]:
    """The coded range ``[lo, hi)`` of the chunk covering absolute positions ``[a, b)`` of a
    ``total``-token context: head ``[a, lo)`` and tail ``[hi, b)`` are exact (module
    docstring "Layout"); ``lo == hi`` when nothing is coded."""
    s_end = min(sink, total)
    r_start = max(total - recent, s_end)
    lo = min(max(s_end, a), b)
    hi = min(max(r_start, lo), b)
    return lo, hi


def config_hash(codec: str, level: Optional[int] = None, config: Any = None, *,
                num_layers: Optional[int] = None, sink: int = 0, recent: int = 0) -> str:
    """``codec.config_hash`` with the anchors in it: the same 16 hex digits when
    ``sink = recent = 0`` (an ordinary container), otherwise the SHA-256 prefix of that
    hash, the anchor version and ``(sink, recent)``, so an anchored entry is never served
    to a reader asking without anchors (or with others). ValueError as
    ``codec.config_hash`` and on bad anchors."""
    sink, recent = check_anchors(sink, recent)
    base = plain_config_hash(codec, level, config, num_layers=num_layers)
    if sink == 0 and recent == 0:
        return base
    blob = json.dumps({"base": base, "anchor_version": ANCHOR_VERSION, "sink": sink, "recent": recent},
                      sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


# -------------------------------------------------------------------------- encoding
def _encode_part(k, v, codec, level, config, off, total, index, count, backend, ct, sink, recent
                 ) -> tuple[bytes, dict]:
    """The anchored container of ``k``/``v`` (positions ``off .. off + T - 1`` of a
    ``total``-token context) and its stats."""
    L, T, H, D = k.shape
    lo, hi = anchor_spans(off, off + T, total, sink, recent)
    nh, nt = lo - off, off + T - hi
    dtype_name = DTYPE_NAMES[k.dtype]
    arrays = {"head_k": to_bits(k[:, :nh]), "head_v": to_bits(v[:, :nh]),
              "tail_k": to_bits(k[:, T - nt:]), "tail_v": to_bits(v[:, T - nt:])}
    middle, stats = b"", {}
    if hi > lo:
        middle, stats = encode_one(k[:, nh:T - nt], v[:, nh:T - nt], codec, level, config, lo, total,
                                   index, count, backend=backend, chunk_tokens=ct)
    lvl = peek_header(middle)["level"] if middle else level
    header = {"kind": ANCHOR_KIND, "anchor_version": ANCHOR_VERSION, "codec": get_codec(codec).name,
              "level": lvl, "L": L, "T": T, "H": H, "D": D, "dtype": dtype_name, "token_offset": off,
              "total_tokens": total, "chunk_index": index, "num_chunks": count, "chunk_tokens": ct,
              "sink": sink, "recent": recent, "n_head": nh, "n_tail": nt, "middle_bytes": len(middle)}
    bf16 = list(arrays) if dtype_name == "bfloat16" else []
    data = bitstream.pack(header, arrays, middle, bf16=bf16, version=bitstream.FORMAT_VERSION)
    out = {f"middle_{key}": x for key, x in stats.items() if isinstance(x, (int, float))}
    out.update(bytes=len(data), elements=2 * L * T * H * D,
               dtype_bytes=2 * L * T * H * D * DTYPE_BYTES[dtype_name],
               anchor_tokens=nh + nt, anchor_bytes=int(sum(a.nbytes for a in arrays.values())),
               exact_tokens=nh + nt + (_codec_exact(middle) if middle else 0))
    return data, out


def _prepare(k, v, codec, level, config, backend, sink, recent, token_offset):
    c = get_codec(codec)
    level = check_level(c, level, config)
    sink, recent = check_anchors(sink, recent)
    _, T, _, _ = check_kv(k, v)
    if isinstance(token_offset, bool) or not isinstance(token_offset, int) or not 0 <= token_offset < 2 ** 31:
        raise ValueError(f"token_offset must be an int in [0, 2**31), got {token_offset!r}")
    return level, sink, recent, T, backend_for(k.device, backend)


def encode_with_stats(k: torch.Tensor, v: torch.Tensor, codec: str = "cachegen", level: Optional[int] = None,
                      config: Any = None, backend: str = "auto", *, sink: int = 0, recent: int = 0,
                      token_offset: int = 0) -> tuple[bytes, dict]:
    """Encode ``k``, ``v`` ``[L, T, H, D]`` (fp16/bf16/fp32, finite) as ONE container with
    the first ``sink`` and last ``recent`` tokens exact (bit for bit, the input dtype).

    ``sink = recent = 0``: ``codec.encode_with_stats`` itself (the ordinary container, the
    same bytes), its stats plus ``exact_tokens`` (the codec's own exact tokens, e.g.
    cachegen's 4 sinks). Otherwise the anchored container and stats: ``bytes`` (the
    whole container), ``elements``, ``dtype_bytes``, ``anchor_tokens``, ``anchor_bytes``
    (the exact bits), ``exact_tokens`` (anchors plus the codec's own exact tokens in the
    middle) and the middle's numeric stats prefixed ``middle_``. Other arguments as
    ``codec.encode_kv``. Raises ValueError on bad input (one line)."""
    level, sink, recent, T, bk = _prepare(k, v, codec, level, config, backend, sink, recent, token_offset)
    if sink == 0 and recent == 0:
        from .api import encode_with_stats as plain

        data, stats = plain(k, v, codec, level, config, backend=backend, token_offset=token_offset)
        return data, dict(stats, exact_tokens=_codec_exact(data), anchor_tokens=0)
    return _encode_part(k, v, codec, level, config, token_offset, token_offset + T, 0, 1, bk, T, sink, recent)


def encode(k: torch.Tensor, v: torch.Tensor, codec: str = "cachegen", level: Optional[int] = None,
           config: Any = None, backend: str = "auto", *, sink: int = 0, recent: int = 0,
           token_offset: int = 0) -> bytes:
    """:func:`encode_with_stats` without the stats."""
    return encode_with_stats(k, v, codec, level, config, backend, sink=sink, recent=recent,
                             token_offset=token_offset)[0]


def encode_chunks(k: torch.Tensor, v: torch.Tensor, codec: str = "cachegen", level: Optional[int] = None,
                  config: Any = None, chunk_tokens: Optional[int] = None, backend: str = "auto", *,
                  sink: int = 0, recent: int = 0, token_offset: int = 0) -> list[bytes]:
    """``codec.encode_chunks`` with exact anchors: chunk ``i`` covers the tokens of
    ``codec.chunk_bounds`` and holds its share of the head, the coded middle and the tail
    (the sinks in the first chunk, the recent tokens in the last chunk(s)); each chunk
    decodes on its own (:func:`decode`). ``sink = recent = 0``: ``codec.encode_chunks``'
    own chunks, the same bytes. Raises ValueError on bad input."""
    level, sink, recent, T, bk = _prepare(k, v, codec, level, config, backend, sink, recent, token_offset)
    if sink == 0 and recent == 0:
        from .api import encode_chunks as plain

        return plain(k, v, codec, level, config, chunk_tokens, backend, token_offset)
    if chunk_tokens is None and config is not None:
        chunk_tokens = getattr(config, "chunk_tokens", None)
    bounds = chunk_bounds(T, chunk_tokens)
    ct = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    off = token_offset
    return [_encode_part(k[:, a:b], v[:, a:b], codec, level, config, off + a, off + T, i, len(bounds), bk,
                         ct, sink, recent)[0] for i, (a, b) in enumerate(bounds)]


# -------------------------------------------------------------------------- decoding
def _int(h: dict, key: str, lo: int, hi: int) -> int:
    x = h.get(key)
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise CodecError(f"anchor header field {key!r} invalid: {x!r}")
    return x


def peek_anchor_header(data: bytes) -> dict:
    """The validated header of an anchored container (fields as the module docstring) plus
    ``bytes`` (len(data)). Raises CodecError on any malformed input."""
    h, _, payload = unpack_kind(data, ANCHOR_KIND, "anchored KV")
    if h.get("anchor_version") != ANCHOR_VERSION:
        raise CodecError(f"unsupported anchor_version {h.get('anchor_version')!r}")
    if not isinstance(h.get("codec"), str) or h["codec"] not in CODECS:
        raise CodecError(f"unknown codec {h.get('codec')!r} in anchor header")
    dims = {key: _int(h, key, 1, MAX_DIM[key]) for key in "LTHD"}
    if dims["L"] * dims["T"] * dims["H"] * dims["D"] > MAX_ELEMENTS:
        raise CodecError("anchor header declares a KV larger than the decoder's limit")
    if not isinstance(h.get("dtype"), str) or h["dtype"] not in DTYPES:
        raise CodecError(f"anchor header dtype {h.get('dtype')!r} not in {sorted(DTYPES)}")
    total = _int(h, "total_tokens", 1, MAX_DIM["T"])
    off = _int(h, "token_offset", 0, total - dims["T"])
    count = _int(h, "num_chunks", 1, MAX_DIM["T"])
    _int(h, "chunk_index", 0, count - 1)
    sink, recent = _int(h, "sink", 0, MAX_DIM["T"]), _int(h, "recent", 0, MAX_DIM["T"])
    lo, hi = anchor_spans(off, off + dims["T"], total, sink, recent)
    if _int(h, "n_head", 0, dims["T"]) != lo - off or _int(h, "n_tail", 0, dims["T"]) != off + dims["T"] - hi:
        raise CodecError("anchor header's exact token counts disagree with its sink/recent")
    if _int(h, "middle_bytes", 0, len(payload)) != len(payload) or (len(payload) > 0) != (hi > lo):
        raise CodecError("anchor header's middle_bytes disagrees with its payload")
    return dict(h, bytes=len(data))


def decode(data: bytes, device: Any = "cpu", backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` ``[L, T, H, D]`` in the original dtype on ``device`` from an anchored
    container (exact tokens bit for bit) or an ordinary one (``codec.decode_kv``).
    Raises CodecError on malformed input; ValueError on a bad device or backend."""
    if not is_anchored(data):
        return decode_kv(data, device, backend=backend)
    dev = as_device(device)
    backend_for(dev, backend)
    h = peek_anchor_header(data)
    _, arrays, payload = unpack_kind(data, ANCHOR_KIND, "anchored KV")
    L, T, H, D, dt = h["L"], h["T"], h["H"], h["D"], h["dtype"]
    nh, nt = h["n_head"], h["n_tail"]
    parts_k = [from_bits(arrays.get("head_k"), dt, (L, nh, H, D), "head_k")]
    parts_v = [from_bits(arrays.get("head_v"), dt, (L, nh, H, D), "head_v")]
    if len(payload):
        mh = peek_header(bytes(payload))
        want = {"codec": h["codec"], "L": L, "H": H, "D": D, "dtype": dt, "T": T - nh - nt,
                "token_offset": h["token_offset"] + nh, "total_tokens": h["total_tokens"]}
        bad = [key for key, x in want.items() if mh[key] != x]
        if bad:
            raise CodecError(f"anchored middle container disagrees with its header on {bad}")
        mk, mv = decode_kv(bytes(payload), dev, backend=backend)
        parts_k.append(mk.to("cpu"))
        parts_v.append(mv.to("cpu"))
    parts_k.append(from_bits(arrays.get("tail_k"), dt, (L, nt, H, D), "tail_k"))
    parts_v.append(from_bits(arrays.get("tail_v"), dt, (L, nt, H, D), "tail_v"))
    k, v = torch.cat(parts_k, 1), torch.cat(parts_v, 1)
    if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
        raise CodecError("anchored KV contains NaN/inf (corrupt bitstream)")
    return k.to(dev), v.to(dev)


def decode_chunks(chunks: Sequence[bytes], device: Any = "cpu", backend: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode all chunks of one :func:`encode_chunks` call (anchored or ordinary) and
    concatenate along tokens. Raises CodecError when chunks are missing, out of order or
    from different KVs; ValueError on a bad device or backend."""
    if not chunks:
        raise CodecError("no chunks")
    if not is_anchored(chunks[0]):
        from .api import decode_chunks as plain

        return plain(chunks, device, backend)
    return join_chunks(chunks, peek_anchor_header, lambda data: decode(data, device, backend),
                       CHUNK_FIELDS + ("sink", "recent"))


def is_anchored(data: Any) -> bool:
    """Whether ``data`` parses as an anchored container (False for an ordinary one or junk)."""
    try:
        unpack_kind(data, ANCHOR_KIND, "anchored KV")
    except CodecError:
        return False
    return True


def _codec_exact(data: bytes) -> int:
    """Exact tokens an ordinary container keeps by itself (its codec header's ``n_sink`` +
    ``n_recent``: cachegen's sinks, kvtc's sinks and recent tokens; 0 for codecs without)."""
    h, _, _ = unpack_kind(data, "kvcodec", "KV codec")
    ch = h.get("codec_header") if isinstance(h.get("codec_header"), dict) else {}
    n = 0
    for key in ("n_sink", "n_recent"):
        x = ch.get(key, 0)
        n += x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else 0
    return n


def exact_tokens(data: bytes) -> int:
    """Tokens of one container (anchored or ordinary) stored exactly: the anchors plus the
    codec's own exact tokens (``n_sink`` / ``n_recent`` of its header). CodecError on
    malformed input."""
    if is_anchored(data):
        h = peek_anchor_header(data)
        _, _, payload = unpack_kind(data, ANCHOR_KIND, "anchored KV")
        return h["n_head"] + h["n_tail"] + (_codec_exact(bytes(payload)) if len(payload) else 0)
    return _codec_exact(data)
