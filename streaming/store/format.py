"""KV store entry format: context keys, backend key layout, the manifest (cgh-manifest-v3).

Paper: CacheGen section 5 (each context's KV is stored as chunks at several levels). The
layout and guarantees are described in streaming.store (which re-exports these names);
every client builds a manifest with build_manifest and every reader parses it with
Manifest.from_dict. A stored level is an int (a codec level, 0 included) or None: the one
slot of a codec without levels (raw, quant8, kivi, ...), written "none" in chunk keys and
manifest object keys and null in the manifest's level lists (streaming.identity.level_key).
Not runnable by itself.
"""

from __future__ import annotations

import array
import hashlib
import secrets
import sys
import zlib
from dataclasses import dataclass, field
from typing import Sequence

from cachegen_common.bounded_json import parse as parse_bounded_json
from streaming.errors import StoreError
from streaming.identity import check_entry, level_key, level_order, parse_level, parse_level_key
from streaming.identity import EntryIdentity

MANIFEST_FORMAT = "cgh-manifest-v3"
# v1: no per-chunk checksums, chunks written in place; v2: a codec without levels stored
# under level 0 (v3: level None, "none")
LEGACY_MANIFEST_FORMATS = ("cgh-manifest-v1", "cgh-manifest-v2")
ANY_BASE = object()  # put_manifest without a base: no race check (last writer wins)
_KEY_DOMAIN = b"cgh-context-key-v1\x00"


# The largest manifest a reader parses: a manifest holds the context's token ids (about
# 7 bytes each) and a few numbers per chunk and level, ~1 MiB for 100K tokens; 64 MiB is a
# context of several million tokens. Deeper nesting than 32 is never written (a manifest
# is at most four levels deep).
MAX_MANIFEST_BYTES = 64 << 20
MAX_MANIFEST_DEPTH = 32


def manifest_json(raw: bytes | bytearray | memoryview | str, what: str = "stored manifest") -> dict:
    """The JSON object of a stored manifest's bytes, parsed within MAX_MANIFEST_BYTES and
    MAX_MANIFEST_DEPTH (untrusted: the store is shared). Raises StoreError (one line) for
    bytes over either bound, not UTF-8, not JSON, or not a JSON object."""
    return parse_bounded_json(raw, what=what, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_MANIFEST_DEPTH,
                              expect=dict, error=StoreError)


def context_key(model_id: str, weights_hash: str, codec_tag: str, token_ids: Sequence[int]) -> str:
    """SHA-256 hex key of a context: model id, weights hash, codec tag and the prefix's token
    ids (as little-endian int64). Writers with a full streaming.identity.EntryIdentity use
    `entry_key` (codec_tag = identity.codec_tag(): a hash of the tokenizer, dtype, KV shape,
    codec name, version and per-level config hashes). Raises ValueError on empty ids or
    non-str fields."""
    for name, v in (("model_id", model_id), ("weights_hash", weights_hash), ("codec_tag", codec_tag)):
        if not isinstance(v, str) or not v or "\x00" in v:
            raise ValueError(f"{name} must be a non-empty str without NUL, got {v!r}")
    try:
        ids = array.array("q", token_ids)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"token_ids must be int64 integers: {e}") from None
    if not ids:
        raise ValueError("token_ids must not be empty")
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.sha256(_KEY_DOMAIN)
    for v in (model_id, weights_hash, codec_tag):
        h.update(v.encode("utf-8") + b"\x00")
    h.update(ids.tobytes())
    return h.hexdigest()


def entry_key(identity: EntryIdentity, token_ids: Sequence[int]) -> str:
    """context_key of an entry with a full identity: model id, weights hash and
    identity.codec_tag() (a hash of every other field: tokenizer, dtype, shape, codec name,
    version, per-level config hashes, calibration). Raises ValueError when the identity
    lacks model_id, weights_hash, codec or level_configs."""
    identity.require_complete()
    return context_key(identity.model_id, identity.weights_hash, identity.codec_tag(), token_ids)


