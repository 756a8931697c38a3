"""Redis Cluster faults at scale: a master killed, slots migrated, a master unreachable, during
thousands of loads and saves of token-identifying KV - every load checked.

Paper: CacheGen section 5 (encoded KV lives in a remote store shared by engines); the store
here is a real Redis Cluster on loopback (streaming.store.redis_cluster_server: 3 masters + 3
replicas, cluster-node-timeout 1000 ms) read through streaming.store.redis_client.RedisStoreClient
over streaming.store.redis_cluster.RedisClusterBackend. KV: raw-codec float32 chunks whose K value
at token t is (t, version), V = -K, so a decoded chunk proves its token positions and the
save it came from. Per fault: loader threads load random contexts while a saver re-saves
them (version + 1); the fault strikes after a quarter of the loads. Counted: loads that are
the right KV (hit / partial), recorded misses (with their reasons), wrong KV, loads slower
than their bound (a hang), saves ok / failed before, during and after the fault, and a
final pass that saves and loads every context again. Not a test: writes
benchmarks/redis_cluster.json with n, the machine and its load average.

Run: python -m bench.redis_cluster --loads 1000            (docs/redis.md, "Redis Cluster")
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

import codec
from cachegen_common import flags
from cachegen_common.files import atomic_write_json
from cachegen_common.header import environment
from streaming.load import stream_load
from streaming.errors import StoreError, StreamingError
from streaming.identity import NO_LEVEL_KEY, EntryIdentity
from streaming.store.redis_client import RedisStoreClient
from streaming.store.redis_cluster_server import RedisClusterServer
from streaming.store.format import build_manifest
from streaming.store.kv import run_steps, save_steps

L, H, D = 2, 1, 2
TOKENS, CHUNK_TOKENS = 384, 64
IDENTITY = EntryIdentity(model_id="m", weights_hash="w", dtype="float32", num_layers=L,
                         num_kv_heads=H, head_dim=D, codec="raw", level_configs={None: "raw-test"})
SOCKET_TIMEOUT_S = 2.0   # per socket operation of the store client
FAILOVER_WAIT_S = 4.0    # how long an operation retries while its slot has no master
FAULTS = ("kill-master", "migrate-slots", "pause-master")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "redis_cluster.json"


def token_kv(n: int, version: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [L, n, H, D] float32: k[..., t, :, 0] = t, k[..., 1] = version; v = -k."""
    k = torch.zeros(L, n, H, D, dtype=torch.float32)
    k[..., 0] = torch.arange(n, dtype=torch.float32)[None, :, None]
    k[..., 1] = float(version)
    return k, -k


def ids_of(case: int) -> list[int]:
    """Token ids of context `case` (distinct contexts, distinct keys)."""
    return [case * 100_000 + i for i in range(TOKENS)]


def entry(case: int, version: int):
    """(key, manifest, chunks) of context `case` holding version `version` of its KV."""
    k, v = token_kv(TOKENS, version)
    chunks = {None: codec.encode_chunks(k, v, codec="raw", chunk_tokens=CHUNK_TOKENS)}
    key, man = build_manifest("m", "w", "raw", ids_of(case), chunks, codec.chunk_bounds(TOKENS, CHUNK_TOKENS),
                              meta={"version": version}, identity=IDENTITY)
    return key, man, chunks


def save(client, case: int, version: int) -> str:
    """Save version `version` of context `case`; returns its key (StoreError on failure)."""
    key, man, chunks = entry(case, version)
    run_steps(save_steps(client, man, chunks))
    return key


def check_load(client, key: str) -> tuple[str, object]:
    """Load `key` and check every decoded chunk. Returns ("load" | "partial", version),
    ("miss", reason) or ("wrong", detail) - a chunk of other tokens or another save."""
    res = stream_load(client, key, NO_LEVEL_KEY, lambda b: codec.decode_kv(b, device="cpu"), model_id="m",
                      weights_hash="w", codec_tag="raw")
    if not res.hit:
        return "miss", res.reason or "(no reason given)"
    version = res.manifest.meta["version"]
    for st in res.chunks:
        if st.text_fallback:
            if not st.note:
                return "wrong", f"chunk {st.index} recomputed without a note"
            continue
        a, b = res.manifest.token_ranges[st.index]
        k, v = res.decoded[st.index]
        if (not torch.equal(k[0, :, 0, 0], torch.arange(a, b, dtype=torch.float32))
                or not bool((k[..., 1] == version).all()) or not torch.equal(v, -k)):
            return "wrong", f"chunk {st.index} of {key[:12]} holds other tokens or another save"
    return ("partial" if res.recompute_tokens else "load"), version


