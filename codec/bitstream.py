"""Generic safe container for codec bitstreams (docs/bitstream.md section 4.1).

Purpose: one self-describing, checksummed byte string per encoded chunk: a JSON header,
a directory of named little-endian numpy arrays, and an opaque payload - with no pickle
and no Python-object deserialisation (the peers' pickled bitstreams execute code on
untrusted input: the Python docs' warning on the pickle module). Every malformed input raises
`codec.errors.CodecError` with a clear message; nothing is allocated beyond what the
input's own length justifies, and parsing is linear in the input size.

Layout (all integers little-endian; details and limits in docs/bitstream.md 4.1):
  magic "KVCG" | version u16 | flags u16 | header_len u32 | header JSON (UTF-8)
  | n_arrays u16 | n_arrays x (name_len u8, name, dtype u8, ndim u8, shape ndim x u64)
  | zero padding to a multiple of 8 | array data (each padded to a multiple of 8)
  | payload_len u64 | payload | checksum of every byte before it: xxh3-64 u64 (version 6,
  written) or zlib.crc32 u32 (versions 1-5, still read; ``reseal`` writes either)

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_bitstream*.py -q
"""
from __future__ import annotations

import json
import math
import re
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import xxhash

from .errors import CodecError

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "READ_VERSIONS",
    "MAX_HEADER_BYTES",
    "DEFAULT_MAX_BYTES",
    "DTYPE_CODES",
    "Container",
    "pack",
    "unpack",
    "unpack_container",
    "peek_header",
    "reseal",
    "checksum_bytes",
    "checksum",
]

MAGIC = b"KVCG"
FORMAT_VERSION = 6             # written; docs/bitstream.md section 4.1 "Versions"
NEWEST_VERSION = 6
LEGACY_WRITE_VERSIONS = (4, 5)  # ``pack``/``reseal`` can still write these (CRC32 trailer):
#                                fixtures and tests of the older readers' bytes
READ_VERSIONS = (1, 2, 3, 4, 5, 6)  # read: 1 = before the outlier side list, 2 = 16-bit
#                                model tables, 3 = Rice-coded tables without ranges, 4/5 =
#                                CRC32 trailer, 6 = xxh3-64 trailer (all decode)
XXH3_FROM_VERSION = 6          # versions >= this end with an xxh3-64 (u64), older ones CRC32 (u32)
MAX_HEADER_BYTES = 1 << 20  # JSON header cap: headers are small (layout, shapes, names)
DEFAULT_MAX_BYTES = 1 << 36  # 64 GiB: refuse anything larger outright
MAX_ARRAYS = 256
MAX_NDIM = 6
MAX_NAME = 64
MAX_JSON_DEPTH = 32
MAX_EMPTY_EXTENT = 1 << 32  # product of the non-zero dims of an EMPTY array (shape sanity)
_ALIGN = 8
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

# dtype code -> (name, numpy dtype stored). bf16 is stored as its raw 16-bit pattern.
DTYPE_CODES: dict[int, tuple[str, np.dtype]] = {
    1: ("u8", np.dtype("<u1")),
    2: ("i8", np.dtype("<i1")),
    3: ("u16", np.dtype("<u2")),
    4: ("i16", np.dtype("<i2")),
    5: ("u32", np.dtype("<u4")),
    6: ("i32", np.dtype("<i4")),
    7: ("u64", np.dtype("<u8")),
    8: ("i64", np.dtype("<i8")),
    9: ("f16", np.dtype("<f2")),
    10: ("bf16", np.dtype("<u2")),
    11: ("f32", np.dtype("<f4")),
}
_CODE_OF = {np.dtype(v[1]).str: k for k, v in DTYPE_CODES.items() if v[0] != "bf16"}
_FIXED = struct.Struct("<4sHHI")  # magic, version, flags, header_len
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


@dataclass
class Container:
    """A parsed container: header (dict), arrays (name -> read-only ndarray), payload
    (bytes), dtypes (name -> dtype code name, e.g. "bf16" for uint16 bit patterns)."""

    header: dict
    arrays: dict
    payload: bytes
    dtypes: dict


def checksum_bytes(version: int) -> int:
    """Size in bytes of the trailing checksum of a container of format ``version``: 8 (the
    xxh3-64 of version 6) or 4 (the CRC32 of versions 1-5)."""
    return 8 if version >= XXH3_FROM_VERSION else 4


