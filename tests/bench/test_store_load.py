"""The store load benchmark (bench.store_load) on a tiny run, its KV check, and overwrites
racing a load.

- `--quick` (8 clients in 2 processes, 240 operations per backend, a few seconds): 0 wrong
  KV, every operation counted, the result file's schema (n, machine, load average, per
  backend throughput, latency percentiles, the RSS series, descriptors before and after);
- the check itself catches KV of other tokens, of another context and of another save;
- an entry overwritten while a load of it runs: the load returns one whole save (the one
  it planned from, kept until the next overwrite), or, when that save was deleted under it
  (two overwrites), recomputes the missing chunks with a note; never chunks of two saves.
  A load that starts after the overwrite gets the newer whole entry. On the store server
  and on Redis (skipped only when redis-server is not installed).

Run: .venv/bin/python -m pytest tests/bench/test_store_load.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

import codec
from bench import store_load
from bench.store_load.clients import IDENTITY, check_load, load, save, token_kv
from streaming.store.folder import LocalFolderBackend
from streaming.load import stream_load
from streaming.identity import NO_LEVEL_KEY
from streaming.store.redis_server import RedisServer, find_redis_server
from streaming.store import KVStoreServer, StoreClient

needs_redis = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")
TOKENS, CT = 128, 32


def test_quick_run_has_no_wrong_kv_and_writes_the_schema(tmp_path, capsys):
    out = tmp_path / "load.json"
    backends = ["store", "redis"] if find_redis_server() is not None else ["store"]
    assert store_load.main(["--quick", "--out", str(out), "--backends", *backends]) == 0
    doc = json.loads(out.read_text())
    assert doc["n"]["ops_per_backend"] == 240 and doc["n"]["clients"] == 8
    assert doc["machine"]["cpu_model"] and len(doc["load_avg_before"]) == 3 and len(doc["load_avg_after"]) == 3
    assert set(doc["backends"]) == set(backends)
    for b, row in doc["backends"].items():
        assert row["wrong_kv"] == 0 and row["loaded_unsaved"] == 0, (b, row["errors"])
        assert row["ops"] == 240 == sum(row["counts"].values()), row["counts"]
        assert row["counts"].get("hit", 0) > 0 and row["counts"].get("saved", 0) > 0
        assert not row["counts"].get("client_failed") and not row["counts"].get("save_error"), row["errors"]
        assert row["threads_per_process"] == [4, 4] and row["throughput_ops_s"] > 0
        for op in ("save", "load"):
            lat = row["latency"][op]
            assert lat["n"] > 0 and 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
        assert row["latency"]["save"]["n"] + row["latency"]["load"]["n"] == 240
        mem = row["memory"]
        assert len(mem["series"]) >= 2 and all(len(s) == 3 and s[1] > 0 for s in mem["series"])
        assert mem["growth_after_warmup_mib"] == pytest.approx(mem["after_warmup_max_mib"] - mem["warmup_max_mib"],
                                                               abs=0.011)
        assert row["fds"]["before"] > 0 and row["fds"]["after"] > 0 and row["fds"]["max_during"] >= row["fds"]["before"]
    assert "wrong KV 0" in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys):
    assert store_load.main(["--clients", "2", "--processes", "3"]) == 2
    assert store_load.main(["--ops", "0"]) == 2
    assert store_load.main(["--write-fraction", "1.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("error: ") for e in err)


class _Res:
    """A stand-in LoadResult of one decoded chunk, for the check alone."""

    def __init__(self, k, v, writer=1, seq=1):
        class _M:
            token_ranges = [(0, k.shape[1])]
            meta = {"writer": writer, "seq": seq}

        class _S:
            index, text_fallback, note = 0, False, ""

        self.hit, self.manifest, self.chunks, self.decoded, self.recompute_tokens = True, _M, [_S], [(k, v)], 0


def test_the_check_catches_wrong_kv():
    k, v = token_kv(8, 3, 1, 1)
    assert check_load(_Res(k, v), 3, 8) == ("hit", (1, 1), 0)
    assert check_load(_Res(k, v), 4, 8)[2] == 1                 # another context
    assert check_load(_Res(k, v, seq=2), 3, 8)[2] == 1          # another save of it
    k2 = k.clone()
    k2[:, 5, :, 0] = 6.0                                         # KV of another token
    assert check_load(_Res(k2, -k2), 3, 8)[2] == 1
    assert check_load(_Res(k, v.clone().fill_(0)), 3, 8)[2] == 1  # V not of this K


# --------------------------------------------------------------------------- overwrites
class _ServerStore:
    def __init__(self, tmp):
        self.srv = KVStoreServer(LocalFolderBackend(tmp / "srv"))
        self.srv.start_thread()

    def client(self):
        return StoreClient(*self.srv.address, timeout=10)

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


class _RedisStore:
    def __init__(self, tmp):
        from streaming.store.redis_client import RedisStoreClient

        self.rs = RedisServer().__enter__()
        self._cls = RedisStoreClient

    def client(self):
        return self._cls(self.rs.url)

    def close(self):
        self.rs.__exit__(None, None, None)


STORES = [pytest.param(_ServerStore, id="server"), pytest.param(_RedisStore, id="redis", marks=needs_redis)]


def _load_with_overwrites(reader, writer, key, overwrites: int, at_chunk: int = 1):
    """Load `key` through `reader`; just before chunk `at_chunk` is requested, `writer`
    saves the context `overwrites` more times (saves 2, 3, ...)."""
    done = []

    def hook(k: int) -> None:
        if k == at_chunk and not done:
            done.append(1)
            for s in range(overwrites):
                save(writer, 0, 2, 2 + s, TOKENS, CT)

    res = stream_load(reader, key, NO_LEVEL_KEY, lambda b: codec.decode_kv(b, device="cpu"), identity=IDENTITY,
                      before_chunk=hook)
    assert done, "the overwrite did not run during the load"
    return res


@pytest.mark.parametrize("store_cls", STORES)
@pytest.mark.parametrize("overwrites", [1, 2])
def test_an_overwrite_during_a_load_is_never_a_mix(tmp_path, store_cls, overwrites):
    store = store_cls(tmp_path)
    reader, writer = store.client(), store.client()
    try:
        key = save(writer, 0, 1, 1, TOKENS, CT)
        res = _load_with_overwrites(reader, writer, key, overwrites)
        kind, saved, wrong = check_load(res, 0, TOKENS)
        assert wrong == 0
        seen = {(int(k[0, 0, 0, 2]), int(k[0, 0, 0, 3])) for k, _ in (d for d in res.decoded if d is not None)}
        assert len(seen) <= 1, f"chunks of several saves in one load: {seen}"
        if overwrites == 1:   # the planned save keeps its chunks until the next overwrite
            assert (kind, saved) == ("hit", (1, 1))
        else:                 # deleted under the load: recomputed with a note, or a miss
            assert kind in ("partial", "miss"), kind
            assert seen <= {(1, 1)}
            assert all(st.note for st in res.chunks if st.text_fallback)
        after = load(reader, key, 0, TOKENS)   # a load after the overwrite: the newest whole save
        assert after == ("hit", (2, 1 + overwrites), 0)
    finally:
        reader.close()
        writer.close()
        store.close()


def test_token_kv_values_are_exact():
    k, v = token_kv(TOKENS, 7, 63, 999)
    assert k.dtype == torch.float32 and tuple(k.shape) == (2, TOKENS, 2, 4)
    assert int(k[1, TOKENS - 1, 1, 0]) == TOKENS - 1 and int(k[0, 0, 0, 3]) == 999 and torch.equal(v, -k)
