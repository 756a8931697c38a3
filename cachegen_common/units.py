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