def checksum(version: int, body) -> bytes:
    """The trailer of a container of ``version`` over ``body`` (bytes-like): xxh3-64 as a
    little-endian u64 (version 6: ~25 GB/s on one core, measured here, against ~4 GB/s
    for zlib's CRC32) or zlib.crc32 as a little-endian u32 (versions 1-5)."""
    if version >= XXH3_FROM_VERSION:
        return _U64.pack(xxhash.xxh3_64_intdigest(body))
    return _U32.pack(zlib.crc32(body) & 0xFFFFFFFF)


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def _check_json_value(v, depth: int = 0) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError("header nested too deeply")
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ValueError(f"header keys must be str, got {type(k).__name__}")
            _check_json_value(x, depth + 1)
    elif isinstance(v, list):
        for x in v:
            _check_json_value(x, depth + 1)
    elif isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError("header floats must be finite")
    elif v is None or isinstance(v, (str, bool, int)):
        pass
    else:
        raise ValueError(f"header values must be JSON types (dict, list, str, int, float, bool, None), got {type(v).__name__}")


def pack(header: dict, arrays: dict, payload: bytes = b"", bf16: tuple | list | set = (),
         version: int = FORMAT_VERSION) -> bytes:
    """Serialise a header, named arrays and a payload into one checksummed byte string.

    Args:
      header: JSON-able dict (str keys; dict/list/str/int/finite float/bool/None values;
        depth <= 32); encoded as compact UTF-8 JSON, at most 1 MiB.
      arrays: name -> np.ndarray. Names: 1-64 chars of [A-Za-z0-9_.-], at most 256
        arrays, ndim <= 6. Dtypes: uint8/int8/uint16/int16/uint32/int32/uint64/int64/
        float16/float32 (any byte order; stored little-endian, C order).
      payload: opaque bytes-like.
      bf16: names of uint16/int16 arrays holding bfloat16 bit patterns; they are tagged
        "bf16" (dtype code 10) and come back from `unpack` as uint16 arrays, with the tag
        in `unpack_container(...).dtypes`.
      version: the format version written: FORMAT_VERSION (6, the xxh3-64 trailer), or 4 /
        5 (``LEGACY_WRITE_VERSIONS``, the CRC32 trailer the readers of those versions
        check: fixtures and tests; 4 must not be used for a chunk needing a version-5
        feature, which the caller knows).
    Returns: bytes (docs/bitstream.md section 4.1).
    Raises: ValueError on any unsupported input.
    """
    if not isinstance(header, dict):
        raise ValueError("header must be a dict")
    if version not in (FORMAT_VERSION,) + LEGACY_WRITE_VERSIONS:
        raise ValueError(f"version must be one of {(FORMAT_VERSION,) + LEGACY_WRITE_VERSIONS}, "
                         f"got {version!r}")
    _check_json_value(header)
    hdr = json.dumps(header, separators=(",", ":"), sort_keys=True, allow_nan=False, ensure_ascii=False).encode("utf-8")
    if len(hdr) > MAX_HEADER_BYTES:
        raise ValueError(f"header is {len(hdr)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    if not isinstance(arrays, dict) or len(arrays) > MAX_ARRAYS:
        raise ValueError(f"arrays must be a dict of at most {MAX_ARRAYS} entries")
    bf16 = set(bf16)
    unknown = bf16 - set(arrays)
    if unknown:
        raise ValueError(f"bf16 names {sorted(unknown)} are not in arrays")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError(f"payload must be bytes-like, got {type(payload).__name__}")
    payload = bytes(payload) if not isinstance(payload, bytes) else payload
    parts = [_FIXED.pack(MAGIC, version, 0, len(hdr)), hdr, _U16.pack(len(arrays))]
    datas = []
    for name, a in arrays.items():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"array name {name!r} must be 1-64 chars of [A-Za-z0-9_.-]")
        if not isinstance(a, np.ndarray):
            raise ValueError(f"array {name!r} must be a numpy array, got {type(a).__name__}")
        if a.ndim > MAX_NDIM:
            raise ValueError(f"array {name!r} has ndim {a.ndim} > {MAX_NDIM}")
        if a.size == 0 and math.prod(max(d, 1) for d in a.shape) > MAX_EMPTY_EXTENT:
            raise ValueError(f"empty array {name!r} has an absurd shape {a.shape}")
        le = a.dtype.newbyteorder("<") if a.dtype.byteorder not in ("|",) else a.dtype
        if name in bf16:
            if a.dtype.kind not in "ui" or a.dtype.itemsize != 2:
                raise ValueError(f"bf16 array {name!r} must be uint16/int16 bit patterns, got {a.dtype}")
            code = 10
            le = np.dtype("<u2")
        else:
            code = _CODE_OF.get(np.dtype(le).str)
            if code is None:
                raise ValueError(f"array {name!r}: unsupported dtype {a.dtype} (allowed: "
                                 + ", ".join(v[0] for v in DTYPE_CODES.values()) + ")")
        if name in bf16:  # raw 16-bit patterns, whatever the integer kind/byte order
            raw = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).view("<u2")
        else:
            raw = np.ascontiguousarray(a).astype(le, copy=False)
        nb = name.encode("ascii")
        parts.append(struct.pack("<B", len(nb)) + nb + struct.pack("<BB", code, a.ndim) + b"".join(_U64.pack(int(d)) for d in a.shape))
        datas.append(raw.tobytes(order="C"))
    head = b"".join(parts)
    out = [head, b"\0" * _pad(len(head))]
    for d in datas:
        out.append(d)
        out.append(b"\0" * _pad(len(d)))
    out.append(_U64.pack(len(payload)))
    out.append(payload)
    body = b"".join(out)
    return body + checksum(version, body)


