"""LMCache's end-to-end serde flow with our serdes: every object layout LMCache 0.5.6 hands
a serde, stored through its own ``StorageManager`` (L1 -> serialize -> L2) and prefetched
back (L2 -> deserialize -> L1), on the CPU, with its ``MockL2Adapter`` as L2.

The flow (write, wait for the L2 store, clear L1, prefetch, read, release, L1 back to 0
bytes) follows LMCache's own e2e serde tests; the layouts are theirs (a generic
``[100, 2, 512]`` in bf16 / fp16, ``[50, 2, 256]`` fp32, a large ``[256, 4, 2, 2048]``, a
1-element and an odd ``[7, 13, 3]`` one, a three-group object) plus the KV layouts of
the MP server (``[2, L, T, H*D]``, ``[2, L, T, H, D]``, one plane ``[L, T, C]``, fused
``[1, L, T, C]``, a bf16 + fp16 two-group object, objects of 1 and 16 tokens and
Gaussian (incompressible) KV). ``tests/lmcache_serde/test_lmcache_e2e.py`` asserts on it;
run as a module it reports, per layout, the written ratio (KV bytes / bytes L2 holds)
and the error of what comes back (relative L2 error and max abs error), together, and
the step each object was coded at:

    .venv-lmcache/bin/python -m bench.lmcache_e2e [--layers 30] [--serde-json '{...}'] \
        [--kv DUMP.safetensors] [--out results.json]

Needs the optional environment (``bash scripts/setup.sh lmcache``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from bench.codec.contexts import synthetic_kv

from lmcache.v1.distributed.api import (GroupedObjectKeys, MemoryLayoutDesc, ObjectKey,
                                        PrefetchTaskSpec)
from lmcache.v1.distributed.config import (EvictionConfig, L1ManagerConfig,
                                           L1MemoryManagerConfig, StorageManagerConfig)
from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2AdapterConfig
from lmcache.v1.distributed.serde import SerdeConfig
from lmcache.v1.distributed.storage_manager import StorageManager

import third_party.lmcache as plugin
from third_party.lmcache import serde as S
from third_party.lmcache.settings import parse_settings

WAIT_S = 120.0          # a deadline for LMCache's background threads, never a timing


@dataclass(frozen=True)
class Case:
    """One object layout: ``shapes``/``dtypes`` per kernel group and ``fill(key index,
    group index, shape, dtype)`` -> the group's values."""

    shapes: tuple
    dtypes: tuple
    fill: Callable
    keys: int = 3

    def layout(self) -> MemoryLayoutDesc:
        return MemoryLayoutDesc(shapes=[torch.Size(s) for s in self.shapes],
                                dtypes=list(self.dtypes))


def pattern(i: int, g: int, shape, dtype) -> torch.Tensor:
    """Small exact values cycling with the key and group (LMCache's tests fill alike)."""
    n = math.prod(shape)
    vals = ((torch.arange(n) + 3 * i + g) % 7).float() * 0.5
    return vals.to(dtype).reshape(shape)


def _kv(kind: str, L: int, T: int, H: int, D: int, real=None):
    def fill(i: int, g: int, shape, dtype) -> torch.Tensor:
        if kind == "gauss":
            gen = torch.Generator().manual_seed(100 + 10 * i + g)
            return torch.randn(tuple(shape), generator=gen).to(dtype)
        if real is not None:        # key i: the dump's tokens [i T, (i + 1) T) (wrapping)
            n = real[0].shape[1]
            idx = torch.arange(i * T + 7 * g, i * T + 7 * g + T) % n
            k, v = real[0][:, idx].to(dtype), real[1][:, idx].to(dtype)
        else:
            with torch.random.fork_rng():   # synthetic_kv's values also draw on the global RNG
                torch.manual_seed(10 * i + g)
                k, v = synthetic_kv(L, T, H, D, seed=10 * i + g, dtype=dtype)
        if len(shape) == 5:
            return torch.stack([k, v])
        planes = torch.stack([k.reshape(L, T, H * D), v.reshape(L, T, H * D)])
        if len(shape) == 4 and shape[0] == 2:
            return planes
        plane = torch.cat([k, v], -1)        # fused K/V: each head's K then V, 2C channels
        return plane.reshape(shape)
    return fill


