"""KV store: content keys, per-context manifests, a threaded TCP server and its client.

Paper: CacheGen section 5 - each context's KV cache is split into chunks, each chunk
encoded at several quality levels and kept with its text; the streamer fetches chunk by
chunk. Keys hash model id + weights hash + codec tag + the prefix's token ids; with an
entry identity (streaming.identity.EntryIdentity: tokenizer, dtype, KV shape, codec name,
version, the full config hash of every level, calibration) the codec tag is
`identity.codec_tag()`, a hash of all of it (`entry_key`), and the manifest repeats the
identity. Every reader checks it (streaming.identity.check_entry), so an entry written for
another model or codec config is never served (a clean miss with a reason), even if the
store is reused across runs with a changed codec schedule.

Layout in a backend (keys):
    cal/<sha256>                      a codec calibration artifact (kvtc: safetensors +
                                      JSON), content-addressed, written before any chunk
    ctx/<key>/g/<gen>/<level>/<index> encoded chunk bytes of write generation <gen> (a
                                      random id per save: two saves never share a chunk key)
    ctx/<key>/manifest                JSON manifest (cgh-manifest-v3), published last with a
                                      compare-and-swap: it names its generation and binds
                                      every chunk (token range, size, CRC-32, sha256), the
                                      chunking, the identity and the calibrations
    ctx/<key>/chunk/<level>/<index>   raw slots without a manifest (prefix-index records)
    ctx/<key>/g/<gen>/aborted         Redis: generation <gen> settled as never published
                                      (a writer lost its publish reply; expires in an hour)
<level> is a codec level's decimal number (0 included), or "none" for a codec without levels
(raw, quant8, kivi, ...; level None in Python, null in manifest level lists and on the wire).
Guarantees (docs/streaming.md, "Store guarantees"): entries are immutable; a reader sees
the old complete entry, the new complete entry or a miss, whatever a writer's crash point;
of two writers that read the same state, the first to publish wins and the other gets
StoreRaceLostError; an entry that lost a chunk (eviction, deletion) or whose chunk fails
its checksum is dropped and reads as a miss with the reason; a writer that loses the reply
to a request deletes nothing before asking the store whether its save is published
(streaming.store.kv.settle, KVStore.resolve). Manifests of previous formats
(cgh-manifest-v1, no per-chunk checksums; cgh-manifest-v2, a codec without levels stored
under level 0) are clean misses ("store it again").

Run the server: python -m streaming.store serve --backend DIR --host 127.0.0.1 --port 0
(prints "READY host:port" on stdout when listening; SIGTERM/SIGINT stop it).
List contexts:  python -m streaming.store list --backend DIR

Modules (this one re-exports their public names, so `from streaming.store import X` keeps
working; private helpers are imported from their own module):
    streaming.store.format  context_key, entry_key, key layout, Manifest, build_manifest
    streaming.store.kv      KVStore (the store logic over a backend)
    streaming.store.kv   save_steps, run_steps (the crash-safe steps of one save)
    streaming.store.server  KVStoreServer, start_store_server, StoreServerHandle, watch_parent
    streaming.store.client  StoreClient (TCP), LocalStoreClient (in-process)
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from streaming.store.backend import StoreBackend, open_backend  # noqa: F401  (re-exported)
from streaming.errors import StoreError
from streaming.store.protocol import DEFAULT_MAX_BODY
from streaming.store.client import (  # noqa: F401  (re-exported)
    LocalStoreClient,
    StoreClient,
)
from streaming.store.format import (  # noqa: F401  (re-exported)
    LEGACY_MANIFEST_FORMATS,
    MANIFEST_FORMAT,
    Manifest,
    build_manifest,
    context_key,
    entry_key,
    new_generation,
)
from streaming.store.kv import KVStore
from streaming.store.server import (  # noqa: F401  (re-exported)
    FaultHook,
    KVStoreServer,
    StoreServerHandle,
    limit_malloc_arenas,
    start_store_server,
    watch_parent,
)
from streaming.store.kv import run_steps, save_steps  # noqa: F401  (re-exported)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streaming.store",
                                 description="KV store server (CacheGen section 5).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("serve", help="serve a backend over TCP")
    sp.add_argument("--backend", required=True, help="folder path, file:///path or redis://...")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=0)
    sp.add_argument("--max-body-mb", type=int, default=DEFAULT_MAX_BODY >> 20)
    sp.add_argument("--malloc-arenas", type=int, default=2,
                    help="glibc malloc arenas of the server (default 2: flat memory under many "
                         "clients; 0: glibc's default)")
    sp.add_argument("--exit-with-parent", action="store_true",
                    help="shut down when the parent process dies (no orphan servers after a crash)")
    lp = sub.add_parser("list", help="list stored context keys")
    lp.add_argument("--backend", required=True)
    a = ap.parse_args(argv)
    try:
        backend = open_backend(a.backend)
    except (ValueError, StoreError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.cmd == "list":
        for k in KVStore(backend).list_contexts():
            print(k)
        return 0
    limit_malloc_arenas(a.malloc_arenas)
    try:
        srv = KVStoreServer(backend, a.host, a.port, max_body=a.max_body_mb << 20)
    except OSError as e:
        print(f"error: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr)
        return 2

    def _stop(signum, frame):
        threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if a.exit_with_parent:
        watch_parent(srv.shutdown)
    h, p = srv.address
    print(f"READY {h}:{p}", flush=True)
    try:
        srv.serve_forever(poll_interval=0.2)
    finally:
        srv.server_close()
    return 0