def _fail(msg: str):
    raise CodecError(msg)


def _json_no_constants(name: str):
    raise ValueError(f"non-finite number {name} in header")


def _no_duplicates(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate keys in a JSON object")
    return d


def _parse_fixed(data, n: int) -> tuple[int, int]:
    """Check magic/version/flags/header length; return (header_len, version)."""
    if n < _FIXED.size:
        _fail(f"container truncated: {n} bytes, the fixed header alone is {_FIXED.size}")
    magic, version, flags, hlen = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        _fail(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a KV codec bitstream")
    if version not in READ_VERSIONS:
        _fail(f"unsupported format version {version} (this reader supports versions "
              f"{', '.join(map(str, READ_VERSIONS))}; a newer writer made it: upgrade the codec)")
    if flags != 0:
        _fail(f"unsupported flags 0x{flags:04x} (version {version} defines none)")
    if hlen > MAX_HEADER_BYTES:
        _fail(f"header length {hlen} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if _FIXED.size + hlen > n:
        _fail(f"container truncated inside the header ({hlen} header bytes declared, {n} total)")
    return hlen, version


def _parse_header(data, hlen: int) -> dict:
    raw = bytes(data[_FIXED.size : _FIXED.size + hlen])
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_json_no_constants, object_pairs_hook=_no_duplicates)
        if not isinstance(header, dict):
            raise ValueError("header JSON must be an object")
        _check_json_value(header)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise CodecError(f"invalid JSON header: {e}") from None
    return header


def peek_header(data, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """Return the JSON header without checking the CRC or reading arrays/payload.
    Raises CodecError if the fixed part or the header is malformed."""
    data = _as_buffer(data, max_bytes)
    hlen, _ = _parse_fixed(data, len(data))
    return _parse_header(data, hlen)


def _as_buffer(data, max_bytes: int):
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    mv = memoryview(data)
    if mv.ndim != 1 or mv.itemsize != 1 or mv.format != "B":
        mv = mv.cast("B")
    mv = mv.toreadonly()   # the arrays are views of the input: never writable ones
    if len(mv) > max_bytes:
        _fail(f"container of {len(mv)} bytes exceeds max_bytes={max_bytes}")
    return mv


def unpack_container(data, max_bytes: int = DEFAULT_MAX_BYTES, copy: bool = True) -> Container:
    """Parse and verify a container; see `unpack`. Also returns the dtype tags.
    ``copy=False``: the payload is a read-only memoryview of ``data`` instead of a bytes
    copy (the arrays are views either way), so parsing reads the input once, for its
    checksum; ``data`` must then not change while the result is in use."""
    mv = _as_buffer(data, max_bytes)
    n = len(mv)
    hlen, version = _parse_fixed(mv, n)
    tail = checksum_bytes(version)
    if n < _FIXED.size + hlen + 2 + 8 + tail:
        _fail(f"container truncated: {n} bytes")
    body_end = n - tail
    stored = bytes(mv[body_end:])
    actual = checksum(version, mv[:body_end])
    if stored != actual:
        what = "xxh3-64" if tail == 8 else "CRC32"
        _fail(f"{what} mismatch (stored 0x{int.from_bytes(stored, 'little'):0{2 * tail}x}, computed "
              f"0x{int.from_bytes(actual, 'little'):0{2 * tail}x}): corrupt or truncated bitstream")
    header = _parse_header(mv, hlen)
    pos = _FIXED.size + hlen

    def need(k: int, what: str) -> None:
        if pos + k > body_end:
            _fail(f"container truncated in {what}: need {k} bytes at offset {pos}, {body_end - pos} left")

    need(2, "array count")
    (n_arrays,) = _U16.unpack_from(mv, pos)
    pos += 2
    if n_arrays > MAX_ARRAYS:
        _fail(f"{n_arrays} arrays declared, limit {MAX_ARRAYS}")
    directory = []
    total = 0
    names = set()
    for j in range(n_arrays):
        need(1, f"array {j} name length")
        name_len = mv[pos]
        pos += 1
        if not 1 <= name_len <= MAX_NAME:
            _fail(f"array {j}: name length {name_len} outside [1, {MAX_NAME}]")
        need(name_len + 2, f"array {j} entry")
        try:
            name = bytes(mv[pos : pos + name_len]).decode("ascii")
        except UnicodeDecodeError:
            name = ""
        if not _NAME_RE.match(name):
            _fail(f"array {j}: invalid name {bytes(mv[pos:pos + name_len])!r}")
        if name in names:
            _fail(f"array {j}: duplicate name {name!r}")
        names.add(name)
        pos += name_len
        code, ndim = mv[pos], mv[pos + 1]
        pos += 2
        if code not in DTYPE_CODES:
            _fail(f"array {name!r}: unknown dtype code {code}")
        if ndim > MAX_NDIM:
            _fail(f"array {name!r}: ndim {ndim} > {MAX_NDIM}")
        need(8 * ndim, f"array {name!r} shape")
        shape = tuple(_U64.unpack_from(mv, pos + 8 * d)[0] for d in range(ndim))
        pos += 8 * ndim
        itemsize = DTYPE_CODES[code][1].itemsize
        bound = 1
        for d in shape:  # Python ints: no overflow; zero dims counted as 1 so that an
            bound *= max(d, 1)  # empty array cannot declare an absurd shape either
            if bound > MAX_EMPTY_EXTENT or (0 not in shape and bound * itemsize > n):
                _fail(f"array {name!r}: shape {shape} is absurd for a container of {n} bytes")
        nbytes = itemsize * math.prod(shape)
        total += nbytes + _pad(nbytes)
        if total > n:
            _fail(f"arrays declare {total} bytes, more than the whole container ({n})")
        directory.append((name, code, shape, nbytes))
    pad = _pad(pos)
    need(pad, "directory padding")
    if any(mv[pos : pos + pad]):
        _fail("non-zero padding after the array directory")
    pos += pad
    need(total + 8, "array data")  # checked BEFORE any array is materialised
    arrays, dtypes = {}, {}
    for name, code, shape, nbytes in directory:
        dt = DTYPE_CODES[code][1]
        count = nbytes // dt.itemsize
        try:
            a = np.frombuffer(mv, dtype=dt, count=count, offset=pos).reshape(shape)  # zero-copy view
        except ValueError as e:  # pragma: no cover - excluded by the checks above
            raise CodecError(f"array {name!r}: {e}") from None
        pos += nbytes
        p = _pad(nbytes)
        if any(mv[pos : pos + p]):
            _fail(f"array {name!r}: non-zero padding")
        pos += p
        arrays[name] = a
        dtypes[name] = DTYPE_CODES[code][0]
    need(8, "payload length")
    (plen,) = _U64.unpack_from(mv, pos)
    pos += 8
    if plen != body_end - pos:
        _fail(f"payload length {plen} does not match the {body_end - pos} bytes before the CRC")
    payload = bytes(mv[pos:body_end]) if copy else mv[pos:body_end]
    return Container(header=header, arrays=arrays, payload=payload, dtypes=dtypes)


def reseal(data, version: int | None = None) -> bytes:
    """The container ``data`` with its format version set to ``version`` (default: its own)
    and its checksum recomputed for that version; nothing else is checked or changed.

    For tests and tools that craft inputs (a changed field behind a valid checksum must
    reach the parser) and for rewriting a container between versions 4, 5 and 6, whose
    layouts differ only in the trailer (CRC32 u32 vs xxh3-64 u64). Raises CodecError when
    ``data`` is not bytes-like, too short, has no valid magic/version, or when a
    rewrite between versions with different layouts is asked for."""
    mv = _as_buffer(data, DEFAULT_MAX_BYTES)
    n = len(mv)
    _, old = _parse_fixed(mv, n)
    new = old if version is None else version
    if new not in READ_VERSIONS or (new != old and not {old, new} <= {4, 5, 6}):
        _fail(f"cannot rewrite a version-{old} container as version {new!r}")
    tail = checksum_bytes(old)
    if n < _FIXED.size + tail:
        _fail(f"container truncated: {n} bytes")
    body = bytearray(mv[: n - tail])
    _U16.pack_into(body, 4, new)
    return bytes(body) + checksum(new, body)


def unpack(data, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[dict, dict, bytes]:
    """Parse and verify a container made by `pack`.

    Args: data: bytes-like; max_bytes: refuse larger inputs outright.
    Returns: (header dict, arrays: name -> read-only np.ndarray view into `data`
      (little-endian dtypes; bf16 arrays as uint16), payload bytes).
    Raises: CodecError on anything wrong: wrong type, size over max_bytes, truncation,
      bad magic/version/flags, invalid JSON or header over 1 MiB, invalid
      names/dtype codes/ndim, shapes needing more bytes than present, non-zero padding,
      payload length mismatch, checksum mismatch (xxh3-64 in version 6, CRC32 before).
      Never allocates more than about len(data) bytes.
    """
    c = unpack_container(data, max_bytes)
    return c.header, c.arrays, c.payload