def cases(L: int = 4, T: int = 256, H: int = 3, D: int = 64, real=None) -> dict[str, Case]:
    """The layouts of the flow; KV ones of L layers, T tokens, H heads x D (the default
    model: 30 layers, 3 x 64), synthetic, or slices of ``real`` = (K, V) [L, N, H, D]
    (a dump of the model's KV; L, H, D then come from it)."""
    bf, fp, f32 = torch.bfloat16, torch.float16, torch.float32
    if real is not None:
        L, _, H, D = real[0].shape
    C = H * D
    kv = _kv("kv", L, T, H, D, real)
    return {
        # LMCache's generic layouts
        "generic-bf16 [100,2,512]": Case(((100, 2, 512),), (bf,), pattern, keys=5),
        "generic-fp16 [100,2,512]": Case(((100, 2, 512),), (fp,), pattern),
        "generic-fp32 [50,2,256]": Case(((50, 2, 256),), (f32,), pattern),
        "large [256,4,2,2048]": Case(((256, 4, 2, 2048),), (bf,), pattern, keys=2),
        "one element [1]": Case(((1,),), (bf,), pattern),
        "odd [7,13,3]": Case(((7, 13, 3),), (bf,), pattern),
        "three groups [1,2,4,8]+[4,4]+[8]": Case(((1, 2, 4, 8), (4, 4), (8,)), (bf, fp, f32),
                                                 pattern, keys=2),
        # the MP server's KV layouts
        "kv [2,L,T,C] bf16": Case(((2, L, T, C),), (bf,), kv),
        "kv [2,L,T,C] fp16": Case(((2, L, T, C),), (fp,), kv),
        "kv [2,L,T,C] fp32": Case(((2, L, T, C),), (f32,), kv),
        "kv [2,L,T,H,D]": Case(((2, L, T, H, D),), (bf,), kv),
        "fused [1,L,T,2C]": Case(((1, L, T, 2 * C),), (bf,), kv),
        "one plane [L,T,2C]": Case(((L, T, 2 * C),), (bf,), kv),
        "two groups bf16+fp16": Case(((2, L, T, C), (2, L, T, C)), (bf, fp), kv),
        "1 token": Case(((2, L, 1, C),), (bf,), _kv("kv", L, 1, H, D, real)),
        "16 tokens": Case(((2, L, 16, C),), (bf,), _kv("kv", L, 16, H, D, real)),
        "gaussian [2,L,T,C]": Case(((2, L, T, C),), (bf,), _kv("gauss", L, T, H, D)),
    }


def keys_for(ids, model: str = "e2e") -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(i), model_name=model, kv_rank=0)
            for i in ids]


def storage_manager(serde: Optional[SerdeConfig], l1_mb: int = 256) -> StorageManager:
    """LMCache's StorageManager with an L1 of ``l1_mb`` MB and one MockL2Adapter whose
    serde is ``serde`` (None: no serde)."""
    plugin.register()
    l2 = MockL2AdapterConfig(max_size_gb=1.0, mock_bandwidth_gb=100.0)
    if serde is not None:
        l2.serde_config = serde
    return StorageManager(StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(memory_config=L1MemoryManagerConfig(
            size_in_bytes=l1_mb << 20, use_lazy=False, init_size_in_bytes=l1_mb << 20)),
        eviction_config=EvictionConfig(eviction_policy="LRU"),
        l2_adapter_config=L2AdaptersConfig(adapters=[l2])))


def wait_until(pred: Callable[[], bool], deadline_s: float = WAIT_S) -> bool:
    """Wait for LMCache's background threads (no event to wait on): pred() or False at
    the deadline."""
    ev = threading.Event()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if pred():
            return True
        ev.wait(0.01)
    return pred()


