"""Store load benchmark: many concurrent clients (threads in several processes) saving and
loading contexts through the store server and through Redis, every loaded KV checked.

Paper: CacheGen section 5 (encoded KV chunks live in a shared store that many engines read
and write). Per backend it reports throughput, p50/p99 latency per operation (save, load),
the server process's memory (RSS sampled over time: before, after warm-up, at the end, and
the growth after warm-up) and its open file descriptors before and after the run. The KV
is token-identifying (bench.store_load.clients): every load is checked chunk by chunk
against the manifest it planned from, and each loaded save against the saves the writers
made; "wrong_kv" counts every failure (the goal is 0). Backends:
    store  `python -m streaming.store serve` over a local folder (a child process), one
           StoreClient connection per client
    redis  a redis-server this command starts on loopback (streaming.store.redis_server), one
           RedisStoreClient per client (engines reading Redis directly)
Timings depend on the machine and its load: the file records the machine
(cachegen_common.machine.cpu_info) and the load average before and after.

Run: python -m bench.store_load [--clients 64 --processes 4 --ops 10000 --backends store redis]
     python -m bench.store_load --quick        (a few seconds: 8 clients, 240 operations)
Writes benchmarks/store_load.json (--out); exits 1 if any KV was wrong or a client failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from bench.store_load.clients import load, make_client, merge, save, worker
from cachegen_common import flags, header
from cachegen_common.cli import exit_status
from cachegen_common.files import atomic_write_json
from cachegen_common.machine import cpu_info
from streaming.errors import StoreError, StreamingError
from streaming.store.redis_server import RedisServer, find_redis_server, redis_server_version
from streaming.store import start_store_server

BACKENDS = ("store", "redis")
DEFAULT_OUT = Path("benchmarks/store_load.json")
QUICK = {"clients": 8, "processes": 2, "ops": 240, "contexts": 4, "context_tokens": 128, "chunk_tokens": 32}


@contextmanager
def serve(backend: str, arenas: int | None = None) -> Iterator[tuple[tuple, int, str]]:
    """Start the server of `backend` (the store server with `--malloc-arenas arenas` when
    given); yields (client target, server pid, description)."""
    if backend == "store":
        extra = [] if arenas is None else ["--malloc-arenas", str(arenas)]
        with tempfile.TemporaryDirectory(prefix="cg-storeload-") as tmp:
            h = start_store_server(tmp, extra_args=extra)
            try:
                yield (("store", h.host, h.port), h.proc.pid,
                       " ".join(["python -m streaming.store serve (local folder)", *extra]))
            finally:
                h.stop()
    else:
        if find_redis_server() is None:
            raise StoreError("redis-server is not installed (apt-get install redis-server), "
                             "or run with --backends store")
        with RedisServer() as srv:
            yield ("redis", srv.url), srv.pid, f"redis-server {redis_server_version() or '?'} (loopback)"


class Sampler:
    """RSS (MiB) and open descriptors of process `pid` every `every_s` seconds, in a thread."""

    def __init__(self, pid: int, every_s: float):
        self.proc, self.every_s = psutil.Process(pid), every_s
        self.series: list[tuple[float, float, int]] = []  # (seconds since start, RSS MiB, fds)
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="cgh-rss-sampler", daemon=True)

    def sample(self) -> tuple[float, float, int]:
        return (round(time.perf_counter() - self._t0, 3), self.proc.memory_info().rss / 2**20,
                self.proc.num_fds())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.series.append(self.sample())
            self._stop.wait(self.every_s)

    def start(self) -> "Sampler":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.series.append(self.sample())


def settled_fds(pid: int, timeout_s: float = 5.0) -> int:
    """Open descriptors of `pid` once two readings 0.3 s apart agree (closed connections
    take a moment to be reaped by the server), or the last reading after timeout_s."""
    p = psutil.Process(pid)
    last, end = p.num_fds(), time.monotonic() + timeout_s
    while time.monotonic() < end:
        time.sleep(0.3)
        now = p.num_fds()
        if now == last:
            break
        last = now
    return last


def percentiles(xs: list[float]) -> dict[str, Any]:
    """n, p50, p99 and max of latencies `xs` (seconds) in milliseconds (None when empty)."""
    if not xs:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    t = torch.tensor(xs, dtype=torch.float64) * 1e3
    q = torch.quantile(t, torch.tensor([0.5, 0.99], dtype=torch.float64))
    return {"n": len(xs), "p50_ms": round(float(q[0]), 3), "p99_ms": round(float(q[1]), 3),
            "max_ms": round(float(t.max()), 3)}


def memory_summary(series: list[tuple[float, float, int]], warmup_fraction: float) -> dict[str, Any]:
    """RSS figures (MiB) of a sampler series: the warm-up is the first `warmup_fraction`
    of the run's duration; growth_after_warmup_mib = max after it - max during it."""
    end_t = series[-1][0] or 1.0
    warm = [r for t, r, _ in series if t <= warmup_fraction * end_t] or [series[0][1]]
    after = [r for t, r, _ in series if t > warmup_fraction * end_t] or [series[-1][1]]
    return {"start_mib": round(series[0][1], 2), "warmup_max_mib": round(max(warm), 2),
            "after_warmup_max_mib": round(max(after), 2), "end_mib": round(series[-1][1], 2),
            "growth_after_warmup_mib": round(max(after) - max(warm), 2),
            "series": [[t, round(r, 2), f] for t, r, f in series]}


