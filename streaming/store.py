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
    ctx/<key>/chunk/<level>/<index>   encoded chunk bytes (written first)
    ctx/<key>/manifest                JSON manifest (written last: a context is visible
                                      only when all its chunks are stored and verified)

Run the server: python -m streaming.store serve --backend DIR --host 127.0.0.1 --port 0
(prints "READY host:port" on stdout when listening; SIGTERM/SIGINT stop it).
List contexts:  python -m streaming.store list --backend DIR
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import os
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

MANIFEST_FORMAT = "cgh-manifest-v1"
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


def _chunk_key(key: str, level: int, index: int) -> str:
    return f"ctx/{key}/chunk/{int(level)}/{int(index)}"


def _manifest_key(key: str) -> str:
    return f"ctx/{key}/manifest"


def _check_hex_key(key) -> str:
    if not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"context key must be 64 lowercase hex chars, got {str(key)[:80]!r}")
    return key


@dataclass(frozen=True)
class Manifest:
    """Everything the streamer needs about one stored context.

    levels: quality levels stored, ascending quality (and size); sizes[level][i] and
    crc32[level][i] are the byte size and CRC-32 of chunk i at that level; token_ranges[i]
    = (start, end) token positions of chunk i; text[i] = its token ids (the text fallback);
    identity: streaming.identity.EntryIdentity.to_dict() of what made the entry (None for
    entries written without one; such an entry misses for any reader that knows an
    identity field).
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
            "text": [list(t) for t in self.text],
            "meta": self.meta,
            **({"identity": self.identity} if self.identity is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        """Validate and build. Raises StoreError for any inconsistency."""
        try:
            if d.get("format") != MANIFEST_FORMAT:
                raise StoreError(f"unknown manifest format {d.get('format')!r}")
            levels = tuple(int(x) for x in d["levels"])
            n = int(d["chunk_count"])
            ranges = tuple((int(a), int(b)) for a, b in d["token_ranges"])
            sizes = {int(k): tuple(int(x) for x in v) for k, v in d["sizes"].items()}
            crcs = {int(k): tuple(int(x) for x in v) for k, v in d["crc32"].items()}
            text = tuple(tuple(map(int, ids)) for ids in d["text"])
            m = cls(
                key=_check_hex_key(d["key"]), model_id=str(d["model_id"]),
                weights_hash=str(d["weights_hash"]), codec_tag=str(d["codec_tag"]),
                levels=levels, token_ranges=ranges, sizes=sizes, crc32=crcs, text=text,
                meta=dict(d.get("meta") or {}),
                identity=dict(d["identity"]) if d.get("identity") is not None else None,
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
            if len(sizes.get(lv, ())) != n or len(crcs.get(lv, ())) != n:
                raise StoreError(f"manifest sizes/crc32 of level {lv} do not cover {n} chunks")
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


class KVStore:
    """Store logic over a backend (used in-process by the server, or directly)."""

    def __init__(self, backend: StoreBackend):
        self.backend = backend

    def put_chunk(self, key: str, level: int, index: int, data: bytes) -> None:
        _check_hex_key(key)
        if int(index) < 0:
            raise ValueError("chunk index must be >= 0")
        self.backend.put(_chunk_key(key, level, index), bytes(data))

    def put_manifest(self, manifest: dict) -> Manifest:
        """Verify every chunk (present, size, CRC) then store the manifest (commit).
        Raises StoreError if anything is missing or differs."""
        m = Manifest.from_dict(manifest)
        for lv in m.levels:
            for i in range(m.chunk_count):
                data = self.backend.get(_chunk_key(m.key, lv, i))
                if data is None:
                    raise StoreError(f"chunk {i} level {lv} missing: put chunks before the manifest")
                if len(data) != m.sizes[lv][i] or zlib.crc32(data) != m.crc32[lv][i]:
                    raise StoreError(f"chunk {i} level {lv} differs from the manifest (size/CRC)")
        self.backend.put(_manifest_key(m.key), json.dumps(m.to_dict()).encode("utf-8"))
        return m

    def get_manifest(self, key: str, model_id=None, weights_hash=None, codec_tag=None,
                     identity: EntryIdentity | dict | None = None) -> tuple[Manifest | None, str]:
        """(manifest, "") or (None, reason) - unknown key, corrupt or mismatched entry
        (model/codec expectation and identity checked by Manifest.mismatch)."""
        try:
            _check_hex_key(key)
        except ValueError as e:
            return None, str(e)
        raw = self.backend.get(_manifest_key(key))
        if raw is None:
            return None, "unknown key"
        try:
            m = Manifest.from_dict(json.loads(raw.decode("utf-8")))
        except (StoreError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            return None, f"stored manifest unusable: {e}"
        if m.key != key:
            return None, "stored manifest belongs to another key"
        why = m.mismatch(model_id, weights_hash, codec_tag, identity)
        if why:
            return None, why
        return m, ""

    def get_chunk(self, key: str, level: int, index: int) -> bytes | None:
        _check_hex_key(key)
        return self.backend.get(_chunk_key(key, level, index))

    def list_contexts(self, limit: int = 10000) -> list[str]:
        out = []
        for k in self.backend.keys("ctx/"):
            if k.endswith("/manifest"):
                out.append(k.split("/")[1])
                if len(out) >= limit:
                    break
        return sorted(out)

    def delete_context(self, key: str) -> None:
        _check_hex_key(key)
        self.backend.delete(_manifest_key(key))  # invisible first, then the chunks
        for k in list(self.backend.keys(f"ctx/{key}/")):
            self.backend.delete(k)


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
                                     exp.get("codec_tag"), exp.get("identity"))
            if m is None:
                return FrameType.MISS, {"reason": why}, b""
            return FrameType.OK, {"manifest": m.to_dict()}, b""
        if ftype == FrameType.GET_CHUNK:
            key, lv, idx = meta.get("key"), int(meta.get("level")), int(meta.get("index"))
            data = st.get_chunk(key, lv, idx)
            if data is None:
                return FrameType.MISS, {"reason": f"no chunk {idx} at level {lv}"}, b""
            if self.fault_hook is not None:
                data = self.fault_hook(key, lv, idx, data)
            return FrameType.OK, {"bytes": len(data)}, data
        if ftype == FrameType.PUT_CHUNK:
            st.put_chunk(meta.get("key"), int(meta.get("level")), int(meta.get("index")), body)
            return FrameType.OK, {}, b""
        if ftype == FrameType.PUT_MANIFEST:
            m = st.put_manifest(meta.get("manifest"))
            return FrameType.OK, {"key": m.key}, b""
        if ftype == FrameType.LIST:
            return FrameType.OK, {"keys": st.list_contexts(int(meta.get("limit", 10000)))}, b""
        if ftype == FrameType.HAS:
            m, why = st.get_manifest(meta.get("key"))
            return FrameType.OK, {"exists": m is not None, "reason": why}, b""
        if ftype == FrameType.DELETE:
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
                     identity: EntryIdentity | dict | None = None) -> Manifest | None:
        """Manifest of a stored context, or None (clean miss; reason in last_miss_reason).
        The expectation (and `identity`, see streaming.identity.check_entry) is checked by
        the server and again here."""
        if isinstance(identity, EntryIdentity):
            identity = identity.to_dict()
        exp = {"model_id": model_id, "weights_hash": weights_hash, "codec_tag": codec_tag,
               "identity": identity}
        f = self._call(FrameType.GET_MANIFEST, {"key": key, "expect": exp})
        if f.type == FrameType.MISS:
            self.last_miss_reason = str(f.meta.get("reason", "miss"))
            return None
        try:
            m = Manifest.from_dict(f.meta["manifest"])
        except (StoreError, KeyError, TypeError) as e:
            self.last_miss_reason = f"server sent an unusable manifest: {e}"
            return None
        why = m.mismatch(model_id, weights_hash, codec_tag, identity) or (None if m.key == key else "wrong key")
        if why:
            self.last_miss_reason = why
            return None
        return m

    def get_chunk(self, key: str, level: int, index: int) -> bytes | None:
        """Bytes of chunk `index` at `level`, or None if absent."""
        f = self._call(FrameType.GET_CHUNK, {"key": key, "level": int(level), "index": int(index)})
        if f.type == FrameType.MISS:
            self.last_miss_reason = str(f.meta.get("reason", "miss"))
            return None
        return bytes(f.body) if isinstance(f.body, bytearray) else f.body

    def put_chunk(self, key: str, level: int, index: int, data: bytes) -> None:
        """Write one chunk without a manifest (low level: put_context commits contexts).
        Used for small index records keyed by their own 64-hex key
        (third_party.vllm.prefix's chunk hash chain). Raises StoreError if refused."""
        self._check_size(len(data))
        self._call(FrameType.PUT_CHUNK, {"key": key, "level": int(level), "index": int(index)},
                   bytes(data))

    def list_contexts(self, limit: int = 10000) -> list[str]:
        return list(self._call(FrameType.LIST, {"limit": limit}).meta.get("keys", []))

    def has(self, key: str) -> bool:
        return bool(self._call(FrameType.HAS, {"key": key}).meta.get("exists"))

    def delete_context(self, key: str) -> None:
        self._call(FrameType.DELETE, {"key": key})

    def put_context(self, model_id: str, weights_hash: str, codec_tag: str, token_ids: Sequence[int],
                    chunks: dict[int, Sequence[bytes]], token_ranges: Sequence[tuple[int, int]],
                    meta: dict | None = None, identity: EntryIdentity | None = None) -> str:
        """Store a context: chunks[level][i] = encoded bytes of chunk i at that level (levels
        in ascending quality), token_ranges[i] = (start, end) of chunk i in token_ids.
        Chunks are sent first, the manifest last (commit). Returns the context key.
        With `identity`, prefer put_entry. Raises ValueError on inconsistent arguments,
        StoreError if the server refuses."""
        key, man = build_manifest(model_id, weights_hash, codec_tag, token_ids, chunks, token_ranges,
                                  meta, identity)
        self._check_size(max(len(c) for lv in man["levels"] for c in chunks[lv]))  # before any write
        for lv in man["levels"]:
            for i, data in enumerate(chunks[lv]):
                self._call(FrameType.PUT_CHUNK, {"key": key, "level": lv, "index": i}, bytes(data))
        self._call(FrameType.PUT_MANIFEST, {"manifest": man})
        return key

    def put_entry(self, identity: EntryIdentity, token_ids: Sequence[int],
                  chunks: dict[int, Sequence[bytes]], token_ranges: Sequence[tuple[int, int]],
                  meta: dict | None = None) -> str:
        """put_context keyed by a full identity (streaming.store.entry_key): the manifest
        records it, readers check it. Raises ValueError for an incomplete identity or
        levels that differ from identity.level_configs."""
        identity.require_complete()
        return self.put_context(identity.model_id, identity.weights_hash, identity.codec_tag(),
                                token_ids, chunks, token_ranges, meta, identity)


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
        "text": [ids[int(a):int(b)] for a, b in token_ranges],
        "meta": dict(meta or {}),
    }
    if identity is not None:
        man["identity"] = identity.to_dict()
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