def l2_objects(sm: StorageManager) -> tuple[int, int]:
    """(objects, bytes) the L2 adapters hold."""
    st = sm.report_status()["l2_adapters"]
    return (sum(a["stored_object_count"] for a in st),
            sum(a.get("current_size_bytes", 0) for a in st))


def write(sm: StorageManager, case: Case, ids) -> int:
    """Write the case's objects for keys ``ids`` into L1 and wait until the store
    controller is done with them. Returns the objects L2 gained (a refused one: not)."""
    keys = keys_for(ids)
    before = l2_objects(sm)[0]
    got = sm.reserve_write(keys, case.layout())
    if len(got) != len(keys):
        raise RuntimeError(f"reserve_write: {len(got)} of {len(keys)}")
    for key in keys:
        obj, i = got[key], int.from_bytes(key.chunk_hash, "big")
        for g, (sh, dt) in enumerate(zip(case.shapes, case.dtypes)):
            t = obj.get_tensor(g) if len(case.shapes) > 1 else obj.tensor
            t.copy_(case.fill(i, g, sh, dt))
    sm.finish_write(list(got))

    def settled() -> bool:
        st = sm.report_status()["store_controller"]
        return st["in_flight_task_count"] == 0 and st["pending_keys_count"] == 0 and \
            l2_objects(sm)[0] >= before + len(keys)
    wait_until(settled)
    wait_until(lambda: sm.report_status()["store_controller"]["in_flight_task_count"] == 0)
    return l2_objects(sm)[0] - before


def clear_l1(sm: StorageManager) -> bool:
    """Clear L1 until it holds nothing (the store's read locks drop shortly after)."""
    def drained() -> bool:
        sm.clear()
        return sm.report_status()["l1_manager"]["total_object_count"] == 0
    return wait_until(drained)


def prefetch(sm: StorageManager, case: Case, ids) -> int:
    """Prefetch keys ``ids`` from L2: the number of leading hits."""
    spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys_for(ids), 0, case.layout())])
    handle = sm.submit_prefetch_task(spec)
    if not sm.wait_prefetch_status(handle, WAIT_S):
        raise RuntimeError("prefetch did not finish")
    res = sm.query_prefetch_status(handle)
    return res.hit_cells[0].count_leading_ones()


def read(sm: StorageManager, case: Case, ids) -> Optional[list[list[torch.Tensor]]]:
    """The prefetched objects' groups (copies), then the read locks released."""
    keys = keys_for(ids)
    with sm.read_prefetched_results(keys) as objs:
        out = None if objs is None else [
            [(o.get_tensor(g) if len(case.shapes) > 1 else o.tensor).clone()
             for g in range(len(case.shapes))] for o in objs]
    sm.finish_read_prefetched(keys)
    return out


def l1_bytes(sm: StorageManager) -> int:
    return sm.report_status()["l1_manager"]["memory_used_bytes"]


def expected(case: Case, ids) -> list[list[torch.Tensor]]:
    return [[case.fill(i, g, sh, dt) for g, (sh, dt) in enumerate(zip(case.shapes, case.dtypes))]
            for i in ids]


def errors(got, want) -> dict:
    """Relative L2 error (||got - want|| / ||want|| over every group) and max abs error."""
    num = den = 0.0
    mx = 0.0
    for a_obj, b_obj in zip(got, want):
        for a, b in zip(a_obj, b_obj):
            d = a.double() - b.double()
            num += float((d * d).sum())
            den += float((b.double() ** 2).sum())
            mx = max(mx, float(d.abs().max()))
    return {"rel_l2": math.sqrt(num / den) if den > 0 else math.sqrt(num), "max_abs": mx}


