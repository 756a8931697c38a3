"""LocalDirSource ("local"): a context's KV from a local folder, and save_local_context.

Part of third_party.vllm.sources (whose face forwards the public names here): the folder layout,
the crash-safe save steps (local_save_steps) and the reader. No vLLM import. Not runnable
by itself.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from cachegen_common.bounded_json import parse as parse_bounded_json
from streaming.store.context_keys import key_file_name
from streaming.identity import EntryIdentity, check_entry, codec_identity
from streaming.store.format import MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH
from third_party.vllm.sources.base import (
    ChunkSink,
    DecodeFn,
    LoadStats,
    Lookup,
    SourceError,
    SourceMiss,
    identity_miss_lookup,
    matched_tokens,
    window_checked,
    default_decode_fn,
    encode_for_save,
    expected_identity,
    lookup_subject,
)

logger = logging.getLogger("cachegen.sources")


# --------------------------------------------------------------------------- local folder
MANIFEST = "manifest.json"
LOCAL_FORMAT = 2          # manifest "version": 2 = generations + per-chunk sha256
CAL_DIR = ".cal"          # <root>/.cal/<hash>.safetensors: calibrations the entries need


def _gen_dir(d: Path, gen: str) -> Path:
    if not isinstance(gen, str) or not gen or any(c not in "0123456789abcdef" for c in gen):
        raise SourceError(f"bad generation {str(gen)[:40]!r} in the manifest of {d}")
    return d / f"g-{gen}"


def _fsync_write(p: Path, data: bytes) -> None:
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _local_calibration_bytes(h: str, calibrations: dict[str, bytes] | None) -> bytes:
    """The artifact bytes of calibration ``h``: from ``calibrations`` (the caller's), else
    from the codec (registry or cache folder). Raises StoreError when this writer does
    not have it (the store path's error for the same case)."""
    if calibrations and h in calibrations:
        return calibrations[h]
    from streaming.errors import StoreError

    try:
        from codec.kvtc import calibration_bytes
    except ImportError as e:
        raise StoreError(f"calibration {h[:16]} named by the entry: codec unavailable ({e})") from None
    try:
        return calibration_bytes(h)
    except ValueError as e:  # codec.CodecError is a ValueError
        raise StoreError(f"calibration {h[:16]} named by the entry is not available to the "
                         f"writer: {e}") from None


def local_save_steps(root: str | os.PathLike, context_key: str, token_ids: list[int],
                     chunks: list[bytes], chunk_tokens: list[int],
                     info: dict[str, Any] | None = None, identity: EntryIdentity | None = None,
                     calibrations: dict[str, bytes] | None = None):
    """The write steps of save_local_context as a generator (tests stop it anywhere to
    model a crash). Yields ("base", gen read), ("cal", hash), ("chunk", i) per chunk,
    ("manifest", folder). Layout: <root>/<name>/g-<gen>/chunk_<i>.bin and a copy of the
    manifest there (immutable), then <root>/<name>/manifest.json published last by
    rename under an exclusive flock of <root>/<name>/.lock, only if the key still holds
    the generation read first (else streaming.errors.StoreRaceLostError, and this save's
    folder is removed). The entry two saves back is deleted (one overwrite of grace for
    readers that planned from the previous one). <name> is
    streaming.store.context_keys.key_file_name(context_key, identity.partition): the key itself
    when short and unpartitioned, else a hash (the manifest records the key)."""
    import fcntl
    import hashlib
    import secrets
    import shutil

    from streaming.errors import StoreRaceLostError

    name = key_file_name(context_key, identity.partition if identity is not None else "")
    if len(chunks) != len(chunk_tokens) or sum(chunk_tokens) != len(token_ids):
        raise ValueError(
            f"{len(chunks)} chunks, chunk_tokens sum {sum(chunk_tokens)}, "
            f"{len(token_ids)} token ids: must agree"
        )
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    base = _read_local_manifest(d / MANIFEST)
    base_gen = None if base is None else str(base.get("gen") or "")
    gen = secrets.token_hex(16)
    yield ("base", base_gen)
    cals = list(identity.calibration_hashes()) if identity is not None else []
    for h in cals:
        cdir = Path(root) / CAL_DIR
        cdir.mkdir(exist_ok=True)
        dst = cdir / f"{h}.safetensors"
        if not dst.is_file():
            tmp = cdir / f".tmp-{secrets.token_hex(8)}"
            _fsync_write(tmp, _local_calibration_bytes(h, calibrations))
            os.replace(tmp, dst)
        yield ("cal", h)
    g = _gen_dir(d, gen)
    g.mkdir()
    for i, data in enumerate(chunks):
        _fsync_write(g / f"chunk_{i}.bin", bytes(data))
        yield ("chunk", i)
    man = {
        "version": LOCAL_FORMAT,
        "gen": gen,
        "context_key": context_key,
        "num_tokens": len(token_ids),
        "chunk_tokens": [int(t) for t in chunk_tokens],
        "sizes": [len(c) for c in chunks],
        "sha256": [hashlib.sha256(bytes(c)).hexdigest() for c in chunks],
        "token_ids": [int(t) for t in token_ids],
        "calibrations": cals,
        "info": dict(info or {}),
    }
    if identity is not None:
        man["identity"] = identity.to_dict()
    blob = json.dumps(man).encode()
    _fsync_write(g / MANIFEST, blob)          # the immutable copy a load plans from
    fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        cur = _read_local_manifest(d / MANIFEST)
        cur_gen = None if cur is None else str(cur.get("gen") or "")
        if cur_gen != base_gen and cur is not None:  # (a deleted entry has nothing to keep)
            shutil.rmtree(g, ignore_errors=True)
            raise StoreRaceLostError(f"another writer published {context_key!r} first: the "
                                     "folder keeps the other complete entry")
        old = (cur or {}).get("prev")
        man["prev"] = cur_gen or None
        tmp = d / f".{MANIFEST}.tmp-{gen}"
        _fsync_write(tmp, json.dumps(man).encode())
        os.replace(tmp, d / MANIFEST)
    finally:
        os.close(fd)
    if isinstance(old, str) and old and old != gen:
        shutil.rmtree(_gen_dir(d, old), ignore_errors=True)
    yield ("manifest", d)


def _parse_manifest_file(p: Path):
    """The JSON value of the manifest file at p, read and parsed within the store's manifest
    bounds (size, nesting): the folder may be shared, its files are untrusted. Raises
    FileNotFoundError / OSError, or JsonBoundsError (a ValueError) with one line."""
    with open(p, "rb") as fh:
        raw = fh.read(MAX_MANIFEST_BYTES + 1)
    return parse_bounded_json(raw, what=f"manifest {p}", max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_MANIFEST_DEPTH)


def _ints(x, n: int | None = None) -> bool:
    return isinstance(x, list) and (n is None or len(x) == n) and all(type(t) is int and t >= 0 for t in x)


def _manifest_fields_problem(man: dict) -> str | None:
    """Why a parsed local manifest's fields have the wrong types or disagree (None when
    they are usable): chunk_tokens, sizes (ints >= 0, one per chunk), sha256 (str per
    chunk), num_tokens (int) and as many token_ids (ints), gen (str), info and identity
    (objects), calibrations (list)."""
    ct = man.get("chunk_tokens")
    if not _ints(ct) or not ct or 0 in ct:
        return "chunk_tokens is not a list of positive integers"
    if not _ints(man.get("sizes"), len(ct)):
        return "sizes is not one integer per chunk"
    sha = man.get("sha256")
    if not isinstance(sha, list) or len(sha) != len(ct) or not all(isinstance(h, str) for h in sha):
        return "sha256 is not one string per chunk"
    n = man.get("num_tokens")
    if type(n) is not int or not _ints(man.get("token_ids"), n):
        return "num_tokens and token_ids disagree"
    if not isinstance(man.get("gen"), str) or not isinstance(man.get("info", {}), dict):
        return "gen or info has the wrong type"
    if not isinstance(man.get("identity", {}), (dict, type(None))):
        return "identity is not an object"
    if not isinstance(man.get("calibrations", []), list):
        return "calibrations is not a list"
    return None


def _read_local_manifest(p: Path) -> dict | None:
    """The JSON manifest at p (None when absent; {} when unreadable)."""
    try:
        m = _parse_manifest_file(p)
        return m if isinstance(m, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def save_local_context(
    root: str | os.PathLike,
    context_key: str,
    token_ids: list[int],
    chunks: list[bytes],
    chunk_tokens: list[int],
    info: dict[str, Any] | None = None,
    identity: EntryIdentity | None = None,
    calibrations: dict[str, bytes] | None = None,
) -> Path:
    """Write encoded chunks of one context for LocalDirSource; returns its folder.

    token_ids: the context's token ids (len == sum(chunk_tokens)); chunks: encoded bytes,
    one per chunk, in token order (e.g. `codec.encode_chunks(k, v, codec="raw")`).
    Entries are immutable: the chunks go to a fresh generation folder, the manifest (per
    chunk size and sha256) is published last, atomically, so a reader never sees a
    half-written or mixed context whatever the writer's crash point (local_save_steps).
    `identity` (streaming.identity.EntryIdentity of the model and codec config that made
    the chunks) is recorded; LocalDirSource serves the entry only to a matching reader; a
    calibration it names is stored under <root>/.cal/ (bytes from `calibrations` or the
    codec). The folder is <root>/key_file_name(context_key, identity.partition). Raises
    ValueError (one line) on inconsistent lengths or a key that is not a plain name of at
    most streaming.store.context_keys.MAX_KEY_CHARS characters,
    streaming.errors.StoreRaceLostError when another writer published the key first.
    """
    out = None
    for step in local_save_steps(root, context_key, token_ids, chunks, chunk_tokens, info,
                                 identity, calibrations):
        if step[0] == "manifest":
            out = step[1]
    return out


def _invalidate_local(d: Path, gen: str | None, why: str) -> None:
    """Unpublish a local entry whose chunk file is missing or corrupt, if manifest.json
    still names generation `gen` (under the folder's lock): later lookups miss instead of
    failing every load. Best effort."""
    import fcntl

    try:
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        cur = _read_local_manifest(d / MANIFEST)
        if cur and gen and cur.get("gen") == gen:
            os.unlink(d / MANIFEST)
            logger.warning("local source: dropped entry %s: %s", d.name, why)
    except OSError:
        pass
    finally:
        os.close(fd)


def header_range(data: bytes) -> tuple[int, int] | None:
    """(token_offset, T) from a codec container's header (header only, no CRC or arrays
    read: codec.bitstream.peek_header), or None for bytes that are not a codec container
    (stand-in chunks of tests)."""
    try:
        from codec.bitstream import peek_header

        h = peek_header(data)
        off, t = h.get("token_offset"), h.get("T")
    except (ImportError, ValueError):
        return None
    if isinstance(off, int) and isinstance(t, int) and not isinstance(off, bool):
        return off, t
    return None


def calibration_of(chunks: list[bytes]) -> str:
    """The calibration hash the first encoded chunk names in its header (kvtc's
    ``config.calibration``), "" when none (or the bytes are not a codec container)."""
    if not chunks:
        return ""
    try:
        import codec

        cfg = codec.peek_header(chunks[0]).get("config") or {}
    except (ImportError, ValueError):
        return ""
    h = cfg.get("calibration") if isinstance(cfg, dict) else None
    return str(h) if isinstance(h, str) else ""


class _LocalCalClient:
    """ensure_calibrations' view of a LocalDirSource root: get_calibration(h) reads
    <root>/.cal/<h>.safetensors."""

    def __init__(self, root: Path):
        self.root, self.last_miss_reason = root, ""

    def get_calibration(self, h: str) -> bytes | None:
        try:
            return (self.root / CAL_DIR / f"{h}.safetensors").read_bytes()
        except OSError as e:
            self.last_miss_reason = f"not in {self.root / CAL_DIR} ({e.strerror or e})"
            return None


class LocalDirSource:
    """KV chunks from a local folder (see save_local_context). params: {"context_key"}.

    root: the folder (operator configuration; a request cannot override it).
    identity: the reader's own model identity (the connector sets it from its model
    config); an entry whose recorded identity differs (streaming.identity.check_entry),
    or that records none while the reader knows its model, is a miss with the reason.
    max_key_chars: the operator's key bound (None: streaming.store.context_keys.MAX_KEY_CHARS),
    the same the trust check applies. params "cache_partition" (set by the connector from
    the request's cache_salt / LoRA, never by a client) selects the partition's folder.
    """

    name = "local"

    def __init__(self, root: str | os.PathLike | None, decode_fn: DecodeFn | None = None,
                 identity: EntryIdentity | None = None, max_key_chars: int | None = None):
        self.root = Path(root) if root else None
        self._decode_fn = decode_fn
        self.identity = identity
        self.max_key_chars = max_key_chars

    def _dir(self, params: dict[str, Any]) -> Path:
        """<root>/key_file_name(context_key, partition). The root is the operator's
        (constructor), never a request's (a client must not name server paths); the key
        must be a plain name within the key bound (third_party.vllm.trust.check_key) and
        the folder must resolve inside the root. Raises SourceError."""
        from third_party.vllm.trust import RequestRejected, check_key

        root, key = self.root, params.get("context_key")
        if not root or not key:
            raise SourceError("local source needs a root folder (extra config 'source_dir') "
                              "and a 'context_key'")
        try:
            key = check_key(key, self.max_key_chars)
        except RequestRejected as e:
            raise SourceError(str(e)) from None
        d = Path(root) / key_file_name(key, str(params.get("cache_partition") or ""))
        if Path(os.path.realpath(d)).parent != Path(os.path.realpath(root)):
            raise SourceError(f"context folder {key!r} resolves outside the source root")
        return d

    def lookup(self, params: dict[str, Any], prompt_token_ids: list[int]) -> Lookup:
        t0 = time.perf_counter()
        d = self._dir(params)
        try:
            man = _parse_manifest_file(d / MANIFEST)
        except FileNotFoundError:
            return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": "no manifest"})
        except (OSError, ValueError) as e:
            raise SourceError(f"unreadable manifest in {d}: {e}") from e
        if not isinstance(man, dict) or man.get("version") != LOCAL_FORMAT:
            why = (f"entry in the previous format (version {man.get('version') if isinstance(man, dict) else '?'}: "
                   "chunks written in place, no checksums): not served; save it again")
            logger.warning("local source: miss for %s: %s", lookup_subject(params), why)
            return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": why})
        bad = _manifest_fields_problem(man)
        if bad:
            return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": f"manifest unusable: {bad}"})
        if man.get("context_key", params.get("context_key")) != params.get("context_key"):
            return Lookup(0, lookup_s=time.perf_counter() - t0,
                          info={"miss": "the folder holds another context key"})
        try:
            g = _gen_dir(d, man.get("gen"))
            n_files = len(man["chunk_tokens"])
            missing = [i for i in range(n_files) if not (g / f"chunk_{i}.bin").is_file()]
        except (SourceError, KeyError, TypeError) as e:
            return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": f"manifest unusable: {e}"})
        if missing:
            why = f"entry incomplete: {len(missing)} of {n_files} chunk files missing (deleted)"
            logger.warning("local source: miss for %s: %s", lookup_subject(params), why)
            return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": why})
        try:
            why = check_entry(expected_identity(self.identity, params), man.get("identity"))
        except ValueError as e:
            why = str(e)
        if why:
            return identity_miss_lookup("local", params, why, t0)
        n = int(man.get("num_tokens", 0))
        n_match = matched_tokens(params, prompt_token_ids, man.get("token_ids"), n)
        if n_match <= 0:
            return Lookup(0, lookup_s=time.perf_counter() - t0,
                          info={"miss": "stored token ids differ from the prompt"})
        n_match, winfo = window_checked(man.get("identity"), n_match, n, {})
        if n_match <= 0:
            return Lookup(0, lookup_s=time.perf_counter() - t0, info=winfo)
        return Lookup(n_match, [int(t) for t in man["chunk_tokens"]],
                      time.perf_counter() - t0, {"key": params.get("context_key"), **man.get("info", {}),
                                                 "gen": man["gen"], **winfo})

    def save(self, params: dict[str, Any], token_ids: list[int], k, v) -> dict[str, Any]:
        """Encode and write one context (params: source_dir, context_key, codec, level,
        chunk_tokens). Returns {"encode_s", "put_s", "bytes", "context_key"}."""
        d = self._dir(params)
        chunks, sizes, enc_s = encode_for_save(params, k, v, self.identity)
        ident = codec_identity(expected_identity(self.identity, params), params.get("codec", "raw"),
                               [params.get("level")], calibration_hash=calibration_of(chunks))
        t0 = time.perf_counter()
        save_local_context(d.parent, params["context_key"], token_ids, chunks, sizes,
                           info={"codec": params.get("codec", "raw"), "level": params.get("level"),
                                 **({"operating_point": params["operating_point"]}
                                    if params.get("operating_point") else {})},
                           identity=ident)
        return {"encode_s": enc_s, "put_s": time.perf_counter() - t0,
                "bytes": sum(len(c) for c in chunks), "context_key": params["context_key"]}

    def load(self, params, lookup: Lookup, num_tokens: int, on_chunk: ChunkSink) -> LoadStats:
        """Chunks of the generation the lookup planned from (lookup.info["gen"]: its
        immutable manifest copy), each checked against that manifest (size, sha256) and
        its decoded token count against the plan. Raises SourceMiss (nothing placed)
        when that generation is gone or its calibration is unavailable; SourceError for a
        chunk that fails its check (the chunks before it are placed)."""
        import hashlib

        d = self._dir(params)
        decode = self._decode_fn or default_decode_fn()
        try:
            g = _gen_dir(d, lookup.info.get("gen"))
            man = _parse_manifest_file(g / MANIFEST)
        except (OSError, ValueError) as e:
            raise SourceMiss(f"local entry {d.name!r} replaced since the lookup (its generation "
                             f"is gone: {e})") from None
        bad = _manifest_fields_problem(man) if isinstance(man, dict) else "not a JSON object"
        if bad:
            raise SourceMiss(f"local entry {d.name!r}: planned manifest unusable: {bad}")
        if [int(t) for t in man.get("chunk_tokens", [])] != [int(t) for t in lookup.chunk_tokens]:
            raise SourceMiss(f"local entry {d.name!r}: the planned generation's chunking differs "
                             "from the lookup's plan")
        if man.get("calibrations"):
            from streaming.calibrations import ensure_calibrations

            why = ensure_calibrations(_LocalCalClient(Path(d.parent)), man["calibrations"])
            if why:
                raise SourceMiss(f"local entry {d.name!r}: {why}")
        shas, sizes = man["sha256"], man["sizes"]
        # chunks needed to cover [0, num_tokens)
        needed, acc = [], 0
        for i, t in enumerate(lookup.chunk_tokens):
            if acc >= num_tokens:
                break
            needed.append((i, acc, t))
            acc += t
        st = LoadStats()
        q: queue.Queue = queue.Queue(maxsize=2)  # reader runs at most 2 chunks ahead
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def reader():
            for i, start, t in needed:
                t0 = time.perf_counter()
                try:
                    data = (g / f"chunk_{i}.bin").read_bytes()
                    if len(data) != sizes[i] or hashlib.sha256(data).hexdigest() != shas[i]:
                        raise OSError(f"chunk file differs from its manifest (size/sha256)")
                except OSError as e:
                    put((i, start, t, None, 0.0, e))
                    return
                if not put((i, start, t, data, time.perf_counter() - t0, None)):
                    return

        th = threading.Thread(target=reader, name="kv-local-reader", daemon=True)
        th.start()
        try:
            for _ in needed:
                i, start, t, data, tr_s, err = q.get()
                if err is not None:
                    _invalidate_local(d, lookup.info.get("gen"), f"chunk {i}: {err}")
                    raise SourceError(f"chunk {i}: {err}")
                hr = header_range(data)
                if hr is not None and hr != (start, t):
                    raise SourceError(f"chunk {i}: its header says tokens {hr[0]}..{hr[0] + hr[1]}, "
                                      f"the plan {start}..{start + t}: not placed")
                t0 = time.perf_counter()
                k, v = decode(data)
                dec_s = time.perf_counter() - t0
                if k.shape[1] != t:
                    raise SourceError(f"chunk {i} holds {k.shape[1]} tokens, manifest says {t}")
                on_chunk(start, k, v)
                st.loaded_tokens = min(num_tokens, start + t)
                st.bytes += len(data)
                st.transfer_s += tr_s
                st.decode_s += dec_s
                st.chunks.append({"index": i, "tokens": t, "bytes": len(data),
                                  "transfer_s": tr_s, "decode_s": dec_s})
        finally:
            stop.set()  # a reader blocked on a full queue gives up within 0.1 s
            th.join(timeout=5)
        return st

