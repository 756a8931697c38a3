"""Shared pytest fixtures.

``default_bundle`` loads the embedded default model (SmolLM2-135M-Instruct, bf16) once
per session, fetching and converting it into the cache folder on first use
(``scripts/setup.sh`` normally does that). Tests that use it are marked ``slow``; they
still run in the default test command and in CI.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

# Tests never reach a model/dataset hub: a hub id they use must fail fast and clearly.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """tests/fixtures/."""
    return FIXTURES


@pytest.fixture(scope="session")
def default_bundle():
    """The default model, loaded once (``kv_extraction_hf.model.load_model()``)."""
    from kv_extraction_hf.model import load_model

    return load_model(log=lambda msg: None)


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer only (fast: no weights loaded)."""
    from transformers import AutoTokenizer

    from kv_extraction_hf.model import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir(log=lambda msg: None))
