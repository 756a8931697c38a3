"""The KV store on a real Redis Cluster (3 masters + 3 replicas on loopback, started and
stopped here): the single-node Redis guarantees hold (a reader sees a whole entry or a miss;
stale, foreign and torn entries are misses), an entry's keys share one hash slot while
entries spread across shards, and under faults - a master killed during loads and saves,
slots migrated during loads (ASK, then MOVED), a master unreachable (SIGSTOP), an
acknowledged save lost by asynchronous replication - every load is the right KV or a
recorded miss, none waits past its bound, and saves succeed after the failover. A bad
cluster address, a plain node and uncovered slots are one line and exit 2.

KV is token-identifying (bench.redis_cluster: K at token t is (t, version)), so a decoded
chunk proves its positions and its save. Skipped only when redis-server is not installed.
Run: .venv/bin/python -m pytest tests/streaming/test_redis_cluster.py -q   (about a minute)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from bench.redis_cluster import check_load, entry, run_fault, save
from streaming.store.backend import open_backend
from streaming.errors import StoreError
from streaming.store.redis_client import RedisStoreClient
from streaming.store.redis_cluster import (
    RedisClusterBackend,
    is_cluster_url,
    parse_cluster_url,
    tag_key,
    untag_key,
)
from streaming.store.redis_cluster_server import RedisClusterServer, find_redis_cli
from streaming.store.redis_server import RedisServer, find_redis_server, free_port

pytestmark = pytest.mark.skipif(find_redis_server() is None or find_redis_cli() is None,
                                reason="redis-server / redis-cli not installed (apt-get install redis-server)")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the tests that leave it whole."""
    with RedisClusterServer() as cl:
        yield cl


@pytest.fixture
def fresh_cluster():
    """A cluster of its own, for a test that kills or moves things."""
    with RedisClusterServer() as cl:
        yield cl


def test_cluster_url_and_key_tags():
    assert parse_cluster_url("redis+cluster://a:1,b:2") == ([("a", 1), ("b", 2)], None, None)
    assert parse_cluster_url("redis+cluster://:pw@a:1/0") == ([("a", 1)], None, "pw")
    for bad in ("redis://a:1", "redis+cluster://a", "redis+cluster://a:1/3", "redis+cluster://a:x"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)
    assert is_cluster_url("redis+cluster://a:1") and not is_cluster_url("redis://a:1")
    k = "ab" * 32
    assert tag_key(f"ctx/{k}/g/0123abcd/0/1") == f"ctx/{{{k}}}/g/0123abcd/0/1"
    assert untag_key(tag_key(f"ctx/{k}/manifest")) == f"ctx/{k}/manifest"
    assert tag_key("cal/" + k) == "cal/" + k


def test_round_trip_one_slot_per_entry_and_misses(cluster):
    backend = open_backend(cluster.url)
    assert isinstance(backend, RedisClusterBackend)
    backend.close()
    with RedisStoreClient(cluster.url) as c:
        keys = [save(c, case, 1) for case in range(12)]
        assert all(check_load(c, k) == ("load", 1) for k in keys)
        assert sorted(c.list_contexts()) == sorted(keys)
        # every key of an entry (manifest, chunks, the generation's copy) in one slot
        raw = [k.decode()[3:] for node in cluster.masters()
               for k in redis.Redis(port=node.port).keys(f"cg:ctx/{{{keys[0]}}}/*")]
        assert len(raw) >= 8 and len({c.backend.slot_of(untag_key(r)) for r in raw}) == 1
        # entries spread across the three masters
        owners = {cluster.master_of(c.backend.slot_of(f"ctx/{k}/manifest")).port for k in keys}
        assert len(owners) == 3
        # an overwrite: the new version, never a mix
        save(c, 0, 2)
        assert check_load(c, keys[0]) == ("load", 2)
        # another tenant's expectation: a miss with its reason
        from streaming.load import stream_load

        res = stream_load(c, keys[1], 0, lambda b: b, model_id="other", weights_hash="w", codec_tag="raw")
        assert not res.hit and "model_id" in res.reason
        # a torn entry (a chunk lost): a recorded miss or chunks recomputed with a note
        gen = c.current_gen(keys[2])
        c.backend.delete(f"ctx/{keys[2]}/g/{gen}/none/1")  # raw: the no-level slot
        kind, what = check_load(c, keys[2])
        assert kind in ("miss", "partial"), (kind, what)
        c.delete_context(keys[3])
        assert check_load(c, keys[3])[0] == "miss" and keys[3] not in c.list_contexts()


