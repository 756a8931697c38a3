"""Warm-up of the codecs' JIT kernels before the first request.

Purpose: the CPU coder and quantizers are numba kernels (`cache=True`: compiled once per
machine into numba's on-disk cache), but a fresh process still pays for loading (or, the
first time, compiling) them and for starting numba's threading layer at its FIRST decode -
measured 1.6 s for a 30-layer cachegen chunk against 0.03 s for the tenth. The connector
calls `warm_up_codecs` once at start in the worker process (extra config "warmup", default
on), so that cost moves from the first request's TTFT to engine start-up.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5 (decoding pipelined with transfer) -
a decode that is 50x slower on the first chunk breaks that pipeline's budget.
A library module (no command); the figure in docs/vllm-connector.md comes from a
fresh-process probe: first vs tenth decode of one chunk, with and without this warm-up.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

logger = logging.getLogger("cachegen.vllm_warmup")

# codecs warmed by default: every registered codec except those that need an external
# calibration artifact (kvtc) - one failing codec is logged and skipped, never fatal
DEFAULT_SKIP = ("kvtc",)
# The CPU rANS coder has a serial kernel for small chunks and a parallel (prange) one from
# codec.threads.PARALLEL_MIN_SYMBOLS symbols up (distinct numba cache entries): entropy-
# coded codecs are warmed a second time with a chunk above that size, or a real chunk's
# first decode still compiles the parallel kernel (measured 5.3 s when numba's cache was
# stale).
ENTROPY_CODED = ("cachegen", "cachegen-ref")


def warm_up_codecs(codecs: Iterable[str] | None = None, dtype: Any = None,
                   shape: tuple[int, int, int, int] = (2, 32, 2, 64)) -> dict[str, Any]:
    """Encode and decode a tiny synthetic KV with each codec so that every JIT kernel the
    decode path uses is compiled (or loaded from numba's cache) now.

    codecs: codec names (default: all of `codec.CODECS` except DEFAULT_SKIP).
    dtype: torch dtype of the synthetic K/V (default torch.bfloat16, the engine's KV dtype;
        numba specialises on the array dtypes the codec hands it, not on shapes).
    shape: (layers, tokens, kv heads, head_dim) of the synthetic K/V (small: seconds matter).
    Entropy-coded codecs (ENTROPY_CODED) are also run once on a chunk large enough for
    the coder's parallel kernels (PARALLEL_MIN_SYMBOLS symbols, same L, H, D).
    Returns {"total_s": float, "codecs": {name: seconds or "error: ..."}}. Raises nothing:
    a codec that fails to warm is reported in the dict and logged.
    """
    import torch

    import codec as codec_pkg

    dtype = dtype or torch.bfloat16
    names = list(codecs) if codecs is not None else \
        [c for c in codec_pkg.CODECS if c not in DEFAULT_SKIP]
    try:
        from codec.threads import PARALLEL_MIN_SYMBOLS as par_min
    except ImportError:  # pragma: no cover - coder without a size switch
        par_min = 1 << 18
    L, T, H, D = shape
    big = (L, max(T, -(-int(par_min) // (2 * L * H * D)) + 1), H, D)
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    t_all = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        try:
            for shp in (shape, big) if name in ENTROPY_CODED else (shape,):
                k = torch.randn(shp, generator=g).to(dtype)
                v = torch.randn(shp, generator=g).to(dtype)
                data = codec_pkg.encode_kv(k, v, codec=name)
                kd, vd = codec_pkg.decode_kv(data, device="cpu")
                if tuple(kd.shape) != tuple(shp) or tuple(vd.shape) != tuple(shp):
                    raise RuntimeError(f"decoded shape {tuple(kd.shape)} != {shp}")
            out[name] = round(time.perf_counter() - t0, 4)
        except Exception as e:  # noqa: BLE001 - warm-up is best effort
            out[name] = f"error: {type(e).__name__}: {e}"
            logger.warning("codec warm-up of %s failed: %s", name, out[name])
    return {"total_s": round(time.perf_counter() - t_all, 4), "codecs": out}
