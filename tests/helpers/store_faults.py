"""Token-identifying KV entries for the store fault tests: raw-codec float32 chunks whose
K value at token t is (t, version) (V = -K), so a decoded chunk proves both its token
positions and which save it came from; ``classify`` loads an entry and checks just that."""
from __future__ import annotations

from collections import Counter

import torch

import codec
from streaming.identity import NO_LEVEL_KEY, EntryIdentity
from streaming.load import stream_load
from streaming.store import build_manifest

L, H, D = 2, 1, 2
T = 384


def kv(n: int, version: int):
    """k [L, n, H, D] float32 with k[..., t, :, 0] = t, k[..., 1] = version; v = -k."""
    k = torch.zeros(L, n, H, D, dtype=torch.float32)
    k[..., 0] = torch.arange(n, dtype=torch.float32)[None, :, None]
    k[..., 1] = float(version)
    return k, -k


def ids_of(case: int, n: int = T) -> list[int]:
    return [case * 100_000 + i for i in range(n)]


IDENTITY = EntryIdentity(model_id="m", weights_hash="w", dtype="float32", num_layers=L,
                         num_kv_heads=H, head_dim=D, codec="raw", level_configs={None: "raw-test"})


def entry(ids: list[int], ct: int, version: int):
    """(key, manifest, chunks) of a raw entry of `ids` with chunk_tokens ct (the key does
    not depend on ct or version: every save of `ids` is a save of the same key)."""
    k, v = kv(len(ids), version)
    chunks = codec.encode_chunks(k, v, codec="raw", chunk_tokens=ct)
    ranges = codec.chunk_bounds(len(ids), ct)
    key, man = build_manifest("m", "w", "raw", ids, {None: chunks}, ranges, meta={"version": version},
                              identity=IDENTITY)
    return key, man, {None: chunks}


def decode(data: bytes):
    return codec.decode_kv(data, device="cpu")


def classify(client, key: str, n: int = T, counts: Counter | None = None,
             **kw) -> tuple[str, int | None]:
    """Load `key` and check every decoded chunk: its token positions are its manifest
    range and its version is the manifest's (one save, never a mix). Returns ("load",
    version), ("partial", version) (some chunks recomputed, each with a note) or ("miss",
    None) (with a reason); asserts there is no wrong KV. Adds the outcome ("miss", "load",
    "partial", "wrong") to ``counts`` when given."""
    counts = Counter() if counts is None else counts
    res = stream_load(client, key, NO_LEVEL_KEY, decode, model_id="m", weights_hash="w", codec_tag="raw", **kw)
    if not res.hit:
        assert res.reason, "a miss must say why"
        counts["miss"] += 1
        return "miss", None
    version = res.manifest.meta["version"]
    for st in res.chunks:
        a, b = res.manifest.token_ranges[st.index]
        if st.text_fallback:
            assert st.note, "a recomputed chunk must say why"
            continue
        k, v = res.decoded[st.index]
        wrong = (not torch.equal(k[0, :, 0, 0], torch.arange(a, b, dtype=torch.float32))
                 or not bool((k[..., 1] == version).all()) or not torch.equal(v, -k))
        counts["wrong"] += int(wrong)
        assert not wrong, f"chunk {st.index} holds KV of other tokens or another save"
    assert res.manifest.token_ranges[-1][1] == n
    kind = "partial" if res.recompute_tokens else "load"
    counts[kind] += 1
    return kind, version
