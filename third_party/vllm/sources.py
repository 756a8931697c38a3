"""Where the CacheGen connector gets a context's KV from: KV sources (no vLLM import here).

Purpose: decouple the vLLM glue (cachegen_connector.py) from HOW encoded KV chunks are
obtained. A source answers two questions:
  * scheduler side, `lookup(params, prompt_token_ids)`: how many leading tokens of this
    prompt does the source hold KV for? (no side effects: reads a manifest, nothing else);
  * worker side, `load(params, lookup, num_tokens, on_chunk)`: fetch + decode the chunks that
    cover tokens [0, num_tokens), calling `on_chunk(start, k, v)` for each decoded chunk in
    order (k, v: [L, T, H, D] in the model dtype), and return timing stats.
Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5: the context is split into chunks,
each independently decodable; decoding is pipelined with transfer.

Sources:
  * LocalDirSource ("local"): a folder `<root>/<context_key>/` with `manifest.json` (the
    published entry) and `g-<gen>/chunk_<i>.bin` files of each save's generation (encoded
    by `codec.encode_chunks`; see save_local_context for the guarantees). For tests and
    the demo; disk reads are pipelined with decoding by a reader thread.
  * StoreSource ("store"): our KV store server through `streaming.store.StoreClient`, chunks
    fetched and decoded by `streaming.client.stream_load` (pipelined, adaptive, with text
    fallback). Imported lazily.

Not runnable by itself; see `python -m bench.vllm_demo --help`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from streaming.identity import (
    EntryIdentity,
    check_entry,
    codec_identity,
    folder_tokenizer_hash,
    folder_weights_hash,
    merge_expected,
)

logger = logging.getLogger("cachegen.sources")

# on_chunk(start_token, k [L, T, H, D], v [L, T, H, D]) -> None; raises to abort the load.
ChunkSink = Callable[[int, Any, Any], None]
DecodeFn = Callable[[bytes], tuple[Any, Any]]


class SourceError(RuntimeError):
    """A KV source could not answer (bad parameters, unreadable manifest, lost store)."""


class SourceMiss(SourceError):
    """The entry the lookup planned from cannot be loaded any more (deleted, evicted,
    re-stored with another chunking, a calibration unavailable): a clean miss with the
    reason; nothing was placed."""


@dataclass
class Lookup:
    """Scheduler-side answer of a source for one request.

    num_tokens: tokens of the prompt's prefix whose KV the source holds (0 = miss).
    chunk_tokens: token count of each stored chunk, in order (sum >= num_tokens).
    lookup_s: seconds the lookup took (manifest request over the link included).
    info: small JSON-able facts for the stats record (codec, level, key, reason of a miss).
    """

    num_tokens: int
    chunk_tokens: list[int] = field(default_factory=list)
    lookup_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadStats:
    """Worker-side result of one load (all times in seconds, sizes in bytes).

    loaded_tokens: leading tokens actually delivered to on_chunk (< requested when a chunk
        fell back to text or the load failed; the connector then reports the rest as failed
        blocks so vLLM recomputes them).
    transfer_s / decode_s: summed per-chunk fetch and decode times (they overlap in a
        pipelined load, so they may add up to more than the wall time).
    chunks: per-chunk records {index, tokens, bytes, transfer_s, decode_s, level, ...}.
    """

    loaded_tokens: int = 0
    bytes: int = 0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    chunks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    fallback: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class KVSource(Protocol):
    def lookup(self, params: dict[str, Any], prompt_token_ids: list[int]) -> Lookup: ...

    def load(
        self, params: dict[str, Any], lookup: Lookup, num_tokens: int, on_chunk: ChunkSink
    ) -> LoadStats: ...


def default_decode_fn() -> DecodeFn:
    """`codec.decode_kv` on the CPU (imported lazily so this module imports without codec)."""
    import codec

    def _decode(data: bytes):
        return codec.decode_kv(data, device="cpu")

    return _decode


def load_callable(path: str) -> Callable:
    """Import `module:attr` (e.g. "streaming.store:context_key"). Raises ValueError."""
    mod, sep, attr = str(path).partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {path!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable")
    return fn


def expected_identity(own: EntryIdentity | None, params: dict[str, Any]) -> EntryIdentity:
    """What a stored entry must match for this request: the reader's own model identity
    (`own`, set by the connector from its model config) merged with the request's
    "identity" dict and "model_id" / "weights_hash". Raises ValueError when they conflict
    (the request names another model than the engine's)."""
    req = {k: params[k] for k in ("model_id", "weights_hash") if params.get(k)}
    return merge_expected(own, params.get("identity") or None, req)


def _identity_miss(source: str, params: dict[str, Any], why: str, t0: float) -> "Lookup":
    logger.warning("%s source: miss for context %s: %s", source, params.get("context_key"), why)
    return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": f"identity: {why}"})


def engine_identity(vllm_config: Any, extra: dict[str, Any] | None = None,
                    hash_weights: bool = True) -> EntryIdentity:
    """Model part of the identity of a vLLM engine (duck-typed, no vLLM import): model path
    or name, KV dtype, layers, total KV heads, head size from `vllm_config.model_config`;
    weights hash from extra config "weights_hash", else computed once from the model folder
    (streaming.identity.folder_weights_hash); tokenizer hash from the tokenizer folder;
    model_id only from extra config "model_id" (the name the store writer used);
    hash_weights=False skips hashing (the worker side, which re-checks what the scheduler
    already matched, does not pay for reading the weights again). Fields
    that cannot be read stay unknown ("" / 0) and are logged."""
    extra = extra or {}
    mc = getattr(vllm_config, "model_config", None)
    pc = getattr(vllm_config, "parallel_config", None)
    f: dict[str, Any] = {"model_id": str(extra.get("model_id") or "")}
    try:
        f["dtype"] = str(getattr(mc, "dtype", "") or "").replace("torch.", "")
        total = getattr(mc, "get_total_num_kv_heads", None)
        f["num_kv_heads"] = int(total() if total else mc.get_num_kv_heads(pc))
        layers = getattr(mc, "get_total_num_hidden_layers", None)
        f["num_layers"] = int(layers() if layers else mc.get_num_layers(pc))
        f["head_dim"] = int(mc.get_head_size())
    except Exception as e:  # noqa: BLE001 - an unknown field is checked no further
        logger.warning("connector: cannot read the model shape for identity checks: %s", e)
    folder = Path(str(getattr(mc, "model", "") or ""))
    tok = Path(str(getattr(mc, "tokenizer", "") or folder))
    f["weights_hash"] = str(extra.get("weights_hash") or "")
    try:
        if not f["weights_hash"] and hash_weights and folder.is_dir():
            f["weights_hash"] = folder_weights_hash(folder)
        if tok.is_dir():
            f["tokenizer_hash"] = folder_tokenizer_hash(tok)
    except OSError as e:
        logger.warning("connector: cannot hash the model folder %s: %s", folder, e)
    return EntryIdentity(**f)


def _prefix_match(prompt: list[int], stored: list[int] | None, n: int) -> bool:
    return stored is not None and len(stored) >= n and list(prompt[:n]) == list(stored[:n])


def _matched_tokens(params: dict[str, Any], prompt: list[int], stored: list[int] | None,
                    n_stored: int) -> int:
    """Tokens of the prompt whose stored KV can be used: the whole stored prefix when the
    prompt starts with all of it (or the prompt's length if shorter); with
    params["prefix_match"] also the longest common prefix when they part (the KV of token t
    depends only on tokens <= t); else 0 (a different prompt is a miss, never a wrong load)."""
    from third_party.vllm.prefix import common_prefix

    n = min(n_stored, len(prompt))
    if _prefix_match(prompt, stored, n):
        return n
    if params.get("prefix_match") and stored is not None:
        return min(n, common_prefix(prompt, stored))
    return 0


def _save_config(name: str, identity) -> Any:
    """The codec config a save encodes with: None (the level's preset), or for kvtc a
    KvtcConfig naming the cached default calibration of the engine's model (fitted once by
    `python -m kv_extraction_hf.calibrate --default` or by the first run_benchmarks / bench
    run). SourceError when kvtc has no calibration for this model."""
    if name != "kvtc":
        return None
    from codec.kvtc import KvtcConfig
    from kv_extraction_hf.calibrate import cached_default_calibration

    weights_hash = getattr(identity, "weights_hash", None) if identity is not None else None
    path = cached_default_calibration(weights_hash)
    if path is None:
        raise SourceError("kvtc save needs the model's default calibration: run "
                          "`python -m kv_extraction_hf.calibrate --default` once")
    return KvtcConfig(calibration=str(path))


def encode_for_save(params: dict[str, Any], k, v, identity=None) -> tuple[list[bytes], list[int], float]:
    """Encode k, v [L, T, H, D] with codec.encode_chunks per the save params ("codec",
    default "raw"; "level", default the codec's (codec.resolve_level); "chunk_tokens", default
    codec.DEFAULT_CHUNK_TOKENS) -> (chunks, chunk token counts, encode seconds). kvtc encodes
    with the default calibration of ``identity``'s model (`_save_config`)."""
    import codec

    ct = int(params.get("chunk_tokens") or codec.DEFAULT_CHUNK_TOKENS)
    name = params.get("codec", "raw")
    config = _save_config(name, identity)
    t0 = time.perf_counter()
    chunks = codec.encode_chunks(k, v, codec=name, config=config,
                                 level=params.get("level"), chunk_tokens=ct)
    bounds = codec.chunk_bounds(int(k.shape[1]), ct)
    return chunks, [e - s for s, e in bounds], time.perf_counter() - t0


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
    if calibrations and h in calibrations:
        return calibrations[h]
    from streaming.store import _calibration_bytes

    return _calibration_bytes(h)


def local_save_steps(root: str | os.PathLike, context_key: str, token_ids: list[int],
                     chunks: list[bytes], chunk_tokens: list[int],
                     info: dict[str, Any] | None = None, identity: EntryIdentity | None = None,
                     calibrations: dict[str, bytes] | None = None):
    """The write steps of save_local_context as a generator (tests stop it anywhere to
    model a crash). Yields ("base", gen read), ("cal", hash), ("chunk", i) per chunk,
    ("manifest", folder). Layout: <root>/<key>/g-<gen>/chunk_<i>.bin and a copy of the
    manifest there (immutable), then <root>/<key>/manifest.json published last by
    rename under an exclusive flock of <root>/<key>/.lock, only if the key still holds
    the generation read first (else streaming.errors.StoreRaceLostError, and this save's
    folder is removed). The entry two saves back is deleted (one overwrite of grace for
    readers that planned from the previous one)."""
    import fcntl
    import hashlib
    import secrets
    import shutil

    from streaming.errors import StoreRaceLostError

    if not context_key or "/" in context_key or context_key.startswith("."):
        raise ValueError(f"context key {context_key!r} must be a plain file name")
    if len(chunks) != len(chunk_tokens) or sum(chunk_tokens) != len(token_ids):
        raise ValueError(
            f"{len(chunks)} chunks, chunk_tokens sum {sum(chunk_tokens)}, "
            f"{len(token_ids)} token ids: must agree"
        )
    d = Path(root) / context_key
    d.mkdir(parents=True, exist_ok=True)
    base = _read_local_manifest(d / MANIFEST)
    base_gen = None if base is None else str(base.get("gen") or "")
    gen = secrets.token_hex(16)
    yield ("base", base_gen)
    cals = [identity.calibration_hash] if identity is not None and identity.calibration_hash else []
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


def _read_local_manifest(p: Path) -> dict | None:
    """The JSON manifest at p (None when absent; {} when unreadable)."""
    try:
        m = json.loads(p.read_text())
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
    codec). Raises ValueError on inconsistent lengths or a key that is not a plain name,
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


