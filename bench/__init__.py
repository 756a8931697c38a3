"""Measurements and demos of the CacheGen harness (CacheGen, Liu et al., SIGCOMM 2024).

The stage packages (kv_extraction_hf, codec, streaming, evaluation, third_party.vllm) are
plain libraries; everything that measures them or demonstrates them lives here, one module
per command. Each module prints figures (medians after a warm-up, the machine's load
recorded) and writes JSON where it says so; none is a test. Dependencies point down:
bench may import every stage package and the harness; no stage package imports bench
(tests/project/test_architecture.py checks it).

Commands (run from the repository root):
  python -m bench.quality [--quick] [--tasks] quality vs lossless on WikiText-2 test (KL, top-1,
                                              95% CIs) and task answers (benchmarks/quality.json)
  python -m bench.adapt [--quick] [--no-real] adaptive policy vs oracle and fixed levels on the
                                              artifact traces (benchmarks/adaptation.json)
  python -m bench.codec [--quick]             codec sizes, speed, error and perplexity cost
                                              per codec and level (docs/codec.md)
  python -m bench.codec --device cuda         hands over to bench.triton
  python -m bench.triton --device cuda        Triton kernels vs the CPU backend (docs/gpu.md)
  python -m bench.coder rans|entropy          CPU rANS coder / entropy stage Msym/s
  python -m bench.schedules [NUM_LAYERS]      the codec's bin schedules of every level
  python -m bench.linkcheck --bandwidth-mbps 100 500 1000   goodput of the shaped link
  python -m bench.streaming pipeline|adapt    pipelined load and adaptation (docs/streaming.md)
  python -m bench.redis --bandwidth-mbps 100 1000   the Redis store behind the link (docs/redis.md)
  python -m bench.vllm_demo --context-tokens 2000   vLLM: prefill vs KV load through the
                                              connector
  python -m bench.warmup                      first vs tenth decode in a fresh process, with and
                                              without the connector's JIT warm-up
  python -m bench.taskcheck --task needle     lossless task scores (docs/tasks.md)
  python -m bench.answer_suite                RULER-kind needle suite: accuracy, agreement with
                                              lossless (Wilson 95%), McNemar vs lossless
Importing the package imports nothing.
"""