def _reason(r: str) -> str:
    """A miss reason without addresses and keys (for counting)."""
    return " ".join(w for w in str(r).split()[:8] if not any(c.isdigit() for c in w))


class _Run:
    """Shared state of one fault run (counters under a lock)."""

    def __init__(self, n_loads: int):
        self.lock = threading.Lock()
        self.n_loads = n_loads
        self.c: Counter = Counter()
        self.reasons: Counter = Counter()
        self.max_load_s = 0.0
        self.phase = "before"  # before -> during -> after
        self.stop = threading.Event()
        self.errors: list[str] = []

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.c[name] += n


def run_fault(cl: RedisClusterServer, fault: str, n_loads: int, n_contexts: int = 24,
              loaders: int = 3, seed: int = 0) -> dict:
    """Run `fault` (one of FAULTS) on cluster `cl` during `n_loads` checked loads; returns the
    record (counts, the load bound, miss reasons, saves per phase, the final pass)."""
    rng = random.Random(seed)
    base = RedisStoreClient(cl.url, socket_timeout_s=SOCKET_TIMEOUT_S, failover_wait_s=FAILOVER_WAIT_S)
    keys = [save(base, i, 1) for i in range(n_contexts)]
    versions = {i: 1 for i in range(n_contexts)}
    run = _Run(n_loads)
    # a load does a few round trips per chunk; each waits at most a socket timeout, and the
    # first one to meet a dead master retries for up to FAILOVER_WAIT_S
    bound_s = FAILOVER_WAIT_S + 4 * SOCKET_TIMEOUT_S + 2.0

    def loader(tid: int) -> None:
        c, r = base.clone(), random.Random(seed * 100 + tid)
        while not run.stop.is_set():
            with run.lock:
                if run.c["loads"] >= run.n_loads:
                    return
                run.c["loads"] += 1
            i = r.randrange(n_contexts)
            t0 = time.monotonic()
            kind, what = check_load(c, keys[i])
            dt = time.monotonic() - t0
            with run.lock:
                run.c[kind] += 1
                run.c[f"{kind}_{run.phase}"] += 1
                run.max_load_s = max(run.max_load_s, dt)
                if dt > bound_s:
                    run.c["hangs"] += 1
                if kind == "miss":
                    run.reasons[_reason(what)] += 1
                if kind == "wrong":
                    run.errors.append(str(what))
        c.close()

    def saver() -> None:
        c = base.clone()
        while not run.stop.is_set():
            i = rng.randrange(n_contexts)
            phase = run.phase
            try:
                save(c, i, versions[i] + 1)
                versions[i] += 1
                run.add(f"saves_ok_{phase}")
            except (StoreError, StreamingError, OSError) as e:
                run.add(f"saves_failed_{phase}")
                with run.lock:
                    run.reasons["save: " + _reason(e)] += 1
            time.sleep(0.01)
        c.close()

    threads = [threading.Thread(target=loader, args=(t,), daemon=True) for t in range(loaders)]
    threads.append(threading.Thread(target=saver, daemon=True))
    for t in threads:
        t.start()
    while run.c["loads"] < n_loads // 4 and any(t.is_alive() for t in threads[:-1]):
        time.sleep(0.01)
    run.phase = "during"
    t0 = time.monotonic()
    detail = _strike(cl, fault, base, keys, run)
    fault_s = time.monotonic() - t0
    run.phase = "after"
    for t in threads[:-1]:
        t.join()
    run.stop.set()
    threads[-1].join(timeout=bound_s * 2)
    # the final pass: every context saved again (a new version) and loaded back whole
    final = Counter()
    for i in range(n_contexts):
        try:
            save(base, i, versions[i] + 1)
            versions[i] += 1
            kind, v = check_load(base, keys[i])
            final["ok" if kind == "load" and v == versions[i] else f"bad_{kind}"] += 1
        except (StoreError, StreamingError, OSError) as e:
            final["failed"] += 1
            run.reasons["final: " + _reason(e)] += 1
    base.close()
    c = run.c
    return {"fault": fault, "detail": detail, "fault_s": round(fault_s, 2), "contexts": n_contexts,
            "loaders": loaders, "loads": c["loads"], "hits": c["load"], "partial": c["partial"],
            "misses": c["miss"], "wrong_kv": c["wrong"], "hangs": c["hangs"],
            "every_load_hit_or_recorded_miss": c["load"] + c["partial"] + c["miss"] == c["loads"] and not c["wrong"],
            "load_bound_s": bound_s, "max_load_s": round(run.max_load_s, 3),
            "by_phase": {p: {k: c[f"{k}_{p}"] for k in ("load", "partial", "miss")}
                         for p in ("before", "during", "after")},
            "saves": {p: {"ok": c[f"saves_ok_{p}"], "failed": c[f"saves_failed_{p}"]}
                      for p in ("before", "during", "after")},
            "final_pass": {"contexts": n_contexts, **final},
            "miss_and_error_reasons": dict(run.reasons.most_common(8)), "wrong_details": run.errors[:5]}


