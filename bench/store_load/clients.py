"""The clients of the store load benchmark: token-identifying KV, one client's loop of saves
and loads, and a worker process running several such clients in threads.

Paper: CacheGen section 5 (many engines fetch encoded KV chunks from one shared store).
Token-identifying KV: raw-codec float32 chunks whose K at token t of context c saved by
writer w as its save number s is (t, c, w, s) (V = -K), so a decoded chunk proves which
token positions, which context and which save it holds; a load is checked against the
manifest it planned from (one save, never a mix) and, after the run, against the saves
the writers made (bench.store_load). Used by `python -m bench.store_load`; not runnable
by itself.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

import torch

import codec
from streaming.load import stream_load
from streaming.errors import StoreError, StoreRaceLostError
from streaming.identity import NO_LEVEL_KEY, EntryIdentity

L, H, D = 2, 2, 4  # D = 4 features: token position, context, writer, save number
IDENTITY = EntryIdentity(model_id="load-m", weights_hash="load-w", dtype="float32", num_layers=L,
                         num_kv_heads=H, head_dim=D, codec="raw", level_configs={None: "raw-load"})


def context_ids(context: int, tokens: int) -> list[int]:
    """Token ids of context number `context` (distinct per context: distinct store keys)."""
    return [context * 1_000_003 + i for i in range(tokens)]


def token_kv(tokens: int, context: int, writer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [L, tokens, H, D] float32: k[..., t, :, :] = (t, context, writer, seq), v = -k.
    Every value is an integer below 2**24, exact in float32."""
    k = torch.empty(L, tokens, H, D, dtype=torch.float32)
    k[..., 0] = torch.arange(tokens, dtype=torch.float32)[None, :, None]
    k[..., 1] = float(context)
    k[..., 2] = float(writer)
    k[..., 3] = float(seq)
    return k, -k


def save(client, context: int, writer: int, seq: int, tokens: int, chunk_tokens: int) -> str:
    """Save context `context` as writer `writer`'s save `seq` (raw codec, one level).
    Returns the store key. Raises StoreRaceLostError / StoreError as the client does."""
    k, v = token_kv(tokens, context, writer, seq)
    chunks = codec.encode_chunks(k, v, codec="raw", chunk_tokens=chunk_tokens)
    ranges = codec.chunk_bounds(tokens, chunk_tokens)
    return client.put_entry(IDENTITY, context_ids(context, tokens), {None: chunks}, ranges,
                            meta={"context": context, "writer": writer, "seq": seq})


def _decode(data: bytes):
    return codec.decode_kv(data, device="cpu")


def check_load(res, context: int, tokens: int) -> tuple[str, tuple[int, int] | None, int]:
    """Classify a stream_load result and check every decoded chunk against its manifest:
    positions = the chunk's token range, context = `context`, (writer, seq) = the manifest's,
    v = -k. Returns (kind, (writer, seq) or None, wrong chunks): kind "hit" (every chunk
    loaded), "partial" (some recomputed from text, each with a note) or "miss"."""
    if not res.hit:
        return "miss", None, 0
    meta = res.manifest.meta or {}
    saved = (int(meta.get("writer", -1)), int(meta.get("seq", -1)))
    wrong = 0 if res.manifest.token_ranges[-1][1] == tokens else 1
    for st in res.chunks:
        if st.text_fallback:
            wrong += 0 if st.note else 1  # a recomputed chunk must say why
            continue
        a, b = res.manifest.token_ranges[st.index]
        k, v = res.decoded[st.index]
        ok = (tuple(k.shape) == (L, b - a, H, D)
              and torch.equal(k[..., 0], torch.arange(a, b, dtype=torch.float32)[None, :, None]
                              .expand(L, b - a, H))
              and bool((k[..., 1] == context).all()) and bool((k[..., 2] == saved[0]).all())
              and bool((k[..., 3] == saved[1]).all()) and torch.equal(v, -k))
        wrong += 0 if ok else 1
    return ("partial" if res.recompute_tokens else "hit"), saved, wrong


