"""A real, throw-away `redis-server` for tests and benchmarks: unique port and data folder.

Paper: CacheGen section 5 (the KV cache is stored remotely and streamed over the network);
this module starts the remote store (Debian's `redis-server`) on loopback or inside the
server namespace of a shaped link (streaming.link), so the measured link sits between the
engine and Redis; see docs/redis.md.

Run one in the foreground (prints its URL, Ctrl-C stops it and removes its folder):

    python -m streaming.store.redis_server --maxmemory 64mb
    python -m streaming.store.redis_server --netns cg-srv --host 10.77.0.2   # inside a namespace

In code:

    with RedisServer(maxmemory="8mb") as srv:           # loopback, free port
        backend = RedisBackend(srv.url)
    with ShapedLink(100) as link, RedisServer(link=link) as srv:
        backend = RedisBackend(srv.url)                  # Redis behind the shaped link
    with RedisServer(netns_runner=["ip", "netns", "exec", ns], host=server_ip) as srv:
        ...                                              # any namespace, by argv prefix

The generated config binds one address only (127.0.0.1 or the namespace address), keeps
no persistence by default (`save ""`, `appendonly no`), sets `maxmemory` and its eviction
policy when asked, and turns `protected-mode` off only inside a namespace (there the
clients connect from the veth peer, not from loopback). Started from the main thread, the
process gets PR_SET_PDEATHSIG (SIGTERM), so it does not outlive a killed harness; `stop()`
and the context exit shut it down and remove its folder; a folder left by a harness that
was SIGKILLed is removed by the next start (its owner pid is dead). What the process
needs before it starts comes first below: the binary (find_redis_server,
redis_server_version, the install hint), its settings (parse_memory, EVICTION_POLICIES), a
free port, the parent-death signal and the removal of folders left by a killed harness
(cleanup_stale_dirs).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Sequence, Union

from streaming.errors import StreamingError


INSTALL_HINT = "install with apt-get install redis-server, or run bash scripts/setup.sh"
EVICTION_POLICIES = (
    "noeviction",
    "allkeys-lru",
    "allkeys-lfu",
    "allkeys-random",
    "volatile-lru",
    "volatile-lfu",
    "volatile-random",
    "volatile-ttl",
)
_MEM_RE = re.compile(r"^\s*(\d+)\s*(b|k|kb|m|mb|g|gb)?\s*$", re.IGNORECASE)
_MEM_UNITS = {None: 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2,
              "g": 1000**3, "gb": 1024**3}  # Redis's own unit rules (k = 1000, kb = 1024)

class RedisServerError(StreamingError):
    """redis-server could not be started, did not answer PING, or could not be stopped."""


class RedisNotInstalledError(RedisServerError):
    """No redis-server executable on PATH."""


def find_redis_server() -> str | None:
    """Path of the redis-server executable, or None if it is not installed."""
    found = shutil.which("redis-server")
    if found:
        return found
    for cand in ("/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server"):
        if os.access(cand, os.X_OK):
            return cand
    return None


def redis_server_version() -> str | None:
    """Version string of the installed redis-server (e.g. "7.0.15"), None if absent."""
    exe = find_redis_server()
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"v=(\S+)", out)
    return m.group(1) if m else out.strip() or None


def parse_memory(value: int | str | None) -> int | None:
    """Bytes from an int or a Redis-style size ("4mb", "512kb", "1gb", "1000000").

    Raises ValueError for a negative, zero or malformed value.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"maxmemory must be bytes or a size like '64mb', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _MEM_RE.match(str(value))
        if not m:
            raise ValueError(f"maxmemory {value!r} is not a size like 65536, '512kb' or '64mb'")
        n = int(m.group(1)) * _MEM_UNITS[m.group(2).lower() if m.group(2) else None]
    if n <= 0:
        raise ValueError(f"maxmemory must be > 0 bytes, got {value!r}")
    return n


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pdeathsig_preexec():
    """preexec_fn giving the child PR_SET_PDEATHSIG(SIGTERM), or None where unsafe/unknown.

    The signal fires when the forking THREAD exits, so it is only set when starting from the
    main thread; libc is resolved here, in the parent, so the child only makes the call."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:  # runs in the child between fork and exec
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG = 1

    return preexec


_DIR_PREFIX = "cg-redis-"


def cleanup_stale_dirs(tmp_root: str | os.PathLike | None = None) -> list[str]:
    """Remove data folders of RedisServers whose owning process is gone (SIGKILLed
    harness). Returns the removed paths."""
    root = Path(tmp_root or tempfile.gettempdir())
    removed = []
    for d in root.glob(_DIR_PREFIX + "*"):
        try:
            owner = int((d / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        try:
            os.kill(owner, 0)
            continue  # owner alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


# A runner is an argv prefix (["ip", "netns", "exec", NAME]) or a callable that starts argv
# and returns the subprocess.Popen (e.g. a ShapedLink's run_in_server_ns).
NetnsRunner = Union[Sequence[str], Callable[..., "subprocess.Popen"]]


class RedisServer:
    """A redis-server process with a generated config, a unique port and a unique folder.

    Args:
        port: TCP port; None picks a free one (retried if taken by the time Redis binds).
        maxmemory: memory limit in bytes or a Redis size string ("8mb"); None = unlimited.
        policy: eviction policy once maxmemory is reached (default "allkeys-lru": least
            recently used keys are evicted, so a stored context can lose chunks - the store
            turns that into a clean partial miss).
        netns_runner: run the server inside a network namespace: an argv prefix such as
            ["ip", "netns", "exec", "cg-srv"], or a callable taking the argv list and
            returning a subprocess.Popen (extra keyword arguments stdout/stderr/preexec_fn
            are passed when it accepts them). Needs `host`.
        host: address to bind and to put in `.url`; default 127.0.0.1 (required with a
            namespace: the server address of the shaped link).
        link: an open streaming.link.ShapedLink instead of netns_runner/host: the server is
            started with link.run_in_server_ns on link.bind_host, and `.url` is the address
            through the link (link.expose), for both link methods (netns-tbf, userspace).
        persistence: False (default) = no RDB snapshots, no AOF; True = AOF every second.
        startup_timeout_s: seconds to wait for PING after start (default 10).
        tmp_root: parent of the unique data folder (default: the system temp folder).
        password: require this password (`requirepass`); `.url` then carries it
            (redis://:PASSWORD@HOST:PORT/0).
        extra_config: more redis.conf directives, one per string (e.g.
            "proto-max-bulk-len 1mb", "replicaof 127.0.0.1 6379"), appended last.

    Raises:
        RedisNotInstalledError: redis-server is not installed (message says how to install).
        RedisServerError: it exited at start or did not answer PING in time (log tail in the
            message).
        ValueError: bad port, maxmemory or policy.
    """

    def __init__(
        self,
        port: int | None = None,
        maxmemory: int | str | None = None,
        policy: str = "allkeys-lru",
        netns_runner: NetnsRunner | None = None,
        host: str | None = None,
        *,
        link=None,
        persistence: bool = False,
        startup_timeout_s: float = 10.0,
        tmp_root: str | os.PathLike | None = None,
        password: str | None = None,
        extra_config: Sequence[str] = (),
    ):
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"port must be an int in 1..65535 or None, got {port!r}")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; one of {', '.join(EVICTION_POLICIES)}")
        self.link = link
        self._in_namespace = netns_runner is not None
        if link is not None:
            if netns_runner is not None or host is not None:
                raise ValueError("give either link= or netns_runner=/host=, not both")
            if not hasattr(link, "run_in_server_ns") or not hasattr(link, "expose"):
                raise ValueError(f"link= must be an open streaming.link.ShapedLink, got {link!r}")
            netns_runner = link.run_in_server_ns
            host = link.bind_host
            self._in_namespace = bool(getattr(link, "server_ns", None))
        if netns_runner is not None and not host:
            raise ValueError("a namespace runner needs host= (the server address inside the namespace)")
        if isinstance(netns_runner, str):
            netns_runner = netns_runner.split()
        self.port = port
        self._fixed_port = port is not None
        self.maxmemory = parse_memory(maxmemory)
        self.policy = policy
        self.netns_runner = netns_runner
        self.host = host or "127.0.0.1"
        self.persistence = bool(persistence)
        self.startup_timeout_s = float(startup_timeout_s)
        self.tmp_root = tmp_root
        if password is not None and (not password or any(c in password for c in " \n\r\"@:/")):
            raise ValueError("password must be non-empty without spaces, quotes, '@', ':' or '/'")
        self.password = password
        self.extra_config = [str(x) for x in extra_config]
        if any("\n" in x or "\r" in x for x in self.extra_config):
            raise ValueError("extra_config entries must be single lines")
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ properties
    @property
    def url(self) -> str:
        """redis://HOST:PORT/0 a client connects to. With link=, the address through the
        shaped link (link.expose: the namespace address, or the userspace shaper's port)."""
        if self.port is None:
            raise RedisServerError("RedisServer not started: no port yet")
        auth = f":{self.password}@" if self.password else ""
        if self.link is not None:
            h, p = self.link.expose(self.port)
            return f"redis://{auth}{h}:{p}/0"
        return self.direct_url

    @property
    def direct_url(self) -> str:
        """redis://BIND_HOST:PORT/0, the address the server listens on (not through the
        userspace shaper; in a namespace this already crosses the shaped veth)."""
        if self.port is None:
            raise RedisServerError("RedisServer not started: no port yet")
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> Path | None:
        return self.dir / "redis.log" if self.dir is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __repr__(self) -> str:
        where = f" netns={self.netns_runner!r}" if self.netns_runner else ""
        state = "running" if self.running() else "stopped"
        return f"RedisServer({self.host}:{self.port}{where}, maxmemory={self.maxmemory}, {state})"

    # ------------------------------------------------------------------ config
    def config_text(self) -> str:
        """The redis.conf this server runs with (one directive per line)."""
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"protected-mode {'no' if self._in_namespace else 'yes'}",
            "daemonize no",
            f"dir {self.dir}",
            f"logfile {self.dir / 'redis.log'}",
            "databases 16",
            "tcp-keepalive 30",
        ]
        if self.persistence:
            lines += ["save 60 1000", "appendonly yes", "appendfsync everysec"]
        else:
            lines += ['save ""', "appendonly no"]
        if self.maxmemory is not None:
            lines.append(f"maxmemory {self.maxmemory}")
        lines.append(f"maxmemory-policy {self.policy}")
        if self.password:
            lines.append(f'requirepass "{self.password}"')
        lines += self.extra_config
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "RedisServer":
        """Start redis-server and wait until it answers PING. Returns self."""
        if self.running():
            return self
        exe = find_redis_server()
        if exe is None:
            raise RedisNotInstalledError(f"redis-server is not installed: {INSTALL_HINT}")
        cleanup_stale_dirs(self.tmp_root)
        self.dir = Path(tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=self.tmp_root))
        (self.dir / "owner.pid").write_text(f"{os.getpid()}\n")
        self._finalizer = weakref.finalize(self, _cleanup, None, str(self.dir))
        attempts = 1 if self._fixed_port else 5
        last = ""
        for _ in range(attempts):
            if not self._fixed_port:
                self.port = free_port("127.0.0.1" if not self._in_namespace else "0.0.0.0")
            conf = self.dir / "redis.conf"
            conf.write_text(self.config_text())
            log = self.dir / "redis.log"
            if log.exists():
                log.unlink()
            try:
                self._spawn([exe, str(conf)])
            except (OSError, ValueError, RedisServerError) as e:
                self._terminate(force=True)
                self._cleanup_dir()
                raise RedisServerError(f"could not run redis-server via {self.netns_runner!r}: {e}") from None
            ok, last = self._wait_ready()
            if ok:
                return self
            self._terminate(force=True)
            if "Address already in use" not in last:
                break
        self._cleanup_dir()
        raise RedisServerError(
            f"redis-server did not start on {self.host}:{self.port}"
            f"{' (in ' + repr(self.netns_runner) + ')' if self.netns_runner else ''}: {last.strip()[-800:]}"
        )

    def _spawn(self, argv: list[str]) -> None:
        out = open(self.dir / "stdout.log", "ab")
        self._log_file = out
        kw = dict(stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                  preexec_fn=_pdeathsig_preexec())
        if self.netns_runner is None:
            self.proc = subprocess.Popen(argv, **kw)
        elif callable(self.netns_runner):
            self.proc = self.netns_runner(argv, **kw)
            if not isinstance(self.proc, subprocess.Popen):
                raise RedisServerError(
                    f"netns_runner {self.netns_runner!r} must return a subprocess.Popen, got {type(self.proc).__name__}"
                )
        else:
            self.proc = subprocess.Popen(list(self.netns_runner) + argv, **kw)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self.proc, str(self.dir))

    def _read_logs(self) -> str:
        text = ""
        for name in ("stdout.log", "redis.log"):
            p = self.dir / name if self.dir else None
            if p is not None and p.exists():
                text += p.read_text(errors="replace")
        return text

    def _wait_ready(self) -> tuple[bool, str]:
        import redis  # the client library, only needed here and in the backend
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        deadline = time.monotonic() + self.startup_timeout_s
        err = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False, f"exited with code {self.proc.returncode}: {self._read_logs()}"
            try:
                c = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0, password=self.password,
                                socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
                try:
                    if c.ping():
                        return True, ""
                finally:
                    c.close()
            except (redis.exceptions.RedisError, OSError) as e:
                err = str(e)
            time.sleep(0.02)
        return False, f"no PING answer within {self.startup_timeout_s:.0f} s ({err}); log: {self._read_logs()}"

    def _terminate(self, force: bool = False, timeout_s: float = 5.0) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGKILL if force else signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _cleanup_dir(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._finalizer is not None:
            self._finalizer.detach()

    def stop(self) -> None:
        """Shut the server down (SIGTERM, SIGKILL after 5 s) and remove its folder."""
        self._terminate(force=False)
        self._cleanup_dir()

    def kill(self) -> None:
        """SIGKILL the server now (fault tests: Redis dies mid-load). The folder stays
        until stop() or the context exit."""
        self._terminate(force=True)

    def pause(self) -> None:
        """SIGSTOP the server (fault tests: a server that hangs; clients must time out)."""
        if self.running():
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self.running():
            os.kill(self.proc.pid, signal.SIGCONT)

    def info(self, section: str = "memory") -> dict:
        """Redis INFO section as a dict (e.g. used_memory, evicted_keys in "stats")."""
        import redis

        c = redis.Redis(host=self.host, port=self.port, socket_timeout=5.0, socket_connect_timeout=2.0,
                        password=self.password)
        try:
            return c.info(section)
        finally:
            c.close()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:  # a stopped (SIGSTOP) server would ignore SIGTERM until continued
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stop()


def _cleanup(proc: subprocess.Popen | None, folder: str) -> None:
    """Finalizer: kill a server left running by a forgotten RedisServer, remove its folder."""
    if proc is not None and proc.poll() is None:
        try:
            proc.kill()
            proc.wait(timeout=5)
        except (OSError, subprocess.SubprocessError):
            pass
    shutil.rmtree(folder, ignore_errors=True)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m streaming.store.redis_server",
        description="Run a throw-away redis-server (unique port and folder) until Ctrl-C.",
    )
    ap.add_argument("--port", type=int, default=None, help="TCP port (default: a free one)")
    ap.add_argument("--maxmemory", default=None, help="memory limit, bytes or e.g. 64mb (default: none)")
    ap.add_argument("--policy", default="allkeys-lru", choices=EVICTION_POLICIES)
    ap.add_argument("--netns", default=None, help="run inside this network namespace (ip netns exec NAME)")
    ap.add_argument("--host", default=None, help="bind address (default 127.0.0.1; required with --netns)")
    args = ap.parse_args(argv)
    runner = ["ip", "netns", "exec", args.netns] if args.netns else None
    try:
        srv = RedisServer(port=args.port, maxmemory=args.maxmemory, policy=args.policy,
                          netns_runner=runner, host=args.host).start()
    except (ValueError, RedisServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(srv.url, flush=True)
    try:
        signal.signal(signal.SIGTERM, _raise_interrupt)
        while srv.running():
            time.sleep(0.5)
        print(f"error: redis-server exited: {srv._read_logs()[-400:]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
