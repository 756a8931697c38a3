"""kv_extraction_hf: load a model, build prompts, prefill, dump K/V, inject K/V back.

The first stage of the pipeline (extract -> encode -> store + link -> stream + decode ->
inject -> measure). See docs/architecture.md for the contracts; CacheGen paper (Liu et al.,
SIGCOMM 2024) section 5 for what the KV cache is used for.

Run: ``python -m kv_extraction_hf --help``.
"""

from kv_extraction_hf.errors import ExtractionError

__all__ = ["ExtractionError"]
