"""The crash-safe write steps of one save (save_steps), shared by every writer: KVStore
(in-process), StoreClient (over TCP) and RedisStoreClient (one atomic publish).

A save is a generator of steps so that tests can stop it anywhere to model a crash; the
store logic it drives (KVStore) is in streaming.store_kv, the entry format in
streaming.store_format. Re-exported by streaming.store. Not runnable by itself.
"""

from __future__ import annotations

import json
import logging
from typing import Sequence

from streaming.errors import StoreError
from streaming.store_format import Manifest, _check_gen, _parse_gen, new_generation

logger = logging.getLogger("cachegen.store")


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