def _header_range(data: bytes) -> tuple[int, int] | None:
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
    """

    name = "local"

    def __init__(self, root: str | os.PathLike | None, decode_fn: DecodeFn | None = None,
                 identity: EntryIdentity | None = None):
        self.root = Path(root) if root else None
        self._decode_fn = decode_fn
        self.identity = identity

    def _dir(self, params: dict[str, Any]) -> Path:
        """<root>/<context_key>. The root is the operator's (constructor), never a request's
        (issue 17: a client must not name server paths); the key must be a plain name
        (third_party.vllm.trust.check_key) and the folder must resolve inside the root.
        Raises SourceError."""
        from third_party.vllm.trust import RequestRejected, check_key

        root, key = self.root, params.get("context_key")
        if not root or not key:
            raise SourceError("local source needs a root folder (extra config 'source_dir') "
                              "and a 'context_key'")
        try:
            key = check_key(key)
        except RequestRejected as e:
            raise SourceError(str(e)) from None
        d = Path(root) / key
        if Path(os.path.realpath(d)).parent != Path(os.path.realpath(root)):
            raise SourceError(f"context folder {key!r} resolves outside the source root")
        return d

    def lookup(self, params: dict[str, Any], prompt_token_ids: list[int]) -> Lookup:
        t0 = time.perf_counter()
        d = self._dir(params)
        try:
            man = json.loads((d / MANIFEST).read_text())
        except FileNotFoundError:
            return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": "no manifest"})
        except (OSError, ValueError) as e:
            raise SourceError(f"unreadable manifest in {d}: {e}") from e
        if not isinstance(man, dict) or man.get("version") != LOCAL_FORMAT:
            why = (f"entry in the previous format (version {man.get('version') if isinstance(man, dict) else '?'}: "
                   "chunks written in place, no checksums): not served; save it again")
            logger.warning("local source: miss for context %s: %s", params.get("context_key"), why)
            return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": why})
        try:
            g = _gen_dir(d, man.get("gen"))
            n_files = len(man["chunk_tokens"])
            missing = [i for i in range(n_files) if not (g / f"chunk_{i}.bin").is_file()]
        except (SourceError, KeyError, TypeError) as e:
            return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": f"manifest unusable: {e}"})
        if missing:
            why = f"entry incomplete: {len(missing)} of {n_files} chunk files missing (deleted)"
            logger.warning("local source: miss for context %s: %s", params.get("context_key"), why)
            return Lookup(0, lookup_s=time.perf_counter() - t0, info={"miss": why})
        try:
            why = check_entry(expected_identity(self.identity, params), man.get("identity"))
        except ValueError as e:
            why = str(e)
        if why:
            return _identity_miss("local", params, why, t0)
        n = int(man.get("num_tokens", 0))
        n_match = _matched_tokens(params, prompt_token_ids, man.get("token_ids"), n)
        if n_match <= 0:
            return Lookup(0, lookup_s=time.perf_counter() - t0,
                          info={"miss": "stored token ids differ from the prompt"})
        return Lookup(n_match, [int(t) for t in man["chunk_tokens"]],
                      time.perf_counter() - t0, {"key": d.name, **man.get("info", {}),
                                                 "gen": man["gen"]})

    def save(self, params: dict[str, Any], token_ids: list[int], k, v) -> dict[str, Any]:
        """Encode and write one context (params: source_dir, context_key, codec, level,
        chunk_tokens). Returns {"encode_s", "put_s", "bytes", "context_key"}."""
        d = self._dir(params)
        chunks, sizes, enc_s = encode_for_save(params, k, v, self.identity)
        ident = codec_identity(expected_identity(self.identity, params), params.get("codec", "raw"),
                               [params.get("level")], calibration_hash=calibration_of(chunks))
        t0 = time.perf_counter()
        save_local_context(d.parent, d.name, token_ids, chunks, sizes,
                           info={"codec": params.get("codec", "raw"), "level": params.get("level")},
                           identity=ident)
        return {"encode_s": enc_s, "put_s": time.perf_counter() - t0,
                "bytes": sum(len(c) for c in chunks), "context_key": d.name}

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
            man = json.loads((g / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise SourceMiss(f"local entry {d.name!r} replaced since the lookup (its generation "
                             f"is gone: {e})") from None
        if [int(t) for t in man.get("chunk_tokens", [])] != [int(t) for t in lookup.chunk_tokens]:
            raise SourceMiss(f"local entry {d.name!r}: the planned generation's chunking differs "
                             "from the lookup's plan")
        if man.get("calibrations"):
            from streaming.client import ensure_calibrations

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
                hr = _header_range(data)
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


# --------------------------------------------------------------------------- KV store
def _parse_addr(addr: Any) -> tuple[str, int]:
    if isinstance(addr, (list, tuple)) and len(addr) == 2:
        return str(addr[0]), int(addr[1])
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SourceError(f"store address must be 'host:port', got {addr!r}")
    return host, int(port)


class _PrefixPolicy:
    """Wraps a streaming.adapt policy so that nothing is fetched after the first chunk that
    cannot be used: vLLM can only take a KV PREFIX, so once chunk k falls back to text (by
    the policy's choice, a CRC failure or a lost connection) every later chunk is
    recomputed anyway. Also stops at the first chunk not needed for [0, num_tokens)."""

    def __init__(self, inner, needed_chunks: int):
        self.inner = inner
        self.needed = needed_chunks
        self.stopped = False
        self.recompute_s = 0.0

    @property
    def decisions(self):
        return getattr(self.inner, "decisions", [])

    def start(self, manifest) -> None:
        self.inner.start(manifest)

    def choose(self, k: int, elapsed_s: float):
        if self.stopped or k >= self.needed:
            return None
        lv = self.inner.choose(k, elapsed_s)
        if lv is None:
            self.stopped = True
        return lv

    def transfer_deadline_s(self, k: int):
        f = getattr(self.inner, "transfer_deadline_s", None)
        return f(k) if f is not None else None

    def observe_transfer(self, k, level, nbytes, transfer_s, elapsed_end_s=None) -> None:
        if elapsed_end_s is None:  # (an inner policy may take only the older 4 arguments)
            self.inner.observe_transfer(k, level, nbytes, transfer_s)
        else:
            self.inner.observe_transfer(k, level, nbytes, transfer_s, elapsed_end_s)

    def should_abandon(self, k, received_bytes, elapsed_s, wire_bytes=None, wire_s=None) -> bool:
        f = getattr(self.inner, "should_abandon", None)
        if f is None:
            return False
        if wire_bytes is None:  # (an inner policy may take only the older 3 arguments)
            return bool(f(k, received_bytes, elapsed_s))
        return bool(f(k, received_bytes, elapsed_s, wire_bytes=wire_bytes, wire_s=wire_s))

    def observe_abandon(self, k, level, wire_s, received_bytes=None) -> None:
        if hasattr(self.inner, "observe_abandon"):
            if received_bytes is None:
                self.inner.observe_abandon(k, level, wire_s)
            else:
                self.inner.observe_abandon(k, level, wire_s, received_bytes)

    def observe_text(self, k) -> None:
        if hasattr(self.inner, "observe_text") and not self.stopped and k < self.needed:
            self.inner.observe_text(k)

    def observe_decode(self, k, decode_s) -> None:
        self.inner.observe_decode(k, decode_s)


def default_stored_level(codec_name: str | None, levels) -> int:
    """The level a request without "level" fetches: the codec's own default
    (codec.default_level, the same default as codec and harness) when the entry stores it,
    else the highest stored level (codecs without levels are stored under level 0)."""
    import codec

    levels = [int(x) for x in levels] or [0]
    if codec_name in codec.CODECS:
        d = codec.default_level(codec_name)
        if d is not None and d in levels:
            return d
    return max(levels)


class StoreSource:
    """KV chunks from our KV store server (streaming.store) through the (shaped) link.

    params (per request, from kv_transfer_params; engine defaults fill the gaps):
      store: "host:port"; context_key: 64-hex key (streaming.store.context_key);
      level: stored quality level to fetch (default: the codec's default level,
        codec.default_level, when stored, else the highest stored), or a per-chunk
        list of levels with None = text fallback (experiments, tests);
      policy: {"slo_s", "prefill_tokens_per_s", "initial_throughput_mbps", ...} -> an
        streaming.adapt.AdaptivePolicy (per-chunk level or text fallback) instead of `level`;
      model_id / weights_hash / codec_tag: optional expectation checked against the manifest;
      identity: optional streaming.identity.EntryIdentity dict (the HF engine path gives the
        full identity it stored with), merged with the source's own `identity` (the
        connector's model); any mismatch is a miss with the reason, never data.
    The scheduler-side lookup reads the manifest (one round trip over the link) and checks
    that the stored token ids equal the prompt's prefix. The worker-side load runs
    streaming.client.stream_load (receiver thread fetching chunk k+1 while chunk k is decoded
    and injected in the calling thread).
    """

    name = "store"

    def __init__(self, decode_fn: DecodeFn | None = None, timeout_s: float = 30.0,
                 identity: EntryIdentity | None = None):
        self._decode_fn = decode_fn
        self.timeout_s = timeout_s
        self._clients: dict[tuple[str, int], Any] = {}
        self.identity = identity

    def _client(self, params):
        from streaming.store import StoreClient

        addr = _parse_addr(params.get("store"))
        c = self._clients.get(addr)
        if c is None:
            c = StoreClient(addr[0], addr[1], timeout=self.timeout_s)
            self._clients[addr] = c
        return c

    def _expect(self, params) -> dict[str, Any]:
        """Keyword expectation for get_manifest / stream_load. Raises ValueError when the
        request's identity conflicts with the source's own."""
        exp = {k: params.get(k) or None for k in ("model_id", "weights_hash", "codec_tag")}
        ident = expected_identity(self.identity, params)
        if ident != EntryIdentity():
            exp["identity"] = ident.to_dict()
        return exp

    def lookup(self, params: dict[str, Any], prompt_token_ids: list[int]) -> Lookup:
        from streaming.errors import StreamingError

        t0 = time.perf_counter()
        key = params.get("context_key")
        if not key and not params.get("prefix_match"):
            raise SourceError("store source needs 'context_key' (or prefix matching)")
        client = self._client(params)
        try:
            expect = self._expect(params)
        except ValueError as e:
            return _identity_miss("store", params, str(e), t0)
        info: dict[str, Any] = {}
        try:
            if key:
                man = client.get_manifest(key, **expect)
                why = "" if man is not None else (client.last_miss_reason or "not in store")
            else:  # prefix matching: the index names the entries sharing the prefix
                key, man, why, info = self._prefix_lookup(client, params, prompt_token_ids, expect)
        except (OSError, StreamingError) as e:
            raise SourceError(f"store {params.get('store')} unreachable: {e}") from e
        dt = time.perf_counter() - t0
        if man is None:
            why = info.get("miss") or why
            if why != "unknown key":
                logger.warning("store source: miss for context %s: %s", key, why)
            return Lookup(0, lookup_s=dt, info={"miss": why, **info})
        stored = man.token_ids
        n_match = _matched_tokens(params, prompt_token_ids, stored, len(stored))
        if n_match <= 0:
            return Lookup(0, lookup_s=dt, info={"miss": "stored token ids differ from the prompt"})
        chunk_tokens = [b - a for a, b in man.token_ranges]
        # the plan this request keeps for its lifetime: the load verifies against it
        return Lookup(n_match, chunk_tokens, dt,
                      {"key": key, "levels": list(man.levels), "codec_tag": man.codec_tag,
                       "codec": (man.identity or {}).get("codec") or None,
                       "stored_tokens": len(stored), "gen": getattr(man, "gen", ""), **info})

    def _prefix_lookup(self, client, params, prompt: list[int], expect: dict):
        """(key, manifest, miss reason, info) of the longest indexed prefix of the prompt
        whose entry really loads (third_party.vllm.prefix.find_loadable: falls back to
        shorter chain levels, drops index records of deleted / evicted entries)."""
        from third_party.vllm.prefix import find_loadable

        ns = (self.identity.weights_hash if self.identity else "") or params.get("weights_hash")
        if not ns:
            return None, None, "", {"miss": "prefix matching needs the model's weights hash"}

        def usable(k):
            m = client.get_manifest(k, **expect)
            return m, ("" if m is not None else (client.last_miss_reason or "not in store"))

        matched, key, man, fi = find_loadable(client, ns, prompt, usable)
        info = {"prefix_index_tokens": matched, "prefix_index_trips": fi["trips"],
                "prefix_index_dropped": fi["dropped"]}
        if man is None:
            info["miss"] = fi.get("miss") or \
                "no stored chunk matches the prompt's first tokens (prefix index)"
        return key, man, "", info

    def _policy(self, params, lookup: Lookup):
        from streaming.adapt import AdaptivePolicy, FixedPolicy

        pol = params.get("policy")
        if pol:
            if not isinstance(pol, dict):
                raise SourceError("'policy' must be a dict of streaming.adapt.AdaptivePolicy args")
            try:  # a preset of streaming.adapt_params.PolicyParams + this request's inputs
                return AdaptivePolicy.from_request(pol)
            except (TypeError, ValueError) as e:
                raise SourceError(f"bad policy: {e}") from None
        level = params.get("level")
        if isinstance(level, (list, tuple)):  # per-chunk levels, None = text (experiments)
            return FixedPolicy([None if x is None else int(x) for x in level])
        if level is None:
            level = default_stored_level(lookup.info.get("codec"), lookup.info.get("levels") or [0])
        return FixedPolicy(int(level))

    def save(self, params: dict[str, Any], token_ids: list[int], k, v) -> dict[str, Any]:
        """Encode and put one context into the store (params: store, model_id,
        weights_hash, codec_tag (default: the codec name), codec, level (stored level,
        default 0), chunk_tokens). Returns {"encode_s", "put_s", "bytes", "context_key"}."""
        chunks, sizes, enc_s = encode_for_save(params, k, v, self.identity)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        ranges = [(a, a + t) for a, t in zip(starts, sizes)]
        ident = codec_identity(expected_identity(self.identity, params), params.get("codec", "raw"),
                               [params.get("level")], calibration_hash=calibration_of(chunks))
        t0 = time.perf_counter()
        client = self._client(params)
        if ident.model_id and ident.weights_hash:  # full identity: the key commits to it
            key = client.put_entry(ident, token_ids, {ident.levels[0]: chunks}, ranges)
        else:
            key = client.put_context(
                str(params.get("model_id") or "unknown-model"),
                str(params.get("weights_hash") or "unknown-weights"),
                str(params.get("codec_tag") or params.get("codec", "raw")), token_ids,
                {int(params.get("level") or 0): chunks}, ranges)
        put_s = time.perf_counter() - t0
        indexed = 0
        if ident.weights_hash:  # findable by prefix (third_party.vllm.prefix)
            from third_party.vllm.prefix import index_entry

            indexed = index_entry(client, ident.weights_hash, token_ids, key,
                                  params.get("codec", "raw"))
        return {"encode_s": enc_s, "put_s": put_s, "index_s": time.perf_counter() - t0 - put_s,
                "index_records": indexed, "bytes": sum(len(c) for c in chunks),
                "context_key": key}

    def load(self, params, lookup: Lookup, num_tokens: int, on_chunk: ChunkSink,
             before_chunk=None) -> LoadStats:
        """See KVSource.load; before_chunk(k) (in-process callers only, e.g. a bandwidth
        trace driving the link) runs just before chunk k is requested."""
        from streaming.client import stream_load

        inner = self._decode_fn or default_decode_fn()

        def decode(data: bytes):  # (k, v, the header's (token_offset, T) or None)
            k, v = inner(data)
            return k, v, _header_range(data)

        client = self._client(params)
        starts = [0]
        for t in lookup.chunk_tokens:
            starts.append(starts[-1] + t)
        needed = sum(1 for s in starts[:-1] if s < num_tokens)
        policy = _PrefixPolicy(self._policy(params, lookup), needed)
        st = LoadStats()
        delivered = [0]

        bad: list[str] = []

        def on_decoded(i: int, out) -> None:
            # (policy.stopped may already be set by the receiver, which runs ahead: chunks
            # before the first text chunk are still part of the prefix)
            if starts[i] != delivered[0] or bad:
                policy.stopped = True  # a gap before chunk i: it is useless to vLLM
                return
            k, v, hr = out
            want = starts[i + 1] - starts[i]
            if hr is not None and hr != (starts[i], want):
                bad.append(f"chunk {i}: its header says tokens {hr[0]}..{hr[0] + hr[1]}, the plan "
                           f"{starts[i]}..{starts[i + 1]}")
                policy.stopped = True
                logger.warning("store source: %s: %s", params.get("context_key"), bad[-1])
                return
            if getattr(k, "shape", None) is None or len(k.shape) < 2 or k.shape[1] != want:
                # never place KV of another token range: the plan says chunk i holds `want`
                bad.append(f"chunk {i} decoded to {getattr(k, 'shape', None)}, the plan says "
                           f"{want} tokens at {starts[i]}")
                policy.stopped = True
                logger.warning("store source: %s: %s", params.get("context_key"), bad[-1])
                return
            on_chunk(starts[i], k, v)
            delivered[0] = starts[i + 1]

        plan = [(starts[i], starts[i + 1]) for i in range(needed)]
        res = stream_load(client, params["context_key"], policy, decode,
                          on_decoded=on_decoded, keep_decoded=False, before_chunk=before_chunk,
                          plan=plan, plan_gen=lookup.info.get("gen") or None,
                          **self._expect(params))
        if not res.hit:
            raise SourceMiss(f"store miss at load time: {res.reason}")
        for c in res.chunks:
            rec = {k: getattr(c, k) for k in ("index", "level", "text_fallback", "bytes",
                                              "transfer_s", "decode_s", "crc_ok", "refetched",
                                              "token_start", "token_end", "fetch_start_s",
                                              "fetch_end_s", "decode_end_s", "note")}
            if c.index >= needed:
                rec["note"] = (rec["note"] + "; " if rec["note"] else "") + "not needed"
            st.chunks.append(rec)
        st.bytes = res.bytes
        st.transfer_s = res.transfer_s
        st.decode_s = res.decode_s
        st.loaded_tokens = min(num_tokens, delivered[0])
        st.fallback = st.loaded_tokens < num_tokens
        st.error = res.error or (bad[0] if bad else None)
        st.extra = {"manifest_s": res.manifest_s, "stream_total_s": res.total_s,
                    "decisions": [dict(d.__dict__) for d in res.decisions]}
        return st


def make_source(kind: str, extra: dict[str, Any], identity: EntryIdentity | None = None) -> KVSource:
    """Source registry: "local" (LocalDirSource) or "store" (StoreSource); `identity` is the
    reader's own model identity (engine_identity) every entry is checked against. Raises
    ValueError."""
    decode_fn = load_callable(extra["decode_fn"]) if extra.get("decode_fn") else None
    if kind == "local":
        return LocalDirSource(extra.get("source_dir"), decode_fn, identity)
    if kind == "store":
        return StoreSource(decode_fn, identity=identity)
    raise ValueError(f"unknown KV source {kind!r}; available: local, store")