def load(client, key: str, context: int, tokens: int):
    """stream_load of `key` checked with check_load."""
    res = stream_load(client, key, NO_LEVEL_KEY, _decode, identity=IDENTITY)
    return check_load(res, context, tokens)


def run_client(client, writer: int, ops: int, keys: list[str], cfg: dict, rng: random.Random) -> dict:
    """One client's loop: `ops` operations, each a save (probability cfg["write_fraction"])
    or a load of a random context of `keys`. Returns the counts, latencies (seconds) per
    op kind, the saves attempted/acknowledged and the (context, writer, seq) loaded."""
    out: dict[str, Any] = {"lat": {"save": [], "load": []}, "counts": {}, "attempted": [],
                           "acked": [], "loaded": [], "wrong": 0, "errors": []}
    counts = out["counts"]
    seq = 0
    for _ in range(ops):
        c = rng.randrange(len(keys))
        t0 = time.perf_counter()
        if rng.random() < cfg["write_fraction"]:
            seq += 1
            out["attempted"].append((c, writer, seq))
            try:
                save(client, c, writer, seq, cfg["tokens"], cfg["chunk_tokens"])
                out["acked"].append((c, writer, seq))
                kind = "saved"
            except StoreRaceLostError:
                kind = "race_lost"  # another writer published first: correct, counted
            except StoreError as e:
                kind = "save_error"
                out["errors"].append(str(e)[:200])
            out["lat"]["save"].append(time.perf_counter() - t0)
        else:
            kind, saved, wrong = load(client, keys[c], c, cfg["tokens"])
            out["lat"]["load"].append(time.perf_counter() - t0)
            out["wrong"] += wrong
            if saved is not None:
                out["loaded"].append((c, *saved))
        counts[kind] = counts.get(kind, 0) + 1
    return out


def merge(parts: list[dict]) -> dict:
    """Sum of run_client results (lists concatenated, counts added)."""
    tot: dict[str, Any] = {"lat": {"save": [], "load": []}, "counts": {}, "attempted": [], "acked": [],
                           "loaded": [], "wrong": 0, "errors": []}
    for p in parts:
        for op in ("save", "load"):
            tot["lat"][op].extend(p["lat"][op])
        for k, n in p["counts"].items():
            tot["counts"][k] = tot["counts"].get(k, 0) + n
        for f in ("attempted", "acked", "loaded", "errors"):
            tot[f].extend(p[f])
        tot["wrong"] += p["wrong"]
    return tot


def make_client(target: tuple):
    """A fresh client of `target`: ("store", host, port) -> StoreClient; ("redis", url) ->
    RedisStoreClient."""
    if target[0] == "store":
        from streaming.store import StoreClient

        return StoreClient(target[1], target[2], timeout=60.0)
    from streaming.store.redis_client import RedisStoreClient

    return RedisStoreClient(target[1])


def worker(target: tuple, first_writer: int, threads: int, ops: int, keys: list[str], cfg: dict,
           start, out_q) -> None:
    """A worker process: `threads` clients (writers first_writer ...), each with its own
    connection and `ops` operations, started together when `start` (an Event) is set;
    puts the merged result (or {"fatal": message}) on out_q."""
    parts: list[dict] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        client = make_client(target)
        try:
            client.connect()
            start.wait()
            r = run_client(client, first_writer + i, ops, keys, cfg, random.Random(cfg["seed"] * 7919 + first_writer + i))
        except Exception as e:  # noqa: BLE001 - reported to the parent, counted as failed
            r = merge([])
            r["errors"].append(f"client {first_writer + i}: {e!r}"[:300])
            r["counts"]["client_failed"] = 1
        finally:
            client.close()
        with lock:
            parts.append(r)

    torch.set_num_threads(1)
    logging.getLogger("cachegen.stream").setLevel(logging.ERROR)  # partial loads are counted, not logged
    ts = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out_q.put(merge(parts))
