"""A real, throw-away Redis Cluster on loopback for tests and benchmarks: 3 masters + 3 replicas.

Paper: CacheGen section 5 (the KV cache lives in a remote store shared by engines); this
module starts that store as a Redis Cluster, the form a store takes once it outgrows one
machine, so that failover and slot migration can be exercised for real; see docs/redis.md.

Each node is a streaming.store.redis_server.RedisServer (its own port, cluster bus port and temp
folder) with `cluster-enabled yes` and a short `cluster-node-timeout` (default 1000 ms: with
Redis's 15 s default a killed master stays "fail?" for many seconds), then
`redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes` joins them. Faults:
`kill(node)` / `pause(node)` a node, `wait_failover(node)` until its replica serves its
slots, `migrate_slot(slot, dst, keys_first=n)` moves a slot by hand (CLUSTER SETSLOT
IMPORTING / MIGRATING, MIGRATE, SETSLOT NODE) so clients meet ASK and then MOVED.

Run one in the foreground (prints its URL, Ctrl-C stops it and removes its folders):

    python -m streaming.store.redis_cluster_server

In code:

    with RedisClusterServer() as cl:
        backend = RedisClusterBackend(cl.url)    # redis+cluster://127.0.0.1:P1,...
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from typing import Iterable

from streaming.store.redis_server import RedisServer
from streaming.store.redis_server import RedisServerError, find_redis_server, free_port

CLUSTER_SLOTS = 16384


def find_redis_cli() -> str | None:
    """Path of redis-cli (installed beside redis-server), or None."""
    import shutil

    exe = find_redis_server()
    if exe:
        import os

        cand = os.path.join(os.path.dirname(exe), "redis-cli")
        if os.access(cand, os.X_OK):
            return cand
    return shutil.which("redis-cli")


class RedisClusterServer:
    """`masters` masters with `replicas` replicas each, on 127.0.0.1, joined as one cluster.

    Args:
        masters: master count (>= 3, Redis's minimum for a cluster; default 3).
        replicas: replicas per master (default 1).
        node_timeout_ms: cluster-node-timeout, ms (default 1000): how long a silent master
            stays up before its replica is promoted.
        startup_timeout_s: seconds to wait for the cluster to report state ok (default 30).
        extra_config: more redis.conf directives for every node.

    Raises:
        RedisNotInstalledError: redis-server is not installed.
        RedisServerError: a node did not start, or the cluster did not form in time.
        ValueError: masters < 3 or replicas < 0.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, *, node_timeout_ms: int = 1000,
                 startup_timeout_s: float = 30.0, extra_config: Iterable[str] = ()):
        if masters < 3 or replicas < 0:
            raise ValueError(f"a cluster needs >= 3 masters and >= 0 replicas, got {masters}, {replicas}")
        self.n_masters, self.n_replicas = int(masters), int(replicas)
        self.node_timeout_ms = int(node_timeout_ms)
        self.startup_timeout_s = float(startup_timeout_s)
        self.extra_config = list(extra_config)
        self.nodes: list[RedisServer] = []

    # ------------------------------------------------------------------ addresses
    @property
    def url(self) -> str:
        """redis+cluster://127.0.0.1:P1,127.0.0.1:P2,... (every node a seed)."""
        return "redis+cluster://" + ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    def _conn(self, node: RedisServer, timeout_s: float = 2.0):
        import redis

        return redis.Redis(host=node.host, port=node.port, socket_timeout=timeout_s,
                           socket_connect_timeout=timeout_s, decode_responses=True)

    def command(self, node: RedisServer, *args, timeout_s: float = 5.0):
        """Run one command on one node (a plain, non-cluster connection); returns its reply."""
        c = self._conn(node, timeout_s)
        try:
            return c.execute_command(*args)
        finally:
            c.close()

    def node_id(self, node: RedisServer) -> str:
        """The node's cluster id (CLUSTER MYID)."""
        return self.command(node, "CLUSTER", "MYID")

    def _live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running()]

    def _slot_owner_id(self, slot: int, via: RedisServer) -> str | None:
        for start, end, master, *_ in self.command(via, "CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(end):
                return master[2]
        return None

    def master_of(self, slot: int) -> RedisServer:
        """The live node serving `slot` as master, as a live node sees it."""
        ids = {self.node_id(n): n for n in self._live()}
        owner = self._slot_owner_id(slot, self._live()[0])
        if owner not in ids:
            raise RedisServerError(f"slot {slot} is served by node {owner}, which is not running")
        return ids[owner]

    def masters(self) -> list[RedisServer]:
        """The live nodes that are masters now."""
        return [n for n in self._live() if self.command(n, "ROLE")[0] == "master"]

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A live replica of `master`."""
        mid = self.node_id(master)
        for n in self._live():
            if n is not master and self.command(n, "CLUSTER", "MYID") != mid:
                for line in self.command(n, "CLUSTER", "NODES").splitlines():
                    f = line.split()
                    if "myself" in f[2] and "slave" in f[2] and f[3] == mid:
                        return n
        raise RedisServerError(f"master {master.host}:{master.port} has no live replica")

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "RedisClusterServer":
        """Start every node, join them (redis-cli --cluster create) and wait for state ok."""
        cli = find_redis_cli()
        try:
            for _ in range(self.n_masters * (1 + self.n_replicas)):
                conf = ["cluster-enabled yes", "cluster-config-file nodes.conf",
                        f"cluster-node-timeout {self.node_timeout_ms}",
                        f"cluster-port {free_port()}",
                        "cluster-replica-validity-factor 0",  # a replica always may take over
                        "cluster-allow-reads-when-down no", "appendonly no",
                        "repl-diskless-sync-delay 0"]  # replicas in sync at once, not after 5 s + self.extra_config
                self.nodes.append(RedisServer(port=free_port(), policy="noeviction",
                                              extra_config=conf).start())
            if cli is None:
                raise RedisServerError("redis-cli is not installed (apt-get install redis-tools)")
            argv = [cli, "--cluster", "create"] + [f"{n.host}:{n.port}" for n in self.nodes] + [
                "--cluster-replicas", str(self.n_replicas), "--cluster-yes"]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=self.startup_timeout_s)
            if r.returncode != 0:
                raise RedisServerError(f"redis-cli --cluster create failed: {(r.stdout + r.stderr)[-800:]}")
            self.wait_ok(self.startup_timeout_s)
            return self
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every live node says cluster_state:ok, all slots are served and each
        master has its replicas, each with its replication link up (synced); raises RedisServerError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                infos = [self.command(n, "CLUSTER", "INFO") for n in self._live()]
                ok = all("cluster_state:ok" in i and f"cluster_slots_ok:{CLUSTER_SLOTS}" in i for i in infos)
                if ok and len(self._live()) == len(self.nodes):
                    roles = [self.command(n, "ROLE") for n in self._live()]
                    # a replica is in sync once its link is "connected" (ROLE's 4th field)
                    ok = sum(1 for r in roles if r[0] == "slave" and r[3] == "connected") \
                        == self.n_masters * self.n_replicas
                if ok:
                    return
                last = infos[0].splitlines()[0] if infos else "no node running"
            except Exception as e:  # a node still starting or just killed: ask again
                last = str(e)
            time.sleep(0.05)
        raise RedisServerError(f"the Redis Cluster is not ok after {timeout_s:.0f} s ({last})")

    def wait_failover(self, dead: RedisServer, timeout_s: float = 30.0) -> RedisServer:
        """Wait until another node (its replica, promoted) serves the slots of the dead
        (killed or paused) master `dead` and every live node says cluster_state:ok; call it
        right after the kill (the dead node's slots are read first). Returns the promoted
        node; raises RedisServerError after timeout_s."""
        addr = f"{dead.host}:{dead.port}"
        live = [n for n in self._live() if n is not dead]
        mid = next(f[0] for f in (x.split() for x in self.command(live[0], "CLUSTER", "NODES").splitlines())
                   if f[1].split("@")[0] == addr)
        slots = [int(r[0]) for r in self.command(live[0], "CLUSTER", "SLOTS") if r[2][2] == mid]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                owner = self._slot_owner_id(slots[0], live[0]) if slots else None
                if owner is not None and owner != mid and all(
                        "cluster_state:ok" in self.command(n, "CLUSTER", "INFO") for n in live):
                    return next(n for n in live if self.node_id(n) == owner)
            except Exception:  # a node answering late during the election: ask again
                pass
            time.sleep(0.05)
        raise RedisServerError(f"no replica took over from {addr} in {timeout_s:.0f} s")

    def kill(self, node: RedisServer) -> None:
        """SIGKILL one node (its folder stays until stop())."""
        node.kill()

    def pause(self, node: RedisServer) -> None:
        """SIGSTOP one node: it accepts connections but never answers (unreachable)."""
        node.pause()

    def resume(self, node: RedisServer) -> None:
        """SIGCONT a paused node."""
        node.resume()

    def migrate_slot(self, slot: int, dst: RedisServer, *, keys_first: int | None = None,
                     between=None, batch: int = 10) -> int:
        """Move `slot` from its master to `dst` (a master) by hand: SETSLOT IMPORTING on dst,
        MIGRATING on the source, MIGRATE its keys `batch` at a time (when keys_first is
        given, that many first, then `between()` is called while the slot is half moved:
        a client then meets ASK), then SETSLOT NODE on every master (MOVED from then on).
        Returns the number of keys moved."""
        src = self.master_of(slot)
        if src is dst:
            return 0
        sid, did = self.node_id(src), self.node_id(dst)
        self.command(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", sid)
        self.command(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", did)
        moved = 0

        def move(limit: int | None) -> None:
            nonlocal moved
            while limit is None or limit > 0:
                n = batch if limit is None else min(batch, limit)
                keys = self.command(src, "CLUSTER", "GETKEYSINSLOT", slot, n)
                if not keys:
                    return
                self.command(src, "MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *keys, timeout_s=10)
                moved += len(keys)
                if limit is not None:
                    limit -= len(keys)

        if keys_first is not None:
            move(keys_first)
            if between is not None:
                between()
        move(None)
        for n in [dst, src] + [m for m in self.masters() if m not in (src, dst)]:
            self.command(n, "CLUSTER", "SETSLOT", slot, "NODE", did)
        return moved

    def stop(self) -> None:
        """Stop every node and remove their folders."""
        for n in self.nodes:
            n.__exit__(None, None, None)
        self.nodes = []

    def __enter__(self) -> "RedisClusterServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A throw-away Redis Cluster on loopback (CacheGen section 5 store).")
    ap.add_argument("--masters", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--node-timeout-ms", type=int, default=1000)
    a = ap.parse_args(argv)
    try:
        cl = RedisClusterServer(a.masters, a.replicas, node_timeout_ms=a.node_timeout_ms).start()
    except (RedisServerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    print(cl.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cl.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
