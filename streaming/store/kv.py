"""KVStore: the store logic over a backend, and the crash-safe write steps of one save
(save_steps, run_steps) that every writer shares: KVStore (in-process), StoreClient (over
TCP) and RedisStoreClient (one atomic publish). A save is a generator of steps so that
tests can stop it anywhere to model a crash.

Paper: CacheGen section 5. Entry format in streaming.store.format; guarantees in
streaming.store (which re-exports these names) and docs/streaming.md. Not runnable by itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Sequence

from cachegen_common.bounded_json import JsonBoundsError
from cachegen_common.bounded_json import parse as parse_bounded_json
from streaming.errors import (
    ProtocolError,
    StoreError,
    StoreOutcomeUnknownError,
    StoreRaceLostError,
    StoreUnavailableError,
)
from streaming.identity import EntryIdentity
from streaming.store.backend import StoreBackend
from streaming.store.format import (
    ANY_BASE,
    Manifest,
    cal_key,
    check_gen,
    check_hex_key,
    chunk_digest,
    chunk_key,
    manifest_key,
    parse_gen,
    manifest_gens,
    manifest_json,
    manifest_levels,
    new_generation,
)


logger = logging.getLogger("cachegen.store")


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
        check_hex_key(key)
        return parse_gen(self.backend.get(manifest_key(key)))

    def put_chunk(self, key: str, level: int | None, index: int, data: bytes, gen: str | None = None) -> None:
        """Store one chunk of write generation `gen` (None: the raw slot without a
        manifest, for prefix-index records)."""
        check_hex_key(key)
        if int(index) < 0:
            raise ValueError("chunk index must be >= 0")
        self.backend.put(chunk_key(key, level, index, gen), bytes(data))

    def put_calibration(self, h: str, data: bytes) -> None:
        """Store a calibration artifact under cal/<h> unless present (content-addressed:
        the bytes must hash to h; raises ValueError otherwise)."""
        k = cal_key(h)
        if hashlib.sha256(bytes(data)).hexdigest() != h and not _cal_named(data, h):
            raise ValueError(f"calibration bytes do not carry hash {h[:16]}")
        if not self.backend.exists(k):
            self.backend.put(k, bytes(data))

    def get_calibration(self, h: str) -> bytes | None:
        return self.backend.get(cal_key(h))

    def has_calibration(self, h: str) -> bool:
        return self.backend.exists(cal_key(h))

    def put_manifest(self, manifest: dict, base_gen=ANY_BASE) -> Manifest:
        """Verify every chunk of the manifest's generation (present, size, CRC, sha256)
        and its calibrations, then publish the manifest atomically if the key's manifest
        is still at `base_gen` (what the writer read with current_gen before its first
        write; None = no entry). Raises StoreError if anything is missing or differs,
        StoreRaceLostError if another writer published first (nothing of this write is
        visible then). The entry it replaces keeps its chunks until the next overwrite."""
        m = Manifest.from_dict(manifest)
        for lv in m.levels:
            for i in range(m.chunk_count):
                data = self.backend.get(chunk_key(m.key, lv, i, m.gen))
                if data is None:
                    raise StoreError(f"chunk {i} level {lv} missing: {self._loss_cause()}")
                if chunk_digest(data) != (m.sizes[lv][i], m.crc32[lv][i], m.sha256[lv][i]):
                    raise StoreError(f"chunk {i} level {lv} differs from the manifest (size/CRC/sha256)")
        for h in m.calibrations:
            if not self.backend.exists(cal_key(h)):
                raise StoreError(f"calibration {h[:16]} missing: put it before the manifest")
        mk = manifest_key(m.key)
        for _ in range(100):  # retried only when a no-race publish (base ANY_BASE) sees a change
            cur = self.backend.get(mk)
            cur_gen = parse_gen(cur)
            # a key whose manifest is gone (evicted, dropped, deleted) has no entry to keep:
            # publishing over nothing never hides another writer's complete entry
            if base_gen is not ANY_BASE and cur_gen != base_gen and cur is not None:
                raise StoreRaceLostError(
                    f"another writer published key {m.key[:16]} first (its generation "
                    f"{str(cur_gen)[:8] or '-'}, this writer read {str(base_gen)[:8] or '-'}): "
                    "the store keeps the other complete entry")
            d = m.to_dict()
            prev_of_cur = None
            if cur is not None:
                try:
                    old = manifest_json(cur)
                    d["prev"] = {"gen": check_gen(old["gen"]), "levels": manifest_levels(old["levels"]),
                                 "chunk_count": int(old["chunk_count"])}
                    prev_of_cur = old.get("prev")
                except (StoreError, ValueError, KeyError, TypeError, AttributeError):
                    d["prev"] = None
            else:
                d["prev"] = None
            blob = json.dumps(d).encode("utf-8")
            self.backend.put(manifest_key(m.key, m.gen), blob)  # the generation's own copy
            if self._cas(mk, cur, blob):
                break
            if base_gen is not ANY_BASE:
                raise StoreRaceLostError(f"another writer published key {m.key[:16]} first")
        else:
            raise StoreError(f"could not publish key {m.key[:16]}: the manifest kept changing")
        if isinstance(prev_of_cur, dict):  # two generations back: no reader plans from it now
            try:
                self.discard(m.key, check_gen(prev_of_cur["gen"]), prev_of_cur["levels"],
                             int(prev_of_cur["chunk_count"]))
            except (ValueError, KeyError, TypeError, StoreError, OSError) as e:
                logger.warning("store: could not delete old chunks of %s: %s", m.key[:16], e)
        return Manifest.from_dict(d)

    def _eviction(self) -> str:
        """The backend's eviction, named with the fix, when it evicts keys (a Redis under
        an allkeys-* policy: RedisBackend.eviction_note), else ""."""
        note = getattr(self.backend, "eviction_note", None)
        return note() if note is not None else ""

    def _loss_cause(self) -> str:
        """Why a chunk a writer put is gone: evicted (the backend's eviction named), else
        the caller's order of steps."""
        evicts = self._eviction()
        return f"evicted: {evicts}" if evicts else "put chunks before the manifest"

    def resolve(self, key: str, gen: str, levels, chunk_count: int) -> bool:
        """Settle a save whose outcome its writer does not know (the reply to its publish,
        or to a chunk, was lost or late): True when write generation `gen` is published -
        the key's entry, or the entry that replaced it names it as its previous one (a
        reader may still plan from it) - and nothing is touched; False when it is not,
        and then its chunks are deleted, so a publish of it that arrives later finds them
        missing and is refused. Callers that serve several writers run it under the same
        lock as put_manifest (KVStoreServer does). Raises ValueError for a malformed key
        or generation."""
        check_hex_key(key)
        check_gen(gen)
        if gen in manifest_gens(self.backend.get(manifest_key(key))):
            return True
        self.discard(key, gen, levels, chunk_count)
        return False

    def discard(self, key: str, gen: str, levels, chunk_count: int) -> None:
        """Delete the chunks of one write generation (a loser's, a failed writer's, or an
        entry two overwrites back). Never touches a published manifest."""
        check_hex_key(key)
        self.backend.delete(manifest_key(key, gen))
        for lv in levels:
            for i in range(int(chunk_count)):
                self.backend.delete(chunk_key(key, lv, i, gen))

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
            check_hex_key(key)
            if gen is not None:
                check_gen(gen)
        except ValueError as e:
            return None, str(e)
        raw = self.backend.get(manifest_key(key, gen))
        if raw is None:
            return None, "unknown key" if gen is None else \
                f"generation {gen[:8]} gone (the entry was replaced since it was planned)"
        try:
            m = Manifest.from_dict(manifest_json(raw))
        except StoreError as e:
            return None, f"stored manifest unusable: {e}"
        if m.key != key:
            return None, "stored manifest belongs to another key"
        why = m.mismatch(model_id, weights_hash, codec_tag, identity)
        if why:
            return None, why
        if verify:
            keys = m.chunk_keys()
            have = self._count_existing(keys + [manifest_key(key, m.gen)])  # + the copy a load reads
            cal_missing = [h for h in m.calibrations if not self.backend.exists(cal_key(h))]
            if have < len(keys) + 1 or cal_missing:
                chunks_have = self._count_existing(keys) if have < len(keys) + 1 else len(keys)
                if chunks_have < len(keys):
                    evicts = self._eviction()
                    why = (f"entry incomplete: {len(keys) - chunks_have} of {len(keys)} chunks "
                           f"missing (evicted or deleted{'; ' + evicts if evicts else ''})")
                elif cal_missing:
                    why = (f"entry incomplete: calibration {cal_missing[0][:16]} missing "
                           "(evicted or deleted)")
                else:
                    why = "entry incomplete: its generation's manifest copy is missing (evicted or deleted)"
                self._drop(key, raw, why)  # the published manifest only if it is these bytes
                return None, why + "; entry dropped"
        return m, ""

    def _drop(self, key: str, raw: bytes, why: str) -> bool:
        dropped = self._cas(manifest_key(key), raw, None)
        if dropped:
            logger.warning("store: dropped entry %s: %s", key[:16], why)
        return dropped

    def invalidate(self, key: str, gen: str, reason: str) -> bool:
        """Drop the key's entry if it is still generation `gen` (a reader found one of its
        chunks missing or failing its checksum): later lookups miss instead of failing
        forever; a newer entry is never touched. Returns True if dropped."""
        check_hex_key(key)
        raw = self.backend.get(manifest_key(key))
        if raw is None or parse_gen(raw) != gen:
            return False
        return self._drop(key, raw, reason)

    def get_chunk(self, key: str, level: int | None, index: int, gen: str | None = None) -> bytes | None:
        """Chunk bytes of generation `gen` at `level` (None: a codec without levels), or None. gen None: the raw slot (index
        records), else the chunk of the key's current entry."""
        check_hex_key(key)
        if gen is None:
            data = self.backend.get(chunk_key(key, level, index))
            if data is not None:
                return data
            gen = parse_gen(self.backend.get(manifest_key(key)))
            if not gen:
                return None
        return self.backend.get(chunk_key(key, level, index, gen))

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
        check_hex_key(key)
        self.backend.delete(manifest_key(key))  # invisible first, then the chunks
        for k in list(self.backend.keys(f"ctx/{key}/")):
            self.backend.delete(k)

    # ------------------------------------------------------------------ whole saves
    def save_steps(self, man: dict, chunks: dict[int | None, Sequence[bytes]],
                   calibrations: dict[str, bytes] | None = None):
        """The steps of one save, as a generator (tests stop it anywhere to model a
        crash): see save_steps()."""
        return save_steps(self, man, chunks, calibrations)


def _cal_named(data: bytes, h: str) -> bool:
    """True when `data` is a safetensors artifact whose metadata records hash `h` (the
    codec's content hash is over the parameters, not the file bytes; the reader verifies
    it again with codec.artifacts.load_artifact before any use)."""
    try:
        n = int.from_bytes(bytes(data[:8]), "little")
        if not 0 < n <= min(len(data) - 8, 1 << 24):
            return False
        head = parse_bounded_json(data[8:8 + n], what="calibration artifact header", max_bytes=n, expect=dict)
        return (head.get("__metadata__") or {}).get("hash") == h
    except (JsonBoundsError, AttributeError):
        return False


logger = logging.getLogger("cachegen.store")

SETTLE_TRIES = 3  # questions a writer asks after a lost reply: one more lost reply or one
# broken connection is survived; a store that stays silent this long is down (outcome unknown)
OUTCOME_UNKNOWN = (StoreUnavailableError, ProtocolError, OSError)  # the request may have been
# carried out: a lost connection, a timeout, a garbled reply (a refusal is a definite answer)


def _prev_of(raw: bytes | None) -> dict | None:
    """{"gen", "levels", "chunk_count"} of a stored manifest's bytes (None if unusable)."""
    if raw is None:
        return None
    try:
        old = manifest_json(raw)
        return {"gen": check_gen(old["gen"]), "levels": manifest_levels(old["levels"]),
                "chunk_count": int(old["chunk_count"])}
    except (StoreError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_steps(ops, man: dict, chunks: dict[int | None, Sequence[bytes]],
               calibrations: dict[str, bytes] | None = None):
    """Generator of the write steps of one save through `ops`. Yields after each step:
    ("base", gen read), ("cal", hash) per calibration, then either ("chunk", level, index)
    per chunk and ("manifest", key) (a KVStore or StoreClient: current_gen,
    put_calibration, put_chunk(..., gen), put_manifest(man, base_gen), discard), or one
    ("manifest", key) when `ops` publishes chunks and manifest in one atomic step
    (RedisStoreClient.publish_atomic: a Lua script). A generator stopped at any point (a
    crash) leaves nothing visible: at most chunks of a fresh generation that no manifest
    names. A refused write or publish (StoreRaceLostError, StoreError: a definite answer)
    deletes this save's chunks and re-raises. A write whose outcome is unknown (a lost or
    late reply: StoreUnavailableError, StoreTimeoutError, OSError, ProtocolError) deletes
    nothing until the writer has asked the store (`ops.resolve`, up to SETTLE_TRIES
    times): published - the save succeeds; not published - its chunks are gone and the
    error is re-raised, saying so; no answer - StoreOutcomeUnknownError, nothing
    deleted. An overwrite's previous entry is only ever replaced by a published one."""
    key = man["key"]
    atomic = getattr(ops, "publish_atomic", None)
    if atomic is not None:
        base_raw = ops.manifest_raw(key)
        base = parse_gen(base_raw)
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
    try:
        for lv in man["levels"]:
            for i, data in enumerate(chunks[lv]):
                ops.put_chunk(key, lv, i, bytes(data), gen=gen)
                yield ("chunk", lv, i)
        ops.put_manifest(man, base_gen=base)
    except OUTCOME_UNKNOWN as e:
        settle(getattr(ops, "resolve", None), key, gen, man["levels"], man["chunk_count"], e)  # if published
    except StoreError:
        try:
            ops.discard(key, gen, man["levels"], man["chunk_count"])
        except (StoreError, OSError, ValueError):
            pass
        raise
    yield ("manifest", key)


def settle(resolve, key: str, gen: str, levels, chunk_count: int, err: BaseException) -> None:
    """After `err` (an OUTCOME_UNKNOWN failure of a write of generation `gen`), ask the
    store whether `gen` is published: resolve(key, gen, levels, chunk_count) -> bool (e.g.
    KVStore.resolve, StoreClient.resolve), up to SETTLE_TRIES times. Returns when it is
    (the save succeeded after all); raises `err`'s class with the answer in the message when
    it is not (the store kept nothing of it); raises StoreOutcomeUnknownError (nothing
    deleted) when the store never answers or cannot answer, or `resolve` is None."""
    last: BaseException = err
    for _ in range(SETTLE_TRIES if resolve is not None else 0):
        try:
            published = resolve(key, gen, levels, chunk_count)
        except (*OUTCOME_UNKNOWN, StoreError) as e:  # an old server refuses the question too
            last = e
            continue
        if published:
            logger.info("store: reply lost while saving %s, but generation %s is published: saved",
                        key[:16], gen[:8])
            return
        msg = (f"{err}; asked the store: generation {gen[:8]} of key {key[:16]} is not published "
               "and nothing of it is kept; the key's previous entry (if any) is unchanged")
        raise (type(err)(msg) if isinstance(err, StoreError) else StoreUnavailableError(msg)) from None
    raise StoreOutcomeUnknownError(
        f"{err}; whether generation {gen[:8]} of key {key[:16]} was published is unknown (asking "
        f"the store failed: {last}): nothing of it was deleted; look the key up or save again "
        "once the store answers") from None


def _prev_of_prev(raw: bytes | None) -> dict | None:
    """The "prev" record ({"gen", "levels", "chunk_count"}) of a stored manifest's bytes:
    the generation two saves back once a new save replaces this one (None if none)."""
    if raw is None:
        return None
    try:
        prev = manifest_json(raw).get("prev")
        if not prev:
            return None
        return {"gen": check_gen(prev["gen"]), "levels": manifest_levels(prev["levels"]),
                "chunk_count": int(prev["chunk_count"])}
    except (StoreError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _calibration_bytes(h: str) -> bytes:
    """The artifact bytes of calibration `h` from the codec (``codec.artifacts``: its
    registry or cache folder). Raises StoreError when this writer does not have it."""
    try:
        from codec.artifacts import artifact_bytes
    except ImportError as e:
        raise StoreError(f"calibration {h[:16]} named by the entry: codec unavailable ({e})") from None
    try:
        return artifact_bytes(h)
    except ValueError as e:  # codec.CodecError is a ValueError
        raise StoreError(f"calibration {h[:16]} named by the entry is not available to the "
                         f"writer: {e}") from None


def run_steps(steps) -> None:
    for _ in steps:
        pass
