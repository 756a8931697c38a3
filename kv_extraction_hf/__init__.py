"""kv_extraction_hf: load a model, build prompts, prefill, dump K/V, inject K/V back.

The first stage of the pipeline (extract -> encode -> store + link -> stream + decode ->
inject -> measure). See docs/architecture.md for the contracts; CacheGen paper (Liu et al.,
SIGCOMM 2024) section 5 for what the KV cache is used for.

Packages: ``kv_extraction_hf.model`` (load a model; ``model.fetch``: the registry of named
models, the cache folder and the fetches), ``kv_extraction_hf.prompts`` (build_prompt; one
module per kind of task: ``base``, ``synthetic``, ``topics``, ``datasets``, ``user_data``),
``kv_extraction_hf.calibrate`` (the model-facing kvtc calibration; ``groups``: one per layer
group, ``stats``: the model statistics it weights its fit with).

Run: ``python -m kv_extraction_hf --help``.
"""

from kv_extraction_hf.errors import ExtractionError

__all__ = ["ExtractionError"]
