"""Streaming client: pipelined load, text fallback and the link and store faults, over a real
shaped link (userspace token bucket always; netns + tc tbf too when running as root)."""

import socket
import threading
import time
import zlib

import pytest

from tests.helpers.policy import make_policy
from bench import standin_codec as standin
from streaming.store.folder import LocalFolderBackend
from streaming.load import stream_load
from streaming.link import ShapedLink, netns_available
from streaming.store.protocol import FrameType, send_frame
from streaming.store import KVStoreServer, StoreClient, start_store_server

NETNS_OK, NETNS_WHY = netns_available()
METHODS = ["userspace", pytest.param("netns", marks=pytest.mark.skipif(not NETNS_OK, reason=f"netns link needs root: {NETNS_WHY}"))]


def put_context(client, n=4, nbytes=200_000, levels=(1, 2), tokens=100, model="m"):
    ids = list(range(n * tokens))
    ranges = [(i * tokens, (i + 1) * tokens) for i in range(n)]
    chunks = {lv: [standin.make_chunk(nbytes * lv // max(levels), seed=100 * lv + i) for i in range(n)] for lv in levels}
    return client.put_context(model, "w", "standin", ids, chunks, ranges), chunks


def calibrated_rounds(nbytes, target_s):
    data = standin.make_chunk(nbytes, 0)
    t = time.perf_counter()
    standin.decode(data, 20)
    per = (time.perf_counter() - t) / 20
    return max(1, int(target_s / per))


@pytest.mark.parametrize("method", METHODS)
def test_pipelined_load_shorter_than_transfer_plus_decode(tmp_path, method):
    n, nbytes, rate = 6, 300_000, 24.0  # 0.1 s per chunk on the wire
    rounds = calibrated_rounds(nbytes, 0.08)
    with ShapedLink(rate, method=method) as link:
        with start_store_server(tmp_path / "s", link) as h, h.client(timeout=10) as c:
            key, chunks = put_context(c, n=n, nbytes=nbytes, levels=(1,))
            r = stream_load(c, key, 1, standin.decoder(rounds), model_id="m")
    assert r.hit and r.error is None
    assert [ch.level for ch in r.chunks] == [1] * n and not any(ch.text_fallback for ch in r.chunks)
    assert all(ch.bytes == nbytes and ch.crc_ok and not ch.refetched for ch in r.chunks)
    assert r.decoded[3] == standin.decode(chunks[1][3])
    # structural overlap: chunk k+1 was requested before chunk k's decode ended
    for a, b in zip(r.chunks, r.chunks[1:]):
        assert b.fetch_start_s < a.decode_end_s
    # the measured consequence: total below transfer + decode
    assert r.total_s < r.transfer_s + r.decode_s
    # the link really is shaped: 300 KB at 24 Mbit/s cannot arrive faster than 0.1 s minus a burst
    assert r.transfer_s >= n * 0.07


HEALTHY_TRIES = 3         # attempts of the rate-step scenario whose healthy part the host starved
HEALTHY_MBPS = 50.0       # a throughput estimate below this on the 200 Mbit/s link: the host, not the link


def _rate_step(tmp_path, method, attempt):
    from streaming.adapt import AdaptivePolicy
    from streaming.adapt.traces import apply_trace, step

    with ShapedLink(200, method=method) as link:
        with start_store_server(tmp_path / f"s{attempt}", link) as h, h.client(timeout=20) as c:
            key, _ = put_context(c, n=6, nbytes=400_000, levels=(1, 2, 3))
            # Chunk sizes ~133/267/400 KB; text costs 100 tokens / 200 tokens/s = 0.5 s a chunk,
            # so KV is needed for a 1.5 s SLO. At 200 Mbit/s level 3 takes 0.016 s. Chunk 3 is
            # requested at 4 Mbit/s (0.8 s for level 3): its transfer overruns the deadline and is
            # cut (streaming.adapt abandon on overrun), then chunk 3 and the rest are re-planned.
            trace = step([200, 4], 3)
            pol = make_policy(slo_s=1.5, prefill_tokens_per_s=200, initial_throughput_mbps=200)
            r = stream_load(c, key, pol, standin.decoder(1), model_id="m", before_chunk=apply_trace(link, trace))
            assert c.ping()  # the store connection works after the cut
    return r


@pytest.mark.parametrize("method", METHODS)
def test_adaptive_levels_follow_a_rate_step(tmp_path, method):
    """The precondition is a healthy 200 Mbit/s link for chunks 0-2. On a loaded 2-core host
    the userspace proxy (a Python token bucket) once delivered chunk 0 at ~8 Mbit/s
    (2026-12-03, CI at load ~3; the policy then rightly chose level 2 for chunk 1): such an
    attempt, whose measured throughput before the step is below HEALTHY_MBPS, is run again
    (at most HEALTHY_TRIES times, each shown if all fail). Everything the policy decides is
    asserted on the attempt whose healthy part measured healthy."""
    n = 6
    starved = []
    for attempt in range(HEALTHY_TRIES):
        r = _rate_step(tmp_path, method, attempt)
        est = [d.throughput_mbps_est for d in r.decisions[1:3]]
        if all(e >= HEALTHY_MBPS for e in est):
            break
        starved.append(est)
    assert len(starved) < HEALTHY_TRIES, ("the 200 Mbit/s part measured starved in every attempt", starved)
    levels = [ch.level for ch in r.chunks]
    info = [(d.level, d.reason, round(d.elapsed_s, 3), d.budget_s, d.throughput_mbps_est) for d in r.decisions]
    assert levels[:3] == [3, 3, 3], info
    assert [ch.index for ch in r.chunks] == list(range(n)) and r.error is None, info
    assert any(a["chunk"] == 3 and a["level"] == 3 for a in r.abandoned), (r.abandoned, info)
    assert all(lv is None or lv < 3 for lv in levels[3:]), info
    assert r.decisions[4].throughput_mbps_est < 50, info


def test_unknown_key_and_other_model_are_clean_misses(server):
    with StoreClient(*server.address, timeout=5) as c:
        key, _ = put_context(c)
        r = stream_load(c, "f" * 64, 1, standin.decoder())
        assert not r.hit and r.reason == "unknown key" and r.chunks == []
        r = stream_load(c, key, 1, standin.decoder(), model_id="another-model")
        assert not r.hit and "model_id mismatch" in r.reason
        assert stream_load(c, key, 1, standin.decoder(), model_id="m").hit  # still served


def test_transient_corruption_is_refetched(tmp_path):
    seen = {}

    def corrupt_first(key, level, index, data):
        seen[index] = seen.get(index, 0) + 1
        if index == 1 and seen[index] == 1:
            return data[:-1] + bytes([data[-1] ^ 0xFF])
        return data

    srv = KVStoreServer(LocalFolderBackend(tmp_path / "s"), fault_hook=corrupt_first)
    srv.start_thread()
    try:
        with StoreClient(*srv.address, timeout=5) as c:
            key, chunks = put_context(c, levels=(1,))
            r = stream_load(c, key, 1, standin.decoder(), model_id="m")
    finally:
        srv.shutdown()
        srv.server_close()
    assert seen[1] == 2 and seen[0] == 1
    c1 = r.chunks[1]
    assert c1.refetched and c1.crc_ok and not c1.text_fallback and c1.level == 1
    assert r.decoded[1] == standin.decode(chunks[1][1])
    assert not any(ch.refetched for i, ch in enumerate(r.chunks) if i != 1)


def test_persistent_corruption_falls_back_to_text(server):
    with StoreClient(*server.address, timeout=5) as c:
        key, chunks = put_context(c, levels=(1,))
        b = server.store.backend
        bad = bytearray(chunks[1][2])
        bad[100] ^= 0x01
        gen = c.get_manifest(key).gen
        b.put(f"ctx/{key}/g/{gen}/1/2", bytes(bad))  # stored bytes rot on disk
        r = stream_load(c, key, 1, standin.decoder(), model_id="m")
        c2 = r.chunks[2]
        assert c2.text_fallback and c2.level is None and c2.refetched and not c2.crc_ok
        assert "CRC" in c2.note and r.decoded[2] is None and r.text_token_ranges == [(200, 300)]
        assert [ch.text_fallback for ch in r.chunks] == [False, False, True, False]
        # the rotten entry was dropped: later loads miss cleanly instead of failing forever
        r = stream_load(c, key, 1, standin.decoder(), model_id="m")
        assert not r.hit and r.reason == "unknown key"
        # a missing chunk: the lookup sees the entry is incomplete, drops it, misses
        key, chunks = put_context(c, levels=(1,))
        b.delete(f"ctx/{key}/g/{c.get_manifest(key).gen}/1/0")
        r = stream_load(c, key, 1, standin.decoder(), model_id="m")
        assert not r.hit and "1 of 4 chunks missing" in r.reason and not c.has(key)


def test_decode_error_refetch_then_text(server):
    with StoreClient(*server.address, timeout=5) as c:
        key, chunks = put_context(c, levels=(1,))
        calls = {}

        def flaky(data):  # first decode of chunk 1 fails (as codec.CodecError would)
            i = [ch for ch in chunks[1]].index(data)
            calls[i] = calls.get(i, 0) + 1
            if i == 1 and calls[i] == 1:
                raise ValueError("bad bitstream")
            if i == 3:
                raise ValueError("always bad")
            return standin.decode(data)

        r = stream_load(c, key, 1, flaky, model_id="m")
    assert calls == {0: 1, 1: 2, 2: 1, 3: 2}
    assert r.chunks[1].refetched and not r.chunks[1].text_fallback and r.decoded[1] is not None
    assert r.chunks[3].refetched and r.chunks[3].text_fallback and "always bad" in r.chunks[3].note


@pytest.mark.parametrize("method", METHODS)
def test_client_disconnect_mid_transfer_server_keeps_serving(tmp_path, method):
    with ShapedLink(16, method=method) as link:
        with start_store_server(tmp_path / "s", link) as h:
            with h.client(timeout=10) as c:
                key, chunks = put_context(c, n=3, nbytes=400_000, levels=(1,))
            link.set_rate(8)  # 400 KB takes 0.4 s: the reader below leaves mid-chunk
            rude = socket.create_connection((h.host, h.port), timeout=10)
            send_frame(rude, FrameType.GET_CHUNK, {"key": key, "level": 1, "index": 0})
            got = len(rude.recv(20_000))
            rude.close()
            assert 0 < got < 400_000
            link.set_rate(200)
            with h.client(timeout=10) as c2:
                r = stream_load(c2, key, 1, standin.decoder(), model_id="m")
            assert h.alive()
    assert r.hit and r.error is None and not any(ch.text_fallback for ch in r.chunks)
    assert r.decoded == [standin.decode(x) for x in chunks[1]]


@pytest.mark.parametrize("method", METHODS)
def test_server_killed_mid_transfer(tmp_path, method):
    store_dir = tmp_path / "s"
    with ShapedLink(200, method=method) as link:
        h = start_store_server(store_dir, link)
        with h.client(timeout=10) as c:
            key, chunks = put_context(c, n=4, nbytes=500_000, levels=(1,))
        link.set_rate(8)  # 500 KB per chunk = 0.5 s on the wire

        def kill_during_chunk(k):
            if k == 1:  # 0.2 s into chunk 1's 0.5 s transfer
                threading.Timer(0.2, h.proc.kill).start()

        with h.client(timeout=10) as c:
            r = stream_load(c, key, 1, standin.decoder(), model_id="m", before_chunk=kill_during_chunk)
        h.proc.wait(timeout=5)
        assert r.hit and r.error and "connection lost" in r.error
        assert not r.chunks[0].text_fallback and r.decoded[0] == standin.decode(chunks[1][0])
        # bytes the dead server had already handed to the kernel may still arrive whole
        # (real TCP); every chunk is either CRC-verified and decoded, or text
        for i, ch in enumerate(r.chunks):
            assert (ch.crc_ok and r.decoded[i] == standin.decode(chunks[1][i])) or (ch.text_fallback and r.decoded[i] is None)
        assert r.chunks[-1].text_fallback and "connection lost" in r.chunks[-1].note
        # restart on the same folder: nothing stored was lost
        link.set_rate(200)
        with start_store_server(store_dir, link) as h2, h2.client(timeout=10) as c:
            r2 = stream_load(c, key, 1, standin.decoder(), model_id="m")
        assert r2.hit and r2.error is None and r2.decoded == [standin.decode(x) for x in chunks[1]]
    assert all(zlib.crc32(x) == r2.manifest.crc32[1][i] for i, x in enumerate(chunks[1]))


class StubClient:
    """Store client double whose connection drops at a given chunk (unit test of the
    receiver's reconnect-once logic; the real kill is tested above)."""

    def __init__(self, store_client, drop_at, reconnect_ok):
        self.c, self.drop_at, self.reconnect_ok = store_client, drop_at, reconnect_ok
        self.last_miss_reason = ""
        self.dropped = self.reconnects = 0

    def get_manifest(self, *a, **kw):
        return self.c.get_manifest(*a, **kw)

    def get_chunk(self, key, level, index, gen=None):
        if index == self.drop_at and self.dropped == 0:
            self.dropped += 1
            from streaming.store.protocol import ConnectionClosed
            raise ConnectionClosed("connection closed mid-frame after 10 of 100 bytes")
        return self.c.get_chunk(key, level, index, gen)

    def reconnect(self):
        self.reconnects += 1
        if not self.reconnect_ok:
            raise ConnectionRefusedError("server gone")

    def clone(self):
        return self.c.clone()


@pytest.mark.parametrize("reconnect_ok", [True, False])
def test_connection_drop_reconnects_once_else_text(server, reconnect_ok):
    with StoreClient(*server.address, timeout=5) as c:
        key, chunks = put_context(c, levels=(1,))
        stub = StubClient(c, drop_at=2, reconnect_ok=reconnect_ok)
        r = stream_load(stub, key, 1, standin.decoder(), model_id="m")
    assert stub.reconnects == 1 and r.hit
    if reconnect_ok:
        assert r.error is None and r.decoded == [standin.decode(x) for x in chunks[1]]
    else:
        assert "connection lost" in r.error and [ch.text_fallback for ch in r.chunks] == [False, False, True, True]
