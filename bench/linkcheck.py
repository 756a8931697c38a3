"""Goodput of the shaped link: real TCP bytes through ShapedLink at each requested rate.

Paper: CacheGen section 5 evaluates streaming at fixed bandwidths; this checks that our
link delivers them (goal: measured goodput within 10% of the setting).

Run: python -m bench.linkcheck --bandwidth-mbps 100 500 1000 --out linkcheck.json
Each JSON row: target_mbps, measured_mbps, method, bytes, seconds (median repeat),
repeats_mbps, within_10pct, burst_bytes, burst_rule, short_transfers (96 KiB / 256 KiB /
1 MiB transfers after a 50 ms idle gap: median Mbit/s and ratio to the target - the shaper's
burst lets them run faster than the rate). Goodput = payload bytes * 8 / (time from sending the
request to receiving the last byte), median over --repeats transfers of --seconds each.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from cachegen_common import flags
from cachegen_common.files import atomic_write_json
from cachegen_common.units import check_bandwidth_mbps, goodput_mbps, mbps_to_bytes_per_s

_REQ = struct.Struct("<Q")
_BLOCK = bytes(256 * 1024)


def _serve_source(host: str) -> int:
    """Tiny source server: each connection sends u64 N, gets N bytes back. Prints READY."""
    from streaming.store import watch_parent

    srv = socket.create_server((host, 0))
    watch_parent(lambda: os._exit(0))  # never outlive the measuring process
    print(f"READY {host}:{srv.getsockname()[1]}", flush=True)

    def handle(c: socket.socket) -> None:
        with c:
            try:
                while True:
                    req = b""
                    while len(req) < _REQ.size:
                        d = c.recv(_REQ.size - len(req))
                        if not d:
                            return
                        req += d
                    (n,) = _REQ.unpack(req)
                    mv = memoryview(_BLOCK)
                    while n > 0:
                        k = min(n, len(_BLOCK))
                        c.sendall(mv[:k])
                        n -= k
            except OSError:
                return

    while True:
        c, _ = srv.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()


def start_source(link, timeout: float = 20.0):
    """Start the source server behind `link` -> (Popen, (host, port) to connect to)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = link.run_in_server_ns(
        [sys.executable, "-m", "bench.linkcheck", "--serve-source", link.bind_host],
        stdout=subprocess.PIPE, env=env, text=True,
    )
    line = _readline_timeout(p, timeout)
    if not line.startswith("READY "):
        raise RuntimeError(f"source server did not start: {line!r}")
    port = int(line.split()[1].rsplit(":", 1)[1])
    return p, link.expose(port)


def _readline_timeout(p, timeout: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(p.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not out:
        raise TimeoutError(f"no READY line within {timeout} s")
    return out[0].strip()


def measure_goodput(addr: tuple[str, int], nbytes: int) -> tuple[float, float]:
    """Fetch nbytes over one TCP connection -> (seconds, Mbit/s)."""
    with socket.create_connection(addr, timeout=30) as s:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        t0 = time.perf_counter()
        s.sendall(_REQ.pack(nbytes))
        got = 0
        while got < nbytes:
            r = s.recv_into(view, min(len(buf), nbytes - got))
            if r == 0:
                raise ConnectionError(f"source closed after {got} of {nbytes} bytes")
            got += r
        dt = time.perf_counter() - t0
    return dt, goodput_mbps(nbytes, dt)


SHORT_SIZES = (96 * 1024, 256 * 1024, 1024 * 1024)
IDLE_GAP_S = 0.05  # idle before a short transfer: the shaper's bucket refills (as between chunks)


def short_goodput(addr: tuple[str, int], bandwidth_mbps: float, sizes=SHORT_SIZES, repeats: int = 3) -> list[dict]:
    """Goodput of short transfers started after an idle gap (the shaper's burst inflates
    them) over a link shaped to `bandwidth_mbps` Mbit/s -> rows {bytes, mbps_median,
    ratio_vs_target, repeats_mbps}."""
    out = []
    for n in sizes:
        runs = []
        for _ in range(repeats):
            # Not a stand-in for a network: the gap lets the token bucket fill, which is the
            # situation being measured (a chunk requested after the decoder caught up).
            time.sleep(IDLE_GAP_S)
            runs.append(measure_goodput(addr, n)[1])
        med = statistics.median(runs)
        out.append({"bytes": n, "mbps_median": round(med, 2), "ratio_vs_target": round(med / bandwidth_mbps, 3),
                    "repeats_mbps": [round(x, 2) for x in runs]})
    return out


def check_rate(bandwidth_mbps: float, method: str = "auto", seconds: float = 3.0, repeats: int = 3) -> dict:
    """Set up a link at `bandwidth_mbps` Mbit/s (check_bandwidth_mbps: ValueError outside
    its bound), measure goodput `repeats` times -> one JSON row."""
    from streaming.link import ShapedLink

    bandwidth_mbps = check_bandwidth_mbps(bandwidth_mbps)
    nbytes = max(2 << 20, int(mbps_to_bytes_per_s(bandwidth_mbps) * seconds))
    with ShapedLink(bandwidth_mbps, method=method) as link:
        proc, addr = start_source(link)
        measure_goodput(addr, min(nbytes, 1 << 20))  # warm-up (TCP slow start, ARP), excluded
        runs = [measure_goodput(addr, nbytes) for _ in range(repeats)]
        short = short_goodput(addr, bandwidth_mbps)
        desc = link.describe()
    mbps = [r[1] for r in runs]
    med = statistics.median(mbps)
    return {
        "target_mbps": bandwidth_mbps,
        "measured_mbps": round(med, 2),
        "method": desc["method"],
        "bytes": nbytes,
        "seconds": round(statistics.median(r[0] for r in runs), 4),
        "repeats_mbps": [round(x, 2) for x in mbps],
        "within_10pct": abs(med - bandwidth_mbps) <= 0.1 * bandwidth_mbps,
        "burst_bytes": desc["burst_bytes"],
        "burst_rule": desc.get("burst_rule"),
        "short_transfers": short,
        "added_latency_ms": 0,
        "fallback_reason": desc["fallback_reason"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.linkcheck", description=__doc__.split("\n\n")[0])
    flags.add_bandwidth(ap, nargs="+", default=[100.0, 500.0, 1000.0],
                        help="target link rates, Mbit/s (default %(default)s)")
    flags.add_link_method(ap)
    ap.add_argument("--seconds", type=float, default=3.0, help="length of one transfer at the target rate")
    flags.add_repeats(ap, default=3)
    flags.add_out(ap, type=Path, help="write the rows here (JSON, atomically)")
    ap.add_argument("--serve-source", metavar="HOST", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_source:
        return _serve_source(a.serve_source)
    from streaming.errors import LinkError

    rows = []
    try:
        for r in a.bandwidth_mbps:
            row = check_rate(r, a.link_method, a.seconds, a.repeats)
            rows.append(row)
            print(f"{row['target_mbps']:>8.1f} Mbit/s target  {row['measured_mbps']:>8.2f} measured  "
                  f"method={row['method']}  runs={row['repeats_mbps']}  within10%={row['within_10pct']}", flush=True)
            print("          short transfers after idle (burst " + str(row["burst_bytes"]) + " B): " + ", ".join(
                f"{s['bytes'] // 1024} KiB {s['ratio_vs_target']:.2f}x" for s in row["short_transfers"]), flush=True)
    except (LinkError, ValueError, OSError, RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.out:
        atomic_write_json(a.out, rows, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