def round_trip(case: Case, serde_type: str = "cachegen", kwargs: Optional[dict] = None,
               detail: bool = False, l1_mb: int = 96) -> dict:
    """The whole flow for one case: write, store, clear L1, prefetch, read back, release.
    Returns hits, stored objects, L1 bytes left, the errors of what came back, the bytes
    L2 holds vs the KV's, and the steps the objects were coded at (our serializer's
    stats, read through ``serializer_stats``); ``detail``: also the groups read back
    (``got``, per key)."""
    kwargs = dict(kwargs or {})
    ids = list(range(case.keys))
    sm = storage_manager(SerdeConfig(type=serde_type, kwargs=kwargs), l1_mb)
    stats_before = stat_totals()
    try:
        stored = write(sm, case, ids)
        l2_n, l2_bytes = l2_objects(sm)
        drained = clear_l1(sm)
        hits = prefetch(sm, case, ids)
        got = read(sm, case, ids[:hits]) if hits else []
        left = l1_bytes(sm) if wait_until(lambda: l1_bytes(sm) == 0) else l1_bytes(sm)
        st = stat_delta(stats_before)       # while our serializer is alive (a weak set)
    finally:
        sm.close()
    kv_bytes = case.keys * sum(math.prod(s) * dt.itemsize for s, dt in zip(case.shapes, case.dtypes))
    out = {"keys": case.keys, "stored": stored, "hits": hits, "l1_drained": drained,
           "l1_bytes_left": left, "kv_bytes": kv_bytes, "l2_bytes": l2_bytes,
           "ratio": kv_bytes / l2_bytes if l2_bytes else None, **st}
    if got:
        out.update(errors(got, expected(case, ids[:hits])))
    if detail:
        out["got"] = got
    return out


def stat_totals() -> dict:
    tot: dict = {"levels": {}}
    for st in S.serializer_stats():
        for k in ("objects", "refused", "floor", "raw", "verbatim_groups", "coarser"):
            tot[k] = tot.get(k, 0) + st[k]
        for lv, n in st["levels"].items():
            tot["levels"][lv] = tot["levels"].get(lv, 0) + n
    return tot


def stat_delta(before: dict) -> dict:
    now = stat_totals()
    out = {k: now.get(k, 0) - before.get(k, 0) for k in now if k != "levels"}
    out["levels"] = {str(lv): n - before["levels"].get(lv, 0) for lv, n in now["levels"].items()
                     if n - before["levels"].get(lv, 0)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serde", default="cachegen", choices=list(plugin.SERDE_TYPES))
    ap.add_argument("--serde-json", default="{}", help="serde options (JSON object)")
    ap.add_argument("--layers", type=int, default=30, help="KV layers (default model: 30)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per object (LMCache's chunk)")
    ap.add_argument("--kv", default=None, help="a KV dump (python -m kv_extraction_hf ... "
                    "--out DIR): the KV layouts carry its tokens, not synthetic KV")
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    try:
        kw = json.loads(a.serde_json)
        if not isinstance(kw, dict):
            raise ValueError("not a JSON object")
        parse_settings(a.serde, kw)
    except ValueError as e:
        print(f"error: --serde-json: {e}", file=sys.stderr)
        return 2
    real = None
    if a.kv:
        from kv_extraction_hf.dump import load_kv
        from kv_extraction_hf.errors import ExtractionError
        try:
            k, v, _ = load_kv(a.kv)
        except (ExtractionError, OSError, ValueError) as e:
            print(f"error: --kv {a.kv}: {e}", file=sys.stderr)
            return 2
        real = (k, v)
    rows = {}
    print(f"{'layout':36} {'hits':>7} {'ratio':>7} {'rel L2 err':>11} {'max abs':>9}  steps")
    for name, case in cases(L=a.layers, T=a.tokens, real=real).items():
        if a.only and a.only not in name:
            continue
        r = round_trip(case, a.serde, kw)
        rows[name] = r
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        print(f"{name:36} {r['hits']:>3}/{r['keys']:<3} {ratio:>7} {r.get('rel_l2', float('nan')):>11.4f} "
              f"{r.get('max_abs', float('nan')):>9.4f}  {r['levels']}", flush=True)
    if a.out:
        from cachegen_common.files import atomic_write_json
        atomic_write_json(a.out, {"serde": a.serde, "options": kw, "layers": a.layers,
                                  "tokens": a.tokens, "kv": a.kv, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
