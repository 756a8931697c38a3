"""Link rates: Mbit/s (every flag, config key, result field ``*_mbps``) <-> bytes/s (what
the token buckets, estimators and timers compute with). 1 Mbit/s = 10**6 bits/s =
125,000 bytes/s (decimal mega, as tc and iperf count).
"""
from __future__ import annotations

BYTES_PER_S_PER_MBPS = 1e6 / 8
"""Bytes per second in one Mbit/s (125,000.0)."""


def mbps_to_bytes_per_s(mbps: float) -> float:
    """A rate in Mbit/s as bytes/s (float; 1 Mbit/s -> 125000.0)."""
    return mbps * 1e6 / 8


def bytes_per_s_to_mbps(bytes_per_s: float) -> float:
    """A rate in bytes/s as Mbit/s (float; 125000 bytes/s -> 1.0)."""
    return bytes_per_s * 8 / 1e6


def goodput_mbps(nbytes: float, seconds: float) -> float:
    """The rate of ``nbytes`` bytes moved in ``seconds`` seconds, in Mbit/s.

    Raises:
        ZeroDivisionError: ``seconds`` is 0.
    """
    return nbytes * 8 / seconds / 1e6


MAX_BANDWIDTH_MBPS = 100_000.0
"""The largest link rate any entry point accepts, Mbit/s (100 Gbit/s: above anything tc tbf
or the userspace token bucket can shape here)."""


def check_bandwidth_mbps(bandwidth_mbps: float) -> float:
    """The one check of a link rate (``--bandwidth-mbps``, the config's ``bandwidth_mbps``,
    ShapedLink's rate): a finite float in (0, MAX_BANDWIDTH_MBPS] Mbit/s, returned as float.

    Raises:
        ValueError: not a number, not positive, or above MAX_BANDWIDTH_MBPS.
    """
    try:
        r = float(bandwidth_mbps)
    except (TypeError, ValueError):
        raise ValueError(f"bandwidth_mbps must be a number in Mbit/s, got {bandwidth_mbps!r}") from None
    if not 0 < r <= MAX_BANDWIDTH_MBPS:
        raise ValueError(f"bandwidth_mbps must be in (0, {MAX_BANDWIDTH_MBPS:g}] Mbit/s, got {bandwidth_mbps!r}")
    return r