def check_gen(gen) -> str:
    if not isinstance(gen, str) or not 8 <= len(gen) <= 64 or any(c not in "0123456789abcdef" for c in gen):
        raise ValueError(f"write generation must be 8-64 lowercase hex chars, got {str(gen)[:80]!r}")
    return gen


def chunk_key(key: str, level: int | None, index: int, gen: str | None = None) -> str:
    """Backend key of chunk `index` at `level` (None: a codec without levels, "none" in
    the key) of write generation `gen` (None: a raw slot without a manifest). Raises
    ValueError for a level that is neither an int >= 0 nor None."""
    lv = level_key(level)
    if gen is None:
        return f"ctx/{key}/chunk/{lv}/{int(index)}"
    return f"ctx/{key}/g/{check_gen(gen)}/{lv}/{int(index)}"


def manifest_levels(values, what: str = "levels") -> list[int | None]:
    """The stored levels of a manifest's JSON list (ints >= 0, or [null] for a codec without
    levels), in level_order. Raises StoreError (one line) for a malformed level, a level
    listed twice, or the no-level slot mixed with numbered levels."""
    if not isinstance(values, list):
        raise StoreError(f"malformed manifest: {what} is not a JSON array")
    try:
        levels = [parse_level(x) for x in values]
    except ValueError as e:
        raise StoreError(f"malformed manifest: {what}: {e}") from None
    if len(set(levels)) != len(levels):
        raise StoreError(f"malformed manifest: {what} lists a level twice")
    if None in levels and len(levels) > 1:
        raise StoreError(f"malformed manifest: {what} mixes the no-level slot with numbered levels")
    return sorted(levels, key=level_order)


def _per_level(d: dict, name: str, conv) -> dict:
    """{level: tuple(conv(x))} of a manifest's per-level object (keys level_key form)."""
    out = {}
    for k, v in d[name].items():
        try:
            lv = parse_level_key(k)
        except ValueError as e:
            raise StoreError(f"malformed manifest: {name}: {e}") from None
        out[lv] = tuple(conv(x) for x in v)
    return out


def cal_key(h: str) -> str:
    if not isinstance(h, str) or len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise ValueError(f"calibration hash must be 64 lowercase hex chars, got {str(h)[:80]!r}")
    return f"cal/{h}"


def new_generation() -> str:
    """A fresh write-generation id (32 hex chars, random): the chunk keys of one save."""
    return secrets.token_hex(16)


def manifest_key(key: str, gen: str | None = None) -> str:
    """The published manifest of a key, or (gen) the immutable copy of generation gen's
    manifest that a load planned from that generation reads."""
    if gen is None:
        return f"ctx/{key}/manifest"
    return f"ctx/{key}/g/{check_gen(gen)}/manifest"


def abort_marker_key(key: str, gen: str) -> str:
    """Key of the marker that settles write generation `gen` of context `key` as never
    published (set when a writer that lost its publish reply asks and finds it
    unpublished): a publish of that generation arriving late is refused. Raises ValueError
    for a malformed key or generation."""
    return f"ctx/{check_hex_key(key)}/g/{check_gen(gen)}/aborted"


def check_hex_key(key) -> str:
    if not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"context key must be 64 lowercase hex chars, got {str(key)[:80]!r}")
    return key


