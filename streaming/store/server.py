"""The KV store's threaded TCP server and the process that runs it (start_store_server).

Paper: CacheGen section 5 (the streamer fetches encoded chunks from a remote store). The
server runs as `python -m streaming.store serve` (streaming.store re-exports these names).
Not runnable by itself.
"""

from __future__ import annotations

import os
import socket
import socketserver
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from streaming.store.backend import StoreBackend
from streaming.errors import ProtocolError, StoreError, StoreTooLargeError
from streaming.store.protocol import ConnectionClosed, recv_frame, send_frame
from streaming.store.protocol import DEFAULT_MAX_BODY, DEFAULT_MAX_META, FrameTooLarge, FrameType
from streaming.store.client import StoreClient
from streaming.identity import parse_level
from streaming.store.format import ANY_BASE
from streaming.store.kv import KVStore

# --------------------------------------------------------------------------- server
FaultHook = Callable[[str, "int | None", int, bytes], bytes]


def request_level(meta: dict) -> int | None:
    """The level a chunk request names: its "level" field, required, an int >= 0 or null
    (a codec without levels; a typed JSON null, never a number). Raises ValueError (the
    server's ERR reply) when the field is absent or malformed."""
    if "level" not in meta:
        raise ValueError("chunk request names no level (null for a codec without levels)")
    return parse_level(meta["level"])


def request_levels(meta: dict) -> list[int | None]:
    """The levels of a RESOLVE / DELETE request (a JSON array of request_level values).
    Raises ValueError / TypeError when absent or malformed."""
    return [parse_level(x) for x in meta["levels"]]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: KVStoreServer = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(srv.idle_timeout_s)
        while True:
            try:
                f = recv_frame(sock, max_body=srv.max_body)
            except FrameTooLarge as e:
                self._reply(FrameType.ERR, {
                    "error": f"{e}: the store server refuses values above {e.limit} bytes "
                             f"(start it with a larger --max-body-mb)",
                    "kind": StoreTooLargeError.kind, "limit": e.limit})
                return  # the stream position is lost: close the connection
            except ProtocolError as e:
                self._reply(FrameType.ERR, {"error": f"protocol error: {e}"})
                return  # the stream position is lost: close the connection
            except (ConnectionClosed, OSError):
                return  # client went away (or idle timeout): nothing to clean up
            try:
                rtype, meta, body = srv.dispatch(f.type, f.meta, f.body)
            except StoreError as e:  # classified (full, read-only, ...): the client re-raises the kind
                rtype, meta, body = FrameType.ERR, {"error": str(e), "kind": e.kind}, b""
            except (ValueError, KeyError, TypeError) as e:
                rtype, meta, body = FrameType.ERR, {"error": str(e)}, b""
            except Exception as e:  # noqa: BLE001 - the server must keep serving others
                rtype, meta, body = FrameType.ERR, {"error": f"internal error: {e!r}"}, b""
            if not self._reply(rtype, meta, body):
                return

    def _reply(self, rtype, meta, body=b"") -> bool:
        try:
            send_frame(self.request, rtype, meta, body)
            return True
        except OSError:
            return False  # client disconnected mid-transfer


