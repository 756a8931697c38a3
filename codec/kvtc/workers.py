"""KVTC decode workers: the thread pool the inverse transform is split over (per layer or
per layer group), the worker count (``CACHEGEN_KVTC_THREADS``, capped), and whether this
CPU's bf16 matmul is used for the decode product (``bf16_gemm``). No codec logic.
"""
from __future__ import annotations

import threading

import torch


# Decode workers (Python threads running torch ops, which release the GIL): at most this
# many, and at most torch.get_num_threads(); one pool per process, made on first use.
_MAX_DECODE_WORKERS = 8
_POOL = None
_POOL_LOCK = threading.Lock()


def _decode_workers() -> int:
    """Worker threads of ``inverse.inverse_layers``: the larger of torch's and numba's thread
    counts (numba's is the one the rANS decoder of the same chunk uses; inside the vLLM CPU
    worker torch runs with 1 thread but the decode may use both cores while the engine
    waits on the load), at most ``_MAX_DECODE_WORKERS``."""
    n = torch.get_num_threads()
    try:
        import numba

        from ..threads import configure_threading_layer
        configure_threading_layer()      # get_num_threads launches numba's thread pool
        n = max(n, int(numba.get_num_threads()))
    except Exception:  # noqa: BLE001 - no numba: torch's count
        pass
    return max(1, min(n, _MAX_DECODE_WORKERS))


_BF16_GEMM = None


def bf16_gemm() -> bool:
    """Whether ``inverse.inverse_layers`` multiplies in bf16 (float32 accumulation) for a bf16
    destination: the CPU has native bf16 dot products (AVX512-BF16, as torch reports it).
    Without them bf16 products are emulated and slower than float32."""
    global _BF16_GEMM
    if _BF16_GEMM is None:
        try:
            _BF16_GEMM = bool(torch.cpu._is_avx512_bf16_supported())
        except Exception:  # noqa: BLE001 - an older torch: float32 products
            _BF16_GEMM = False
    return _BF16_GEMM


def _decode_pool():
    """The process-wide ThreadPoolExecutor of ``inverse.inverse_layers`` (created on first
    use; ``_MAX_DECODE_WORKERS`` threads named ``kvtc-decode-*``, idle between decodes)."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                from concurrent.futures import ThreadPoolExecutor
                _POOL = ThreadPoolExecutor(_MAX_DECODE_WORKERS, thread_name_prefix="kvtc-decode")
    return _POOL


def rows_view(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The first rows * cols elements of the 1-D scratch ``flat`` as a contiguous [rows,
    cols] matrix (a GEMM operand with leading dimension = cols: no undefined element
    inside its rows, whatever the kernel reads; codec/scratch.py)."""
    return flat[:rows * cols].view(rows, cols)


def split_over_workers(fn, n: int) -> None:
    """Run ``fn(idx)`` over the items 0..n-1: in the calling thread with one worker
    (``_decode_workers()``), else item w, w + W, ... on worker w of ``_decode_pool()``
    (each item's arithmetic is the same either way). Re-raises a worker's exception."""
    workers = min(n, _decode_workers())
    if workers <= 1:
        fn(range(n))
        return
    futs = [_decode_pool().submit(fn, range(w, n, workers)) for w in range(workers)]
    for f in futs:
        f.result()