@dataclass(frozen=True)
class Manifest:
    """Everything the streamer needs about one stored context.

    levels: quality levels stored, ascending quality (and size), or (None,) for a codec
    without levels (JSON: levels [null], per-level keys "none"); sizes[level][i],
    crc32[level][i] and sha256[level][i] are the byte size, CRC-32 and sha256 (hex) of
    chunk i at that level; token_ranges[i] = (start, end) token positions of chunk i
    (chunk_tokens: the split size, the first range's length); text[i] = its token ids (the
    text fallback); identity: streaming.identity.EntryIdentity.to_dict() of what made the
    entry (None for entries written without one; such an entry misses for any reader that
    knows an identity field); gen: the write generation its chunks are stored under;
    prev: {"gen", "levels", "chunk_count"} of the entry it replaced (its chunks are
    deleted when the next overwrite lands: one overwrite of grace for readers);
    calibrations: sha256 hashes of the codec calibrations the chunks need (stored under
    cal/<hash>).
    """

    key: str
    model_id: str
    weights_hash: str
    codec_tag: str
    levels: tuple[int | None, ...]
    token_ranges: tuple[tuple[int, int], ...]
    sizes: dict[int | None, tuple[int, ...]]
    crc32: dict[int | None, tuple[int, ...]]
    text: tuple[tuple[int, ...], ...]
    meta: dict = field(default_factory=dict)
    identity: dict | None = None  # EntryIdentity.to_dict() of what made the entry (None: legacy)
    sha256: dict[int | None, tuple[str, ...]] = field(default_factory=dict)
    gen: str = ""
    prev: dict | None = None
    calibrations: tuple[str, ...] = ()

    @property
    def chunk_tokens(self) -> int:
        a, b = self.token_ranges[0]
        return b - a

    def chunk_keys(self) -> list[str]:
        """Backend keys of every chunk of every level (under this entry's generation)."""
        return [chunk_key(self.key, lv, i, self.gen) for lv in self.levels for i in range(self.chunk_count)]

    @property
    def chunk_count(self) -> int:
        return len(self.token_ranges)

    @property
    def token_ids(self) -> list[int]:
        return [t for ids in self.text for t in ids]

    def to_dict(self) -> dict:
        return {
            "format": MANIFEST_FORMAT,
            "key": self.key,
            "model_id": self.model_id,
            "weights_hash": self.weights_hash,
            "codec_tag": self.codec_tag,
            "levels": list(self.levels),
            "chunk_count": self.chunk_count,
            "token_ranges": [list(r) for r in self.token_ranges],
            "sizes": {level_key(lv): list(v) for lv, v in self.sizes.items()},
            "crc32": {level_key(lv): list(v) for lv, v in self.crc32.items()},
            "sha256": {level_key(lv): list(v) for lv, v in self.sha256.items()},
            "chunk_tokens": self.chunk_tokens,
            "gen": self.gen,
            "prev": self.prev,
            "calibrations": list(self.calibrations),
            "text": [list(t) for t in self.text],
            "meta": self.meta,
            **({"identity": self.identity} if self.identity is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        """Validate and build. Raises StoreError for any inconsistency."""
        try:
            if d.get("format") in LEGACY_MANIFEST_FORMATS:
                raise StoreError(f"entry in a previous format {d.get('format')} (now {MANIFEST_FORMAT}: "
                                 "levels of codecs without levels stored apart): not served; store it again")
            if d.get("format") != MANIFEST_FORMAT:
                raise StoreError(f"unknown manifest format {d.get('format')!r}")
            for name, kind in (("levels", list), ("token_ranges", list), ("text", list), ("sizes", dict),
                               ("crc32", dict), ("sha256", dict)):
                if not isinstance(d.get(name), kind):   # a str would pass int() per character
                    what = "array" if kind is list else "object"
                    raise StoreError(f"malformed manifest: {name} is not a JSON {what}")
            if not all(isinstance(ids, list) for ids in d["text"]):
                raise StoreError("malformed manifest: text is not a list of token id arrays")
            levels = tuple(manifest_levels(d["levels"]))
            n = int(d["chunk_count"])
            ranges = tuple((int(a), int(b)) for a, b in d["token_ranges"])
            sizes = _per_level(d, "sizes", int)
            crcs = _per_level(d, "crc32", int)
            text = tuple(tuple(map(int, ids)) for ids in d["text"])
            shas = _per_level(d, "sha256", str)
            gen = check_gen(d["gen"])
            prev = d.get("prev")
            if prev is not None:
                prev = {"gen": check_gen(prev["gen"]), "levels": manifest_levels(prev["levels"], "prev levels"),
                        "chunk_count": int(prev["chunk_count"])}
            cals = tuple(str(h) for h in d.get("calibrations") or ())
            for h in cals:
                cal_key(h)
            m = cls(
                key=check_hex_key(d["key"]), model_id=str(d["model_id"]),
                weights_hash=str(d["weights_hash"]), codec_tag=str(d["codec_tag"]),
                levels=levels, token_ranges=ranges, sizes=sizes, crc32=crcs, text=text,
                meta=dict(d.get("meta") or {}),
                identity=dict(d["identity"]) if d.get("identity") is not None else None,
                sha256=shas, gen=gen, prev=prev, calibrations=cals,
            )
        except StoreError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreError(f"malformed manifest: {e!r}") from None
        if not levels or len(set(levels)) != len(levels):
            raise StoreError("manifest levels must be non-empty and distinct")
        if n < 1 or len(ranges) != n or len(text) != n:
            raise StoreError("manifest chunk_count, token_ranges and text disagree")
        pos = 0
        for (a, b), ids in zip(ranges, text):
            if a != pos or b <= a or len(ids) != b - a:
                raise StoreError("manifest token ranges must tile the context and match the text")
            pos = b
        for lv in levels:
            if len(sizes.get(lv, ())) != n or len(crcs.get(lv, ())) != n or len(shas.get(lv, ())) != n:
                raise StoreError(f"manifest sizes/crc32/sha256 of level {lv} do not cover {n} chunks")
        if "chunk_tokens" in d and int(d["chunk_tokens"]) != ranges[0][1] - ranges[0][0]:
            raise StoreError("manifest chunk_tokens differs from its first token range")
        if context_key(m.model_id, m.weights_hash, m.codec_tag, m.token_ids) != m.key:
            raise StoreError("manifest key does not match its model/config/token ids")
        if m.identity is not None:
            try:
                ident = EntryIdentity.from_dict(m.identity)
                tag = ident.codec_tag()
            except ValueError as e:
                raise StoreError(f"manifest identity malformed: {e}") from None
            if (ident.model_id, ident.weights_hash, tag) != (m.model_id, m.weights_hash, m.codec_tag):
                raise StoreError("manifest identity does not match its model id, weights hash "
                                 "and codec tag (the key would not commit to it)")
            if set(ident.levels) != set(levels):
                raise StoreError(f"manifest levels {list(levels)} differ from its identity's "
                                 f"level configs {list(ident.levels)}")
            if any(h not in cals for h in ident.calibration_hashes()):
                raise StoreError("manifest identity names a calibration its manifest does not list")
        return m

    def mismatch(self, model_id=None, weights_hash=None, codec_tag=None,
                 identity: EntryIdentity | dict | None = None) -> str | None:
        """Reason why this entry must not be served for the given expectation, or None.
        `identity` (streaming.identity.EntryIdentity or its dict) is checked with
        streaming.identity.check_entry: an entry without an identity misses whenever the
        reader knows any identity field. A codec_tag that is a bare codec name matches the
        identity's codec name (older callers)."""
        for name, want in (("model_id", model_id), ("weights_hash", weights_hash), ("codec_tag", codec_tag)):
            have = getattr(self, name)
            if want is None or want == have:
                continue
            if name == "codec_tag" and "#" not in want and self.identity is not None \
                    and self.identity.get("codec") == want:
                continue
            return f"{name} mismatch: stored {have!r}, requested {want!r}"
        return check_entry(identity, self.identity)


def parse_gen(raw: bytes | None) -> str | None:
    """The write generation of a stored manifest's bytes: None when absent, "" for a
    manifest of another format or an unreadable one (it is still a state a writer read)."""
    if raw is None:
        return None
    try:
        g = manifest_json(raw).get("gen")
        return g if isinstance(g, str) else ""
    except StoreError:
        return ""


def manifest_gens(raw: bytes | None) -> tuple[str | None, str | None]:
    """(generation, previous generation) of a stored manifest's bytes: the save it
    publishes and the one it replaced (readers may still plan from that one). Each is None
    when absent or unreadable."""
    if raw is None:
        return None, None
    try:
        d = manifest_json(raw)
        prev = d.get("prev")
        g, p = d.get("gen"), prev.get("gen") if isinstance(prev, dict) else None
    except StoreError:
        return None, None
    return (g if isinstance(g, str) else None), (p if isinstance(p, str) else None)


def chunk_digest(data: bytes) -> tuple[int, int, str]:
    return len(data), zlib.crc32(data), hashlib.sha256(data).hexdigest()



def build_manifest(model_id: str, weights_hash: str, codec_tag: str, token_ids: Sequence[int],
                   chunks: dict[int | None, Sequence[bytes]], token_ranges: Sequence[tuple[int, int]],
                   meta: dict | None = None, identity: EntryIdentity | None = None) -> tuple[str, dict]:
    """(context key, manifest dict) of a context to store (every client builds it here).

    chunks: {level: [chunk bytes, ...]}, level None for a codec without levels (alone).
    With `identity`, model_id / weights_hash / codec_tag must equal the identity's (or
    codec_tag be its bare codec name) and chunks' levels must equal its level_configs.
    Raises ValueError on inconsistent arguments, StoreError when ranges do not tile the ids.
    """
    ids = [int(t) for t in token_ids]
    if identity is not None:
        identity.require_complete()
        if (model_id, weights_hash) != (identity.model_id, identity.weights_hash) or \
                codec_tag not in (identity.codec_tag(), identity.codec):
            raise ValueError("model_id/weights_hash/codec_tag differ from the entry identity")
        codec_tag = identity.codec_tag()
        if set(parse_level(lv) for lv in chunks) != set(identity.levels):
            raise ValueError(f"chunk levels {sorted(chunks, key=level_order)} differ from the identity's "
                             f"level configs {list(identity.levels)}")
    key = context_key(model_id, weights_hash, codec_tag, ids)
    levels = sorted((parse_level(lv) for lv in chunks), key=level_order)
    n = len(token_ranges)
    for lv in levels:
        if len(chunks[lv]) != n:
            raise ValueError(f"level {lv} has {len(chunks[lv])} chunks, token_ranges has {n}")
    man = {
        "format": MANIFEST_FORMAT, "key": key, "model_id": model_id, "weights_hash": weights_hash,
        "codec_tag": codec_tag, "levels": levels, "chunk_count": n,
        "token_ranges": [[int(a), int(b)] for a, b in token_ranges],
        "sizes": {level_key(lv): [len(c) for c in chunks[lv]] for lv in levels},
        "crc32": {level_key(lv): [zlib.crc32(bytes(c)) for c in chunks[lv]] for lv in levels},
        "sha256": {level_key(lv): [hashlib.sha256(bytes(c)).hexdigest() for c in chunks[lv]] for lv in levels},
        "chunk_tokens": int(token_ranges[0][1]) - int(token_ranges[0][0]) if n else 0,
        "gen": "0" * 32,  # replaced by the writer's fresh generation (save_steps)
        "prev": None,
        "calibrations": [],
        "text": [ids[int(a):int(b)] for a, b in token_ranges],
        "meta": dict(meta or {}),
    }
    if identity is not None:
        man["identity"] = identity.to_dict()
        if identity.calibration_hash:
            man["calibrations"] = list(identity.calibration_hashes())
    Manifest.from_dict(man)  # fail here, before anything is sent, on bad ranges
    return key, man