class KVStoreServer(socketserver.ThreadingTCPServer):
    """Threaded TCP server of a KVStore. One thread per connection; a client that
    disconnects (even mid-chunk) ends only its own thread.

    fault_hook(key, level, index, data) -> data lets tests corrupt bytes in transit (level
    None: a codec without levels).
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, backend: StoreBackend, host: str = "127.0.0.1", port: int = 0,
                 max_body: int = DEFAULT_MAX_BODY, idle_timeout_s: float = 600.0,
                 fault_hook: FaultHook | None = None):
        self.store = KVStore(backend)
        self.max_body = max_body
        self.idle_timeout_s = idle_timeout_s
        self.fault_hook = fault_hook
        self._publish_lock = threading.Lock()
        super().__init__((host, port), _Handler)

    @property
    def address(self) -> tuple[str, int]:
        return self.server_address[0], self.server_address[1]

    def dispatch(self, ftype: FrameType, meta: dict, body: bytes):
        st = self.store
        if ftype == FrameType.PING:  # with the limits, so a client refuses too large values up front
            return FrameType.OK, {"pong": True, "max_body": self.max_body, "max_meta": DEFAULT_MAX_META}, b""
        if ftype == FrameType.GET_MANIFEST:
            exp = meta.get("expect") or {}
            m, why = st.get_manifest(meta.get("key"), exp.get("model_id"), exp.get("weights_hash"),
                                     exp.get("codec_tag"), exp.get("identity"), gen=meta.get("gen"))
            if m is None:
                return FrameType.MISS, {"reason": why}, b""
            return FrameType.OK, {"manifest": m.to_dict()}, b""
        if ftype == FrameType.GET_CHUNK:
            if meta.get("cal") is not None:
                data = st.get_calibration(meta.get("cal"))
                if data is None:
                    return FrameType.MISS, {"reason": f"no calibration {str(meta.get('cal'))[:16]}"}, b""
                return FrameType.OK, {"bytes": len(data)}, data
            key, lv, idx = meta.get("key"), request_level(meta), int(meta.get("index"))
            data = st.get_chunk(key, lv, idx, meta.get("gen"))
            if data is None:
                where = "without a level" if lv is None else f"at level {lv}"
                return FrameType.MISS, {"reason": f"no chunk {idx} {where}"}, b""
            if self.fault_hook is not None:
                data = self.fault_hook(key, lv, idx, data)
            return FrameType.OK, {"bytes": len(data)}, data
        if ftype == FrameType.PUT_CHUNK:
            if meta.get("cal") is not None:
                st.put_calibration(meta.get("cal"), body)
                return FrameType.OK, {}, b""
            st.put_chunk(meta.get("key"), request_level(meta), int(meta.get("index")), body,
                         meta.get("gen"))
            return FrameType.OK, {}, b""
        if ftype == FrameType.PUT_MANIFEST:
            base = meta.get("base_gen") if meta.get("has_base") else ANY_BASE
            with self._publish_lock:  # the server serialises publishes
                m = st.put_manifest(meta.get("manifest"), base)
            return FrameType.OK, {"key": m.key}, b""
        if ftype == FrameType.RESOLVE:
            with self._publish_lock:  # never between a publish's chunk check and its swap
                published = st.resolve(meta.get("key"), meta.get("gen"), request_levels(meta),
                                       int(meta["chunk_count"]))
            return FrameType.OK, {"published": published}, b""
        if ftype == FrameType.LIST:
            return FrameType.OK, {"keys": st.list_contexts(int(meta.get("limit", 10000)))}, b""
        if ftype == FrameType.HAS:
            if meta.get("cal") is not None:
                return FrameType.OK, {"exists": st.has_calibration(meta.get("cal"))}, b""
            if meta.get("gen_only"):
                return FrameType.OK, {"gen": st.current_gen(meta.get("key"))}, b""
            m, why = st.get_manifest(meta.get("key"))
            return FrameType.OK, {"exists": m is not None, "reason": why}, b""
        if ftype == FrameType.DELETE:
            if meta.get("gen") is not None:
                if meta.get("levels") is not None:  # a writer's own unpublished chunks
                    st.discard(meta.get("key"), meta.get("gen"), request_levels(meta),
                               int(meta.get("chunk_count", 0)))
                    return FrameType.OK, {}, b""
                return FrameType.OK, {"dropped": st.invalidate(meta.get("key"), meta.get("gen"),
                                                               str(meta.get("reason", "")))}, b""
            st.delete_context(meta.get("key"))
            return FrameType.OK, {}, b""
        raise ValueError(f"not a request frame type: {ftype.name}")

    def start_thread(self) -> threading.Thread:
        """Serve in a daemon thread (in-process use, tests); stop with shutdown()+server_close()."""
        t = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        t.start()
        return t



# --------------------------------------------------------------------------- process handle
def _readline_timeout(stream, timeout: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0].strip() if out else ""


@dataclass
class StoreServerHandle:
    """A running store server process: connect with client(); stop() ends it."""

    proc: subprocess.Popen
    host: str  # address this process connects to (through the link if any)
    port: int
    method: str  # link method, or "direct-loopback"

    def client(self, timeout: float = 30.0) -> StoreClient:
        return StoreClient(self.host, self.port, timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> "StoreServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_store_server(backend: str | os.PathLike, link=None, timeout: float = 30.0,
                       extra_args: Sequence[str] = ()) -> StoreServerHandle:
    """Start `python -m streaming.store serve` on `backend` (folder path or URL) behind
    `link` (a ShapedLink: in its server namespace for netns) or on loopback if None,
    wait for READY. Raises StoreError if it does not come up within `timeout` seconds."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    bind = link.bind_host if link is not None else "127.0.0.1"
    argv = [sys.executable, "-m", "streaming.store", "serve", "--backend", os.fspath(backend),
            "--host", bind, "--port", "0", "--exit-with-parent", *extra_args]
    kw = dict(stdout=subprocess.PIPE, env=env, text=True)
    proc = link.run_in_server_ns(argv, **kw) if link is not None else subprocess.Popen(argv, **kw)
    line = _readline_timeout(proc.stdout, timeout)
    if not line.startswith("READY "):
        proc.kill()
        proc.wait()
        raise StoreError(f"store server did not start (got {line!r}, exit {proc.poll()})")
    port = int(line.split()[1].rsplit(":", 1)[1])
    host, cport = link.expose(port) if link is not None else ("127.0.0.1", port)
    return StoreServerHandle(proc, host, cport, link.method if link is not None else "direct-loopback")


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas of this process at `arenas` (mallopt M_ARENA_MAX; 0 keeps
    glibc's default of 8 per core). The server runs a thread per connection: under 64
    clients the default arenas kept growing the RSS after warm-up, 2 kept it flat
    (docs/notes/2026-12-06-store-load.md). A MALLOC_ARENA_MAX in the environment wins.
    Returns True when the cap was set (False: not glibc, or left as it was)."""
    if arenas <= 0 or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").mallopt(-8, int(arenas)) == 1  # -8: M_ARENA_MAX
    except (OSError, AttributeError):
        return False


def watch_parent(on_orphan: Callable[[], None], poll_s: float = 1.0) -> threading.Thread:
    """Call on_orphan() once the parent process is gone (getppid changes), polling every
    poll_s seconds in a daemon thread. Keeps a crashed harness from leaving servers behind."""
    ppid = os.getppid()

    def run() -> None:
        while os.getppid() == ppid:
            threading.Event().wait(poll_s)
        on_orphan()

    t = threading.Thread(target=run, name="cgh-parent-watch", daemon=True)
    t.start()
    return t

