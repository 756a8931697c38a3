"""The shaped link's rate rules (methods, tbf and token-bucket burst sizes, pacing quanta), its
shell helpers and subnet choice (the userspace shaper itself: streaming.link.proxy). The
design is described in streaming.link (the package's face names these too).
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import subprocess

from cachegen_common.units import mbps_to_bytes_per_s
from streaming.errors import LinkError


METHOD_NETNS = "netns-tbf"
METHOD_USERSPACE = "userspace-tokenbucket"
METHOD_ALIASES = {
    "netns": METHOD_NETNS,
    METHOD_NETNS: METHOD_NETNS,
    "userspace": METHOD_USERSPACE,
    METHOD_USERSPACE: METHOD_USERSPACE,
}
NS_PREFIX = "cgh-"
NS_RE = re.compile(r"^cgh-(\d+)-([0-9a-f]+)-srv$")
VETH_RE = re.compile(r"^cg(\d+)-([0-9a-f]{3})[hs]$")
LOCK_PATH = "/tmp/cgh-link.lock"
PACING_QUANTUM = 16 * 1024  # userspace shaper releases bytes in quanta of at least 16 KiB
MAX_PACING_QUANTUM = 128 * 1024  # ... and at most 128 KiB (1 ms at 1 Gbit/s)


def pacing_quantum(rate_bytes_s: float) -> int:
    """Bytes released per token-bucket step: 0.5 ms at the rate, clamped to [16, 128] KiB
    (fewer Python steps at high rates keep the userspace shaper off the CPU limit)."""
    return int(min(MAX_PACING_QUANTUM, max(PACING_QUANTUM, rate_bytes_s * 0.0005)))
TBF_LATENCY_MS = 50  # tbf queue depth in time: deep enough for TCP at the rate, bounded


MTU_BYTES = 1514  # Ethernet frame on the veth (1500 + header)
TBF_BURST_MIN_BYTES = 10 * MTU_BYTES  # a few frames: tbf must hold whole frames
TBF_BURST_S = 0.001  # tbf burst = 1 ms at the rate (above the minimum)


def default_burst_bytes(bandwidth_mbps: float) -> int:
    """tbf burst: max(10 MTU-sized frames, 1 ms at the rate `bandwidth_mbps` Mbit/s), bytes.

    The burst lets a transfer that starts on a full bucket run faster than the rate: a
    transfer of N bytes after idle takes (N - burst)/rate. Sized to the rate (1 ms) it
    inflates a 96 KiB transfer by 1.18x at 100 Mbit/s and 1.15x at 1 Gbit/s (was 32 KiB or
    2 ms: 1.33-1.40x measured). The burst is recorded in ShapedLink.describe() so that a
    goodput estimator can correct for it (streaming.adapt.ThroughputEstimator).
    """
    return max(TBF_BURST_MIN_BYTES, int(mbps_to_bytes_per_s(bandwidth_mbps) * TBF_BURST_S))


USERSPACE_BURST_S = 0.005  # userspace token bucket: 5 ms at the rate


def userspace_burst_bytes(bandwidth_mbps: float) -> int:
    """Token-bucket burst for the userspace shaper: max(2 pacing quanta, 5 ms at the rate
    `bandwidth_mbps` Mbit/s), bytes.

    Two quanta let the pacing thread release one quantum while the next accrues; 5 ms covers
    a late wake-up on a busy machine. (Was max(64 KiB, 10 ms): short transfers after idle
    measured 2.9-9x the rate.)
    """
    rate_b = mbps_to_bytes_per_s(bandwidth_mbps)
    return max(2 * pacing_quantum(rate_b), int(rate_b * USERSPACE_BURST_S))


# --------------------------------------------------------------------------- shell helpers
def run_cmd(argv: list[str], check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LinkError(f"{' '.join(argv)}: {e}") from None
    if check and cp.returncode != 0:
        raise LinkError(f"{' '.join(argv)} failed ({cp.returncode}): {cp.stderr.strip()}")
    return cp


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    cp = run_cmd(["ip", "-o", "-4", "addr", "show"], check=False)
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", cp.stdout):
        nets.append(ipaddress.ip_interface(m.group(1)).network)
    cp = run_cmd(["ip", "-4", "route", "show", "table", "all"], check=False)
    for line in cp.stdout.splitlines():
        tok = line.split()
        for t in tok[:2]:
            try:
                if "/" in t:
                    nets.append(ipaddress.ip_network(t, strict=False))
                    break
            except ValueError:
                continue
    return nets


def pick_subnet(rng: secrets.SystemRandom) -> ipaddress.IPv4Network:
    used = used_networks()
    for _ in range(200):
        net = ipaddress.ip_network(
            f"10.{rng.randint(200, 254)}.{rng.randint(0, 255)}.{rng.randint(0, 63) * 4}/30"
        )
        if not any(net.overlaps(u) for u in used):
            return net
    raise LinkError("could not find a free 10.x.y.z/30 for the veth pair")