def run_backend(backend: str, cfg: dict) -> dict[str, Any]:
    """One backend's run (see the module docstring); returns its row of the result file."""
    per_proc = [cfg["clients"] // cfg["processes"] + (i < cfg["clients"] % cfg["processes"])
                for i in range(cfg["processes"])]
    ops_each = -(-cfg["ops"] // cfg["clients"])
    with serve(backend, cfg["store_malloc_arenas"]) as (target, pid, what):
        c = make_client(target)
        try:
            keys = [save(c, i, 0, 0, cfg["tokens"], cfg["chunk_tokens"]) for i in range(cfg["contexts"])]
            load(c, keys[0], 0, cfg["tokens"])  # imports and compiles the decode path before the fork
        finally:
            c.close()
        fds_before = settled_fds(pid)
        ctx = mp.get_context("fork")  # the parent has no running threads here
        start, out_q = ctx.Event(), ctx.Queue()
        procs, first = [], 1
        for n in per_proc:
            procs.append(ctx.Process(target=worker, args=(target, first, n, ops_each, keys, cfg, start, out_q),
                                     daemon=True))
            first += n
        for p in procs:
            p.start()
        sampler = Sampler(pid, cfg["sample_s"]).start()
        t0 = time.perf_counter()
        start.set()
        parts = []
        try:
            for _ in procs:
                parts.append(out_q.get(timeout=cfg["timeout_s"]))
        except queue.Empty:
            raise StoreError(f"{backend}: a worker process gave no result within {cfg['timeout_s']} s") from None
        finally:
            duration = time.perf_counter() - t0
            sampler.stop()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        fds_after = settled_fds(pid)
    tot = merge(parts)
    attempted = set(map(tuple, tot["attempted"])) | {(i, 0, 0) for i in range(cfg["contexts"])}
    acked = set(map(tuple, tot["acked"])) | {(i, 0, 0) for i in range(cfg["contexts"])}
    loaded = [tuple(x) for x in tot["loaded"]]
    unsaved = sum(1 for x in loaded if x not in attempted)  # KV no writer ever saved: wrong
    ops = len(tot["lat"]["save"]) + len(tot["lat"]["load"])
    return {"backend": backend, "server": what, "clients": cfg["clients"], "processes": cfg["processes"],
            "threads_per_process": per_proc, "ops": ops, "duration_s": round(duration, 3),
            "throughput_ops_s": round(ops / duration, 1),
            "latency": {op: percentiles(tot["lat"][op]) for op in ("save", "load")},
            "counts": dict(sorted(tot["counts"].items())),
            "wrong_kv": tot["wrong"] + unsaved, "wrong_chunks": tot["wrong"], "loaded_unsaved": unsaved,
            "loaded_unacknowledged": sum(1 for x in loaded if x not in acked),
            "memory": memory_summary(sampler.series, cfg["warmup_fraction"]),
            "fds": {"before": fds_before, "after": fds_after,
                    "max_during": max(f for _, _, f in sampler.series)},
            "errors": tot["errors"][:5]}


def print_row(row: dict) -> None:
    s, ld, m, f = row["latency"]["save"], row["latency"]["load"], row["memory"], row["fds"]
    print(f"{row['backend']:>6}: {row['ops']} ops by {row['clients']} clients in {row['duration_s']:.1f} s "
          f"= {row['throughput_ops_s']:.0f} ops/s; load p50/p99 {ld['p50_ms']}/{ld['p99_ms']} ms (n={ld['n']}), "
          f"save p50/p99 {s['p50_ms']}/{s['p99_ms']} ms (n={s['n']}); wrong KV {row['wrong_kv']}; "
          f"counts {row['counts']}", flush=True)
    print(f"{'':>8}server RSS {m['start_mib']:.1f} -> warm-up max {m['warmup_max_mib']:.1f} -> "
          f"max after {m['after_warmup_max_mib']:.1f} MiB (growth after warm-up "
          f"{m['growth_after_warmup_mib']:+.2f} MiB); fds {f['before']} before, {f['after']} after, "
          f"{f['max_during']} max", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.store_load",
        description="Benchmark: concurrent clients (threads in processes) saving and loading contexts "
                    "through the store server and Redis; every loaded KV checked (writes JSON).")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients in all (default 64)")
    ap.add_argument("--processes", type=int, default=4,
                    help="worker processes the clients are spread over, as threads (default 4)")
    ap.add_argument("--ops", type=int, default=10000, help="operations per backend (default 10000)")
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    ap.add_argument("--contexts", type=int, default=32, help="distinct contexts read and written (default 32)")
    flags.add_context_tokens(ap, default=256, help="tokens per context (default 256)")
    ap.add_argument("--chunk-tokens", type=int, default=64, help="tokens per chunk (default 64)")
    ap.add_argument("--write-fraction", type=float, default=0.2,
                    help="share of operations that save (overwrite) a context (default 0.2)")
    ap.add_argument("--sample-s", type=float, default=0.25, help="RSS sampling period, s (default 0.25)")
    ap.add_argument("--warmup-fraction", type=float, default=0.2,
                    help="share of the run counted as warm-up for the memory growth (default 0.2)")
    ap.add_argument("--store-malloc-arenas", type=int, default=None, metavar="N",
                    help="the store server's --malloc-arenas (default: the server's own, 2; 0: glibc's)")
    flags.add_seed(ap)
    flags.add_quick(ap, help="a tiny run (seconds): " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    flags.add_out(ap, default=DEFAULT_OUT, type=Path, help="result file (default %(default)s)")
    return ap


def config(a: argparse.Namespace) -> dict:
    """The run's settings from parsed arguments; raises ValueError for bad values."""
    cfg = {"clients": a.clients, "processes": a.processes, "ops": a.ops, "contexts": a.contexts,
           "context_tokens": a.context_tokens, "chunk_tokens": a.chunk_tokens}
    if a.quick:
        cfg.update(QUICK)
    if min(cfg.values()) < 1:
        raise ValueError("--clients, --processes, --ops, --contexts, --context-tokens and --chunk-tokens "
                         "must be positive")
    if cfg["processes"] > cfg["clients"]:
        raise ValueError(f"--processes {cfg['processes']} exceeds --clients {cfg['clients']}")
    if not 0.0 <= a.write_fraction <= 1.0 or not 0.0 < a.warmup_fraction < 1.0 or a.sample_s <= 0:
        raise ValueError("--write-fraction must be in [0, 1], --warmup-fraction in (0, 1), --sample-s > 0")
    cfg.update(tokens=cfg.pop("context_tokens"), write_fraction=a.write_fraction, seed=a.seed,
               sample_s=a.sample_s, store_malloc_arenas=a.store_malloc_arenas, warmup_fraction=a.warmup_fraction, timeout_s=1800.0)
    return cfg


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        cfg = config(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # tiny tensors; and no thread pool in the parent before it forks
    doc: dict[str, Any] = {"command": "python -m bench.store_load " + " ".join(argv if argv is not None else sys.argv[1:]),
                           "n": {"ops_per_backend": cfg["ops"], "clients": cfg["clients"]},
                           "machine": cpu_info(),
                           "environment": header.environment(["date", "python", "platform", "num_cpus", "git_commit"]),
                           "load_avg_before": list(os.getloadavg()), "config": cfg, "backends": {}}

    def run() -> None:
        for b in a.backends:
            doc["backends"][b] = row = run_backend(b, cfg)
            print_row(row)
        doc["load_avg_after"] = list(os.getloadavg())
        atomic_write_json(a.out, doc)
        print(f"wrote {a.out} (load average {doc['load_avg_before'][0]:.2f} before, "
              f"{doc['load_avg_after'][0]:.2f} after)")

    rc = exit_status(run, (StreamingError, OSError))
    bad = [b for b, r in doc["backends"].items() if r["wrong_kv"] or r["counts"].get("client_failed")]
    if rc == 0 and bad:
        print(f"error: wrong KV or failed clients on {', '.join(bad)}", file=sys.stderr)
        return 1
    return rc

