"""Test-only hooks for CacheGenConnector's extra config "test_chunk_hook" (off by default;
never set by the harness). Imported inside vLLM's worker process (PYTHONPATH = repo root).

``hold_until_cancelled(params, chunk_start, cancelled)``: for a request whose stats_tag is
"abort_me", before its first chunk after chunk 0 (chunk_start > 0): write the marker file
$CG_TEST_HOOK_DIR/reached, then wait until the request is cancelled (vLLM finished it) or
$CG_TEST_HOOK_WAIT_S seconds (default 120) pass. This makes "aborted mid-load" a fixed
point of the load (after chunk 0) instead of a race with a slow link. Other requests pass.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def hold_until_cancelled(params: dict, chunk_start: int, cancelled) -> None:
    if params.get("stats_tag") != "abort_me" or chunk_start == 0:
        return
    d = Path(os.environ["CG_TEST_HOOK_DIR"])
    (d / "reached").write_text(str(chunk_start))
    deadline = time.monotonic() + float(os.environ.get("CG_TEST_HOOK_WAIT_S", "120"))
    while not cancelled() and time.monotonic() < deadline:
        time.sleep(0.01)  # a test hook: waits for the engine's cancel, stands in for nothing
    (d / "released").write_text("cancelled" if cancelled() else "timeout")
