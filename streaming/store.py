"""KV store: content keys, per-context manifests, a threaded TCP server and its client.

Paper: CacheGen section 5 - each context's KV cache is split into chunks, each chunk
encoded at several quality levels and kept with its text; the streamer fetches chunk by
chunk. Keys hash model id + weights hash + codec tag + the prefix's token ids; with an
entry identity (streaming.identity.EntryIdentity: tokenizer, dtype, KV shape, codec name,
version, the full config hash of every level, calibration) the codec tag is
`identity.codec_tag()`, a hash of all of it (`entry_key`), and the manifest repeats the
identity. Every reader checks it (streaming.identity.check_entry), so an entry written for
another model or codec config is never served (a clean miss with a reason), even if the
store is reused across runs with a changed codec schedule.

Layout in a backend (keys):
    cal/<sha256>                      a codec calibration artifact (kvtc: safetensors +
                                      JSON), content-addressed, written before any chunk
    ctx/<key>/g/<gen>/<level>/<index> encoded chunk bytes of write generation <gen> (a
                                      random id per save: two saves never share a chunk key)
    ctx/<key>/manifest                JSON manifest (cgh-manifest-v2), published last with a
                                      compare-and-swap: it names its generation and binds
                                      every chunk (token range, size, CRC-32, sha256), the
                                      chunking, the identity and the calibrations
    ctx/<key>/chunk/<level>/<index>   raw slots without a manifest (prefix-index records)
Guarantees (docs/streaming.md, "Store guarantees"): entries are immutable; a reader sees
the old complete entry, the new complete entry or a miss, whatever a writer's crash point;
of two writers that read the same state, the first to publish wins and the other gets
StoreRaceLostError; an entry that lost a chunk (eviction, deletion) or whose chunk fails
its checksum is dropped and reads as a miss with the reason. Manifests of the previous
format (cgh-manifest-v1, no per-chunk checksums) are clean misses ("store it again").

Run the server: python -m streaming.store serve --backend DIR --host 127.0.0.1 --port 0
(prints "READY host:port" on stdout when listening; SIGTERM/SIGINT stop it).
List contexts:  python -m streaming.store list --backend DIR
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import logging
import os
import secrets
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from streaming.backends import StoreBackend, open_backend
from streaming.errors import (
    ProtocolError,
    StoreError,
    StoreRaceLostError,
    StoreTimeoutError,
    StoreTooLargeError,
    StoreUnavailableError,
    StreamingError,
    store_error,
)
from streaming.identity import EntryIdentity, check_entry
from streaming.protocol import (
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_META,
    ConnectionClosed,
    FrameTooLarge,
    FrameType,
    recv_frame,
    send_frame,
)

MANIFEST_FORMAT = "cgh-manifest-v2"
LEGACY_MANIFEST_FORMATS = ("cgh-manifest-v1",)
logger = logging.getLogger("cachegen.store")
_ANY = object()  # put_manifest without a base: no race check (last writer wins)
_KEY_DOMAIN = b"cgh-context-key-v1\x00"


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


def _check_gen(gen) -> str:
    if not isinstance(gen, str) or not 8 <= len(gen) <= 64 or any(c not in "0123456789abcdef" for c in gen):
        raise ValueError(f"write generation must be 8-64 lowercase hex chars, got {str(gen)[:80]!r}")
    return gen


def _chunk_key(key: str, level: int, index: int, gen: str | None = None) -> str:
    if gen is None:
        return f"ctx/{key}/chunk/{int(level)}/{int(index)}"
    return f"ctx/{key}/g/{_check_gen(gen)}/{int(level)}/{int(index)}"


def _cal_key(h: str) -> str:
    if not isinstance(h, str) or len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise ValueError(f"calibration hash must be 64 lowercase hex chars, got {str(h)[:80]!r}")
    return f"cal/{h}"


def new_generation() -> str:
    """A fresh write-generation id (32 hex chars, random): the chunk keys of one save."""
    return secrets.token_hex(16)


def _manifest_key(key: str, gen: str | None = None) -> str:
    """The published manifest of a key, or (gen) the immutable copy of generation gen's
    manifest that a load planned from that generation reads."""
    if gen is None:
        return f"ctx/{key}/manifest"
    return f"ctx/{key}/g/{_check_gen(gen)}/manifest"


def _check_hex_key(key) -> str:
    if not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"context key must be 64 lowercase hex chars, got {str(key)[:80]!r}")
    return key


@dataclass(frozen=True)
class Manifest:
    """Everything the streamer needs about one stored context.

    levels: quality levels stored, ascending quality (and size); sizes[level][i],
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
    levels: tuple[int, ...]
    token_ranges: tuple[tuple[int, int], ...]
    sizes: dict[int, tuple[int, ...]]
    crc32: dict[int, tuple[int, ...]]
    text: tuple[tuple[int, ...], ...]
    meta: dict = field(default_factory=dict)
    identity: dict | None = None  # EntryIdentity.to_dict() of what made the entry (None: legacy)
    sha256: dict[int, tuple[str, ...]] = field(default_factory=dict)
    gen: str = ""
    prev: dict | None = None
    calibrations: tuple[str, ...] = ()

    @property
    def chunk_tokens(self) -> int:
        a, b = self.token_ranges[0]
        return b - a

    def chunk_keys(self) -> list[str]:
        """Backend keys of every chunk of every level (under this entry's generation)."""
        return [_chunk_key(self.key, lv, i, self.gen) for lv in self.levels for i in range(self.chunk_count)]

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
            "sizes": {str(lv): list(v) for lv, v in self.sizes.items()},
            "crc32": {str(lv): list(v) for lv, v in self.crc32.items()},
            "sha256": {str(lv): list(v) for lv, v in self.sha256.items()},
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
                raise StoreError(f"entry in the previous format {d.get('format')} (no per-chunk "
                                 "checksums, chunks written in place): not served; store it again")
            if d.get("format") != MANIFEST_FORMAT:
                raise StoreError(f"unknown manifest format {d.get('format')!r}")
            levels = tuple(int(x) for x in d["levels"])
            n = int(d["chunk_count"])
            ranges = tuple((int(a), int(b)) for a, b in d["token_ranges"])
            sizes = {int(k): tuple(int(x) for x in v) for k, v in d["sizes"].items()}
            crcs = {int(k): tuple(int(x) for x in v) for k, v in d["crc32"].items()}
            text = tuple(tuple(map(int, ids)) for ids in d["text"])
            shas = {int(k): tuple(str(x) for x in v) for k, v in d["sha256"].items()}
            gen = _check_gen(d["gen"])
            prev = d.get("prev")
            if prev is not None:
                prev = {"gen": _check_gen(prev["gen"]), "levels": [int(x) for x in prev["levels"]],
                        "chunk_count": int(prev["chunk_count"])}
            cals = tuple(str(h) for h in d.get("calibrations") or ())
            for h in cals:
                _cal_key(h)
            m = cls(
                key=_check_hex_key(d["key"]), model_id=str(d["model_id"]),
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
                raise StoreError(f"manifest levels {sorted(levels)} differ from its identity's "
                                 f"level configs {sorted(ident.levels)}")
            if ident.calibration_hash and ident.calibration_hash not in cals:
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


def _parse_gen(raw: bytes | None) -> str | None:
    """The write generation of a stored manifest's bytes: None when absent, "" for a
    manifest of another format or an unreadable one (it is still a state a writer read)."""
    if raw is None:
        return None
    try:
        g = json.loads(raw.decode("utf-8")).get("gen")
        return g if isinstance(g, str) else ""
    except (UnicodeDecodeError, ValueError, AttributeError):
        return ""


def _chunk_digest(data: bytes) -> tuple[int, int, str]:
    return len(data), zlib.crc32(data), hashlib.sha256(data).hexdigest()


class KVStore:
    """Store logic over a backend (used in-process by the server, or directly).

    Every save writes its chunks under a fresh generation id, then publishes the manifest
    with a compare-and-swap against the state the writer read first (`current_gen`):
    entries are immutable, a reader never sees a mix of two saves, and of two writers that
    read the same state the first to publish wins (the other gets StoreRaceLostError).
    Backends with `compare_and_put` (local folder: flock; Redis: a Lua script) make this
    safe across processes; others get an in-process lock."""

    def __init__(self, backend: StoreBackend):
        self.backend = backend
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ atomic primitives
    def _cas(self, key: str, expected: bytes | None, data: bytes | None) -> bool:
        cas = getattr(self.backend, "compare_and_put", None)
        if cas is not None:
            return bool(cas(key, expected, data))
        with self._lock:
            if self.backend.get(key) != expected:
                return False
            if data is None:
                self.backend.delete(key)
            else:
                self.backend.put(key, data)
            return True

    def _count_existing(self, keys: list[str]) -> int:
        f = getattr(self.backend, "count_existing", None)
        if f is not None:
            return int(f(keys))
        return sum(1 for k in keys if self.backend.exists(k))

    # ------------------------------------------------------------------ writes
    def current_gen(self, key: str) -> str | None:
        """Generation of the key's stored manifest (None: none stored; "": one of another
        format or unreadable). A writer reads this first and publishes against it."""
        _check_hex_key(key)
        return _parse_gen(self.backend.get(_manifest_key(key)))

    def put_chunk(self, key: str, level: int, index: int, data: bytes, gen: str | None = None) -> None:
        """Store one chunk of write generation `gen` (None: the raw slot without a
        manifest, for prefix-index records)."""
        _check_hex_key(key)
        if int(index) < 0:
            raise ValueError("chunk index must be >= 0")
        self.backend.put(_chunk_key(key, level, index, gen), bytes(data))

    def put_calibration(self, h: str, data: bytes) -> None:
        """Store a calibration artifact under cal/<h> unless present (content-addressed:
        the bytes must hash to h; raises ValueError otherwise)."""
        k = _cal_key(h)
        if hashlib.sha256(bytes(data)).hexdigest() != h and not _cal_named(data, h):
            raise ValueError(f"calibration bytes do not carry hash {h[:16]}")
        if not self.backend.exists(k):
            self.backend.put(k, bytes(data))

    def get_calibration(self, h: str) -> bytes | None:
        return self.backend.get(_cal_key(h))

    def has_calibration(self, h: str) -> bool:
        return self.backend.exists(_cal_key(h))

    def put_manifest(self, manifest: dict, base_gen=_ANY) -> Manifest:
        """Verify every chunk of the manifest's generation (present, size, CRC, sha256)
        and its calibrations, then publish the manifest atomically if the key's manifest
        is still at `base_gen` (what the writer read with current_gen before its first
        write; None = no entry). Raises StoreError if anything is missing or differs,
        StoreRaceLostError if another writer published first (nothing of this write is
        visible then). The entry it replaces keeps its chunks until the next overwrite."""
        m = Manifest.from_dict(manifest)
        for lv in m.levels:
            for i in range(m.chunk_count):
                data = self.backend.get(_chunk_key(m.key, lv, i, m.gen))
                if data is None:
                    raise StoreError(f"chunk {i} level {lv} missing: put chunks before the manifest")
                if _chunk_digest(data) != (m.sizes[lv][i], m.crc32[lv][i], m.sha256[lv][i]):
                    raise StoreError(f"chunk {i} level {lv} differs from the manifest (size/CRC/sha256)")
        for h in m.calibrations:
            if not self.backend.exists(_cal_key(h)):
                raise StoreError(f"calibration {h[:16]} missing: put it before the manifest")
        mk = _manifest_key(m.key)
        for _ in range(100):  # retried only when a no-race publish (base _ANY) sees a change
            cur = self.backend.get(mk)
            cur_gen = _parse_gen(cur)
            # a key whose manifest is gone (evicted, dropped, deleted) has no entry to keep:
            # publishing over nothing never hides another writer's complete entry
            if base_gen is not _ANY and cur_gen != base_gen and cur is not None:
                raise StoreRaceLostError(
                    f"another writer published key {m.key[:16]} first (its generation "
                    f"{str(cur_gen)[:8] or '-'}, this writer read {str(base_gen)[:8] or '-'}): "
                    "the store keeps the other complete entry")
            d = m.to_dict()
            prev_of_cur = None
            if cur is not None:
                try:
                    old = json.loads(cur.decode("utf-8"))
                    d["prev"] = {"gen": _check_gen(old["gen"]), "levels": [int(x) for x in old["levels"]],
                                 "chunk_count": int(old["chunk_count"])}
                    prev_of_cur = old.get("prev")
                except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
                    d["prev"] = None
            else:
                d["prev"] = None
            blob = json.dumps(d).encode("utf-8")
            self.backend.put(_manifest_key(m.key, m.gen), blob)  # the generation's own copy
            if self._cas(mk, cur, blob):
                break
            if base_gen is not _ANY:
                raise StoreRaceLostError(f"another writer published key {m.key[:16]} first")
        else:
            raise StoreError(f"could not publish key {m.key[:16]}: the manifest kept changing")
        if isinstance(prev_of_cur, dict):  # two generations back: no reader plans from it now
            try:
                self.discard(m.key, _check_gen(prev_of_cur["gen"]), prev_of_cur["levels"],
                             int(prev_of_cur["chunk_count"]))
            except (ValueError, KeyError, TypeError, StoreError, OSError) as e:
                logger.warning("store: could not delete old chunks of %s: %s", m.key[:16], e)
        return Manifest.from_dict(d)

    def discard(self, key: str, gen: str, levels, chunk_count: int) -> None:
        """Delete the chunks of one write generation (a loser's, a failed writer's, or an
        entry two overwrites back). Never touches a published manifest."""
        _check_hex_key(key)
        self.backend.delete(_manifest_key(key, gen))
        for lv in levels:
            for i in range(int(chunk_count)):
                self.backend.delete(_chunk_key(key, lv, i, gen))

    # ------------------------------------------------------------------ reads
    def get_manifest(self, key: str, model_id=None, weights_hash=None, codec_tag=None,
                     identity: EntryIdentity | dict | None = None,
                     verify: bool = True, gen: str | None = None) -> tuple[Manifest | None, str]:
        """(manifest, "") or (None, reason) - unknown key, corrupt, previous-format or
        mismatched entry (model/codec expectation and identity checked by
        Manifest.mismatch). verify: also check that every chunk and calibration the
        manifest names is stored; an entry that lost any (eviction, deletion) is dropped
        (manifest removed by compare-and-swap) and is a miss with the reason. gen: the
        manifest of that write generation (what a lookup planned from), published or
        replaced since; a generation deleted since (two overwrites later) is a miss."""
        try:
            _check_hex_key(key)
            if gen is not None:
                _check_gen(gen)
        except ValueError as e:
            return None, str(e)
        raw = self.backend.get(_manifest_key(key, gen))
        if raw is None:
            return None, "unknown key" if gen is None else \
                f"generation {gen[:8]} gone (the entry was replaced since it was planned)"
        try:
            m = Manifest.from_dict(json.loads(raw.decode("utf-8")))
        except (StoreError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            return None, f"stored manifest unusable: {e}"
        if m.key != key:
            return None, "stored manifest belongs to another key"
        why = m.mismatch(model_id, weights_hash, codec_tag, identity)
        if why:
            return None, why
        if verify:
            keys = m.chunk_keys()
            have = self._count_existing(keys + [_manifest_key(key, m.gen)])  # + the copy a load reads
            cal_missing = [h for h in m.calibrations if not self.backend.exists(_cal_key(h))]
            if have < len(keys) + 1 or cal_missing:
                chunks_have = self._count_existing(keys) if have < len(keys) + 1 else len(keys)
                if chunks_have < len(keys):
                    why = (f"entry incomplete: {len(keys) - chunks_have} of {len(keys)} chunks "
                           "missing (evicted or deleted)")
                elif cal_missing:
                    why = (f"entry incomplete: calibration {cal_missing[0][:16]} missing "
                           "(evicted or deleted)")
                else:
                    why = "entry incomplete: its generation's manifest copy is missing (evicted or deleted)"
                self._drop(key, raw, why)  # the published manifest only if it is these bytes
                return None, why + "; entry dropped"
        return m, ""

    def _drop(self, key: str, raw: bytes, why: str) -> bool:
        dropped = self._cas(_manifest_key(key), raw, None)
        if dropped:
            logger.warning("store: dropped entry %s: %s", key[:16], why)
        return dropped

    def invalidate(self, key: str, gen: str, reason: str) -> bool:
        """Drop the key's entry if it is still generation `gen` (a reader found one of its
        chunks missing or failing its checksum): later lookups miss instead of failing
        forever; a newer entry is never touched. Returns True if dropped."""
        _check_hex_key(key)
        raw = self.backend.get(_manifest_key(key))
        if raw is None or _parse_gen(raw) != gen:
            return False
        return self._drop(key, raw, reason)

    def get_chunk(self, key: str, level: int, index: int, gen: str | None = None) -> bytes | None:
        """Chunk bytes of generation `gen`, or None. gen None: the raw slot (index
        records), else the chunk of the key's current entry."""
        _check_hex_key(key)
        if gen is None:
            data = self.backend.get(_chunk_key(key, level, index))
            if data is not None:
                return data
            gen = _parse_gen(self.backend.get(_manifest_key(key)))
            if not gen:
                return None
        return self.backend.get(_chunk_key(key, level, index, gen))

    def list_contexts(self, limit: int = 10000) -> list[str]:
        out = []
        for k in self.backend.keys("ctx/"):
            parts = k.split("/")
            if len(parts) == 3 and parts[2] == "manifest":  # not a generation's own copy
                out.append(parts[1])
                if len(out) >= limit:
                    break
        return sorted(out)

    def delete_context(self, key: str) -> None:
        _check_hex_key(key)
        self.backend.delete(_manifest_key(key))  # invisible first, then the chunks
        for k in list(self.backend.keys(f"ctx/{key}/")):
            self.backend.delete(k)

    # ------------------------------------------------------------------ whole saves
    def save_steps(self, man: dict, chunks: dict[int, Sequence[bytes]],
                   calibrations: dict[str, bytes] | None = None):
        """The steps of one save, as a generator (tests stop it anywhere to model a
        crash): see save_steps()."""
        return save_steps(self, man, chunks, calibrations)


def _cal_named(data: bytes, h: str) -> bool:
    """True when `data` is a safetensors artifact whose metadata records hash `h` (the
    codec's content hash is over the parameters, not the file bytes; the reader verifies
    it again with codec.kvtc.calibration_from_bytes before any use)."""
    try:
        n = int.from_bytes(bytes(data[:8]), "little")
        if not 0 < n <= min(len(data) - 8, 1 << 24):
            return False
        head = json.loads(bytes(data[8:8 + n]).decode("utf-8"))
        return (head.get("__metadata__") or {}).get("hash") == h
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False


def _prev_of(raw: bytes | None) -> dict | None:
    """{"gen", "levels", "chunk_count"} of a stored manifest's bytes (None if unusable)."""
    if raw is None:
        return None
    try:
        old = json.loads(raw.decode("utf-8"))
        return {"gen": _check_gen(old["gen"]), "levels": [int(x) for x in old["levels"]],
                "chunk_count": int(old["chunk_count"])}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None


def save_steps(ops, man: dict, chunks: dict[int, Sequence[bytes]],
               calibrations: dict[str, bytes] | None = None):
    """Generator of the write steps of one save through `ops`. Yields after each step:
    ("base", gen read), ("cal", hash) per calibration, then either ("chunk", level, index)
    per chunk and ("manifest", key) (a KVStore or StoreClient: current_gen,
    put_calibration, put_chunk(..., gen), put_manifest(man, base_gen), discard), or one
    ("manifest", key) when `ops` publishes chunks and manifest in one atomic step
    (RedisStoreClient.publish_atomic: a Lua script). A generator stopped at any point (a
    crash) leaves nothing visible: at most chunks of a fresh generation that no manifest
    names. A failed publish (StoreRaceLostError, StoreError) deletes this save's chunks
    and re-raises."""
    key = man["key"]
    atomic = getattr(ops, "publish_atomic", None)
    if atomic is not None:
        base_raw = ops.manifest_raw(key)
        base = _parse_gen(base_raw)
    else:
        base = ops.current_gen(key)
    gen = new_generation()
    man = dict(man, gen=gen)
    yield ("base", base)
    for h in man.get("calibrations") or ():
        if not ops.has_calibration(h):  # content-addressed: stored once per store
            data = (calibrations or {}).get(h)
            if data is None:
                data = _calibration_bytes(h)
            ops.put_calibration(h, data)
        yield ("cal", h)
    if atomic is not None:
        man["prev"] = _prev_of(base_raw)
        Manifest.from_dict(man)
        atomic(man, chunks, base_raw)
        old = _prev_of_prev(base_raw)
        if old is not None:
            try:
                ops.discard(key, old["gen"], old["levels"], old["chunk_count"])
            except (StoreError, OSError, ValueError) as e:
                logger.warning("store: could not delete old chunks of %s: %s", key[:16], e)
        yield ("manifest", key)
        return
    for lv in man["levels"]:
        for i, data in enumerate(chunks[lv]):
            ops.put_chunk(key, lv, i, bytes(data), gen=gen)
            yield ("chunk", lv, i)
    try:
        ops.put_manifest(man, base_gen=base)
    except (StoreError, OSError):
        try:
            ops.discard(key, gen, man["levels"], man["chunk_count"])
        except (StoreError, OSError, ValueError):
            pass
        raise
    yield ("manifest", key)


def _prev_of_prev(raw: bytes | None) -> dict | None:
    """The "prev" record ({"gen", "levels", "chunk_count"}) of a stored manifest's bytes:
    the generation two saves back once a new save replaces this one (None if none)."""
    if raw is None:
        return None
    try:
        prev = json.loads(raw.decode("utf-8")).get("prev")
        if not prev:
            return None
        return {"gen": _check_gen(prev["gen"]), "levels": [int(x) for x in prev["levels"]],
                "chunk_count": int(prev["chunk_count"])}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None


def _calibration_bytes(h: str) -> bytes:
    """The artifact bytes of calibration `h` from the codec (registry or cache folder).
    Raises StoreError when this writer does not have it."""
    try:
        from codec.kvtc import calibration_bytes
    except ImportError as e:
        raise StoreError(f"calibration {h[:16]} named by the entry: codec unavailable ({e})") from None
    try:
        return calibration_bytes(h)
    except ValueError as e:  # codec.CodecError is a ValueError
        raise StoreError(f"calibration {h[:16]} named by the entry is not available to the "
                         f"writer: {e}") from None


def run_steps(steps) -> None:
    for _ in steps:
        pass


# --------------------------------------------------------------------------- server
FaultHook = Callable[[str, int, int, bytes], bytes]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: KVStoreServer = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(srv.idle_timeout_s)
        while True:
            try:
                f = recv_frame(sock, max_body=srv.max_body)
            except FrameTooLarge as e:
                self._reply(FrameType.ERR, {
                    "error": f"{e}: the store server refuses values above {e.limit} bytes "
                             f"(start it with a larger --max-body-mb)",
                    "kind": StoreTooLargeError.kind, "limit": e.limit})
                return  # the stream position is lost: close the connection
            except ProtocolError as e:
                self._reply(FrameType.ERR, {"error": f"protocol error: {e}"})
                return  # the stream position is lost: close the connection
            except (ConnectionClosed, OSError):
                return  # client went away (or idle timeout): nothing to clean up
            try:
                rtype, meta, body = srv.dispatch(f.type, f.meta, f.body)
            except StoreError as e:  # classified (full, read-only, ...): the client re-raises the kind
                rtype, meta, body = FrameType.ERR, {"error": str(e), "kind": e.kind}, b""
            except (ValueError, KeyError, TypeError) as e:
                rtype, meta, body = FrameType.ERR, {"error": str(e)}, b""
            except Exception as e:  # noqa: BLE001 - the server must keep serving others
                rtype, meta, body = FrameType.ERR, {"error": f"internal error: {e!r}"}, b""
            if not self._reply(rtype, meta, body):
                return

    def _reply(self, rtype, meta, body=b"") -> bool:
        try:
            send_frame(self.request, rtype, meta, body)
            return True
        except OSError:
            return False  # client disconnected mid-transfer


class KVStoreServer(socketserver.ThreadingTCPServer):
    """Threaded TCP server of a KVStore. One thread per connection; a client that
    disconnects (even mid-chunk) ends only its own thread.

    fault_hook(kind, level, index, data) -> data lets tests corrupt bytes in transit.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, backend: StoreBackend, host: str = "127.0.0.1", port: int = 0,
                 max_body: int = DEFAULT_MAX_BODY, idle_timeout_s: float = 600.0,
                 fault_hook: FaultHook | None = None):
        self.store = KVStore(backend)
        self.max_body = max_body
        self.idle_timeout_s = idle_timeout_s
        self.fault_hook = fault_hook
        self._publish_lock = threading.Lock()
        super().__init__((host, port), _Handler)

    @property
    def address(self) -> tuple[str, int]:
        return self.server_address[0], self.server_address[1]

    def dispatch(self, ftype: FrameType, meta: dict, body: bytes):
        st = self.store
        if ftype == FrameType.PING:  # with the limits, so a client refuses too large values up front
            return FrameType.OK, {"pong": True, "max_body": self.max_body, "max_meta": DEFAULT_MAX_META}, b""
        if ftype == FrameType.GET_MANIFEST:
            exp = meta.get("expect") or {}
            m, why = st.get_manifest(meta.get("key"), exp.get("model_id"), exp.get("weights_hash"),
                                     exp.get("codec_tag"), exp.get("identity"), gen=meta.get("gen"))
            if m is None:
                return FrameType.MISS, {"reason": why}, b""
            return FrameType.OK, {"manifest": m.to_dict()}, b""
        if ftype == FrameType.GET_CHUNK:
            if meta.get("cal") is not None:
                data = st.get_calibration(meta.get("cal"))
                if data is None:
                    return FrameType.MISS, {"reason": f"no calibration {str(meta.get('cal'))[:16]}"}, b""
                return FrameType.OK, {"bytes": len(data)}, data
            key, lv, idx = meta.get("key"), int(meta.get("level")), int(meta.get("index"))
            data = st.get_chunk(key, lv, idx, meta.get("gen"))
            if data is None:
                return FrameType.MISS, {"reason": f"no chunk {idx} at level {lv}"}, b""
            if self.fault_hook is not None:
                data = self.fault_hook(key, lv, idx, data)
            return FrameType.OK, {"bytes": len(data)}, data
        if ftype == FrameType.PUT_CHUNK:
            if meta.get("cal") is not None:
                st.put_calibration(meta.get("cal"), body)
                return FrameType.OK, {}, b""
            st.put_chunk(meta.get("key"), int(meta.get("level")), int(meta.get("index")), body,
                         meta.get("gen"))
            return FrameType.OK, {}, b""
        if ftype == FrameType.PUT_MANIFEST:
            base = meta.get("base_gen") if meta.get("has_base") else _ANY
            with self._publish_lock:  # the server serialises publishes
                m = st.put_manifest(meta.get("manifest"), base)
            return FrameType.OK, {"key": m.key}, b""
        if ftype == FrameType.LIST:
            return FrameType.OK, {"keys": st.list_contexts(int(meta.get("limit", 10000)))}, b""
        if ftype == FrameType.HAS:
            if meta.get("cal") is not None:
                return FrameType.OK, {"exists": st.has_calibration(meta.get("cal"))}, b""
            if meta.get("gen_only"):
                return FrameType.OK, {"gen": st.current_gen(meta.get("key"))}, b""
            m, why = st.get_manifest(meta.get("key"))
            return FrameType.OK, {"exists": m is not None, "reason": why}, b""
        if ftype == FrameType.DELETE:
            if meta.get("gen") is not None:
                if meta.get("levels") is not None:  # a writer's own unpublished chunks
                    st.discard(meta.get("key"), meta.get("gen"), [int(x) for x in meta["levels"]],
                               int(meta.get("chunk_count", 0)))
                    return FrameType.OK, {}, b""
                return FrameType.OK, {"dropped": st.invalidate(meta.get("key"), meta.get("gen"),
                                                               str(meta.get("reason", "")))}, b""
            st.delete_context(meta.get("key"))
            return FrameType.OK, {}, b""
        raise ValueError(f"not a request frame type: {ftype.name}")

    def start_thread(self) -> threading.Thread:
        """Serve in a daemon thread (in-process use, tests); stop with shutdown()+server_close()."""
        t = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        t.start()
        return t


# --------------------------------------------------------------------------- client
class StoreClient:
    """Client of KVStoreServer over one persistent TCP connection (not thread-safe: use
    one per thread, see clone()).

    timeout: seconds WITHOUT PROGRESS (no byte sent or received) before a request fails;
    a large chunk over a slow link does not time out while bytes keep moving.

    Raises classified streaming.errors.StoreError subclasses: StoreUnavailableError (not
    reachable, connection lost), StoreTimeoutError (no progress for `timeout` s),
    StoreTooLargeError (a chunk above the server's --max-body-mb, refused before sending),
    StoreFullError / StoreReadOnlyError (the server's backend refused the write), StoreError
    (other ERR replies); ProtocolError for a malformed reply. Misses are not errors:
    get_manifest/get_chunk return None and set `last_miss_reason`.
    """

    def __init__(self, host: str, port: int, timeout: float = 30.0, max_body: int = DEFAULT_MAX_BODY):
        self.host, self.port, self.timeout, self.max_body = host, int(port), timeout, max_body
        self._sock: socket.socket | None = None
        self._server_max_body: int | None = None
        self.last_miss_reason = ""

    def clone(self) -> "StoreClient":
        return StoreClient(self.host, self.port, self.timeout, self.max_body)

    @property
    def _where(self) -> str:
        return f"store server at {self.host}:{self.port}"

    def connect(self) -> None:
        """Open the connection if needed. Raises StoreUnavailableError / StoreTimeoutError."""
        if self._sock is None:
            try:
                s = socket.create_connection((self.host, self.port), timeout=self.timeout)
            except socket.timeout:
                raise StoreTimeoutError(
                    f"{self._where}: no answer to connect within {self.timeout:g} s "
                    "(host down or the link dropping packets?)") from None
            except socket.gaierror as e:
                raise StoreUnavailableError(f"{self._where}: unknown host ({e})") from None
            except OSError as e:
                raise StoreUnavailableError(
                    f"{self._where} unreachable: {e.strerror or e} (is it running? start one with "
                    "`python -m streaming.store serve --backend DIR`)") from None
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = s

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def reconnect(self) -> None:
        self.close()
        self.connect()

    def __enter__(self) -> "StoreClient":
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, ftype: FrameType, meta: dict, body: bytes = b""):
        self.connect()
        phase = f"sending {ftype.name}"
        try:
            send_frame(self._sock, ftype, meta, body)
            phase = f"waiting for the reply to {ftype.name}"
            f = recv_frame(self._sock, max_body=self.max_body)
        except socket.timeout:
            self.close()  # position in the stream unknown: never reuse this connection
            raise StoreTimeoutError(
                f"{self._where}: no progress for {self.timeout:g} s while {phase} (timeout without "
                "progress: the server or the link stalled; a slow transfer that keeps moving does "
                "not time out - check the server, or raise the client's timeout)") from None
        except ConnectionClosed as e:
            self.close()
            raise StoreUnavailableError(f"{self._where} closed the connection while {phase}: {e}") from None
        except OSError as e:
            self.close()
            raise StoreUnavailableError(f"{self._where}: connection lost while {phase}: "
                                        f"{e.strerror or e}") from None
        except StreamingError:
            self.close()
            raise
        if f.type == FrameType.ERR:
            raise store_error(f.meta.get("kind"), f"{self._where}: {f.meta.get('error', 'server error')}")
        return f

    def server_max_body(self) -> int | None:
        """The server's largest accepted chunk in bytes (from its PING reply; None for a
        server that does not say). Cached per client."""
        if self._server_max_body is None:
            mb = self._call(FrameType.PING, {}).meta.get("max_body")
            self._server_max_body = int(mb) if mb else 0
        return self._server_max_body or None

    def _check_size(self, n: int) -> None:
        limit = self.server_max_body()
        if limit is not None and n > limit:
            raise StoreTooLargeError(
                f"chunk of {n} bytes exceeds the {self._where}'s limit of {limit} bytes: start the "
                f"server with --max-body-mb {-(-n // (1 << 20))} or more, or store smaller chunks "
                "(--chunk-tokens)", limit, n)

    def ping(self) -> bool:
        return self._call(FrameType.PING, {}).type == FrameType.OK

    def get_manifest(self, key: str, model_id=None, weights_hash=None, codec_tag=None,
                     identity: EntryIdentity | dict | None = None,
                     gen: str | None = None) -> Manifest | None:
        """Manifest of a stored context (gen: of that write generation, see
        KVStore.get_manifest), or None (clean miss; reason in last_miss_reason).
        The expectation (and `identity`, see streaming.identity.check_entry) is checked by
        the server and again here."""
        if isinstance(identity, EntryIdentity):
            identity = identity.to_dict()
        exp = {"model_id": model_id, "weights_hash": weights_hash, "codec_tag": codec_tag,
               "identity": identity}
        req = {"key": key, "expect": exp}
        if gen is not None:
            req["gen"] = gen
        f = self._call(FrameType.GET_MANIFEST, req)
        if f.type == FrameType.MISS:
            self.last_miss_reason = str(f.meta.get("reason", "miss"))
            return None
        try:
            m = Manifest.from_dict(f.meta["manifest"])
        except (StoreError, KeyError, TypeError) as e:
            self.last_miss_reason = f"server sent an unusable manifest: {e}"
            return None
        why = m.mismatch(model_id, weights_hash, codec_tag, identity) or (None if m.key == key else "wrong key") \
            or (None if gen is None or m.gen == gen else "wrong generation")
        if why:
            self.last_miss_reason = why
            return None
        return m

    def get_chunk(self, key: str, level: int, index: int, gen: str | None = None) -> bytes | None:
        """Bytes of chunk `index` at `level` of write generation `gen` (a manifest's
        .gen; None: the current entry's, or a raw slot), or None if absent."""
        meta = {"key": key, "level": int(level), "index": int(index)}
        if gen is not None:
            meta["gen"] = gen
        f = self._call(FrameType.GET_CHUNK, meta)
        if f.type == FrameType.MISS:
            self.last_miss_reason = str(f.meta.get("reason", "miss"))
            return None
        return bytes(f.body) if isinstance(f.body, bytearray) else f.body

    def put_chunk(self, key: str, level: int, index: int, data: bytes, gen: str | None = None) -> None:
        """Write one chunk (low level: put_context commits contexts). gen None: a raw slot
        without a manifest, used for small index records keyed by their own 64-hex key
        (third_party.vllm.prefix's chunk hash chain). Raises StoreError if refused."""
        self._check_size(len(data))
        meta = {"key": key, "level": int(level), "index": int(index)}
        if gen is not None:
            meta["gen"] = gen
        self._call(FrameType.PUT_CHUNK, meta, bytes(data))

    def current_gen(self, key: str) -> str | None:
        """Write generation of the key's stored manifest (None: none; "": another format)."""
        return self._call(FrameType.HAS, {"key": key, "gen_only": True}).meta.get("gen")

    def put_manifest(self, manifest: dict, base_gen=_ANY) -> None:
        """Publish a manifest (see KVStore.put_manifest). Raises StoreRaceLostError."""
        meta = {"manifest": manifest}
        if base_gen is not _ANY:
            meta.update(base_gen=base_gen, has_base=True)
        self._call(FrameType.PUT_MANIFEST, meta)

    def discard(self, key: str, gen: str, levels, chunk_count: int) -> None:
        self._call(FrameType.DELETE, {"key": key, "gen": gen, "levels": list(levels),
                                      "chunk_count": int(chunk_count)})

    def invalidate(self, key: str, gen: str, reason: str) -> bool:
        """Drop the entry if it is still generation `gen` (see KVStore.invalidate)."""
        return bool(self._call(FrameType.DELETE, {"key": key, "gen": gen, "reason": reason}
                               ).meta.get("dropped"))

    def put_calibration(self, h: str, data: bytes) -> None:
        self._check_size(len(data))
        self._call(FrameType.PUT_CHUNK, {"cal": h}, bytes(data))

    def has_calibration(self, h: str) -> bool:
        return bool(self._call(FrameType.HAS, {"cal": h}).meta.get("exists"))

    def get_calibration(self, h: str) -> bytes | None:
        """Bytes stored under cal/<h>, or None (reason in last_miss_reason)."""
        f = self._call(FrameType.GET_CHUNK, {"cal": h})
        if f.type == FrameType.MISS:
            self.last_miss_reason = str(f.meta.get("reason", "miss"))
            return None
        return bytes(f.body)

    def list_contexts(self, limit: int = 10000) -> list[str]:
        return list(self._call(FrameType.LIST, {"limit": limit}).meta.get("keys", []))

    def has(self, key: str) -> bool:
        return bool(self._call(FrameType.HAS, {"key": key}).meta.get("exists"))

    def delete_context(self, key: str) -> None:
        self._call(FrameType.DELETE, {"key": key})

    def put_context(self, model_id: str, weights_hash: str, codec_tag: str, token_ids: Sequence[int],
                    chunks: dict[int, Sequence[bytes]], token_ranges: Sequence[tuple[int, int]],
                    meta: dict | None = None, identity: EntryIdentity | None = None,
                    calibrations: dict[str, bytes] | None = None) -> str:
        """Store a context: chunks[level][i] = encoded bytes of chunk i at that level (levels
        in ascending quality), token_ranges[i] = (start, end) of chunk i in token_ids.
        Steps (streaming.store.save_steps): read the key's state, the calibration the
        identity names (cal/<hash>; bytes from `calibrations` or the codec), the chunks
        under a fresh generation, the manifest last (compare-and-swap). Returns the
        context key. With `identity`, prefer put_entry. Raises ValueError on inconsistent
        arguments, StoreRaceLostError when another writer published this key first,
        StoreError if the server refuses."""
        key, man = build_manifest(model_id, weights_hash, codec_tag, token_ids, chunks, token_ranges,
                                  meta, identity)
        self._check_size(max(len(c) for lv in man["levels"] for c in chunks[lv]))  # before any write
        run_steps(save_steps(self, man, chunks, calibrations))
        return key

    def put_entry(self, identity: EntryIdentity, token_ids: Sequence[int],
                  chunks: dict[int, Sequence[bytes]], token_ranges: Sequence[tuple[int, int]],
                  meta: dict | None = None, calibrations: dict[str, bytes] | None = None) -> str:
        """put_context keyed by a full identity (streaming.store.entry_key): the manifest
        records it, readers check it. Raises ValueError for an incomplete identity or
        levels that differ from identity.level_configs."""
        identity.require_complete()
        return self.put_context(identity.model_id, identity.weights_hash, identity.codec_tag(),
                                token_ids, chunks, token_ranges, meta, identity, calibrations)


class LocalStoreClient:
    """The StoreClient interface in-process over a KVStore (a local folder path or any
    StoreBackend): no server; stream_load, put_context and the write steps work on it.
    Misses set `last_miss_reason`. Same guarantees as the server (KVStore)."""

    def __init__(self, backend: StoreBackend | str | os.PathLike):
        self.backend = backend if isinstance(backend, StoreBackend) and not isinstance(backend, (str, os.PathLike)) \
            else open_backend(backend)
        self.store = KVStore(self.backend)
        self.last_miss_reason = ""

    def clone(self) -> "LocalStoreClient":
        c = LocalStoreClient(self.backend)
        c.store = self.store
        return c

    def connect(self) -> None:
        pass

    reconnect = close = connect

    def ping(self) -> bool:
        return True

    def __enter__(self) -> "LocalStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def get_manifest(self, key: str, model_id=None, weights_hash=None, codec_tag=None, identity=None,
                     gen=None) -> Manifest | None:
        m, why = self.store.get_manifest(key, model_id, weights_hash, codec_tag, identity, gen=gen)
        if m is None:
            self.last_miss_reason = why
        return m

    def get_chunk(self, key: str, level: int, index: int, gen: str | None = None) -> bytes | None:
        data = self.store.get_chunk(key, level, index, gen)
        if data is None:
            self.last_miss_reason = f"no chunk {int(index)} at level {int(level)}"
        return data

    def get_calibration(self, h: str) -> bytes | None:
        data = self.store.get_calibration(h)
        if data is None:
            self.last_miss_reason = f"no calibration {h[:16]} in the store"
        return data

    def has_calibration(self, h: str) -> bool:
        return self.store.has_calibration(h)

    def has(self, key: str) -> bool:
        return self.store.get_manifest(key)[0] is not None

    def list_contexts(self, limit: int = 10000) -> list[str]:
        return self.store.list_contexts(limit)

    def delete_context(self, key: str) -> None:
        self.store.delete_context(key)

    def current_gen(self, key: str):
        return self.store.current_gen(key)

    def put_chunk(self, key: str, level: int, index: int, data: bytes, gen: str | None = None) -> None:
        self.store.put_chunk(key, level, index, data, gen)

    def put_manifest(self, manifest: dict, base_gen=_ANY):
        return self.store.put_manifest(manifest, base_gen)

    def put_calibration(self, h: str, data: bytes) -> None:
        self.store.put_calibration(h, data)

    def discard(self, key: str, gen: str, levels, chunk_count: int) -> None:
        self.store.discard(key, gen, levels, chunk_count)

    def invalidate(self, key: str, gen: str, reason: str) -> bool:
        return self.store.invalidate(key, gen, reason)

    def put_context(self, model_id, weights_hash, codec_tag, token_ids, chunks, token_ranges,
                    meta=None, identity=None, calibrations=None) -> str:
        """As StoreClient.put_context (save_steps on the KVStore)."""
        key, man = build_manifest(model_id, weights_hash, codec_tag, token_ids, chunks, token_ranges,
                                  meta, identity)
        run_steps(save_steps(self.store, man, chunks, calibrations))
        return key

    def put_entry(self, identity, token_ids, chunks, token_ranges, meta=None, calibrations=None) -> str:
        identity.require_complete()
        return self.put_context(identity.model_id, identity.weights_hash, identity.codec_tag(),
                                token_ids, chunks, token_ranges, meta, identity, calibrations)


def build_manifest(model_id: str, weights_hash: str, codec_tag: str, token_ids: Sequence[int],
                   chunks: dict[int, Sequence[bytes]], token_ranges: Sequence[tuple[int, int]],
                   meta: dict | None = None, identity: EntryIdentity | None = None) -> tuple[str, dict]:
    """(context key, manifest dict) of a context to store (every client builds it here).

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
        if set(int(lv) for lv in chunks) != set(identity.levels):
            raise ValueError(f"chunk levels {sorted(chunks)} differ from the identity's level "
                             f"configs {list(identity.levels)}")
    key = context_key(model_id, weights_hash, codec_tag, ids)
    levels = sorted(int(lv) for lv in chunks)
    n = len(token_ranges)
    for lv in levels:
        if len(chunks[lv]) != n:
            raise ValueError(f"level {lv} has {len(chunks[lv])} chunks, token_ranges has {n}")
    man = {
        "format": MANIFEST_FORMAT, "key": key, "model_id": model_id, "weights_hash": weights_hash,
        "codec_tag": codec_tag, "levels": levels, "chunk_count": n,
        "token_ranges": [[int(a), int(b)] for a, b in token_ranges],
        "sizes": {str(lv): [len(c) for c in chunks[lv]] for lv in levels},
        "crc32": {str(lv): [zlib.crc32(bytes(c)) for c in chunks[lv]] for lv in levels},
        "sha256": {str(lv): [hashlib.sha256(bytes(c)).hexdigest() for c in chunks[lv]] for lv in levels},
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
            man["calibrations"] = [identity.calibration_hash]
    Manifest.from_dict(man)  # fail here, before anything is sent, on bad ranges
    return key, man


# --------------------------------------------------------------------------- process handle
def _readline_timeout(stream, timeout: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0].strip() if out else ""


@dataclass
class StoreServerHandle:
    """A running store server process: connect with client(); stop() ends it."""

    proc: subprocess.Popen
    host: str  # address this process connects to (through the link if any)
    port: int
    method: str  # link method, or "direct-loopback"

    def client(self, timeout: float = 30.0) -> StoreClient:
        return StoreClient(self.host, self.port, timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> "StoreServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_store_server(backend: str | os.PathLike, link=None, timeout: float = 30.0,
                       extra_args: Sequence[str] = ()) -> StoreServerHandle:
    """Start `python -m streaming.store serve` on `backend` (folder path or URL) behind
    `link` (a ShapedLink: in its server namespace for netns) or on loopback if None,
    wait for READY. Raises StoreError if it does not come up within `timeout` seconds."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    bind = link.bind_host if link is not None else "127.0.0.1"
    argv = [sys.executable, "-m", "streaming.store", "serve", "--backend", os.fspath(backend),
            "--host", bind, "--port", "0", "--exit-with-parent", *extra_args]
    kw = dict(stdout=subprocess.PIPE, env=env, text=True)
    proc = link.run_in_server_ns(argv, **kw) if link is not None else subprocess.Popen(argv, **kw)
    line = _readline_timeout(proc.stdout, timeout)
    if not line.startswith("READY "):
        proc.kill()
        proc.wait()
        raise StoreError(f"store server did not start (got {line!r}, exit {proc.poll()})")
    port = int(line.split()[1].rsplit(":", 1)[1])
    host, cport = link.expose(port) if link is not None else ("127.0.0.1", port)
    return StoreServerHandle(proc, host, cport, link.method if link is not None else "direct-loopback")


def watch_parent(on_orphan: Callable[[], None], poll_s: float = 1.0) -> threading.Thread:
    """Call on_orphan() once the parent process is gone (getppid changes), polling every
    poll_s seconds in a daemon thread. Keeps a crashed harness from leaving servers behind."""
    ppid = os.getppid()

    def run() -> None:
        while os.getppid() == ppid:
            threading.Event().wait(poll_s)
        on_orphan()

    t = threading.Thread(target=run, name="cgh-parent-watch", daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="KV store server (CacheGen section 5).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("serve", help="serve a backend over TCP")
    sp.add_argument("--backend", required=True, help="folder path, file:///path or redis://...")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=0)
    sp.add_argument("--max-body-mb", type=int, default=DEFAULT_MAX_BODY >> 20)
    sp.add_argument("--exit-with-parent", action="store_true",
                    help="shut down when the parent process dies (no orphan servers after a crash)")
    lp = sub.add_parser("list", help="list stored context keys")
    lp.add_argument("--backend", required=True)
    a = ap.parse_args(argv)
    try:
        backend = open_backend(a.backend)
    except (ValueError, StoreError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.cmd == "list":
        for k in KVStore(backend).list_contexts():
            print(k)
        return 0
    try:
        srv = KVStoreServer(backend, a.host, a.port, max_body=a.max_body_mb << 20)
    except OSError as e:
        print(f"error: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr)
        return 2

    def _stop(signum, frame):
        threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if a.exit_with_parent:
        watch_parent(srv.shutdown)
    h, p = srv.address
    print(f"READY {h}:{p}", flush=True)
    try:
        srv.serve_forever(poll_interval=0.2)
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
