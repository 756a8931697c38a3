"""Abandon on overrun over the real shaped link: the shaper's rate drops in the middle of a
chunk's transfer, the client cuts that transfer, re-plans the chunk and finishes the load
(streaming.load + streaming.adapt; userspace token bucket always, netns + tbf as root)."""

import contextlib
import threading

import pytest

from tests.helpers.policy import make_policy
from bench import standin_codec as standin
from streaming.adapt import AdaptivePolicy
from streaming.load import stream_load
from streaming.link import ShapedLink, netns_available
from streaming.store import start_store_server

NETNS_OK, NETNS_WHY = netns_available()
METHODS = ["userspace", pytest.param("netns", marks=pytest.mark.skipif(
    not NETNS_OK, reason=f"netns link needs root: {NETNS_WHY}"))]


N_CHUNKS, TOKENS = 6, 100
SIZES = {1: 750_000, 2: 1_500_000, 3: 3_000_000}  # stand-in chunk bytes per level


@contextlib.contextmanager
def _standin_store(tmp_path, method):
    """A 100 Mbit/s shaped link, a KV store server behind it holding one context of
    N_CHUNKS stand-in chunks at levels 1-3 (SIZES), and a client: yields (link, client, key)."""
    with ShapedLink(100, method=method) as link:
        with start_store_server(tmp_path / "s", link) as h, h.client(timeout=30) as c:
            ids = list(range(N_CHUNKS * TOKENS))
            chunks = {lv: [standin.make_chunk(b, seed=10 * lv + i) for i in range(N_CHUNKS)]
                      for lv, b in SIZES.items()}
            key = c.put_context("m", "w", "standin", ids, chunks,
                                [(i * TOKENS, (i + 1) * TOKENS) for i in range(N_CHUNKS)])
            yield link, c, key


HEALTHY_TRIES = 3  # attempts of a scenario whose healthy-link chunks the host cut (see below)


def _drop_on_chunk3(tmp_path, method, attempt):
    """One run: the rate drops to 0.5 Mbit/s 20 ms after chunk 3's request -> (result, policy)."""
    with _standin_store(tmp_path / f"a{attempt}", method) as (link, c, key):
        fired = []

        def hook(k):
            # chunk 3: the rate drops to 0.5 Mbit/s 20 ms after the request (mid-transfer: 3 MB at
            # 100 Mbit/s take 0.24 s); at 0.5 Mbit/s the rest would take about 40 s
            if k == 3 and not fired:
                fired.append(threading.Timer(0.02, link.set_rate, (0.5,)))
                fired[0].start()

        # text costs 100 tokens / 100 tokens/s = 1 s a chunk: KV is worth fetching
        pol = make_policy(slo_s=3.0, prefill_tokens_per_s=100, initial_throughput_mbps=100,
                             burst_bytes=link.burst_bytes)
        r = stream_load(c, key, pol, standin.decoder(1), before_chunk=hook)
        fired[0].join()
        assert c.ping()  # the connection re-established after the cut serves requests
    return r, pol


@pytest.mark.parametrize("method", METHODS)
def test_rate_drop_mid_transfer_is_abandoned_and_replanned(tmp_path, method):
    """The scenario's precondition is a healthy 100 Mbit/s link for chunks 0-2: each 3 MB chunk
    fits its ~0.9 s deadline 3-4x over. In about 1 CI run in 5 (2 shared cores, never
    reproduced alone or beside CPU hogs) the host stalled chunk 0 past its deadline and the
    policy rightly cut it; that is not what this test is about, so such an attempt is run
    again (at most HEALTHY_TRIES times, each cut shown if all fail). Everything about chunk
    3, the chunk whose rate drops, is asserted on the attempt that kept chunks 0-2 whole."""
    n, sizes = N_CHUNKS, SIZES
    pre_drop_cuts = []
    for attempt in range(HEALTHY_TRIES):
        r, pol = _drop_on_chunk3(tmp_path, method, attempt)
        early = [a for a in r.abandoned if a["chunk"] < 3]
        if not early:
            break
        pre_drop_cuts.append(early)
    info = [(d.chunk, d.level, d.reason, d.budget_s, d.throughput_mbps_est) for d in pol.history]
    assert len(pre_drop_cuts) < HEALTHY_TRIES, ("the healthy link's chunks were cut in every "
                                                "attempt", pre_drop_cuts)
    assert [ch.index for ch in r.chunks] == list(range(n)) and r.error is None, info
    assert [ch.level for ch in r.chunks[:3]] == [3, 3, 3], (info, r.abandoned)
    cut = [a for a in r.abandoned if a["chunk"] == 3]
    assert cut and cut[0]["level"] == 3 and cut[0]["wire_s"] < 2.0, (r.abandoned, info)
    assert cut[0]["rule"] in ("projection", "deadline") and cut[0]["rule"] == (
        "projection" if cut[0]["early"] else "deadline"), cut
    assert any(d.reason == "abandoned" and d.chunk == 3 for d in pol.history)
    # every chunk that was loaded decoded (standin.decode checks magic + CRC): nothing half-written
    for ch in r.chunks:
        if ch.level is not None:
            assert ch.crc_ok and r.decoded[ch.index][0] == sizes[ch.level] - 8
    # the re-planned chunk 3 is not the level that overran
    assert r.chunks[3].level != 3, info


@pytest.mark.parametrize("method", METHODS)
def test_slow_chunk_is_abandoned_early_from_its_progress(tmp_path, method):
    """The rate drops to 10 Mbit/s as chunk 3 is requested: its 3 MB would take ~2.4 s; the
    progress checks (every 64 KiB) project that and cut it long before its deadline."""
    n, sizes = N_CHUNKS, SIZES
    with _standin_store(tmp_path, method) as (link, c, key):

        def hook(k):
            if k == 3:
                link.set_rate(10)

        pol = make_policy(slo_s=3.0, prefill_tokens_per_s=100, initial_throughput_mbps=100,
                             burst_bytes=link.burst_bytes)
        r = stream_load(c, key, pol, standin.decoder(1), before_chunk=hook)
        assert c.ping()
    info = [(d.chunk, d.level, d.reason, d.budget_s, d.throughput_mbps_est) for d in pol.history]
    assert [ch.index for ch in r.chunks] == list(range(n)) and r.error is None, info
    cut = [a for a in r.abandoned if a["chunk"] == 3]
    assert cut and cut[0]["level"] == 3 and cut[0]["early"], (r.abandoned, info)
    # cut from the projection, well before the deadline timer would have fired
    assert cut[0]["wire_s"] < 0.7 * cut[0]["deadline_s"] and cut[0]["received_bytes"] >= 64 * 1024, r.abandoned
    # the entry names the rule and the wire clock it projected from (kernel receive timestamps)
    assert cut[0]["rule"] == "projection" and 0 < cut[0]["wire_clock_bytes"] <= cut[0]["received_bytes"]
    assert 0 < cut[0]["wire_clock_s"] <= cut[0]["wire_s"], r.abandoned
    for ch in r.chunks:  # nothing half-written: every loaded chunk decoded
        if ch.level is not None:
            assert ch.crc_ok and r.decoded[ch.index][0] == sizes[ch.level] - 8
    assert r.chunks[3].level != 3, info
