"""Redis store benchmark: load time of one stored context through the shaped link, three
ways side by side per rate - the TCP store server over a local folder (the default), the
store server over Redis, and the engine reading Redis directly (RedisStoreClient).

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5: encoded KV chunks live in a remote
store and are streamed to the engine on reuse, decoding chunk k while chunk k+1 arrives.
The chunks are stand-ins of the real size with real decode work (bench.standin_codec).
Not a test: prints one JSON line per (rate, setup); medians over --repeats, warm-up excluded.

Run: python -m bench.redis --bandwidth-mbps 100 1000 --repeats 3     (docs/redis.md)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from typing import Sequence

from cachegen_common.cli import exit_status
from cachegen_common import flags
from cachegen_common.units import goodput_mbps
from bench import standin_codec as standin
from streaming.load import stream_load
from streaming.errors import StoreError
from streaming.link import ShapedLink
from streaming.store.redis_client import RedisStoreClient
from streaming.store.redis_server import RedisServer
from streaming.store import start_store_server


def bench(bandwidth_mbps: Sequence[float], chunks: int, chunk_mb: float, repeats: int, method: str,
          rounds: int = 1) -> list[dict]:
    """Load time of one stored context (stand-in chunks, real decode work) through a shaped
    link at each rate of `bandwidth_mbps` (Mbit/s), three ways side by side per rate: the TCP
    store server over a local folder (the default), the store server over Redis, and the
    engine reading Redis directly (RedisStoreClient). Redis and the store server run on the server side of the link.
    Returns one row per (rate, setup): medians over `repeats` (warm-up excluded)."""
    size = int(chunk_mb * 1e6)
    ids = list(range(chunks * 1024))
    ranges = [(i * 1024, (i + 1) * 1024) for i in range(chunks)]
    data = {1: [standin.make_chunk(size + 17 * i, seed=i) for i in range(chunks)]}
    rows = []
    for bw in bandwidth_mbps:
        with ShapedLink(bw, method=method) as link, tempfile.TemporaryDirectory(prefix="cg-bench-") as tmp, \
                RedisServer(link=link) as srv:
            setups = {}
            local = start_store_server(tmp, link=link)
            setups["store-server/local-folder"] = (local, local.client(timeout=60))
            via = start_store_server(srv.direct_url, link=link)
            setups["store-server/redis"] = (via, via.client(timeout=60))
            setups["direct/redis"] = (None, RedisStoreClient(srv.url))
            try:
                for name, (handle, client) in setups.items():
                    key = client.put_context("m", "w", "standin", ids, data, ranges)
                    times = []
                    for r in range(repeats + 1):
                        res = stream_load(client, key, 1, standin.decoder(rounds), model_id="m",
                                          weights_hash="w", codec_tag="standin")
                        if not res.hit or res.recompute_tokens:
                            raise StoreError(f"{name}: load incomplete: {res.reason or res.error}")
                        if r:
                            times.append(res.total_s)
                    med = statistics.median(times)
                    rows.append({"rate_mbps": bw, "link": link.method, "setup": name, "bytes": res.bytes,
                                 "load_s_median": med, "load_s_min": min(times), "load_s_max": max(times),
                                 "goodput_mbps": goodput_mbps(res.bytes, med), "repeats": repeats})
            finally:
                for handle, client in setups.values():
                    client.close()
                    if handle is not None:
                        handle.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.redis",
        description="Benchmark: load a stored context through the shaped link from the local-folder "
                    "store, the store server over Redis, and Redis directly (prints JSON lines).",
    )
    flags.add_bandwidth(ap, nargs="+", default=[100.0, 1000.0],
                        help="link rates, Mbit/s (default %(default)s)")
    ap.add_argument("--chunks", type=int, default=4, help="chunks per context (default 4: ~4K tokens)")
    ap.add_argument("--chunk-mb", type=float, default=3.7,
                    help="bytes per chunk in MB (default 3.7: a 1024-token SmolLM2 chunk, ~6x under bf16)")
    flags.add_repeats(ap, default=3)
    flags.add_link_method(ap)
    a = ap.parse_args(argv)
    if a.chunks < 1 or a.repeats < 1 or a.chunk_mb <= 0:
        print("error: --chunks, --repeats and --chunk-mb must be positive", file=sys.stderr)
        return 2

    def run() -> None:
        for row in bench(a.bandwidth_mbps, a.chunks, a.chunk_mb, a.repeats, a.link_method):
            print(json.dumps(row), flush=True)

    return exit_status(run, (StoreError, ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