def _strike(cl: RedisClusterServer, fault: str, client, keys: list[str], run: _Run) -> dict:
    """Do the fault now; returns what was done. Loads go on meanwhile."""
    slot = client.backend.slot_of(f"ctx/{keys[0]}/manifest")
    master = cl.master_of(slot)
    if fault == "kill-master":
        cl.kill(master)
        promoted = cl.wait_failover(master)
        return {"killed": master.port, "promoted": promoted.port}
    if fault == "pause-master":
        cl.pause(master)
        promoted = cl.wait_failover(master)
        cl.resume(master)  # it comes back and rejoins as a replica of the promoted node
        return {"paused": master.port, "promoted": promoted.port}
    if fault == "migrate-slots":
        slots = sorted({client.backend.slot_of(f"ctx/{k}/manifest") for k in keys})
        dst = next(m for m in cl.masters() if m is not master)
        mine = [s for s in slots if cl.master_of(s) is master]
        moved = 0
        for s in mine:  # each slot half moved (ASK) for a while, then moved (MOVED)
            loads_at = run.c["loads"]
            moved += cl.migrate_slot(s, dst, keys_first=3, between=lambda: _wait_loads(run, loads_at + 20))
        return {"from": master.port, "to": dst.port, "slots": len(mine), "keys_moved": moved}
    raise ValueError(f"unknown fault {fault!r}: one of {', '.join(FAULTS)}")


def _wait_loads(run: _Run, target: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while run.c["loads"] < min(target, run.n_loads) and time.monotonic() < deadline:
        time.sleep(0.005)


def bench(faults, n_loads: int, contexts: int, loaders: int, log: Callable[[str], None]) -> dict:
    """One fresh cluster per fault; returns the result document."""
    doc = {"environment": environment(("python", "platform", "cpu", "num_cpus", "git_commit", "date"),
                                      packages=("redis",)),
           "machine_note": "a shared machine under load (several jobs at once): timings are not quiet-machine figures",
           "load_avg_start": list(os.getloadavg()),
           "settings": {"masters": 3, "replicas_per_master": 1, "cluster_node_timeout_ms": 1000,
                        "socket_timeout_s": SOCKET_TIMEOUT_S, "failover_wait_s": FAILOVER_WAIT_S,
                        "tokens_per_context": TOKENS, "chunk_tokens": CHUNK_TOKENS},
           "runs": []}
    for fault in faults:
        with RedisClusterServer() as cl:
            t0 = time.monotonic()
            rec = run_fault(cl, fault, n_loads, contexts, loaders)
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            rec["load_avg_1m_after"] = os.getloadavg()[0]
        log(f"{fault}: {rec['loads']} loads: {rec['hits']} hits, {rec['partial']} partial, {rec['misses']} "
            f"recorded misses, {rec['wrong_kv']} wrong, {rec['hangs']} hangs (max {rec['max_load_s']} s); "
            f"saves after: {rec['saves']['after']}; final pass {rec['final_pass']}")
        doc["runs"].append(rec)
    doc["load_avg_end"] = list(os.getloadavg())
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.redis_cluster", description=(
        "python -m bench.redis_cluster: Redis Cluster faults (a master killed, slots migrated, a "
        "master unreachable) during checked loads and saves of token-identifying KV."))
    ap.add_argument("--loads", type=int, default=1000, help="checked loads per fault (default 1000)")
    ap.add_argument("--contexts", type=int, default=24, help="stored contexts (default 24)")
    ap.add_argument("--loaders", type=int, default=3, help="loader threads (default 3)")
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    flags.add_out(ap, default=DEFAULT_OUT, type=Path, help=f"result file (default {DEFAULT_OUT})")
    a = ap.parse_args(argv)
    if a.loads < 8 or a.contexts < 3 or a.loaders < 1:
        print("error: need --loads >= 8, --contexts >= 3, --loaders >= 1", file=sys.stderr)
        return 2
    try:
        doc = bench(a.faults, a.loads, a.contexts, a.loaders, lambda m: print(m, file=sys.stderr))
    except (StoreError, StreamingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write_json(a.out, doc)
    print(f"wrote {a.out}", file=sys.stderr)
    bad = sum(r["wrong_kv"] + r["hangs"] for r in doc["runs"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
