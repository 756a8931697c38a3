"""Clients of the KV store: StoreClient (the TCP server's) and LocalStoreClient (in-process).

Paper: CacheGen section 5. Both have the interface that streaming.load.stream_load uses
(streaming.store re-exports these names). Not runnable by itself.
"""

from __future__ import annotations

import os
import socket
from typing import Sequence

from streaming.store.backend import StoreBackend, open_backend
from streaming.errors import (
    StoreError,
    StoreTimeoutError,
    StoreTooLargeError,
    StoreUnavailableError,
    StreamingError,
    store_error,
)
from streaming.identity import EntryIdentity, level_key, parse_level
from streaming.store.protocol import ConnectionClosed, recv_frame, send_frame
from streaming.store.protocol import DEFAULT_MAX_BODY, FrameType
from streaming.store.format import ANY_BASE, Manifest, build_manifest
from streaming.store.kv import KVStore
from streaming.store.kv import run_steps, save_steps


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

    def _lookup(self, ftype: FrameType, meta: dict, gen: str | None = None):
        """_call for a read that may miss: `gen` (a write generation) added to `meta` when
        given; the reply frame, or None on a MISS frame (its reason in last_miss_reason)."""
        if gen is not None:
            meta["gen"] = gen
        f = self._call(ftype, meta)
        if f.type == FrameType.MISS:
            self.last_miss_reason = str(f.meta.get("reason", "miss"))
            return None
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
        f = self._lookup(FrameType.GET_MANIFEST, {"key": key, "expect": exp}, gen)
        if f is None:
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

    def get_chunk(self, key: str, level: int | None, index: int, gen: str | None = None) -> bytes | None:
        """Bytes of chunk `index` at `level` (None: a codec without levels, sent as JSON
        null) of write generation `gen` (a manifest's .gen; None: the current entry's, or a
        raw slot), or None if absent. Raises ValueError for a level that is neither an int
        >= 0 nor None."""
        f = self._lookup(FrameType.GET_CHUNK, {"key": key, "level": parse_level(level), "index": int(index)}, gen)
        if f is None:
            return None
        return bytes(f.body) if isinstance(f.body, bytearray) else f.body

    def put_chunk(self, key: str, level: int | None, index: int, data: bytes, gen: str | None = None) -> None:
        """Write one chunk at `level` (None: a codec without levels) (low level:
        put_context commits contexts). gen None: a raw slot
        without a manifest, used for small index records keyed by their own 64-hex key
        (third_party.vllm.prefix_chain's chunk hash chain). Raises StoreError if refused."""
        self._check_size(len(data))
        meta = {"key": key, "level": parse_level(level), "index": int(index)}
        if gen is not None:
            meta["gen"] = gen
        self._call(FrameType.PUT_CHUNK, meta, bytes(data))

    def current_gen(self, key: str) -> str | None:
        """Write generation of the key's stored manifest (None: none; "": another format)."""
        return self._call(FrameType.HAS, {"key": key, "gen_only": True}).meta.get("gen")

    def put_manifest(self, manifest: dict, base_gen=ANY_BASE) -> None:
        """Publish a manifest (see KVStore.put_manifest). Raises StoreRaceLostError."""
        meta = {"manifest": manifest}
        if base_gen is not ANY_BASE:
            meta.update(base_gen=base_gen, has_base=True)
        self._call(FrameType.PUT_MANIFEST, meta)

    def discard(self, key: str, gen: str, levels, chunk_count: int) -> None:
        self._call(FrameType.DELETE, {"key": key, "gen": gen, "levels": [parse_level(x) for x in levels],
                                      "chunk_count": int(chunk_count)})

    def resolve(self, key: str, gen: str, levels, chunk_count: int) -> bool:
        """Ask the server whether write generation `gen` is published (see
        KVStore.resolve: if not, the server deletes its chunks and a late publish of it is
        refused). Raises StoreError when the server refuses or answers without the field
        (a server that predates the request), StoreUnavailableError when unreachable."""
        f = self._call(FrameType.RESOLVE, {"key": key, "gen": gen, "levels": [parse_level(x) for x in levels],
                                           "chunk_count": int(chunk_count)})
        published = f.meta.get("published")
        if not isinstance(published, bool):
            raise StoreError(f"{self._where} did not say whether generation {gen[:8]} is published")
        return published

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
        f = self._lookup(FrameType.GET_CHUNK, {"cal": h})
        return None if f is None else bytes(f.body)

    def list_contexts(self, limit: int = 10000) -> list[str]:
        return list(self._call(FrameType.LIST, {"limit": limit}).meta.get("keys", []))

    def has(self, key: str) -> bool:
        return bool(self._call(FrameType.HAS, {"key": key}).meta.get("exists"))

    def delete_context(self, key: str) -> None:
        self._call(FrameType.DELETE, {"key": key})

    def put_context(self, model_id: str, weights_hash: str, codec_tag: str, token_ids: Sequence[int],
                    chunks: dict[int | None, Sequence[bytes]], token_ranges: Sequence[tuple[int, int]],
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
                  chunks: dict[int | None, Sequence[bytes]], token_ranges: Sequence[tuple[int, int]],
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

    def get_chunk(self, key: str, level: int | None, index: int, gen: str | None = None) -> bytes | None:
        data = self.store.get_chunk(key, level, index, gen)
        if data is None:
            self.last_miss_reason = f"no chunk {int(index)} at level {level_key(level)}"
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

    def put_chunk(self, key: str, level: int | None, index: int, data: bytes, gen: str | None = None) -> None:
        self.store.put_chunk(key, level, index, data, gen)

    def put_manifest(self, manifest: dict, base_gen=ANY_BASE):
        return self.store.put_manifest(manifest, base_gen)

    def put_calibration(self, h: str, data: bytes) -> None:
        self.store.put_calibration(h, data)

    def discard(self, key: str, gen: str, levels, chunk_count: int) -> None:
        self.store.discard(key, gen, levels, chunk_count)

    def resolve(self, key: str, gen: str, levels, chunk_count: int) -> bool:
        return self.store.resolve(key, gen, levels, chunk_count)

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

