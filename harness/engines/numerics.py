"""What sets a vLLM engine's numerics, made explicit: the OpenMP thread binding of its CPU
worker (:func:`engine_thread_binding`: one CPU per physical core, minus the one reserved for
the engine-core process), its dtype and seed, and the environment variables that change
threads or numerics (:func:`numerics_env`, recorded in results.json ``environment.engine``;
docs/results-schema.md, "Reproducibility"). Separate from the engines because it reads only
the machine (sysfs, affinity, environment) and is tested without one.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_CPUS = 1  # third_party.vllm.engine.ENGINE_ENV["VLLM_CPU_NUM_OF_RESERVED_CPU"]
ENGINE_SEED = 0    # vLLM's sampling seed (greedy decoding does not use it; pinned anyway)
ENGINE_DTYPE = "bfloat16"
NUMERICS_ENV_KEYS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                     "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND",
                     "MKL_NUM_THREADS", "NUMBA_NUM_THREADS", "CACHEGEN_TORCH_THREADS", "LD_PRELOAD")


def cpu_list_str(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the CPU-list syntax of VLLM_CPU_OMP_THREADS_BIND)."""
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpu_list(text: str) -> list[int] | None:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; None for anything else ("auto", "nobind", junk)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            a, _, b = part.strip().partition("-")
            out.extend(range(int(a), int(b or a) + 1))
    except ValueError:
        return None
    return out or None


def sysfs_siblings(cpu: int) -> list[int]:
    """SMT siblings of ``cpu`` (itself included) from sysfs
    ``/sys/devices/system/cpu/cpuN/topology/thread_siblings_list``; ``[cpu]`` without it."""
    try:
        return parse_cpu_list(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/"
                                    "thread_siblings_list").read_text().strip()) or [cpu]
    except OSError:
        return [cpu]


def one_cpu_per_core(cpus: list[int], siblings: Callable[[int], list[int]]) -> list[int]:
    """Drop SMT siblings: keep the lowest allowed CPU of each physical core."""
    keep = []
    for c in cpus:
        sib = siblings(c) or [c]
        if c == min([x for x in sib if x in cpus] or [c]):
            keep.append(c)
    return keep


def engine_thread_binding(allowed_cpus: set[int] | list[int] | None = None,
                          env: dict[str, str] | None = None,
                          siblings: Callable[[int], list[int]] | None = None) -> dict[str, Any]:
    """The CPUs vLLM's CPU worker runs its OpenMP (torch) threads on, made explicit.

    Why: the worker's thread count sets the order of the bf16 reductions in every matmul
    and attention; on a fragile context a different count flips a near-tied greedy token
    (measured: docs/results-schema.md, "Reproducibility"). Left at vLLM's default
    (``VLLM_CPU_OMP_THREADS_BIND=auto``, vllm/utils/ompmultiprocessing.py), the count is
    derived at engine start from the engine process's CPU affinity, the NUMA/SMT topology
    and the reserved-core setting, so it silently changes with ``taskset``/cpuset and
    the environment. The harness therefore passes an explicit list.

    Args:
        allowed_cpus: CPU ids this process may run on (default ``os.sched_getaffinity(0)``).
        env: environment to read a user's ``VLLM_CPU_OMP_THREADS_BIND`` from (default
            ``os.environ``); a user's value is kept as is.
        siblings: ``cpu -> [its SMT siblings]`` (default :func:`sysfs_siblings`).
    Returns:
        ``{"VLLM_CPU_OMP_THREADS_BIND": str, "omp_threads": int | None, "source":
        "harness" | "user", "allowed_cpus": [int]}``. The harness's choice: one logical
        CPU per physical core of the allowed set, minus the highest one (reserved for
        vLLM's engine-core process, as ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``), at least one
        CPU - on a 2-core machine ``"0"``, one thread, what ``auto`` picks there.
        ``omp_threads`` is None when the user's value is not a CPU list (``auto``,
        ``nobind``: vLLM decides at start).
    """
    env = os.environ if env is None else env
    if allowed_cpus is None:
        try:
            allowed_cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # not Linux
            allowed_cpus = range(os.cpu_count() or 1)
    allowed = sorted(set(allowed_cpus))
    user = (env.get(BIND_ENV) or "").strip()
    if user:
        cpus = parse_cpu_list(user)
        return {BIND_ENV: user, "omp_threads": len(cpus) if cpus else None, "source": "user",
                "allowed_cpus": allowed}
    cores = one_cpu_per_core(allowed, siblings or sysfs_siblings) or allowed[:1]
    chosen = cores[:-RESERVED_CPUS] if len(cores) > RESERVED_CPUS else cores[:1]
    return {BIND_ENV: cpu_list_str(chosen), "omp_threads": len(chosen), "source": "harness",
            "allowed_cpus": allowed}


def extraction_dtype(engine: str) -> str | None:
    """The dtype the harness loads the HF model in to extract the KV it stores (a torch dtype
    name for kv_extraction_hf.model.load_model): ENGINE_DTYPE under ``--engine vllm`` (the
    connector serves an entry only if its dtype is the engine's KV dtype, so a float32 or
    float16 checkpoint would miss on every request), None (the checkpoint's own dtype)
    under ``--engine hf``, whose KV is injected into the same model it was extracted from."""
    return ENGINE_DTYPE if engine == "vllm" else None


def numerics_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that change an engine's threads or numerics (set ones only)."""
    env = os.environ if env is None else env
    return {k: env[k] for k in NUMERICS_ENV_KEYS if env.get(k)}
