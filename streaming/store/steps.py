"""The crash-safe write steps of one save (save_steps), shared by every writer: KVStore
(in-process), StoreClient (over TCP) and RedisStoreClient (one atomic publish).

A save is a generator of steps so that tests can stop it anywhere to model a crash; the
store logic it drives (KVStore) is in streaming.store.kv, the entry format in
streaming.store.format. Re-exported by streaming.store. Not runnable by itself.
"""

from __future__ import annotations

import logging
from typing import Sequence

from streaming.errors import ProtocolError, StoreError, StoreOutcomeUnknownError, StoreUnavailableError
from streaming.store.format import Manifest, _check_gen, _parse_gen, manifest_json, new_generation

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
        return {"gen": _check_gen(old["gen"]), "levels": [int(x) for x in old["levels"]],
                "chunk_count": int(old["chunk_count"])}
    except (StoreError, ValueError, KeyError, TypeError, AttributeError):
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
        return {"gen": _check_gen(prev["gen"]), "levels": [int(x) for x in prev["levels"]],
                "chunk_count": int(prev["chunk_count"])}
    except (StoreError, ValueError, KeyError, TypeError, AttributeError):
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

