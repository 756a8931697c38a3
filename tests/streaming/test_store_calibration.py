"""Calibrations travel with their entries: an entry encoded with kvtc
calibration H decodes on a machine that never fitted H - or is a clean miss with the
reason. Two cache folders stand for two machines (CACHEGEN_CACHE differs; each machine
is its own process, so no in-process registry is shared). Stores: the local store folder
(streaming.store.LocalStoreClient), Redis (skipped when redis-server is not installed)
and the connector's local source (third_party.vllm.sources.LocalDirSource).
Run: .venv/bin/python -m pytest tests/streaming/test_store_calibration.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from streaming.store.redis_server import RedisServer, find_redis_server

REPO = Path(__file__).resolve().parents[2]

_MACHINE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import torch
    import codec
    from codec import kvtc
    from streaming.identity import EntryIdentity
    role, kind, where, out = sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5])
    L, H, D, T = 2, 2, 8, 256
    ids = list(range(5000, 5000 + T))

    def kv(seed, n):
        g = torch.Generator().manual_seed(seed)
        mix = torch.randn(L, H * D, H * D, generator=g)
        z = torch.randn(L, n, H * D, generator=g) * torch.logspace(0, -2, H * D)
        return (torch.bmm(z, mix) + 0.5).reshape(L, n, H, D)

    def client():
        if kind == "redis":
            from streaming.store.redis_client import RedisStoreClient
            return RedisStoreClient(where)
        from streaming.store import LocalStoreClient
        return LocalStoreClient(where)

    if role == "write":
        cal = kvtc.fit_calibration(kv(1, 512), kv(2, 512), positions=torch.arange(512),
                                   rope_theta=10000.0)
        h = kvtc.register_calibration(cal)
        k, v = kv(3, T), kv(4, T)
        chunks = codec.encode_chunks(k, v, codec="kvtc",
                                     config=kvtc.KvtcConfig(calibration=h, chunk_tokens=128))
        ref = [codec.decode_kv(c) for c in chunks]
        np.save(out.with_suffix(".ref.npy"), np.stack([np.stack([a.float().numpy(), b.float().numpy()])
                                                       for a, b in ref]))
        ident = EntryIdentity(model_id="m", weights_hash="w", codec="kvtc",
                              level_configs={0: "kvtc-test"}, calibration_hash=h)
        if kind == "local":
            from third_party.vllm.sources import save_local_context
            save_local_context(where, "ctx", ids, chunks, [128, 128], identity=ident)
            key = "ctx"
        else:
            key = client().put_entry(ident, ids, {0: chunks}, [(0, 128), (128, 256)])
        out.write_text(json.dumps({"key": key, "hash": h}))
        sys.exit(0)

    w = json.loads(out.read_text())
    ref = np.load(out.with_suffix(".ref.npy"))
    res = {"had_it": kvtc.has_calibration(w["hash"])}

    def same(i, k, v):
        return bool(np.array_equal(k.float().numpy(), ref[i, 0]) and np.array_equal(v.float().numpy(), ref[i, 1]))

    if kind == "local":
        from third_party.vllm.sources import LocalDirSource, SourceError
        src = LocalDirSource(where, lambda d: codec.decode_kv(d))
        oks = []
        for _ in range(2):
            lk = src.lookup({"context_key": "ctx"}, ids + [1])
            try:
                st = src.load({"context_key": "ctx"}, lk, T,
                              lambda s, k, v: oks.append(same(s // 128, k, v)))
                res["loaded"] = st.loaded_tokens
            except SourceError as e:
                res["miss"] = str(e)
                break
        res["correct"] = bool(oks) and all(oks)
    else:
        from streaming.load import stream_load
        c = client()
        calls = []
        real = c.get_calibration
        c.get_calibration = lambda h: calls.append(h) or real(h)
        oks = []
        for _ in range(2):
            r = stream_load(c, w["key"], 0, lambda d: codec.decode_kv(d), model_id="m")
            if not r.hit:
                res["miss"] = r.reason
                break
            res["recompute"] = r.recompute_tokens
            oks += [same(i, *x) for i, x in enumerate(r.decoded) if x is not None]
        res["correct"] = bool(oks) and all(oks)
        res["fetches"] = len(calls)
    res["cached"] = kvtc.has_calibration(w["hash"])
    out.with_suffix(".read.json").write_text(json.dumps(res))
    """
)


def _machine(role, kind, where, out, cache) -> dict:
    env = dict(os.environ, CACHEGEN_CACHE=str(cache))
    p = subprocess.run([sys.executable, "-c", _MACHINE, str(REPO), role, kind, str(where), str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out.with_suffix(".read.json") if role == "read" else out).read_text())


KINDS = ["folder", pytest.param("redis", marks=pytest.mark.skipif(
    find_redis_server() is None, reason="redis-server not installed")), "local"]


@pytest.mark.parametrize("kind", KINDS)
def test_calibration_travels_with_the_entry(tmp_path, kind):
    """Machine A fits H and stores a kvtc entry; machine B (empty cache) fetches H from the
    store once, verifies it, decodes bit-identically to A, and keeps it; a machine C that
    finds H missing or tampered in the store gets a clean miss with the reason."""
    rs = RedisServer().__enter__() if kind == "redis" else None
    try:
        where = rs.url if rs else tmp_path / "store"
        out = tmp_path / "w.json"
        w = _machine("write", kind, where, out, tmp_path / "A")
        b = _machine("read", kind, where, out, tmp_path / "B")
        assert b["had_it"] is False and b["correct"] and b["cached"], b
        assert "miss" not in b, b
        if kind != "local":
            assert b["fetches"] == 1 and b["recompute"] == 0  # fetched once for two loads
        assert (tmp_path / "B" / "kvtc" / f"{w['hash']}.safetensors").is_file()
        # tampered artifact in the store: verified before use -> a clean miss
        cal_key = f"cal/{w['hash']}"
        if kind == "local":
            (Path(where) / ".cal" / f"{w['hash']}.safetensors").write_bytes(b"not a calibration")
        else:
            from streaming.store.backend import open_backend

            be = open_backend(str(where))
            data = bytearray(be.get(cal_key))
            data[-1] ^= 0xFF
            be.put(cal_key, bytes(data))
        c = _machine("read", kind, where, out, tmp_path / "C")
        assert not c["correct"] and "does not verify" in c["miss"] and not c["cached"], c
        # missing artifact: a clean miss naming the calibration
        if kind == "local":
            (Path(where) / ".cal" / f"{w['hash']}.safetensors").unlink()
        else:
            be.delete(cal_key)
        d = _machine("read", kind, where, out, tmp_path / "D")
        assert not d["correct"] and "calibration" in d["miss"] and w["hash"][:16] in d["miss"], d
    finally:
        if rs is not None:
            rs.__exit__(None, None, None)


def test_streaming_never_imports_codec_kvtc():
    """The generic store knows no codec: it moves calibration bytes by hash through
    ``codec.artifacts`` (AST scan of every streaming/ module's imports)."""
    import ast

    bad = []
    for p in sorted((REPO / "streaming").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad += [f"{p.relative_to(REPO)}:{node.lineno} {n}" for n in names
                    if n == "codec.kvtc" or n.startswith("codec.kvtc.")]
    assert not bad, "streaming/ imports codec.kvtc:\n" + "\n".join(bad)
