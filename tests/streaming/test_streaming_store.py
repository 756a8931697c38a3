"""KV store: backend atomicity, context keys, manifests, misses for unknown / foreign entries."""

import json
import threading
import zlib

import pytest

from bench import standin_codec as standin
from streaming.store.backend import StoreBackend, open_backend
from streaming.store.folder import LocalFolderBackend
from streaming.errors import StoreError
from streaming.store import KVStore, Manifest, StoreClient, context_key


def test_local_folder_backend(tmp_path):
    b = LocalFolderBackend(tmp_path)
    assert isinstance(b, StoreBackend)
    assert b.get("a/b") is None and not b.exists("a/b")
    b.put("a/b", b"x" * 10)
    b.put("a/c", b"")
    b.put("z", b"1")
    assert b.get("a/b") == b"x" * 10 and b.get("a/c") == b"" and b.exists("a/b")
    assert sorted(b.keys("a/")) == ["a/b", "a/c"] and sorted(b.keys()) == ["a/b", "a/c", "z"]
    b.put("a/b", b"new")
    assert b.get("a/b") == b"new"
    b.delete("a/b")
    b.delete("a/b")
    assert b.get("a/b") is None
    assert not list(tmp_path.rglob(".tmp-*"))  # no temp files left behind
    with pytest.raises(ValueError):
        b.put("", b"x")


def test_backend_put_is_atomic_under_concurrent_readers(tmp_path):
    b = LocalFolderBackend(tmp_path)
    vals = [bytes([i]) * 200_000 for i in range(8)]
    b.put("k", vals[0])
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            v = b.get("k")
            seen.append(v is not None and v in vals)

    t = threading.Thread(target=reader)
    t.start()
    for v in vals * 3:
        b.put("k", v)
    stop.set()
    t.join()
    assert seen and all(seen)


def test_open_backend(tmp_path):
    assert isinstance(open_backend(str(tmp_path / "a")), LocalFolderBackend)
    assert isinstance(open_backend(f"file://{tmp_path}/b"), LocalFolderBackend)
    with pytest.raises(ValueError, match="unknown store backend scheme"):
        open_backend("ftp://x/y")


def test_context_key():
    k = context_key("m", "w", "cachegen-v1", [1, 2, 3])
    assert len(k) == 64 and k == context_key("m", "w", "cachegen-v1", (1, 2, 3))
    others = {context_key("m2", "w", "cachegen-v1", [1, 2, 3]), context_key("m", "w2", "cachegen-v1", [1, 2, 3]),
              context_key("m", "w", "quant8", [1, 2, 3]), context_key("m", "w", "cachegen-v1", [1, 2, 4]),
              context_key("m", "w", "cachegen-v1", [1, 2])}
    assert k not in others and len(others) == 5
    with pytest.raises(ValueError):
        context_key("m", "w", "c", [])
    with pytest.raises(ValueError):
        context_key("", "w", "c", [1])


def _put(store_or_client, ids=tuple(range(300)), model="m", levels=(1, 2)):
    ranges = [(0, 100), (100, 200), (200, 300)]
    chunks = {lv: [standin.make_chunk(1000 * lv + i, seed=i) for i in range(3)] for lv in levels}
    return store_or_client.put_context(model, "w", "standin", list(ids), chunks, ranges), chunks


def test_put_get_manifest_and_chunks(server):
    with StoreClient(*server.address, timeout=5) as c:
        key, chunks = _put(c)
        m = c.get_manifest(key, model_id="m", weights_hash="w", codec_tag="standin")
        assert isinstance(m, Manifest)
        assert m.levels == (1, 2) and m.chunk_count == 3 and m.token_ranges[1] == (100, 200)
        assert m.text[2] == tuple(range(200, 300)) and m.sizes[2][1] == 2001
        assert m.crc32[1][0] == zlib.crc32(chunks[1][0])
        for lv in (1, 2):
            for i in range(3):
                assert c.get_chunk(key, lv, i) == chunks[lv][i]
        assert c.get_chunk(key, 3, 0) is None and "no chunk" in c.last_miss_reason
        assert c.list_contexts() == [key] and c.has(key)
        c.delete_context(key)
        assert c.get_manifest(key) is None and not c.has(key)


def test_manifest_refused_when_chunks_missing(server, tmp_path):
    with StoreClient(*server.address, timeout=5) as c:
        ids = list(range(100))
        from streaming.store import build_manifest
        key, man = build_manifest("m", "w", "standin", ids, {1: [b"x" * 10]}, [(0, 100)])
        from streaming.store.protocol import FrameType
        with pytest.raises(StoreError, match="missing"):
            c._call(FrameType.PUT_MANIFEST, {"manifest": man})
        assert c.get_manifest(key) is None  # never visible
        assert c.ping()  # connection still usable after an ERR reply


def test_unknown_key_and_foreign_entries_are_clean_misses(server):
    st = server.store
    with StoreClient(*server.address, timeout=5) as c:
        key, _ = _put(c)
        # 1) unknown key
        assert c.get_manifest(context_key("m", "w", "standin", [9, 9])) is None
        assert c.last_miss_reason == "unknown key"
        # 2) same key requested with another model / config expectation
        assert c.get_manifest(key, model_id="other-model") is None
        assert "model_id mismatch" in c.last_miss_reason
        assert c.get_manifest(key, codec_tag="cachegen-v2") is None
        assert "codec_tag mismatch" in c.last_miss_reason
        # 3) an entry written by another model planted under this key (stale / reused store)
        foreign_key, _ = _put(c, model="other-model")
        raw = st.backend.get(f"ctx/{foreign_key}/manifest")
        st.backend.put(f"ctx/{key}/manifest", raw)
        assert c.get_manifest(key, model_id="m") is None
        assert "belongs to another key" in c.last_miss_reason
        # 4) a forged manifest claiming this key but another model: key check fails
        d = json.loads(raw)
        d["key"] = key
        st.backend.put(f"ctx/{key}/manifest", json.dumps(d).encode())
        assert c.get_manifest(key) is None and "does not match" in c.last_miss_reason
        # 5) garbage manifest
        st.backend.put(f"ctx/{key}/manifest", b"\x00garbage")
        assert c.get_manifest(key) is None and "unusable" in c.last_miss_reason


def test_put_context_rejects_inconsistent_arguments(server):
    with StoreClient(*server.address, timeout=5) as c:
        with pytest.raises(ValueError):
            c.put_context("m", "w", "t", list(range(10)), {1: [b"a"]}, [(0, 5), (5, 10)])
        with pytest.raises(StoreError):  # ranges do not tile the ids
            c.put_context("m", "w", "t", list(range(10)), {1: [b"a", b"b"]}, [(0, 5), (6, 10)])


def test_kvstore_direct(tmp_path):
    st = KVStore(LocalFolderBackend(tmp_path))
    m, why = st.get_manifest("nothex")
    assert m is None and "64 lowercase hex" in why


def test_server_exits_when_its_parent_is_killed(tmp_path):
    """A crashed harness (SIGKILL: no atexit) must not leave a store server behind."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import os,sys\nfrom streaming.store import start_store_server\n"
            "h = start_store_server(sys.argv[1])\nprint(h.proc.pid, flush=True)\nos.kill(os.getpid(), 9)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(root)), timeout=60)
    assert p.returncode == -signal.SIGKILL
    pid = int(p.stdout.split()[0])

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie awaiting its reaper counts as gone
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 20
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone()