def _one_line_exit_2(url: str) -> str:
    p = subprocess.run([sys.executable, "-m", "streaming.store", "list", "--backend", url], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    return p.stderr


def test_bad_cluster_is_one_line_exit_2(cluster, tmp_path, capsys):
    import run_benchmarks

    assert "no Redis Cluster node reachable" in _one_line_exit_2("redis+cluster://127.0.0.1:1")
    assert "bad node" in _one_line_exit_2("redis+cluster://127.0.0.1")
    with RedisServer() as plain:
        assert "plain Redis" in _one_line_exit_2(f"redis+cluster://127.0.0.1:{plain.port}")
    # an explicit cluster bus port: without one Redis takes port + 10000 and refuses ports > 55535
    with RedisServer(extra_config=["cluster-enabled yes", "cluster-config-file nodes.conf",
                                   f"cluster-port {free_port()}"]) as half:
        redis.Redis(port=half.port).execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 8000)
        assert "does not serve every hash slot" in _one_line_exit_2(f"redis+cluster://127.0.0.1:{half.port}")
    rc = run_benchmarks.main(["--store", "redis+cluster://127.0.0.1:1", "--link-method", "userspace",
                              "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: no Redis Cluster node reachable")
    assert not (tmp_path / "r.json").exists()
    p = subprocess.run([sys.executable, "-m", "streaming.store", "list", "--backend", cluster.url], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def _fault_ok(rec: dict) -> None:
    assert rec["wrong_kv"] == 0 and not rec["wrong_details"], rec
    assert rec["hangs"] == 0 and rec["max_load_s"] <= rec["load_bound_s"], rec
    assert rec["every_load_hit_or_recorded_miss"], rec
    assert rec["final_pass"] == {"contexts": rec["contexts"], "ok": rec["contexts"]}, rec


def test_master_killed_during_loads_and_saves(fresh_cluster):
    rec = run_fault(fresh_cluster, "kill-master", n_loads=160, n_contexts=12, loaders=2)
    _fault_ok(rec)
    assert rec["saves"]["after"]["ok"] + rec["final_pass"]["ok"] > 0
    assert rec["hits"] > 0


def test_master_unreachable_then_replaced(fresh_cluster):
    rec = run_fault(fresh_cluster, "pause-master", n_loads=120, n_contexts=12, loaders=2)
    _fault_ok(rec)


def test_slots_migrated_during_loads(fresh_cluster):
    cl = fresh_cluster
    with RedisStoreClient(cl.url) as c:
        key = save(c, 0, 1)
        slot = c.backend.slot_of(f"ctx/{key}/manifest")
        src = cl.master_of(slot)
        dst = next(m for m in cl.masters() if m is not src)
        seen = []
        # half the entry's keys moved: the client follows ASK; then MOVED after SETSLOT NODE
        cl.migrate_slot(slot, dst, keys_first=3, between=lambda: seen.append(check_load(c, key)))
        seen.append(check_load(c, key))
        assert seen == [("load", 1), ("load", 1)]
        assert cl.master_of(slot) is dst
        save(c, 0, 2)
        assert check_load(c, key) == ("load", 2)
    rec = run_fault(cl, "migrate-slots", n_loads=120, n_contexts=12, loaders=2)
    _fault_ok(rec)
    assert rec["detail"]["keys_moved"] > 0


def test_acknowledged_save_lost_at_failover_is_a_miss(fresh_cluster):
    """Replication is asynchronous: a save the master acknowledged but never sent to its
    replica is gone after the failover. Modelled for real: the replica's link is cut
    (the master's requirepass set, its replica's connection killed: the replica cannot
    resync, while the client's open connection stays authenticated), the save
    is acknowledged, the replica is checked to lack it, the master is killed. The load
    after the failover is a recorded miss, never wrong KV, and saving again works."""
    cl = fresh_cluster
    with RedisStoreClient(cl.url, socket_timeout_s=2.0) as c:
        case = 0
        key, _, _ = entry(case, 1)
        master = cl.master_of(c.backend.slot_of(f"ctx/{key}/manifest"))
        replica = cl.replica_of(master)
        c.backend.ping()  # the client's connection to the master is open (authenticated)
        # the replica cannot resync: the master now wants a password it lacks
        m = redis.Redis(port=master.port)
        m.execute_command("CONFIG", "SET", "requirepass", "cut-replica")
        m.execute_command("CLIENT", "KILL", "TYPE", "replica")  # same connection: authenticated
        m.close()
        save(c, case, 1)  # acknowledged by the master
        r = redis.Redis(port=replica.port)
        r.execute_command("READONLY")
        assert not r.exists(c.backend._k(f"ctx/{key}/manifest")), "the replica got the save"
        r.close()
        cl.kill(master)
        cl.wait_failover(master)
        t0 = time.monotonic()
        kind, what = check_load(c, key)
        assert kind == "miss" and what, (kind, what)
        assert time.monotonic() - t0 < 10
        save(c, case, 2)
        assert check_load(c, key) == ("load", 2)


def test_cluster_unreachable_falls_back_only_when_asked(tmp_path, capsys):
    """No node answers: RedisUnavailableError; with a fallback folder, the local store and one
    warning line naming the cluster module; a malformed URL never falls back."""
    from streaming.store.folder import LocalFolderBackend
    from streaming.store.redis_cluster import open_cluster_backend
    from streaming.store.redis_conn import RedisUnavailableError

    url = f"redis+cluster://127.0.0.1:{free_port()}"
    with pytest.raises(RedisUnavailableError):
        open_cluster_backend(url, connect_timeout_s=0.5)
    b = open_cluster_backend(url, fallback_dir=tmp_path / "local", connect_timeout_s=0.5)
    assert isinstance(b, LocalFolderBackend)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streaming.store.redis_cluster: ") and "local store" in err[0]
    with pytest.raises(ValueError):
        open_cluster_backend("redis+cluster://host:port", fallback_dir=tmp_path / "local")
