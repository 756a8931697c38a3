"""The engines the benchmark measures TTFT on, and what they share.

``hf`` (transformers, in-process) and ``vllm`` (our connector, third_party/vllm) serve the
same requests, named by :func:`request_params`, so both load KV by one code path.

- ``harness.engines.protocol``: the request protocol, the prefill-speed measurement and the
  untimed per-variant warm-up;
- ``harness.engines.api``: load outcome, request timings, the merge of the adaptive
  policy's decisions and the :class:`Engine` face;
- ``harness.engines.hf`` / ``harness.engines.vllm``: the transformers and vLLM engines;
- ``harness.engines.numerics``: the vLLM worker's thread binding, dtype, seed and numerics
  environment.

This package's face: the names below are importable from ``harness.engines``.
"""
from harness.engines.api import Engine, LoadOutcome, RequestTiming, merge_decisions
from harness.engines.hf import HFEngine, hf_load
from harness.engines.numerics import (
    BIND_ENV, ENGINE_DTYPE, ENGINE_SEED, NUMERICS_ENV_KEYS, RESERVED_CPUS, cpu_list_str,
    engine_thread_binding, numerics_env, one_cpu_per_core, parse_cpu_list, sysfs_siblings,
)
from harness.engines.protocol import measure_prefill_speed, request_params, warm_up_variants
from harness.engines.vllm import VLLMEngine, check_vllm, timing_from_connector

__all__ = [
    "BIND_ENV", "ENGINE_DTYPE", "ENGINE_SEED", "Engine", "HFEngine", "LoadOutcome",
    "NUMERICS_ENV_KEYS", "RESERVED_CPUS", "RequestTiming", "VLLMEngine", "check_vllm",
    "cpu_list_str", "engine_thread_binding", "hf_load", "measure_prefill_speed",
    "merge_decisions", "numerics_env", "one_cpu_per_core", "parse_cpu_list", "request_params",
    "sysfs_siblings", "timing_from_connector", "warm_up_variants",
]
