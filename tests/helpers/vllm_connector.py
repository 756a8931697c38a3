"""Pieces the vLLM connector tests share (not named vllm.py: the check scripts run from
tests/helpers/ would import it as vLLM): the converted model folder the vLLM check
scripts run on, and the connector's scheduler side built without an engine."""
from __future__ import annotations

import os
from pathlib import Path


def converted_model_dir() -> str | None:
    """CGH_MODEL_DIR, else the default model's converted folder; None if neither exists
    (offline and not yet fetched)."""
    from kv_extraction_hf.errors import ExtractionError
    from kv_extraction_hf.model import default_model_dir

    try:
        mdir = Path(os.environ.get("CGH_MODEL_DIR") or default_model_dir(log=lambda m: None))
    except ExtractionError:
        return None
    return str(mdir) if (mdir / "config.json").is_file() else None


def scheduler_connector(extra: dict, prefix_caching: bool = False):
    """The connector's scheduler side (third_party.vllm.scheduler.CacheGenScheduler) without
    an engine: extra = the operator's kv_connector_extra_config, block size 128, no model
    identity. Used by the connector unit tests (needs vLLM importable). Unless extra says
    otherwise, loads stop at whole blocks ("load_partial_block": false) so the figures of
    those tests stay whole blocks; test_connector_partial_block.py covers the default."""
    from third_party.vllm.connector_settings import ConnectorSettings
    from third_party.vllm.scheduler import CacheGenScheduler

    extra = {"load_partial_block": False, **extra}
    return CacheGenScheduler(ConnectorSettings.from_extra(extra, block_size=128,
                                                          prefix_caching=prefix_caching))
